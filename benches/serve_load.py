#!/usr/bin/env python3
"""Load generator for `tinygpt-cpu serve`: aggregate decode tok/s and inter-token latency
at several numbers of concurrent streams. Python standard library only.

    cargo build --release
    python3 benches/serve_load.py MODEL.gguf [--streams 1,4,16,64] [--tokens 64] [--json out.json]

Starts the release binary on 127.0.0.1 (ephemeral port) with the cache flags given by
--server-flags (default: StreamingLLM sink 4 + window 252, int4 KV), then for each number of
streams C opens C concurrent streaming /v1/completions requests (distinct prompts, greedy,
`ignore_eos`, --tokens each) and records when every SSE chunk arrives. Loopback only; every
round is bounded by --tokens per stream and a socket timeout.

Per round:
  * aggregate tok/s = generated tokens of all streams / (last token of any stream − first
    token of any stream): decode throughput with every stream running (prefill excluded);
  * inter-token latency p50/p99 = gaps between consecutive chunks of one stream, pooled
    over streams;
  * server RSS (VmRSS from /proc) at the end of the round, and the peak (VmHWM); the peak
    KV bytes held and reserved (worst case) over the round, polled from /metrics.
"""

import argparse
import http.client
import json
import os
import subprocess
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def stream_one(host, port, prompt, tokens, out, i, start_barrier):
    start_barrier.wait()
    conn = http.client.HTTPConnection(host, port, timeout=600)
    body = json.dumps({"prompt": prompt, "max_tokens": tokens, "temperature": 0,
                       "ignore_eos": True, "stream": True})
    conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
    r = conn.getresponse()
    if r.status != 200:
        out[i] = {"error": f"{r.status} {r.read()[:200]!r}"}
        return
    times, n_tokens = [], 0
    while True:
        line = r.readline()
        if not line:
            break
        line = line.strip()
        if not line.startswith(b"data: "):
            continue
        data = line[6:]
        if data == b"[DONE]":
            break
        v = json.loads(data)
        if v["choices"][0]["text"]:
            times.append(time.perf_counter())
        if "usage" in v:
            n_tokens = v["usage"]["completion_tokens"]
    conn.close()
    out[i] = {"times": times, "tokens": n_tokens}


def metrics(host, port, names):
    conn = http.client.HTTPConnection(host, port, timeout=30)
    conn.request("GET", "/metrics")
    text = conn.getresponse().read().decode()
    conn.close()
    out = {}
    for line in text.splitlines():
        k, _, v = line.partition(" ")
        if k in names:
            out[k] = float(v)
    return out


def percentile(xs, p):
    xs = sorted(xs)
    if not xs:
        return float("nan")
    k = (len(xs) - 1) * p / 100
    lo, hi = int(k), min(int(k) + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def rss_kib(pid):
    d = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(("VmRSS", "VmHWM")):
                k, v = line.split(":")
                d[k] = int(v.split()[0])
    return d


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--bin", default=os.path.join(ROOT, "target", "release", "tinygpt-cpu"))
    ap.add_argument("--streams", default="1,4,16,64")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--server-flags", default="--streaming-llm-sink 4 --streaming-llm-window 252 --kv-quantize int4")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    streams = [int(s) for s in a.streams.split(",")]
    cmd = [a.bin, "serve", a.model, "--host", "127.0.0.1", "--port", "0",
           "--max-sequences", str(max(streams))] + a.server_flags.split()
    if a.threads:
        cmd += ["--threads", str(a.threads)]
    srv = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    rows = []
    try:
        line = srv.stdout.readline()
        addr = next(w for w in line.split() if w.startswith("http://"))[len("http://"):]
        host, port = addr.rsplit(":", 1)
        port = int(port)
        idle = rss_kib(srv.pid)
        print(f"server {addr}, {' '.join(cmd[2:])}; idle RSS {idle['VmRSS'] / 1024:.1f} MiB", flush=True)
        # Warm-up (page in the weights).
        stream_one(host, port, "Hello", 8, [None], 0, threading.Barrier(1))
        for c in streams:
            out = [None] * c
            barrier = threading.Barrier(c)
            ths = [threading.Thread(target=stream_one,
                                    args=(host, port, f"Story number {i}: once upon a time", a.tokens,
                                          out, i, barrier)) for i in range(c)]
            t0 = time.perf_counter()
            for t in ths:
                t.start()
            # Poll /metrics while the round runs: peak KV bytes held and reserved.
            kv = {"tinygpt_kv_bytes_in_use": 0, "tinygpt_kv_bytes_reserved": 0}
            while any(t.is_alive() for t in ths):
                for k, v in metrics(host, port, kv).items():
                    kv[k] = max(kv[k], v)
                time.sleep(0.2)
            for t in ths:
                t.join()
            wall = time.perf_counter() - t0
            errors = [o["error"] for o in out if "error" in o]
            if errors:
                raise SystemExit(f"{c} streams: {errors[0]}")
            first = min(o["times"][0] for o in out)
            last = max(o["times"][-1] for o in out)
            # Tokens after each stream's first (the first one closes its prefill).
            toks = sum(o["tokens"] - 1 for o in out)
            gaps = [b - a for o in out for a, b in zip(o["times"], o["times"][1:])]
            mem = rss_kib(srv.pid)
            row = {
                "streams": c,
                "tokens_per_stream": a.tokens,
                "aggregate_tok_s": toks / (last - first),
                "itl_p50_ms": 1000 * percentile(gaps, 50),
                "itl_p99_ms": 1000 * percentile(gaps, 99),
                "wall_s": wall,
                "rss_mib": mem["VmRSS"] / 1024,
                "peak_rss_mib": mem["VmHWM"] / 1024,
                "peak_kv_bytes_in_use": kv["tinygpt_kv_bytes_in_use"],
                "peak_kv_bytes_reserved": kv["tinygpt_kv_bytes_reserved"],
            }
            rows.append(row)
            print(f"{c:3d} streams: {row['aggregate_tok_s']:7.1f} tok/s aggregate, "
                  f"ITL p50 {row['itl_p50_ms']:6.1f} ms p99 {row['itl_p99_ms']:6.1f} ms, "
                  f"wall {wall:5.1f} s, RSS {row['rss_mib']:.1f} MiB (peak {row['peak_rss_mib']:.1f}), "
                  f"KV in use {row['peak_kv_bytes_in_use'] / 2**20:.1f} MiB, reserved {row['peak_kv_bytes_reserved'] / 2**20:.1f} MiB",
                  flush=True)
        if rows and rows[0]["streams"] == 1:
            for r in rows[1:]:
                print(f"{r['streams']} streams / 1 stream: {r['aggregate_tok_s'] / rows[0]['aggregate_tok_s']:.2f}x")
    finally:
        srv.terminate()
        srv.wait(timeout=60)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"command": " ".join(sys.argv), "server": cmd, "idle_rss_mib": idle["VmRSS"] / 1024,
                       "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
