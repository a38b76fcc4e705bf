#!/usr/bin/env python3
"""One whisper.cpp transcription timed, for `cargo xtask bench --speech`: load the ggml model, decode
the audio, then time `transcribe` alone (greedy, no timestamps). Prints one JSON line.

    bench_whisper_cpp.py GGML_MODEL AUDIO THREADS
"""
import json
import sys
import time

from pywhispercpp.model import Model

model_path, audio, threads = sys.argv[1], sys.argv[2], int(sys.argv[3])
m = Model(model_path, n_threads=threads, print_progress=False, print_realtime=False, no_timestamps=True)
samples = m._load_audio(audio)
start = time.perf_counter()
segments = m.transcribe(samples)
seconds = time.perf_counter() - start
print(json.dumps({"seconds": seconds, "text": " ".join(s.text.strip() for s in segments)}))
