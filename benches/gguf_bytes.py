#!/usr/bin/env python3
"""Bytes a decode step reads from a GGUF's weights, by tensor type and by role (issue 45).

    python benches/gguf_bytes.py MODEL.gguf

A decode step reads every weight matrix once, except the token embedding, of which it reads
one row (unless the output head is tied to it: then the head reads all of it). Prints one
row per (role, type): tensors, bytes, and the share of the step's bytes; roles are the
attention projections (q/k/v/output), the feed-forward ones (gate/up/down), the output head
and the rest (norms, biases). Needs gguf-py (benches/requirements-llamacpp.txt).
"""
import sys
from collections import defaultdict

import gguf


def role(name: str) -> str:
    if name in ("output.weight",):
        return "head"
    if name == "token_embd.weight":
        return "embedding"
    for r in ("attn_q.", "attn_k.", "attn_v.", "attn_output."):
        if r in name and name.endswith(".weight"):
            return r[:-1]
    for r in ("ffn_gate.", "ffn_up.", "ffn_down."):
        if r in name and name.endswith(".weight"):
            return r[:-1]
    return "norms/biases"


def main() -> int:
    if len(sys.argv) != 2:
        sys.exit(__doc__.split("\n\n")[1])
    r = gguf.GGUFReader(sys.argv[1])
    tied = not any(t.name == "output.weight" for t in r.tensors)
    rows = defaultdict(lambda: [0, 0])
    for t in r.tensors:
        kind = role(t.name)
        n = int(t.n_bytes)
        if kind == "embedding":
            if tied:
                kind = "head (tied embedding)"
            else:
                n //= int(t.shape[-1])  # one row of (vocab, hidden)
                kind = "embedding (one row)"
        key = (kind, t.tensor_type.name)
        rows[key][0] += 1
        rows[key][1] += n
    total = sum(b for _, b in rows.values())
    print(f"# {sys.argv[1]}: {total / 1e6:.1f} MB read per decode step")
    print("| role | type | tensors | MB | share |")
    print("|---|---|---:|---:|---:|")
    for (kind, ty), (count, b) in sorted(rows.items(), key=lambda kv: -kv[1][1]):
        print(f"| {kind} | {ty} | {count} | {b / 1e6:.1f} | {100 * b / total:.1f}% |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
