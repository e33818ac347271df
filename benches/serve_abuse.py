#!/usr/bin/env python3
"""A hostile client against `tinygpt-cpu serve`: the cases of issues 27 and 50, one line each.

Starts the server itself (loopback, ephemeral port) and reports, per case, what the server
did and how long it took; server RSS is read from /proc (Linux). Standard library only.

    cargo build --release
    python3 benches/serve_abuse.py                      # bundled model
    python3 benches/serve_abuse.py --model path/to/model.gguf --header-timeout 2
    python3 benches/serve_abuse.py --model "$MODEL" --only 50   # issue 50 (SmolLM2)

Issue 27's cases run with short timeouts (--header-timeout/--body-timeout 2); issue 50's
against servers with the default hardening flags and `--streaming-llm-sink 4
--streaming-llm-window 252 --kv-quantize int4`, each measured while a stream runs where
the issue says so, against the bounds of its "Done when".

Exit status 1 if a case got an answer the server's documentation says it must not give,
or a measurement missed its bound.
"""

import argparse
import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def rss_mib(pid):
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return float("nan")


def cpu_secs(pid):
    """User + system CPU seconds of process `pid` (Linux)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def start(args, extra, timeouts=True):
    cmd = [args.binary, "serve"] + ([args.model] if args.model else [])
    cmd += ["--host", "127.0.0.1", "--port", "0"]
    if timeouts:
        cmd += ["--header-timeout", str(args.header_timeout), "--body-timeout", str(args.body_timeout)]
    cmd += extra
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    line = p.stdout.readline()
    url = next(w for w in line.split() if w.startswith("http://"))
    host, port = url[len("http://"):].split(":")
    return p, host, int(port)


def closed_after(sock, limit):
    """Seconds until the server closes `sock` (None: still open after `limit`)."""
    t0 = time.time()
    sock.settimeout(0.2)
    while time.time() - t0 < limit:
        try:
            if sock.recv(4096) == b"":
                return time.time() - t0
        except socket.timeout:
            continue
        except OSError:
            return time.time() - t0
    return None


def raw(host, port, data, timeout=30):
    """Sends raw bytes; (status, seconds) of the answer."""
    t0 = time.time()
    s = socket.create_connection((host, port))
    s.settimeout(timeout)
    s.sendall(data)
    buf = b""
    try:
        while b"\r\n" not in buf:
            chunk = s.recv(4096)
            if not chunk:
                break
            buf += chunk
    except socket.timeout:
        return None, time.time() - t0
    s.close()
    parts = buf.split(b" ")
    return (int(parts[1]) if len(parts) > 1 else None), time.time() - t0


def request(host, port, method, path, body=None, headers=None, timeout=120):
    c = http.client.HTTPConnection(host, port, timeout=timeout)
    h = {"Content-Type": "application/json"}
    h.update(headers or {})
    t0 = time.time()
    c.request(method, path, body if body is None or isinstance(body, bytes) else json.dumps(body), h)
    r = c.getresponse()
    data = r.read()
    try:
        data = json.loads(data)
    except ValueError:
        pass
    return r.status, data, time.time() - t0


def issue27(args, row):
    """Timeouts, limits, access rules and the drain (issue 27), with short timeouts."""
    p, host, port = start(args, ["--drain-grace", "1", "--drain-timeout", str(args.drain_timeout),
                                 "--max-request-tokens", "200000"])
    lim = 4 * args.header_timeout + 5
    try:
        s = socket.create_connection((host, port))
        t = closed_after(s, lim)
        row("socket that sends nothing", f"closed after {t:.1f} s" if t else "still open", t is not None)
        s = socket.create_connection((host, port))
        s.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow:")
        t = closed_after(s, lim)
        row("half-sent header", f"closed after {t:.1f} s" if t else "still open", t is not None)
        s = socket.create_connection((host, port))
        s.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        s.recv(4096)
        t = closed_after(s, lim)
        row("idle keep-alive", f"closed after {t:.1f} s" if t else "still open", t is not None)
        code, t = raw(host, port, b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                      b"Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"prompt\":", lim)
        row("stalled body (Content-Length 100, 10 sent)", f"{code} after {t:.1f} s", code == 408)
        idle = [socket.create_connection((host, port)) for _ in range(200)]
        code, data, t = request(host, port, "GET", "/health", timeout=60)
        row("/health with 200 idle sockets open", f"{code} in {t:.2f} s", code == 200)
        for s in idle:
            s.close()

        before = rss_mib(p.pid)
        code, data, t = request(host, port, "POST", "/v1/completions",
                                {"prompt": "word " * 400_000, "max_tokens": 1})
        row("2 MB prompt", f"{code} in {t:.2f} s, RSS {before:.0f} -> {rss_mib(p.pid):.0f} MiB", code == 400)
        code, data, t = request(host, port, "GET", "/v1/models")
        ctx = data["data"][0]["max_model_len"]
        code, data, t = request(host, port, "POST", "/v1/completions",
                                {"prompt": "The", "streaming_llm_window": ctx + 100, "max_tokens": ctx + 200})
        row("window past the context", f"{code} {data.get('error', {}).get('param')}", code == 400)
        texts = {}
        for temp in (0, 1e-40, 1e-45):
            code, data, t = request(host, port, "POST", "/v1/completions",
                                    {"prompt": "The", "max_tokens": 16, "temperature": temp, "seed": 3})
            texts[temp] = data["choices"][0]["text"] if code == 200 else None
        same = texts[1e-40] == texts[0] == texts[1e-45]
        row("temperature 1e-40 / 1e-45", "greedy text" if same else f"{texts}", same)
        code, data, t = request(host, port, "POST", "/v1/chat/completions",
                                {"messages": [{"role": "wizard", "content": "hi"}]})
        row("chat role 'wizard'", f"{code} {data.get('error', {}).get('param')}", code == 400)
        for field, value in (("logprobs", True), ("echo", True), ("tools", [{"type": "function"}]),
                             ("response_format", {"type": "json_object"})):
            code, data, t = request(host, port, "POST", "/v1/completions",
                                    {"prompt": "The", "max_tokens": 2, field: value})
            row(f"{field}={json.dumps(value)}", f"{code} {data.get('error', {}).get('param')}", code == 400)
        code, data, t = request(host, port, "POST", "/v1/completions", {"prompt": "The", "max_tokens": 2},
                                {"Content-Type": "text/plain"})
        row("Content-Type text/plain", str(code), code == 415)
        code, t = raw(host, port, b"GET /health HTTP/1.1\r\nHost: rebind.example\r\nConnection: close\r\n\r\n")
        row("Host rebind.example (DNS rebinding)", str(code), code == 403)
        code, data, t = request(host, port, "POST", "/v1/completions", {"prompt": "The", "max_tokens": 2},
                                {"Origin": "https://evil.example"})
        row("Origin https://evil.example", str(code), code == 403)

        # Drain: a stalled client and an endless stream, then SIGTERM.
        stalled = socket.create_connection((host, port))
        stalled.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: "
                        b"application/json\r\nContent-Length: 100\r\n\r\n{")
        half = socket.create_connection((host, port))
        half.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow:")
        c = http.client.HTTPConnection(host, port, timeout=120)
        c.request("POST", "/v1/completions", json.dumps(
            {"prompt": "The", "max_tokens": 100000, "ignore_eos": True, "streaming_llm_window": 64,
             "stream": True, "temperature": 0}), {"Content-Type": "application/json"})
        stream = c.getresponse()
        stream.readline()
        t0 = time.time()
        p.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        code, data, t = request(host, port, "GET", "/health")
        row("/health right after SIGTERM", str(code), code == 503)
        try:
            p.wait(timeout=args.drain_timeout + 10)
            t = time.time() - t0
            row("SIGTERM with stalled clients and an endless stream",
                f"exit {p.returncode} after {t:.1f} s (--drain-timeout {args.drain_timeout:g})",
                t < args.drain_timeout + 3)
        except subprocess.TimeoutExpired:
            row("SIGTERM with stalled clients and an endless stream", "still running", False)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()


ISSUE50_CACHE = ["--streaming-llm-sink", "4", "--streaming-llm-window", "252", "--kv-quantize", "int4"]


class Stream:
    """A greedy stream that keeps generating; records when each chunk arrived."""

    def __init__(self, host, port):
        self.times = []
        self.stop = False
        self.conn = http.client.HTTPConnection(host, port, timeout=120)
        self.conn.request("POST", "/v1/completions", json.dumps(
            {"prompt": "The", "max_tokens": 60000, "ignore_eos": True, "stream": True, "temperature": 0}),
            {"Content-Type": "application/json"})
        self.resp = self.conn.getresponse()
        self.thread = threading.Thread(target=self.read, daemon=True)
        self.thread.start()

    def read(self):
        while not self.stop:
            try:
                line = self.resp.readline()
            except (AttributeError, OSError, ValueError):
                break  # close() shut the connection under this read
            if not line:
                break
            if line.startswith(b"data: "):
                self.times.append(time.time())

    def longest_gap(self, t0, t1):
        """Longest gap between chunks that touches [t0, t1]."""
        ts = [t for t in self.times if t0 - 2 <= t <= t1 + 2]
        gaps = [(b - a) for a, b in zip(ts, ts[1:]) if b >= t0 and a <= t1]
        return max(gaps) if gaps else float("inf")

    def close(self):
        self.stop = True
        self.conn.close()


def timed(f):
    t0 = time.time()
    r = f()
    return r, time.time() - t0


def issue50(args, row):
    """One hostile request against a running stream (issue 50), default hardening flags."""
    big = json.dumps({"prompt": "a " * 3_900_000}).encode()
    p, host, port = start(args, ISSUE50_CACHE, timeouts=False)
    try:
        request(host, port, "POST", "/v1/completions", {"prompt": "Hello", "max_tokens": 2})
        stream = Stream(host, port)
        time.sleep(2.0)
        before = rss_mib(p.pid)
        health = {}

        def probe():
            time.sleep(0.02)
            (code, _, _), t = timed(lambda: request(host, port, "GET", "/health"))
            health["t"], health["code"] = t, code

        th = threading.Thread(target=probe)
        t0 = time.time()
        th.start()
        code, data, t = request(host, port, "POST", "/v1/completions", big)
        th.join()
        t1 = time.time()
        time.sleep(0.5)
        gap = stream.longest_gap(t0, t1)
        msg = data.get("error", {}).get("message", "") if isinstance(data, dict) else ""
        row(f"{len(big) / 1e6:.1f} MB prompt during a stream", f"{code} in {t * 1000:.0f} ms ({msg[:60]})",
            code == 400 and t <= 0.1)
        row("  the stream's longest gap meanwhile", f"{gap:.3f} s", gap <= 0.5)
        row("  /health meanwhile", f"{health.get('code')} in {health.get('t', float('nan')):.3f} s",
            health.get("code") == 200 and health["t"] <= 0.2)
        for _ in range(9):
            request(host, port, "POST", "/v1/completions", big)
        time.sleep(0.5)
        after = rss_mib(p.pid)
        row("RSS after ten such requests", f"{before:.0f} -> {after:.0f} MiB ({after - before:+.0f})",
            after - before <= 50)
        times = []
        for body in ({"prompt": "word " * 400_000}, {"prompt": "a" * 7_800_000}):
            code, _, t = request(host, port, "POST", "/v1/completions", body)
            times.append(f"{code} in {t * 1000:.0f} ms")
        row("2 MB 'word ' prompt; 7.8 MB without a space", ", ".join(times), True)
        stream.close()
        time.sleep(0.5)
        cpu0 = cpu_secs(p.pid)
        for _ in range(5):
            request(host, port, "POST", "/v1/completions", big)
        cpu = (cpu_secs(p.pid) - cpu0) / 5
        row("server CPU per refused 7.8 MB prompt, no stream", f"{cpu * 1000:.0f} ms", cpu <= 0.1)

        idle = [socket.create_connection((host, port)) for _ in range(300)]
        time.sleep(0.2)
        (code, _, _), t = timed(lambda: request(host, port, "GET", "/health", timeout=30))
        row("/health with 300 silent sockets open", f"{code} in {t:.2f} s", code == 200 and t <= 1.0)
        more = [socket.create_connection((host, port)) for _ in range(300)]
        time.sleep(0.2)
        (code, _, _), t = timed(lambda: request(host, port, "POST", "/v1/completions",
                                                {"prompt": "Hello", "max_tokens": 1}, timeout=30))
        row("a new request with 300 more silent sockets", f"{code} in {t:.2f} s", code == 200 and t <= 1.0)
        for s in idle + more:
            s.close()
    finally:
        p.kill()
        p.wait()

    # RFC cases, with an API key.
    p, host, port = start(args, ["--api-key", "KEY"], timeouts=False)
    try:
        code, t = raw(host, port, b"GET /health HTTP/1.1\r\nConnection: close\r\n\r\n")
        row("HTTP/1.1 without Host", str(code), code == 400)
        code, t = raw(host, port, b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                      b"Authorization: bearer KEY\r\nConnection: close\r\n\r\n")
        row("Authorization: bearer KEY (lower case)", str(code), code == 200)
        code, t = raw(host, port, b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Big: " + b"a" * 100_000
                      + b"\r\nConnection: close\r\n\r\n")
        row("one 100 KB header line", str(code), code == 431)
    finally:
        p.kill()
        p.wait()

    # The drain with half-sent connections and no stream, default --drain-grace 5.
    p, host, port = start(args, [], timeouts=False)
    try:
        half = socket.create_connection((host, port))
        half.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow:")
        body = socket.create_connection((host, port))
        body.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: "
                     b"application/json\r\nContent-Length: 100\r\n\r\n{")
        time.sleep(0.3)
        t0 = time.time()
        p.send_signal(signal.SIGTERM)
        try:
            p.wait(timeout=40)
            t = time.time() - t0
            row("SIGTERM, half-sent header and body, no stream", f"exit {p.returncode} after {t:.1f} s "
                "(--drain-grace 5)", t <= 6.0)
        except subprocess.TimeoutExpired:
            row("SIGTERM, half-sent header and body, no stream", "still running", False)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--binary", default=os.path.join(ROOT, "target", "release", "tinygpt-cpu"))
    ap.add_argument("--model", default=None)
    ap.add_argument("--header-timeout", type=float, default=2.0)
    ap.add_argument("--body-timeout", type=float, default=2.0)
    ap.add_argument("--drain-timeout", type=float, default=5.0)
    ap.add_argument("--only", choices=["27", "50"], help="run one issue's cases")
    args = ap.parse_args()
    rows, bad = [], []

    def row(case, result, ok):
        rows.append((case, result, "ok" if ok else "WRONG"))
        if not ok:
            bad.append(case)

    if args.only != "50":
        issue27(args, row)
    if args.only != "27":
        issue50(args, row)
    w = max(len(r[0]) for r in rows)
    for case, result, verdict in rows:
        print(f"{case:<{w}}  {verdict:<5}  {result}")
    if bad:
        print(f"\n{len(bad)} case(s) answered wrongly: {', '.join(bad)}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
