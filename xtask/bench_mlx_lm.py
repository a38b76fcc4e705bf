"""mlx-lm's prompt and generation speed on an MLX folder, as JSON (the peer of `cargo xtask bench --backend mlx`).

usage: bench_mlx_lm.py MODEL_DIR N_PROMPT N_GEN
Runs a prompt of N_PROMPT tokens and N_GEN greedy tokens through mlx_lm.stream_generate on MLX's default
device, and prints {"pp_tps": ..., "tg_tps": ...} from mlx-lm's own counters.
"""
import json
import sys

from mlx_lm import load, stream_generate
from mlx_lm.sample_utils import make_sampler

model_dir, n_prompt, n_gen = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
model, tokenizer = load(model_dir)
prompt = [(i * 7 + 3) % 10000 + 100 for i in range(n_prompt)]
last = None
for last in stream_generate(model, tokenizer, prompt, max_tokens=n_gen, sampler=make_sampler(temp=0.0)):
    pass
print(json.dumps({"pp_tps": last.prompt_tps, "tg_tps": last.generation_tps}))
