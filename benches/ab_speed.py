#!/usr/bin/env python3
"""Alternating A/B decode and prefill speed of two tinygpt-cpu binaries (issue 47: within 3%).

Usage: python3 benches/ab_speed.py NEW_BINARY BASE_BINARY [ROUNDS]
SmolLM2-135M Q4_1 and Gemma 3 270M Q4_K_M from the fetch scripts cache, a ~100-token prompt,
64 greedy tokens, 1 and 2 threads; the order of the two binaries alternates by round.
"""
import json, subprocess, statistics, sys
bins = {"base": sys.argv[2], "new": sys.argv[1]}
import os
cache = os.environ.get("TINYGPT_CACHE", os.path.expanduser("~/.cache/tinygpt-cpu"))
models = {"smollm2-q4_1": f"{cache}/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
          "gemma3-q4_k_m": f"{cache}/gemma3/gemma-3-270m-q4_k_m.gguf"}
prompt = ("The history of the city begins with a small settlement on the river, where traders "
          "from the north met farmers from the valley. Over the centuries the market grew into a town, "
          "the town built walls, and the walls were torn down again when the railway arrived. Today the "
          "old quarter keeps its narrow streets, its bridges and its bell tower, and visitors come in "
          "summer to walk along the water and to eat in the squares. Tell me more about it:")
rounds = int(sys.argv[3]) if len(sys.argv) > 3 else 3
res = {}
for r in range(rounds):
    for m, path in models.items():
        for t in (1, 2):
            order = ["base", "new"] if r % 2 == 0 else ["new", "base"]
            for b in order:
                out = subprocess.run([bins[b], "sample", path, "--prompt", prompt, "--tokens", "64",
                                      "--temperature", "0", "--ignore-eos", "--threads", str(t), "--json"],
                                     capture_output=True, text=True, check=True)
                d = json.loads(out.stdout)["timing"]
                res.setdefault((m, t, b), []).append((d["decode_tok_s"], d["prefill_tok_s"]))
print("| model | threads | base decode | new decode | ratio | base prefill | new prefill | ratio |")
print("|---|---:|---:|---:|---:|---:|---:|---:|")
for m in models:
    for t in (1, 2):
        b, n = res[(m, t, "base")], res[(m, t, "new")]
        bd, nd = [x[0] for x in b], [x[0] for x in n]
        bp, np_ = [x[1] for x in b], [x[1] for x in n]
        f = lambda v: f"{statistics.median(v):.1f} ({min(v):.1f}–{max(v):.1f})"
        print(f"| {m} | {t} | {f(bd)} | {f(nd)} | {statistics.median(nd)/statistics.median(bd):.3f} | "
              f"{f(bp)} | {f(np_)} | {statistics.median(np_)/statistics.median(bp):.3f} |")
