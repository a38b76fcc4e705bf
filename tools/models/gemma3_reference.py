"""mlx-lm's answers for the Gemma 3 checkpoint that fetch_gemma3.sh converts, as JSON for the Rust tests.

    gemma3_reference.py MLX_DIR OUT.json

For each prompt: mlx-lm's greedy continuation (through its KV cache), and, for every position of the
prompt and that continuation in one forward pass without a cache, the top TOP_K logits and the margin
between the first two (so a test knows where a choice is a near-tie that float noise may flip).
Computed in float32 (the bf16 weights and quantization scales widened; the 4-bit values are mlx-lm's
own) — the precision mlxcel computes in. mlx-lm's default bf16 compute picks different tokens at near
ties (e.g. " popular" for " important" after "The capital of France is a very", a 0.3-logit margin).
"""
import json
import sys

import mlx.core as mx
from mlx.utils import tree_map
from mlx_lm import load
from mlx_lm.generate import generate_step
from mlx_lm.sample_utils import make_sampler

REFERENCE = "mlx-lm 0.32.2 / mlx 0.32.4 (CPU), float32 compute"
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n",
    "The first president of the United States was",
    "1, 2, 3, 4, 5, 6,",
]
N_GREEDY = 20
TOP_K = 8


def main():
    model_dir, out = sys.argv[1], sys.argv[2]
    model, tok = load(model_dir)
    widen = lambda p: p.astype(mx.float32) if p.dtype in (mx.bfloat16, mx.float16) else p
    model.update(tree_map(widen, model.parameters()))
    greedy = make_sampler(temp=0.0)
    cases = []
    for prompt in PROMPTS:
        ids = tok.encode(prompt)
        new = []
        for token, _ in generate_step(mx.array(ids), model, max_tokens=N_GREEDY, sampler=greedy):
            if int(token) in tok.eos_token_ids:
                break
            new.append(int(token))
        seq = ids + new
        logits = model(mx.array([seq]))[0].astype(mx.float32)
        top = []
        for pos in range(len(seq)):
            row = logits[pos]
            order = mx.argsort(-row)[:TOP_K].tolist()
            top.append([[i, round(row[i].item(), 4)] for i in order])
        # The cached greedy path and the one-pass logits must agree where the choice is not a near-tie.
        for k, t in enumerate(new):
            row = top[len(ids) - 1 + k]
            if row[0][1] - row[1][1] > 1e-3:
                assert row[0][0] == t, f"{prompt!r}: cached greedy token {k} is {t}, one-pass argmax {row[0][0]}"
        cases.append({"prompt": prompt, "ids": ids, "greedy": new, "text": tok.decode(new), "top": top})
        print(f"{prompt!r} -> {tok.decode(new)!r}", file=sys.stderr)
    with open(out, "w") as f:
        json.dump({"reference": REFERENCE, "top_k": TOP_K, "cases": cases}, f, indent=1)
        f.write("\n")


if __name__ == "__main__":
    main()
