#!/usr/bin/env python3
"""Decode and prefill tok/s of llama.cpp (through its C API) beside tinygpt-cpu on the same GGUF.

Same model file (SmolLM2-135M-Instruct Q4_1 from scripts/fetch-smollm2.sh), same thread
count, same prompt text, greedy, at contexts of about 128, 1K and 4K tokens: the prompt is
`context - decode` tokens of fixtures/heldout.txt, then `decode` (64) tokens are decoded
one at a time and only that decode phase is timed. KV cache: llama.cpp f16/q8_0/q4_0
(flash attention on, which llama.cpp requires for a quantised V cache) against
tinygpt-cpu fp16/int8/int4. A separate row per thread count times the prefill of a
256-token prompt (f16 / fp16 cache) on both.

  * llama.cpp: through its C API, as llama-bench does: llama-cpp-python's low-level ctypes
    bindings call `llama_init_from_model`, `llama_decode` (prompt in batches of 512, then
    one token per call) and llama.cpp's native greedy sampler (`llama_sampler_sample`).
    No logits are copied into Python and no Python argmax runs. OpenMP's wait policy is
    left at its default (the script warns when OMP_WAIT_POLICY is set).
  * tinygpt-cpu: `target/release/tinygpt-cpu sample MODEL --prompt P --tokens decode+1
    --temperature 0 --ignore-eos --json --threads T --kv-quantize K`; its
    `timing.decode_tok_s` covers the `decode` forward passes after the first sampled
    token (the first comes from the prefill logits, as for llama.cpp).

Before each row the script waits (up to --idle-timeout seconds) for the 1-minute load
average to fall to --idle-load, and prints the load it saw. Each row runs `--repeats`
(default 3) alternating rounds: llama.cpp, then ours, then llama.cpp again, ... so host
drift hits both engines alike. A row reports each engine's median with its spread
(min–max over the rounds) and the ratio of the medians. For the f16 cache llama.cpp runs
with flash attention off and on in every round and its faster median counts (its best
setting); a quantised V cache needs flash attention on. `--background-load N` keeps N
CPU-bound processes (a busy loop each) running during every row, for both engines alike,
as a browser tab or a build would. `match` is how many of the greedy tokens agree (a
sanity check that both run the same model on the same prompt; quantised caches may
legitimately diverge after a while). `st%L` / `st%O` are the host's steal time during
llama.cpp's / our runs of the row, as a percentage of all CPU time then (from /proc/stat:
time the hypervisor gave our vCPUs to another guest; JSON `steal_pct_llama` /
`steal_pct_ours`), so a row slowed by the host rather than by the engines shows it.
`--interleave` runs every row once per round instead (round 1: each row in turn, round 2:
...), under one background load and one idle wait: rows that are compared with each other
(our thread counts, say) then see the same drift, not minutes apart. Every run's tok/s
is also printed to stderr as it finishes (`# round R threads T CONTEXT KV: ...`).

Usage:
    python3 -m venv /root/benchenv
    CMAKE_ARGS="-DGGML_NATIVE=ON" /root/benchenv/bin/pip install -r benches/requirements-llamacpp.txt
    cargo build --release
    /root/benchenv/bin/python benches/llamacpp_compare.py [--threads 1,2] \
        [--contexts 128,1024,4096] [--repeats 3] [--background-load 1] [--json rows.json]

On Intel hosts with AMX, a `-DGGML_NATIVE=ON` build can fault in ggml's AMX path inside a
VM; build with GGML_NATIVE=OFF and the AVX/AVX2/AVX-512 flags listed in
benches/README.md instead. Without llama-cpp-python installed the llama.cpp column is
left empty (`--ours-only` does the same on purpose).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import multiprocessing
import os
import statistics
import platform
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# llama.cpp KV type name -> (ggml_type id, our --kv-quantize)
KV_TYPES = {
    "f16": (1, "fp16"),
    "q8_0": (8, "int8"),
    "q4_0": (2, "int4"),
}


def cpu_name() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        for line in out.splitlines():
            if line.startswith("Model name:"):
                return line.split(":", 1)[1].strip()
    except (OSError, subprocess.CalledProcessError):
        pass
    return platform.processor() or platform.machine()


def fetch_model() -> str:
    out = subprocess.run(
        ["bash", str(ROOT / "scripts" / "fetch-smollm2.sh")],
        capture_output=True, text=True, check=True,
    )
    return out.stdout.strip().splitlines()[-1]


def source_text() -> str:
    text = (ROOT / "fixtures" / "heldout.txt").read_text(encoding="utf-8")
    return text * 2  # far more than 4K tokens either way


class Tokens:
    """Counts prompt tokens: llama.cpp's tokenizer when available, else our binary."""

    def __init__(self, model: str, binary: str, llama):
        self.model = model
        self.binary = binary
        self.llama = llama
        self.chars_per_token = None

    def count(self, text: str) -> int:
        if self.llama is not None:
            return len(self.llama.tokenize(self.model, text))
        res = run_ours(self.binary, self.model, text, 1, 1, "fp32")
        return len(res["prompt_ids"])

    def prompt_of(self, n_tokens: int, text: str) -> str:
        """The longest prefix of `text`, cut at a space, of at most `n_tokens` tokens."""
        lo, hi = 0, min(len(text), n_tokens * 8)
        if self.llama is None:
            # Calibrate characters per token once, then cut (each count is a prefill).
            if self.chars_per_token is None:
                sample = text[:4000]
                self.chars_per_token = len(sample) / self.count(sample)
            cut = int(n_tokens * self.chars_per_token * 0.98)
            return text[: text.rfind(" ", 0, cut)]
        while lo < hi:  # binary search on the character length
            mid = (lo + hi + 1) // 2
            cut = text.rfind(" ", 0, mid)
            if cut > 0 and self.count(text[:cut]) <= n_tokens:
                lo = mid
            else:
                hi = mid - 1
        return text[: text.rfind(" ", 0, lo)]


def run_ours(binary: str, model: str, prompt: str, tokens: int, threads: int, kv: str,
             extra: list | None = None) -> dict:
    cmd = [
        binary, "sample", model, "--prompt", prompt, "--tokens", str(tokens),
        "--temperature", "0", "--ignore-eos", "--json", "--kv-quantize", kv,
    ]
    if threads > 0:  # 0: let tinygpt-cpu choose (its default)
        cmd += ["--threads", str(threads)]
    cmd += extra or []
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd[:3])} ... failed:\n{out.stderr.strip()}")
    return json.loads(out.stdout)


class LlamaC:
    """llama.cpp through its C API (llama-cpp-python's low-level ctypes bindings call the
    shared library directly): `llama_decode` on `llama_batch_get_one`, and llama.cpp's
    own greedy sampler (`llama_sampler_init_greedy` + `llama_sampler_sample`, which reads
    the logits inside the library). No logits are copied to Python and no Python argmax
    runs: per decoded token Python makes two foreign calls, as a C program would."""

    def __init__(self):
        import llama_cpp

        self.L = llama_cpp
        # Silence llama.cpp's load/context logs (kept alive: the library holds the pointer).
        self._quiet = llama_cpp.llama_log_callback(lambda level, text, user: None)
        llama_cpp.llama_log_set(self._quiet, None)
        llama_cpp.llama_backend_init()
        self.models = {}

    def model(self, path: str):
        if path not in self.models:
            params = self.L.llama_model_default_params()
            m = self.L.llama_model_load_from_file(path.encode(), params)
            if not m:
                raise RuntimeError(f"llama.cpp could not load {path}")
            self.models[path] = m
        return self.models[path]

    def tokenize(self, path: str, text: str) -> list:
        vocab = self.L.llama_model_get_vocab(self.model(path))
        raw = text.encode("utf-8")
        cap = len(raw) + 16
        arr = (self.L.llama_token * cap)()
        n = self.L.llama_tokenize(vocab, raw, len(raw), arr, cap, True, False)
        if n < 0:
            raise RuntimeError("llama_tokenize: buffer too small")
        return list(arr[:n])

    def run(self, path: str, toks: list, ctx: int, decode: int, threads: int,
            kv_type: int, flash: bool = True) -> dict:
        L = self.L
        cp = L.llama_context_default_params()
        cp.n_ctx = ctx
        cp.n_batch = 512
        cp.n_ubatch = 512
        cp.n_threads = threads
        cp.n_threads_batch = threads
        cp.type_k = kv_type
        cp.type_v = kv_type
        cp.flash_attn_type = (L.LLAMA_FLASH_ATTN_TYPE_ENABLED if flash
                              else L.LLAMA_FLASH_ATTN_TYPE_DISABLED)
        lctx = L.llama_init_from_model(self.model(path), cp)
        if not lctx:
            raise RuntimeError("llama_init_from_model failed")
        smpl = L.llama_sampler_chain_init(L.llama_sampler_chain_default_params())
        L.llama_sampler_chain_add(smpl, L.llama_sampler_init_greedy())
        n = len(toks)
        arr = (L.llama_token * n)(*toks)
        one = (L.llama_token * 1)()
        t0 = time.perf_counter()
        for start in range(0, n, 512):  # n_batch tokens per llama_decode
            m = min(512, n - start)
            view = ctypes.cast(ctypes.addressof(arr) + 4 * start, ctypes.POINTER(L.llama_token))
            if L.llama_decode(lctx, L.llama_batch_get_one(view, m)) != 0:
                raise RuntimeError("llama_decode (prompt) failed")
        nxt = L.llama_sampler_sample(smpl, lctx, -1)
        prefill_s = time.perf_counter() - t0
        generated = [nxt]
        t1 = time.perf_counter()
        for _ in range(decode):
            one[0] = nxt
            if L.llama_decode(lctx, L.llama_batch_get_one(one, 1)) != 0:
                raise RuntimeError("llama_decode failed")
            nxt = L.llama_sampler_sample(smpl, lctx, -1)
            generated.append(nxt)
        decode_s = time.perf_counter() - t1
        L.llama_sampler_free(smpl)
        L.llama_free(lctx)
        return {
            "prompt_tokens": n,
            "generated_ids": generated,
            "prefill_tok_s": n / prefill_s,
            "decode_tok_s": decode / decode_s,
        }


def wait_idle(max_load: float, timeout_s: float) -> float:
    """Waits until the 1-minute load average is at most `max_load` (or `timeout_s`
    passes); returns the load average it stopped at."""
    t0 = time.time()
    while os.getloadavg()[0] > max_load and time.time() - t0 < timeout_s:
        time.sleep(5)
    return os.getloadavg()[0]


def prefix_match(a: list, b: list) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def _spin(parent: int) -> None:
    # Busy until the parent goes away (even if it is killed before it can stop us).
    while os.getppid() == parent:
        for _ in range(200_000):
            pass


class BackgroundLoad:
    """`n` CPU-bound processes for the duration of a `with` block (none when n is 0)."""

    def __init__(self, n: int):
        self.n = n
        self.procs = []

    def __enter__(self):
        ctx = multiprocessing.get_context("fork")
        for _ in range(self.n):
            p = ctx.Process(target=_spin, args=(os.getpid(),), daemon=True)
            p.start()
            self.procs.append(p)
        return self

    def __exit__(self, *exc):
        for p in self.procs:
            p.terminate()
        for p in self.procs:
            p.join()
        self.procs = []


def cpu_ticks() -> tuple | None:
    """(steal, total) jiffies of all CPUs from /proc/stat (None where there is none)."""
    try:
        fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
    except OSError:
        return None
    vals = [int(v) for v in fields]
    # user nice system idle iowait irq softirq steal [guest guest_nice, counted in user]
    return (vals[7] if len(vals) > 7 else 0), sum(vals[:8])


class StealMeter:
    """Steal time (the hypervisor running another guest on our vCPUs) over the runs of
    one engine, as a percentage of all CPU time in those runs."""

    def __init__(self):
        self.steal, self.total = 0, 0

    def measure(self, f):
        a = cpu_ticks()
        out = f()
        b = cpu_ticks()
        if a is not None and b is not None:
            self.steal += b[0] - a[0]
            self.total += b[1] - a[1]
        return out

    def pct(self) -> float | None:
        return 100.0 * self.steal / self.total if self.total else None


def summary(values: list) -> dict:
    """Median and spread of one engine's tok/s over the rounds of a row."""
    return {"median": statistics.median(values), "min": min(values), "max": max(values),
            "runs": values}


def fmt(s: dict | None) -> str:
    if s is None:
        return "-"
    return f"{s['median']:.1f} ({s['min']:.0f}-{s['max']:.0f})"


def steal(m: StealMeter) -> str:
    p = m.pct()
    return "-" if p is None else f"{p:.1f}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="GGUF file (default: scripts/fetch-smollm2.sh)")
    ap.add_argument("--binary", default=str(ROOT / "target" / "release" / "tinygpt-cpu"))
    ap.add_argument("--threads", default=str(os.cpu_count() or 1),
                    help="comma-separated thread counts, e.g. 1,2 (default: all cores)")
    ap.add_argument("--contexts", default="128,1024,4096")
    ap.add_argument("--decode", type=int, default=64, help="decoded tokens per run")
    ap.add_argument("--kv", default="f16,q8_0,q4_0", help="llama.cpp KV types")
    ap.add_argument("--prefill", type=int, default=256,
                    help="prompt tokens of the prefill rows (0: no prefill rows)")
    ap.add_argument("--repeats", type=int, default=3,
                    help="alternating rounds per row (medians of at least 3 are quoted)")
    ap.add_argument("--background-load", type=int, default=0, metavar="N",
                    help="run N CPU-bound busy-loop processes during every row")
    ap.add_argument("--ours-args", default="",
                    help="extra arguments for tinygpt-cpu sample, e.g. '--kv-rotation none'")
    ap.add_argument("--idle-load", type=float, default=0.5,
                    help="wait for the 1-minute load average to fall to this before a row")
    ap.add_argument("--idle-timeout", type=float, default=120.0,
                    help="seconds to wait for --idle-load at most (then run anyway)")
    ap.add_argument("--ours-only", action="store_true")
    ap.add_argument("--interleave", action="store_true",
                    help="run every row once per round (rows compared with each other, "
                         "e.g. our thread counts, then share the host's drift)")
    ap.add_argument("--json", help="also write the rows to this file")
    args = ap.parse_args()
    # SIGTERM (e.g. `timeout`) unwinds like Ctrl-C, so the background load is stopped.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))

    llama, llama_version, llama_error = None, None, None
    if not args.ours_only:
        try:
            import llama_cpp
            llama, llama_version = LlamaC(), llama_cpp.__version__
        except Exception as e:  # noqa: BLE001 - report whatever stopped the import
            llama_error = f"{type(e).__name__}: {e}"
    if not Path(args.binary).is_file():
        print(f"{args.binary} not found: run `cargo build --release` first", file=sys.stderr)
        return 2
    model = args.model or fetch_model()
    contexts = [int(c) for c in args.contexts.split(",")]
    kvs = args.kv.split(",")
    for k in kvs:
        if k not in KV_TYPES:
            print(f"--kv {k}: expected one of {', '.join(KV_TYPES)}", file=sys.stderr)
            return 2

    threads_list = [int(t) for t in args.threads.split(",")]
    print(f"# {time.strftime('%Y-%m-%d %H:%M')}  cpu: {cpu_name()}  ({os.cpu_count()} cores)  "
          f"model: {Path(model).name}", flush=True)
    if args.ours_only:
        llama_state = "skipped (--ours-only)"
    else:
        llama_state = llama_version or f"not available ({llama_error})"
    omp = os.environ.get("OMP_WAIT_POLICY")
    print(f"# llama-cpp-python: {llama_state} (C API: llama_decode + greedy llama_sampler)"
          f"  decode: {args.decode} tokens  median of {args.repeats} alternating rounds"
          f"  background load: {args.background_load} busy process(es)"
          f"  OMP_WAIT_POLICY={omp or '(unset: OpenMP default)'}", flush=True)
    if omp:
        print("# warning: OMP_WAIT_POLICY is set; llama.cpp's default is to leave it unset",
              flush=True)

    tok = Tokens(model, args.binary, llama)
    text = source_text()
    rows = []
    header = (f"{'threads':>7} {'context':>7} {'prompt':>6} {'kv (llama.cpp/ours)':>20} "
              f"{'llama.cpp tok/s (spread)':>25} {'ours tok/s (spread)':>22} {'ratio':>6} "
              f"{'match':>6} {'fa':>3} {'load':>5} {'st%L':>5} {'st%O':>5}")
    print(header, flush=True)
    prompts = {ctx: tok.prompt_of(ctx - args.decode, text) for ctx in contexts}
    if args.prefill:
        prompts["prefill"] = tok.prompt_of(args.prefill, text)
    jobs = [(t, c, k) for t in threads_list for c in contexts for k in kvs]
    if args.prefill:
        jobs += [(t, "prefill", "f16") for t in threads_list]
    extra = args.ours_args.split()

    def prepare(job, load):
        threads, ctx, k = job
        is_prefill = ctx == "prefill"
        kv_type, ours_kv = KV_TYPES[k]
        return {
            "threads": threads, "ctx": ctx, "k": k, "prompt": prompts[ctx],
            "is_prefill": is_prefill,
            "decode": 1 if is_prefill else args.decode,
            "n_ctx": args.prefill + 64 if is_prefill else ctx,
            "kv_type": kv_type, "ours_kv": ours_kv,
            "metric": "prefill_tok_s" if is_prefill else "decode_tok_s",
            # llama.cpp's best flash-attention setting: both for f16, on for a quantised V.
            "fa_settings": [False, True] if k == "f16" else [True],
            "load": load,
            "runs_l": {fa: [] for fa in ([False, True] if k == "f16" else [True])},
            "runs_o": [],
            "steal_l": StealMeter(), "steal_o": StealMeter(),
            "toks": llama.tokenize(model, prompts[ctx]) if llama is not None else None,
            # llama.cpp threads: the count asked for (0 means all cores, as ours).
            "l_threads": threads or (os.cpu_count() or 1),
        }

    def one_round(j):
        """One round of a row: llama.cpp (each flash-attention setting), then ours. Each
        run's tok/s goes to stderr at once, so a long (interleaved) run shows its data
        before the table, which needs every round, is printed."""
        label = "prefill" if j["is_prefill"] else str(j["ctx"])
        where = f"# round {len(j['runs_o']) + 1} threads {j['threads']} {label} {j['k']}:"
        if llama is not None:
            for fa in j["fa_settings"]:
                r = j["steal_l"].measure(
                    lambda: llama.run(model, j["toks"], j["n_ctx"], j["decode"],
                                      j["l_threads"], j["kv_type"], fa))
                j["runs_l"][fa].append(r)
                where += f" llama.cpp fa={'on' if fa else 'off'} {r[j['metric']]:.1f}"
        r = j["steal_o"].measure(
            lambda: run_ours(args.binary, model, j["prompt"], j["decode"] + 1, j["threads"],
                             j["ours_kv"], extra))
        j["runs_o"].append(r)
        print(f"{where} ours {r['timing'][j['metric']]:.1f}  ({time.strftime('%H:%M:%S')})",
              file=sys.stderr, flush=True)

    def finish(j):
        threads, k, decode, metric = j["threads"], j["k"], j["decode"], j["metric"]
        runs_o, runs_l = j["runs_o"], j["runs_l"]
        s_o = summary([r["timing"][metric] for r in runs_o])
        s_l, best_fa, l_runs = None, None, None
        if llama is not None:
            by_fa = {fa: summary([r[metric] for r in rs]) for fa, rs in runs_l.items()}
            best_fa = max(by_fa, key=lambda fa: by_fa[fa]["median"])
            s_l, l_runs = by_fa[best_fa], runs_l[best_fa]
        row = {
            "kind": "prefill" if j["is_prefill"] else "decode",
            "context": j["n_ctx"],
            "prompt_tokens_ours": len(runs_o[0]["prompt_ids"]),
            "kv_llama": k,
            "kv_ours": j["ours_kv"],
            "ours": s_o,
            "threads": threads,
            "background_load": args.background_load,
            "interleaved": args.interleave,
            "load_avg_1min_before": j["load"],
            "load_avg_1min_after": os.getloadavg()[0],
            "steal_pct_ours": j["steal_o"].pct(),
        }
        if s_l is not None:
            row.update({
                "prompt_tokens_llama": l_runs[0]["prompt_tokens"],
                "llama": s_l,
                "llama_flash_attn": best_fa,
                "steal_pct_llama": j["steal_l"].pct(),
                "ratio": s_o["median"] / s_l["median"],
                "match": prefix_match(l_runs[0]["generated_ids"], runs_o[0]["generated_ids"]),
            })
        rows.append(row)
        ratio = f"{row['ratio']:.2f}" if s_l else "-"
        match = f"{row['match']}/{decode + 1}" if s_l else "-"
        fa = "-" if s_l is None else ("on" if best_fa else "off")
        label = "prefill" if j["is_prefill"] else str(j["ctx"])
        print(f"{threads:>7} {label:>7} {row['prompt_tokens_ours']:>6} {k + '/' + j['ours_kv']:>20} "
              f"{fmt(s_l):>25} {fmt(s_o):>22} {ratio:>6} {match:>6} {fa:>3} "
              f"{j['load']:>5.1f} {steal(j['steal_l']):>5} {steal(j['steal_o']):>5}", flush=True)

    if args.interleave:
        # Every row in every round (round 1: row 1, row 2, ...; round 2: ...), under one
        # background load: rows compared with each other see the same host drift.
        load = wait_idle(args.idle_load, args.idle_timeout)
        states = [prepare(job, load) for job in jobs]
        with BackgroundLoad(args.background_load):
            for _ in range(args.repeats):
                for j in states:
                    one_round(j)
        for j in states:
            finish(j)
    else:
        for job in jobs:
            j = prepare(job, wait_idle(args.idle_load, args.idle_timeout))
            with BackgroundLoad(args.background_load):
                for _ in range(args.repeats):
                    one_round(j)
            finish(j)
    if args.json:
        Path(args.json).write_text(json.dumps({
            "date": time.strftime("%Y-%m-%d %H:%M"), "cpu": cpu_name(),
            "command": " ".join([Path(sys.argv[0]).name] + sys.argv[1:]),
            "repeats": args.repeats, "background_load": args.background_load,
            "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
