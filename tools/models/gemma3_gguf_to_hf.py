"""A Gemma 3 GGUF (llama.cpp's layout) back to a Hugging Face `gemma3_text` folder that mlx-lm converts.

    gemma3_gguf_to_hf.py MODEL.gguf OUT_DIR

Writes config.json (from the GGUF's metadata and Gemma 3's fixed choices that llama.cpp does not store),
model.safetensors (every tensor dequantized to float32 with the `gguf` package — the values the GGUF
holds, exactly) and the tokenizer (tokenizer.json and tokenizer_config.json, rebuilt from the GGUF's
vocabulary by transformers' own GGUF tokenizer converter, which needs no torch).

Undone here what llama.cpp's convert_hf_to_gguf.py did to Gemma 3: it stores every RMSNorm weight as
`1 + w` (ggml multiplies by the weight; Gemma multiplies by `1 + w`), so 1 is subtracted again. Q and K
are not permuted for Gemma (NeoX-style rope in both), and the output head is tied to the embedding.
"""
import json
import sys
from pathlib import Path

import numpy as np
from gguf import GGUFReader
from gguf.quants import dequantize
from safetensors.numpy import save_file
from transformers.integrations.gguf.gguf_tokenizer_mapping import GGUF_TOKENIZER_MAPPING, convert_gguf_tokenizer
from transformers import PreTrainedTokenizerFast

LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def field(reader, key, default=None):
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def hf_name(gguf_name):
    if gguf_name == "token_embd.weight":
        return "model.embed_tokens.weight"
    if gguf_name == "output_norm.weight":
        return "model.norm.weight"
    blk, layer, part, kind = gguf_name.split(".")
    assert blk == "blk" and kind == "weight", gguf_name
    return f"model.layers.{layer}.{LAYER_NAMES[part]}.weight"


def config(reader):
    arch = field(reader, "general.architecture")
    if arch != "gemma3":
        sys.exit(f"gemma3_gguf_to_hf.py: general.architecture is {arch!r}, not 'gemma3'")
    layers = int(field(reader, "gemma3.block_count"))
    # Written for (and checked on) the small text models: the 4B and larger store linear rope scaling,
    # and the 27B scales queries by hidden/heads rather than head_dim; neither is mapped here.
    if "gemma3.rope.scaling.type" in reader.fields or "gemma3.rope.scaling.factor" in reader.fields:
        sys.exit("gemma3_gguf_to_hf.py: this GGUF has rope scaling, which this converter does not map")
    hidden, heads = int(field(reader, "gemma3.embedding_length")), int(field(reader, "gemma3.attention.head_count"))
    if hidden // heads != int(field(reader, "gemma3.attention.key_length")) and layers == 62:
        sys.exit("gemma3_gguf_to_hf.py: Gemma 3 27B's query scale is not mapped by this converter")
    # Gemma 3 text models: every sixth layer global, the rest sliding-window with rope base 10000
    # (llama.cpp hard-codes both for gemma3; Hugging Face's config spells them out).
    pattern = 6
    return {
        "architectures": ["Gemma3ForCausalLM"],
        "model_type": "gemma3_text",
        "hidden_size": int(field(reader, "gemma3.embedding_length")),
        "intermediate_size": int(field(reader, "gemma3.feed_forward_length")),
        "num_hidden_layers": layers,
        "num_attention_heads": int(field(reader, "gemma3.attention.head_count")),
        "num_key_value_heads": int(field(reader, "gemma3.attention.head_count_kv")),
        "head_dim": int(field(reader, "gemma3.attention.key_length")),
        "query_pre_attn_scalar": int(field(reader, "gemma3.attention.key_length")),
        "rms_norm_eps": float(np.float32(field(reader, "gemma3.attention.layer_norm_rms_epsilon"))),
        "max_position_embeddings": int(field(reader, "gemma3.context_length")),
        "rope_theta": float(field(reader, "gemma3.rope.freq_base")),
        "rope_local_base_freq": 10000.0,
        "rope_scaling": None,
        "sliding_window": int(field(reader, "gemma3.attention.sliding_window")),
        "sliding_window_pattern": pattern,
        "layer_types": ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(layers)],
        "hidden_activation": "gelu_pytorch_tanh",
        "final_logit_softcapping": None,
        "attn_logit_softcapping": None,
        "vocab_size": len(reader.fields["tokenizer.ggml.tokens"].data),
        "bos_token_id": int(field(reader, "tokenizer.ggml.bos_token_id")),
        "eos_token_id": int(field(reader, "tokenizer.ggml.eos_token_id")),
        "pad_token_id": int(field(reader, "tokenizer.ggml.padding_token_id")),
        "tie_word_embeddings": True,
        "torch_dtype": "bfloat16",
    }


def tensors(reader):
    out = {}
    for t in reader.tensors:
        values = dequantize(t.data, t.tensor_type).astype(np.float32)
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        values = values.reshape(shape)
        if t.name.endswith("norm.weight"):
            values = values - np.float32(1.0)
        out[hf_name(t.name)] = np.ascontiguousarray(values)
    return out


def tokenizer(reader, out_dir):
    renames = GGUF_TOKENIZER_MAPPING["tokenizer"]
    d = {}
    for key, name in renames.items():
        value = field(reader, f"tokenizer.{key}")
        if value is not None:
            d[name] = value
    backend, _ = convert_gguf_tokenizer("gemma3", d)
    tokens = d["tokens"]
    tok = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=tokens[d["bos_token_id"]],
        eos_token=tokens[d["eos_token_id"]],
        unk_token=tokens[d["unk_token_id"]],
        pad_token=tokens[d["pad_token_id"]],
        add_bos_token=bool(field(reader, "tokenizer.ggml.add_bos_token", True)),
        add_eos_token=bool(field(reader, "tokenizer.ggml.add_eos_token", False)),
    )
    tok.save_pretrained(out_dir)


def main():
    src, out_dir = Path(sys.argv[1]), Path(sys.argv[2])
    reader = GGUFReader(src)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "config.json").write_text(json.dumps(config(reader), indent=2) + "\n")
    save_file(tensors(reader), out_dir / "model.safetensors", metadata={"format": "pt"})
    tokenizer(reader, out_dir)


if __name__ == "__main__":
    main()
