#!/usr/bin/env python3
"""Writes a Hugging Face Whisper folder (config.json, model.safetensors, tokenizer.json) as the ggml file
whisper.cpp loads, the layout of whisper.cpp's models/convert-h5-to-ggml.py, without torch: numpy reads the
safetensors, the mel filter bank is librosa's (Slaney) computed here. Used by `cargo xtask bench` to run
the same checkpoint in whisper.cpp (pywhispercpp) beside mlxcel.

    whisper_ggml.py MODEL_DIR OUT.bin
"""
import json
import os
import struct
import sys

import numpy as np


def read_safetensors(path):
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
        base = 8 + n
        out = {}
        for name, t in header.items():
            if name == "__metadata__":
                continue
            dt = {"F16": np.float16, "F32": np.float32, "BF16": None}[t["dtype"]]
            a, b = t["data_offsets"]
            f.seek(base + a)
            out[name] = np.frombuffer(f.read(b - a), dtype=dt).reshape(t["shape"])
    return out


def mel_filters(sr, n_fft, n_mels):
    f_sp, min_log_hz = 200.0 / 3, 1000.0
    min_log_mel, logstep = min_log_hz / f_sp, np.log(6.4) / 27.0

    def hz_to_mel(f):
        return np.where(f >= min_log_hz, min_log_mel + np.log(np.maximum(f, 1e-10) / min_log_hz) / logstep, f / f_sp)

    def mel_to_hz(m):
        return np.where(m >= min_log_mel, min_log_hz * np.exp(logstep * (m - min_log_mel)), f_sp * m)

    fft = np.linspace(0, sr / 2, 1 + n_fft // 2)
    mel_f = mel_to_hz(np.linspace(hz_to_mel(np.float64(0)), hz_to_mel(np.float64(sr / 2)), n_mels + 2))
    fdiff, ramps = np.diff(mel_f), np.subtract.outer(mel_f, fft)
    w = np.zeros((n_mels, len(fft)))
    for i in range(n_mels):
        w[i] = np.maximum(0, np.minimum(-ramps[i] / fdiff[i], ramps[i + 2] / fdiff[i + 1]))
    return (w * (2.0 / (mel_f[2:] - mel_f[:-2]))[:, None]).astype(np.float32)


def byte_decoder():
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


RENAME = [
    ("model.", ""), (".layers.", ".blocks."), ("self_attn_layer_norm", "attn_ln"), ("encoder_attn_layer_norm", "cross_attn_ln"),
    ("final_layer_norm", "mlp_ln"), ("self_attn.", "attn."), ("encoder_attn.", "cross_attn."), ("q_proj", "query"),
    ("k_proj", "key"), ("v_proj", "value"), ("out_proj", "out"), (".fc1.", ".mlp.0."), (".fc2.", ".mlp.2."),
    ("embed_positions.weight", "positional_embedding"), ("embed_tokens", "token_embedding"),
    ("encoder.layer_norm", "encoder.ln_post"), ("decoder.layer_norm", "decoder.ln"),
]


def main():
    src, dst = sys.argv[1:3]
    cfg = json.load(open(os.path.join(src, "config.json")))
    tensors = read_safetensors(os.path.join(src, "model.safetensors"))
    vocab = json.load(open(os.path.join(src, "tokenizer.json")))["model"]["vocab"]
    with open(dst, "wb") as f:
        f.write(struct.pack("i", 0x67676D6C))
        for k in ["vocab_size", "max_source_positions", "d_model", "encoder_attention_heads", "encoder_layers",
                  "max_target_positions", "d_model", "decoder_attention_heads", "decoder_layers", "num_mel_bins"]:
            f.write(struct.pack("i", cfg[k]))
        f.write(struct.pack("i", 1))  # f16 weights
        filters = mel_filters(16000, 400, cfg["num_mel_bins"])
        f.write(struct.pack("ii", *filters.shape))
        f.write(filters.tobytes())
        dec = byte_decoder()
        f.write(struct.pack("i", len(vocab)))
        for tok, _ in sorted(vocab.items(), key=lambda kv: kv[1]):
            b = bytes(dec[c] for c in tok)
            f.write(struct.pack("i", len(b)))
            f.write(b)
        for name, data in tensors.items():
            for a, b in RENAME:
                name = name.replace(a, b)
            data = data.squeeze() if data.ndim > 1 else data
            if name in ("encoder.conv1.bias", "encoder.conv2.bias"):
                data = data.reshape(data.shape[0], 1)
            small = data.ndim < 2 or name.endswith(("conv1.bias", "conv2.bias", "positional_embedding"))
            data, ftype = (data.astype(np.float32), 0) if small else (data.astype(np.float16), 1)
            raw = name.encode()
            f.write(struct.pack("iii", data.ndim, len(raw), ftype))
            for d in reversed(data.shape):
                f.write(struct.pack("i", d))
            f.write(raw)
            f.write(np.ascontiguousarray(data).tobytes())


if __name__ == "__main__":
    main()
