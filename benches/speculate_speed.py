#!/usr/bin/env python3
"""Speculative decoding's speed against plain decoding (issue 46), by prompt.

    python3 benches/speculate_speed.py MODEL [--bin target/release/tinygpt-cpu]
        [--prompts fixtures/speculate/prompts.json] [--tokens 200] [--threads 1]
        [--rounds 3] [--speculate ngram] [--draft-model FILE] [--idle-load 1.0] [--no-chat]

For each prompt of the set (through the model's chat template, or as plain text with
--no-chat for a model without one such as the PyPI Gemma 3 270M file; greedy, stopping at
the model's end-of-sequence token or after --tokens), runs `tinygpt-cpu sample --json` without
and with `--speculate`, alternating the two in each of --rounds rounds (a host whose speed
drifts favours neither), and prints per prompt the median decode tok/s of each, their ratio
with the per-round ratios as the spread, the acceptance rate and tokens per step. It checks
that both produce the same ids (greedy speculation is bit-identical) and fails otherwise.
Before each round it waits (up to a minute) for the 1-minute load average to fall under
--idle-load. With --draft-model, the speculative runs draft with that model
(`sample --draft-model FILE`) instead of `--speculate`; its reading of the prompt is
prefill time, so the decode tok/s compared here leave it out.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def run(args, model: str, prompt: str, spec: bool) -> dict:
    cmd = [args.bin, "sample", model, "--prompt", prompt, "--tokens", str(args.tokens),
           "--temperature", "0", "--threads", str(args.threads), "--json"]
    if not args.no_chat:
        cmd.append("--chat")
    if spec and args.draft_model:
        cmd += ["--draft-model", args.draft_model]
    elif spec:
        cmd += ["--speculate", args.speculate]
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode != 0:
        sys.exit(f"{' '.join(cmd[:3])} ... failed:\n{out.stderr.strip()}")
    return json.loads(out.stdout)


def wait_idle(max_load: float, timeout_s: float = 60.0) -> None:
    t0 = time.time()
    while os.getloadavg()[0] > max_load and time.time() - t0 < timeout_s:
        time.sleep(5)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("--bin", default=str(REPO / "target/release/tinygpt-cpu"))
    ap.add_argument("--prompts", default=str(REPO / "fixtures/speculate/prompts.json"))
    ap.add_argument("--tokens", type=int, default=200)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--speculate", default="ngram")
    ap.add_argument("--draft-model", help="draft with this model instead of --speculate")
    ap.add_argument("--idle-load", type=float, default=1.0)
    ap.add_argument("--no-chat", action="store_true",
                    help="send the prompts as plain text (a model without a chat template)")
    args = ap.parse_args()
    prompts = json.loads(Path(args.prompts).read_text())["prompts"]
    drafter = (f"--draft-model {Path(args.draft_model).name}" if args.draft_model
               else f"--speculate {args.speculate}")
    print(f"# {Path(args.model).name}, {args.threads} thread(s), {drafter}, "
          f"{args.rounds} alternating rounds, {'plain prompts' if args.no_chat else 'chat template'}, "
          f"host {os.uname().machine}")
    print("| prompt | kind | tokens | plain tok/s | speculate tok/s | ratio (rounds) | accepted | tokens/step |")
    print("|---|---|---:|---:|---:|---|---:|---:|")
    for p in prompts:
        plain, spec, ratios = [], [], []
        last = None
        for _ in range(args.rounds):
            wait_idle(args.idle_load)
            a = run(args, args.model, p["prompt"], False)
            b = run(args, args.model, p["prompt"], True)
            if a["generated_ids"] != b["generated_ids"]:
                sys.exit(f"{p['name']}: {drafter} changed the greedy ids")
            plain.append(a["timing"]["decode_tok_s"])
            spec.append(b["timing"]["decode_tok_s"])
            ratios.append(spec[-1] / plain[-1])
            last = b
        t = last["timing"]
        rate = t["accepted"] / t["drafted"] if t["drafted"] else 0.0
        mp, ms = statistics.median(plain), statistics.median(spec)
        spread = ", ".join(f"{r:.2f}" for r in ratios)
        print(f"| {p['name']} | {p['kind']} | {len(last['generated_ids'])} | {mp:.1f} | {ms:.1f} | "
              f"**{ms / mp:.2f}×** ({spread}) | {100 * rate:.0f}% of {t['drafted']} | "
              f"{t['tokens_per_step']:.2f} |")


if __name__ == "__main__":
    main()
