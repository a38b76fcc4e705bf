"""The peer of `mlxcel bench-embed` for `cargo xtask bench --embeddings`: the same sets of texts through
sentence-transformers on CPU PyTorch (or, where sentence-transformers is not installed, the same
computation written with transformers: the tokenizer truncating at the model's max_seq_length, the
encoder, mean pooling over the real tokens, L2 normalisation — what all-MiniLM-L6-v2's modules.json
says), each set as one batch, in float32.

Usage: bench_sentence_transformers.py MODEL_DIR TEXTS_JSON THREADS REPS
Prints one JSON line: {"impl", "sets": {name: {"texts", "seconds", "embeddings_per_s"}}}.
"""
import json
import os
import statistics
import sys
import time

import torch

model_dir, texts_path, threads, reps = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
torch.set_num_threads(threads)
sets = json.load(open(texts_path))

try:
    from sentence_transformers import SentenceTransformer

    st = SentenceTransformer(model_dir, device="cpu")
    impl = "sentence-transformers"

    def embed(texts):
        return st.encode(texts, batch_size=len(texts), convert_to_numpy=True, normalize_embeddings=False)
except ImportError:
    from transformers import AutoModel, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModel.from_pretrained(model_dir).eval()
    max_len = json.load(open(os.path.join(model_dir, "sentence_bert_config.json")))["max_seq_length"]
    impl = "transformers (sentence-transformers' mean pooling + normalise)"

    def embed(texts):
        with torch.inference_mode():
            b = tok(texts, padding=True, truncation=True, max_length=max_len, return_tensors="pt")
            h = model(**b).last_hidden_state
            m = b["attention_mask"].unsqueeze(-1).float()
            return torch.nn.functional.normalize((h * m).sum(1) / m.sum(1), dim=-1)

out = {}
for name, texts in sets.items():
    embed(texts)  # warm-up
    seconds = []
    for _ in range(reps):
        t0 = time.perf_counter()
        embed(texts)
        seconds.append(time.perf_counter() - t0)
    s = statistics.median(seconds)
    out[name] = {"texts": len(texts), "seconds": s, "embeddings_per_s": len(texts) / s}
print(json.dumps({"impl": impl, "torch": torch.__version__, "sets": out}))
