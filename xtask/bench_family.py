#!/usr/bin/env python3
"""Writes the checkpoints `cargo xtask bench --family` measures: one random MLX 4-bit checkpoint per
model_type, all of the same shape, made by mlx-lm (the reference implementation) the way
`mlx_lm.convert -q` writes them (mlx_lm.utils.quantize_model, group 64, 4 bits).

    python bench_family.py OUT_DIR

Shape of every case: hidden 512, 8 layers, 8 query heads / 4 KV heads of head_dim 64, MLP width 1536,
vocabulary 32000 (the tokenizer is golden_common's small one: the bench feeds random token ids), each
family with its own features on:

  llama        plain Llama (tied head).
  qwen3        per-head q/k RMSNorm, explicit head_dim.
  gemma3_text  (1 + w) norms, four norms per layer, GELU-tanh MLP, sliding window 128 on 5 of every 6
               layers (sliding_window_pattern 6: layer 5 global) with their own rope base, q/k norms,
               embedding scaled by sqrt(hidden).
  phi3         fused qkv_proj and gate_up_proj, partial rotary 0.75.
  glm4         four norms per layer, q/k/v biases, fused gate_up_proj, partial interleaved rotary 0.5,
               separate lm_head (mlx-lm always unties it).
  lfm2         5 gated short-convolution layers (kernel 3) and 3 attention layers with q/k norms.
  qwen3_moe    every layer sparse: 8 experts of width 1536, top-2, norm_topk_prob (router 8-bit, as
               qwen3_moe's quant_predicate says).
  llama-dense8 the MoE's dense equivalent: a llama whose MLP is as wide as all 8 experts together
               (8 x 1536 = 12288), i.e. the cost of computing every expert.

Every folder is loaded back with mlx-lm's loader. A folder whose bench_config.json already equals the
case's config is kept as it is. OUT_DIR/families.json lists the cases: name, model_type, folder,
parameters (before quantization) and parameters used per token (for the MoE: only 2 of 8 experts).
"""
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tools", "fixtures"))
import golden_common  # noqa: E402
import mlx.core as mx  # noqa: E402
from mlx.utils import tree_flatten  # noqa: E402
from mlx_lm.utils import load_model, quantize_model  # noqa: E402

HIDDEN, LAYERS, HEADS, KV_HEADS, HEAD_DIM, INTER, VOCAB = 512, 8, 8, 4, 64, 1536, 32000
EXPERTS, TOP_K = 8, 2
GROUP, BITS = 64, 4
SEED = 1234
# Bumped when the way a folder is written changes, so cached folders are rewritten.
VERSION = 1

BASE = dict(
    hidden_size=HIDDEN,
    num_hidden_layers=LAYERS,
    intermediate_size=INTER,
    num_attention_heads=HEADS,
    num_key_value_heads=KV_HEADS,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    max_position_embeddings=4096,
    vocab_size=VOCAB,
    hidden_act="silu",
)

LFM2_LAYERS = ["conv", "conv", "full_attention", "conv", "conv", "full_attention", "conv", "full_attention"]
GEMMA3_PATTERN = 6

CASES = {
    "llama": dict(BASE, model_type="llama", architectures=["LlamaForCausalLM"], tie_word_embeddings=True),
    "qwen3": dict(BASE, model_type="qwen3", architectures=["Qwen3ForCausalLM"], head_dim=HEAD_DIM,
                  rope_theta=1000000.0, tie_word_embeddings=True),
    "gemma3_text": dict(
        model_type="gemma3_text", architectures=["Gemma3ForCausalLM"], hidden_size=HIDDEN,
        num_hidden_layers=LAYERS, intermediate_size=INTER, num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM, rms_norm_eps=1e-6, rope_theta=1000000.0,
        rope_local_base_freq=10000.0, query_pre_attn_scalar=HEAD_DIM, sliding_window=128,
        sliding_window_pattern=GEMMA3_PATTERN,
        layer_types=["full_attention" if (i + 1) % GEMMA3_PATTERN == 0 else "sliding_attention"
                     for i in range(LAYERS)],
        max_position_embeddings=4096, vocab_size=VOCAB, hidden_activation="gelu_pytorch_tanh",
        final_logit_softcapping=None, attn_logit_softcapping=None),
    "phi3": dict(BASE, model_type="phi3", architectures=["Phi3ForCausalLM"], partial_rotary_factor=0.75,
                 original_max_position_embeddings=4096, tie_word_embeddings=True),
    "glm4": dict(BASE, model_type="glm4", architectures=["Glm4ForCausalLM"], head_dim=HEAD_DIM,
                 attention_bias=True, partial_rotary_factor=0.5, tie_word_embeddings=False),
    "lfm2": dict(
        model_type="lfm2", architectures=["Lfm2ForCausalLM"], hidden_size=HIDDEN, block_dim=HIDDEN,
        conv_dim=HIDDEN, conv_dim_out=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
        num_heads=HEADS, num_key_value_heads=KV_HEADS, max_position_embeddings=4096, norm_eps=1e-5,
        block_norm_eps=1e-5, rope_theta=1000000.0, block_multiple_of=256, block_ffn_dim_multiplier=1.0,
        block_use_swiglu=True, tie_embedding=True, layer_types=LFM2_LAYERS,
        full_attn_idxs=[i for i, t in enumerate(LFM2_LAYERS) if t == "full_attention"], conv_L_cache=3,
        conv_bias=False, block_ff_dim=INTER, block_auto_adjust_ff_dim=False, vocab_size=VOCAB),
    "qwen3_moe": dict(BASE, model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"], head_dim=HEAD_DIM,
                      rope_theta=1000000.0, num_experts=EXPERTS, num_experts_per_tok=TOP_K,
                      moe_intermediate_size=INTER, decoder_sparse_step=1, mlp_only_layers=[],
                      norm_topk_prob=True, tie_word_embeddings=True),
    "llama-dense8": dict(BASE, model_type="llama", architectures=["LlamaForCausalLM"],
                         intermediate_size=EXPERTS * INTER, tie_word_embeddings=True),
}


def counts(model, cfg, drop):
    """(parameters, parameters used per token): an MoE uses top_k of its experts per token. Tensors
    named by `drop` are not written (a tied head), so not counted."""
    params = [(k, v) for k, v in tree_flatten(model.parameters()) if not drop(k)]
    total = sum(v.size for _, v in params)
    active = total
    if cfg.get("num_experts"):
        experts = sum(v.size for k, v in params if ".switch_mlp." in k)
        active = total - experts + experts * cfg["num_experts_per_tok"] // cfg["num_experts"]
    return total, active


def write(folder, name, cfg, tok_path):
    stamp = dict(version=VERSION, seed=SEED, group_size=GROUP, bits=BITS, config=cfg)
    stamp_path = folder / "bench_config.json"
    if stamp_path.is_file() and json.loads(stamp_path.read_text()).get("stamp") == stamp:
        return json.loads(stamp_path.read_text())["counts"], False
    folder.mkdir(parents=True, exist_ok=True)
    stamp_path.unlink(missing_ok=True)
    # gemma3_text's head is tied by leaving lm_head out (mlx-lm's sanitize then ties it).
    drop = (lambda k: k.startswith("lm_head.")) if name == "gemma3_text" else (lambda k: False)
    model = golden_common.build_model(cfg, SEED)
    n = counts(model, cfg, drop)
    model, qcfg = quantize_model(model, dict(cfg), group_size=GROUP, bits=BITS)
    weights = {k: v for k, v in tree_flatten(model.parameters()) if not drop(k)}
    mx.save_safetensors(str(folder / "model.safetensors"), weights)
    (folder / "config.json").write_text(json.dumps(qcfg, indent=1))
    golden_common.write_tokenizer_files(str(folder), tok_path)
    # mlx-lm's own loader reads it back (the files are what mlx-lm would have written).
    load_model(folder)
    stamp_path.write_text(json.dumps(dict(stamp=stamp, counts=n)))
    return n, True


def main():
    if len(sys.argv) != 2:
        raise SystemExit(__doc__)
    out = Path(sys.argv[1]).resolve()
    out.mkdir(parents=True, exist_ok=True)
    tok_path = str(out / "tokenizer.json")
    golden_common.make_tokenizer(tok_path)
    rows = []
    for name, cfg in CASES.items():
        folder = out / name
        (total, active), wrote = write(folder, name, cfg, tok_path)
        print(f"{name}: {'written' if wrote else 'cached'} {folder} ({total / 1e6:.1f} M parameters, "
              f"{active / 1e6:.1f} M per token)", file=sys.stderr)
        rows.append(dict(name=name, model_type=cfg["model_type"], dir=str(folder), params=total, active_params=active))
    (out / "families.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
