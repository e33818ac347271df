#!/usr/bin/env python3
"""Two tinygpt-cpu binaries A/B (a change against its base; issue 47 asked for ±3%).

Decode and prefill tok/s of both on SmolLM2-135M Q4_1 and Gemma 3 270M Q4_K_M (the fetch
scripts' cache), a ~100-token prompt, 64 greedy tokens, 1 and 2 threads, in alternating
rounds (base first in odd rounds, new first in even ones); each row reports both medians
with min–max and the ratio new/base. Runs go through `llamacpp_compare.run_ours`, the same
`sample --json` call the llama.cpp comparison times.

Usage: python3 benches/ab_speed.py NEW_BIN BASE_BIN [--rounds 3] [--kv fp32] [-- EXTRA FLAGS]
"""
import argparse
import os
import statistics
import sys

from llamacpp_compare import run_ours, wait_idle

CACHE = os.environ.get("TINYGPT_CACHE", os.path.expanduser("~/.cache/tinygpt-cpu"))
MODELS = {
    "smollm2-q4_1": f"{CACHE}/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    "gemma3-q4_k_m": f"{CACHE}/gemma3/gemma-3-270m-q4_k_m.gguf",
}
PROMPT = (
    "The history of the city begins with a small settlement on the river, where traders "
    "from the north met farmers from the valley. Over the centuries the market grew into a "
    "town, the town built walls, and the walls were torn down again when the railway arrived. "
    "Today the old quarter keeps its narrow streets, its bridges and its bell tower, and "
    "visitors come in summer to walk along the water and to eat in the squares. Tell me more "
    "about it:"
)


def spread(v):
    return f"{statistics.median(v):.1f} ({min(v):.1f}–{max(v):.1f})"


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("new")
    ap.add_argument("base")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--kv", default="fp32", help="--kv-quantize of both runs")
    argv = sys.argv[1:]
    cut = argv.index("--") if "--" in argv else len(argv)
    args = ap.parse_args(argv[:cut])
    extra = argv[cut + 1:]  # more `sample` flags for both runs
    print(f"# load average before: {wait_idle(0.5, 120):.2f}")
    bins = {"base": args.base, "new": args.new}
    res = {}
    for r in range(args.rounds):
        for name, path in MODELS.items():
            for t in (1, 2):
                for b in (["base", "new"] if r % 2 == 0 else ["new", "base"]):
                    d = run_ours(bins[b], path, PROMPT, args.tokens, t, args.kv, extra)
                    timing = d["timing"]
                    res.setdefault((name, t, b), []).append(
                        (timing["decode_tok_s"], timing["prefill_tok_s"]))
    print("| model | threads | base decode | new decode | ratio | base prefill | new prefill | ratio |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for name in MODELS:
        for t in (1, 2):
            row = [f"| {name} | {t} "]
            for k in (0, 1):
                b = [x[k] for x in res[(name, t, "base")]]
                n = [x[k] for x in res[(name, t, "new")]]
                ratio = statistics.median(n) / statistics.median(b)
                row.append(f"| {spread(b)} | {spread(n)} | {ratio:.3f} ")
            print("".join(row) + "|")


if __name__ == "__main__":
    main()
