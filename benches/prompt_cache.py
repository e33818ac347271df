#!/usr/bin/env python3
"""The server's prompt cache on a multi-turn chat (issue 49). Python standard library only.

    cargo build --release
    python3 benches/prompt_cache.py MODEL.gguf [--turns 8] [--json out.json]

Part 1, time to first token per turn. For each cache mode (--modes; default: dense fp32,
and StreamingLLM sink 4 + window 252 + int4) the release binary is started on 127.0.0.1
and one chat runs --turns turns through the streaming /v1/chat/completions endpoint: each
turn appends a user message of about --user-tokens tokens, the model replies greedily (at
most --reply-tokens), and the reply is appended to the history as the client got it, so
the history grows by about user + reply tokens a turn. Every turn is sent twice, first
with `"cache_prompt": false` (recomputes the whole prompt, keeps nothing) and then with
the default `true` (resumes from the previous turn's kept cache): time to first token
(request sent -> first content chunk) of each, the cached tokens the server reports
(`usage.prompt_tokens_details.cached_tokens`), and a check that both replies are equal
(reuse gives the same bits, so the same greedy text).

Part 2, memory. For each --rss-limits value of --prompt-cache-bytes, a server runs
--rss-requests chat requests: --rss-conversations conversations of distinct content, turn
after turn, --rss-concurrency at a time, so kept entries accumulate and are evicted.
Reports the server's RSS after warm-up, at the end and its peak (VmHWM), with the prompt
cache's counted bytes; the growth over the warm-up RSS should stay within the limit plus
what the running sequences hold.

Loopback only; every request bounded by --reply-tokens and a socket timeout.
"""

import argparse
import http.client
import json
import os
import random
import subprocess
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

MODES = {
    "dense": [],
    "sink4-window252-int4": ["--streaming-llm-sink", "4", "--streaming-llm-window", "252",
                             "--kv-quantize", "int4"],
}

WORDS = ("river mountain harbour library market bridge garden valley castle village "
         "forest island museum station lighthouse orchard meadow canal tower square").split()
VERBS = "built crossed painted described measured visited mapped restored".split()


def user_message(rng, words):
    """A question of about `words` words (~1.3 tokens each), distinct per seed."""
    out = []
    while len(out) < words:
        a, b, c = rng.choice(WORDS), rng.choice(WORDS), rng.choice(VERBS)
        out += f"Who {c} the old {a} near the {b}, and why does it matter today?".split()
    return " ".join(out[:words])


class Server:
    def __init__(self, binary, model, flags):
        self.cmd = [binary, "serve", model, "--host", "127.0.0.1", "--port", "0"] + flags
        self.proc = subprocess.Popen(self.cmd, stdout=subprocess.PIPE, text=True)
        line = self.proc.stdout.readline()
        addr = next(w for w in line.split() if w.startswith("http://"))[len("http://"):]
        host, port = addr.rsplit(":", 1)
        self.host, self.port = host, int(port)

    def close(self):
        self.proc.terminate()
        self.proc.wait(timeout=60)

    def rss_kib(self):
        d = {}
        with open(f"/proc/{self.proc.pid}/status") as f:
            for line in f:
                if line.startswith(("VmRSS", "VmHWM")):
                    k, v = line.split(":")
                    d[k] = int(v.split()[0])
        return d

    def metrics(self):
        conn = http.client.HTTPConnection(self.host, self.port, timeout=30)
        conn.request("GET", "/metrics")
        text = conn.getresponse().read().decode()
        conn.close()
        out = {}
        for line in text.splitlines():
            if line.startswith("tinygpt_"):
                k, _, v = line.partition(" ")
                out[k] = float(v)
        return out

    def chat(self, messages, max_tokens, cache_prompt):
        """One streaming chat request: (reply, time to first content chunk, usage)."""
        conn = http.client.HTTPConnection(self.host, self.port, timeout=900)
        body = json.dumps({"messages": messages, "max_tokens": max_tokens, "temperature": 0,
                           "stream": True, "cache_prompt": cache_prompt})
        t0 = time.perf_counter()
        conn.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})
        r = conn.getresponse()
        if r.status != 200:
            raise SystemExit(f"chat: {r.status} {r.read()[:300]!r}")
        ttft, reply, usage = None, [], None
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
            if "error" in v:
                raise SystemExit(f"chat: {v['error']}")
            text = v["choices"][0]["delta"].get("content")
            if text:
                if ttft is None:
                    ttft = time.perf_counter() - t0
                reply.append(text)
            if v.get("usage"):
                usage = v["usage"]
        conn.close()
        if ttft is None:
            ttft = time.perf_counter() - t0
        return "".join(reply), ttft, usage


def ttft_rows(a, mode, flags):
    srv = Server(a.bin, a.model, flags)
    rows = []
    try:
        srv.chat([{"role": "user", "content": "Hello"}], 4, False)  # page the weights in
        rng = random.Random(1)
        messages = []
        for turn in range(1, a.turns + 1):
            messages.append({"role": "user", "content": user_message(rng, a.user_tokens * 3 // 4)})
            plain, t_plain, u_plain = srv.chat(messages, a.reply_tokens, False)
            reply, t_reuse, u_reuse = srv.chat(messages, a.reply_tokens, True)
            row = {
                "mode": mode, "turn": turn,
                "prompt_tokens": u_reuse["prompt_tokens"],
                "cached_tokens": u_reuse.get("prompt_tokens_details", {}).get("cached_tokens", 0),
                "reply_tokens": u_reuse["completion_tokens"],
                "ttft_no_reuse_s": t_plain, "ttft_reuse_s": t_reuse,
                "ratio": t_reuse / t_plain,
                "same_reply": reply == plain,
            }
            rows.append(row)
            print(f"{mode:22s} turn {turn}: prompt {row['prompt_tokens']:5d} tokens, "
                  f"cached {row['cached_tokens']:5d}; TTFT {t_plain * 1000:8.1f} ms without reuse, "
                  f"{t_reuse * 1000:8.1f} ms with ({row['ratio']:.3f}x); same reply: {row['same_reply']}",
                  flush=True)
            messages.append({"role": "assistant", "content": reply})
    finally:
        srv.close()
    return rows


def rss_row(a, limit):
    flags = MODES[a.rss_mode] + ["--prompt-cache-bytes", str(limit)]
    srv = Server(a.bin, a.model, flags)
    try:
        srv.chat([{"role": "user", "content": "Hello"}], 4, True)
        idle = srv.rss_kib()["VmRSS"]
        turns = max(1, a.rss_requests // a.rss_conversations)
        lock = threading.Lock()
        todo = list(range(a.rss_conversations))
        done = [0]

        def worker():
            while True:
                with lock:
                    if not todo or done[0] >= a.rss_requests:
                        return
                    c = todo.pop(0)
                rng = random.Random(1000 + c)
                messages = []
                for _ in range(turns):
                    with lock:
                        if done[0] >= a.rss_requests:
                            return
                        done[0] += 1
                    messages.append({"role": "user", "content": user_message(rng, 60)})
                    reply, _, _ = srv.chat(messages, a.rss_reply_tokens, True)
                    messages.append({"role": "assistant", "content": reply})

        ths = [threading.Thread(target=worker) for _ in range(a.rss_concurrency)]
        for t in ths:
            t.start()
        for t in ths:
            t.join()
        mem, m = srv.rss_kib(), srv.metrics()
    finally:
        srv.close()
    row = {
        "mode": a.rss_mode, "prompt_cache_bytes": limit, "requests": done[0],
        "rss_after_warmup_mib": idle / 1024, "rss_end_mib": mem["VmRSS"] / 1024,
        "peak_rss_mib": mem["VmHWM"] / 1024,
        "growth_mib": (mem["VmRSS"] - idle) / 1024,
        "peak_growth_mib": (mem["VmHWM"] - idle) / 1024,
        "entries": m.get("tinygpt_prompt_cache_entries"),
        "cache_counted_mib": m.get("tinygpt_prompt_cache_bytes", 0) / 2**20,
        "hits": m.get("tinygpt_prompt_cache_hits_total"),
        "misses": m.get("tinygpt_prompt_cache_misses_total"),
    }
    print(f"--prompt-cache-bytes {limit / 2**20:7.1f} MiB, {row['requests']} requests: RSS "
          f"{row['rss_after_warmup_mib']:.1f} -> {row['rss_end_mib']:.1f} MiB (peak {row['peak_rss_mib']:.1f}); "
          f"growth {row['growth_mib']:.1f} MiB (peak {row['peak_growth_mib']:.1f}); cache counts "
          f"{row['cache_counted_mib']:.1f} MiB in {row['entries']:.0f} entries; hits {row['hits']:.0f}, "
          f"misses {row['misses']:.0f}", flush=True)
    return row


def size(s):
    s = s.strip().upper()
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(s[-1:], 1)
    return int(float(s.rstrip("KMG")) * mult)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--bin", default=os.path.join(ROOT, "target", "release", "tinygpt-cpu"))
    ap.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, of {list(MODES)}")
    ap.add_argument("--turns", type=int, default=8)
    ap.add_argument("--user-tokens", type=int, default=170, help="about this many tokens per user message")
    ap.add_argument("--reply-tokens", type=int, default=80, help="max_tokens of each reply")
    ap.add_argument("--rss-limits", default="0,64M,256M", help="--prompt-cache-bytes values ('' skips part 2)")
    ap.add_argument("--rss-mode", default="sink4-window252-int4", choices=list(MODES))
    ap.add_argument("--rss-requests", type=int, default=200)
    ap.add_argument("--rss-conversations", type=int, default=25)
    ap.add_argument("--rss-concurrency", type=int, default=4)
    ap.add_argument("--rss-reply-tokens", type=int, default=24)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    out = {"command": " ".join(sys.argv), "ttft": [], "rss": []}
    for mode in [m for m in a.modes.split(",") if m]:
        rows = ttft_rows(a, mode, MODES[mode])
        out["ttft"] += rows
        last = rows[-1]
        print(f"{mode}: turn {last['turn']} time to first token with reuse = {last['ratio']:.3f}x "
              f"without (issue 49 asks <= 0.2x); replies equal in every turn: "
              f"{all(r['same_reply'] for r in rows)}", flush=True)
    for limit in [size(s) for s in a.rss_limits.split(",") if s.strip()]:
        out["rss"].append(rss_row(a, limit))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
