#!/usr/bin/env python3
"""Per-token overhead of the Python streaming iterator, against the CLI's decode speed.

    python python/benches/bench_stream.py [--model PATH] [--tokens 256] [--rounds 5] [--threads N]
        [--bin target/release/tinygpt-cpu]

Each round runs, one after the other, the same greedy generation (``--ignore-eos``, the
default dense fp32 cache) twice:

* ``tinygpt-cpu sample MODEL --json``: its ``timing.decode_tok_s`` (decode steps over the
  decode loop's wall time);
* ``Model(MODEL)(prompt, stream=True)`` in this process: chunks after the first, over the
  wall time from the first chunk to the last (each chunk is one token, so this is the
  same count of decode steps).

It prints each round and the medians, and the overhead ``1 - python / cli``. Alternating
the two keeps a machine whose speed drifts (another process, thermal limits) from
favouring one of them; on a machine shared with other work the spread between rounds is
the error bar.

A third number needs no second process: within one stream, the time between tokens
against the engine's own time per decode step (forward pass and sample, as the native
iterator under the stream measures it): ``1 - wall / engine`` is the time spent outside the
engine (the iterator, the interpreter, building chunks), immune to drifts between runs.

Model default: SmolLM2 at ``TINYGPT_SMOLLM2`` or where ``scripts/fetch-smollm2.sh`` puts it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import time
from pathlib import Path
from typing import List, Optional

import tinygpt_cpu

REPO = Path(__file__).resolve().parents[2]
SMOLLM2 = Path.home() / ".cache/tinygpt-cpu/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
PROMPT = "Once upon a time"


def cli_rate(binary: str, model: str, tokens: int, threads: Optional[int]) -> float:
    args = [binary, "sample", model, "--prompt", PROMPT, "--tokens", str(tokens),
            "--temperature", "0", "--ignore-eos", "--json"]
    if threads is not None:
        args += ["--threads", str(threads)]
    p = subprocess.run(args, capture_output=True, text=True, check=True)
    return float(json.loads(p.stdout)["timing"]["decode_tok_s"])


def python_rate(m: tinygpt_cpu.Model, tokens: int) -> float:
    stamps: List[float] = []
    for _ in m(PROMPT, max_tokens=tokens, temperature=0, ignore_eos=True, stream=True):
        stamps.append(time.perf_counter())
    assert len(stamps) == tokens, len(stamps)
    return (len(stamps) - 1) / (stamps[-1] - stamps[0])


def in_run_overhead(m: tinygpt_cpu.Model, tokens: int) -> float:
    """1 - (tokens per second between chunks) / (the engine's decode steps per second), in
    one stream: the iterator under ``stream=True`` (private API), wrapped as the public
    stream wraps it."""
    gen = m._model.generate(PROMPT, ["--temperature=0", "--ignore-eos"], tokens, [], False)
    stamps: List[float] = []
    for _, text, finish in gen:
        {"choices": [{"text": text, "index": 0, "logprobs": None, "finish_reason": finish}]}
        stamps.append(time.perf_counter())
    wall = (len(stamps) - 1) / (stamps[-1] - stamps[0])
    return 1 - wall / gen.decode_tok_s


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=os.environ.get("TINYGPT_SMOLLM2") or str(SMOLLM2))
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--bin", default=str(REPO / "target/release/tinygpt-cpu"))
    a = ap.parse_args()

    m = tinygpt_cpu.Model(a.model, threads=a.threads)
    python_rate(m, 16)  # warm-up: page in the weights
    cli, py, inner = [], [], []
    for r in range(a.rounds):
        cli.append(cli_rate(a.bin, a.model, a.tokens, a.threads))
        py.append(python_rate(m, a.tokens))
        inner.append(in_run_overhead(m, a.tokens))
        print(
            f"round {r + 1}: cli {cli[-1]:.1f} tok/s, python stream {py[-1]:.1f} tok/s, "
            f"outside the engine {100 * inner[-1]:.1f}%"
        )
    c, p = statistics.median(cli), statistics.median(py)
    print(
        f"median: cli {c:.1f} tok/s, python stream {p:.1f} tok/s, overhead {100 * (1 - p / c):+.1f}%; "
        f"outside the engine within a stream {100 * statistics.median(inner):.1f}%"
    )


if __name__ == "__main__":
    main()
