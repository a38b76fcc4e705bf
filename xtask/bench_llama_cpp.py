#!/usr/bin/env python3
"""The llama.cpp side of `cargo xtask bench`: pp (prompt processing) and tg (generation) tokens/s for a
GGUF file through llama-cpp-python, measured like llama-bench (random tokens, tg from an empty context,
one token per eval), and tg on top of contexts of DEPTHS tokens (prefilled untimed, as llama-bench's
`-d`). Prints one JSON object.

    bench_llama_cpp.py MODEL.gguf THREADS N_PROMPT N_GEN [DEPTHS, comma-separated]
"""
import json
import random
import sys
import time

from llama_cpp import Llama


def main():
    path, threads, n_prompt, n_gen = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    depths = [int(d) for d in sys.argv[5].split(",") if d] if len(sys.argv) > 5 else []
    n_ctx = max([n_prompt] + depths) + n_gen + 16
    llm = Llama(model_path=path, n_ctx=n_ctx, n_batch=n_prompt, n_ubatch=n_prompt,
                n_threads=threads, n_threads_batch=threads, verbose=False, logits_all=False)
    rng = random.Random(1)
    vocab = llm.n_vocab()
    prompt = [rng.randrange(vocab) for _ in range(n_prompt)]
    gen = [rng.randrange(vocab) for _ in range(n_gen)]
    context = [rng.randrange(vocab) for _ in range(max(depths, default=0))]
    # Warm-up.
    llm.reset()
    llm.eval(prompt[:32])
    llm.reset()
    t0 = time.perf_counter()
    llm.eval(prompt)
    pp = n_prompt / (time.perf_counter() - t0)
    llm.reset()
    t1 = time.perf_counter()
    for tok in gen:
        llm.eval([tok])
    tg = n_gen / (time.perf_counter() - t1)
    at_depth = []
    for depth in depths:
        llm.reset()
        llm.eval(context[:depth])
        t2 = time.perf_counter()
        for tok in gen:
            llm.eval([tok])
        at_depth.append({"depth": depth, "tg_tps": n_gen / (time.perf_counter() - t2)})
    print(json.dumps({"pp_tps": pp, "tg_tps": tg, "tg_at_depth": at_depth}))


if __name__ == "__main__":
    main()
