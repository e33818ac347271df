#!/usr/bin/env python3
"""Load time and peak memory against llama.cpp (issue 45, item 4), in alternating rounds.

    python benches/load_compare.py MODEL.gguf [MODEL.gguf ...] [--rounds 3]
        [--binary target/release/tinygpt-cpu [--binary OTHER ...]] [--python PY]

Each round runs, for every model, one fresh process of each engine, alternating:

* ours: `tinygpt-cpu sample MODEL --prompt Hello --tokens 1 --temperature 0 --threads 1
  --json`; its `timing.load_s` (opening, checking and repacking the weights, building the
  tokenizer, encoding the prompt) and the process's peak RSS (`wait4`);
* llama.cpp (llama-cpp-python's bindings of the C API, as
  `benches/requirements-llamacpp.txt` installs them, in a child of `--python`): the time of
  `llama_model_load_from_file` (default parameters: mmap, the CPU repack buffers its
  build uses) plus `llama_init_from_model` (a 512-token f16 context, flash attention on) plus
  `llama_tokenize` of the same prompt, timed inside the child after `import llama_cpp`;
  the child's peak RSS includes the Python interpreter (about 10 MiB, printed as
  `python alone`).

`--binary` given more than once compares builds (say before and after a change): each
round runs every binary in turn, then llama.cpp, and the table has a row per model and
binary, each against the same llama.cpp runs.

Prints a markdown table of medians (and ranges) per model: load seconds, peak RSS, and
the ratios. The file's pages are in the page cache from the first round on for both (a
first round of each is run and not counted)."""
import argparse
import json
import os
import statistics
import subprocess
import sys

LLAMA_CHILD = r"""
import ctypes, json, sys, time
import llama_cpp as L
quiet = L.llama_log_callback(lambda level, text, user: None)
L.llama_log_set(quiet, None)
L.llama_backend_init()
path = sys.argv[1]
t0 = time.perf_counter()
m = L.llama_model_load_from_file(path.encode(), L.llama_model_default_params())
if not m:
    sys.exit("llama.cpp could not load " + path)
cp = L.llama_context_default_params()
cp.n_ctx = 512
cp.n_threads = 1
cp.n_threads_batch = 1
cp.flash_attn_type = L.LLAMA_FLASH_ATTN_TYPE_ENABLED
ctx = L.llama_init_from_model(m, cp)
raw = b"Hello"
arr = (L.llama_token * 64)()
n = L.llama_tokenize(L.llama_model_get_vocab(m), raw, len(raw), arr, 64, True, False)
load_s = time.perf_counter() - t0
print(json.dumps({"load_s": load_s, "tokens": n}))
"""


def measure(cmd):
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        os.dup2(w, 1)
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 2)
        os.execvp(cmd[0], cmd)
    os.close(w)
    chunks = []
    while True:
        b = os.read(r, 65536)
        if not b:
            break
        chunks.append(b)
    os.close(r)
    _, status, ru = os.wait4(pid, 0)
    if os.waitstatus_to_exitcode(status) != 0:
        sys.exit(f"{' '.join(cmd)} failed with status {status}")
    return b"".join(chunks).decode(), ru.ru_maxrss / 1024


def main() -> int:
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("models", nargs="+")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--binary", action="append",
                    help="tinygpt-cpu to run (default target/release/tinygpt-cpu); repeatable")
    ap.add_argument("--python", default=sys.executable, help="a Python with llama-cpp-python")
    args = ap.parse_args()
    binaries = args.binary or [os.path.join(root, "target", "release", "tinygpt-cpu")]
    _, py_rss = measure([args.python, "-c", "pass"])
    rows = {(m, b): {"ours": [], "ours_rss": []} for m in args.models for b in binaries}
    llama_rows = {m: {"llama": [], "llama_rss": []} for m in args.models}
    for rnd in range(args.rounds + 1):
        for m in args.models:
            got = []
            for b in binaries:
                out, rss = measure([b, "sample", m, "--prompt", "Hello", "--tokens", "1",
                                    "--temperature", "0", "--threads", "1", "--json"])
                got.append((b, json.loads(out)["timing"]["load_s"], rss))
            out, lrss = measure([args.python, "-c", LLAMA_CHILD, m])
            llama = json.loads(out)["load_s"]
            if rnd == 0:
                continue  # warms the page cache for both
            for b, ours, rss in got:
                rows[(m, b)]["ours"].append(ours)
                rows[(m, b)]["ours_rss"].append(rss)
                print(f"# round {rnd} {os.path.basename(m)}: {b}: {ours:.2f} s {rss:.0f} MiB",
                      file=sys.stderr, flush=True)
            llama_rows[m]["llama"].append(llama)
            llama_rows[m]["llama_rss"].append(lrss)
            print(f"# round {rnd} {os.path.basename(m)}: llama.cpp {llama:.2f} s {lrss:.0f} MiB",
                  file=sys.stderr, flush=True)
    med = statistics.median
    print(f"# {args.rounds} alternating rounds, medians (range); python alone {py_rss:.0f} MiB")
    print("| model | file MiB | ours load s | llama.cpp load s | ratio | ours peak RSS MiB | "
          "llama.cpp peak RSS MiB | ours RSS / file |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for (m, b), r in rows.items():
        size = os.path.getsize(m) / 2**20
        lr = llama_rows[m]
        rng = lambda v, f: f"{med(v):{f}} ({min(v):{f}}–{max(v):{f}})"
        name = os.path.basename(m) + (f" ({b})" if len(binaries) > 1 else "")
        print(f"| {name} | {size:.0f} | {rng(r['ours'], '.2f')} | "
              f"{rng(lr['llama'], '.2f')} | {med(r['ours']) / med(lr['llama']):.2f}× | "
              f"{rng(r['ours_rss'], '.0f')} | {rng(lr['llama_rss'], '.0f')} | "
              f"{med(r['ours_rss']) / size:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
