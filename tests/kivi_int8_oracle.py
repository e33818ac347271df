#!/usr/bin/env python3
"""An independent numpy forward of SmolLM2-135M through an int8 KIVI cache, beside the engine.

The Rust reference now computes in the engine's order, bit for bit (tests/ref_exact.rs), so it
is no longer an independent check of the numerics. This script is one: numpy (BLAS order, not
the engine's), its own weight handling (GGUF tensors dequantised by the `gguf` package, Q/K
un-permuted to the Hugging Face layout, rotate_half RoPE), its own KIVI cache (fake-quantised
rows per docs/design.md §2.3 and the Hadamard rotation of §2.5), and token ids from
transformers' GGUF tokenizer (case 2852 of fixtures/golden/smollm2_tokenizer_cases.json,
an English paragraph of 95 ids, which the engine tokenizes identically: tests/smollm2.rs).
It measures its own scatter under int8 by running three
summation orders (float32, float32 with every dot product's terms reversed, float64: each
moves some values across a code boundary) and requires the engine's int8 perplexity
(`perplexity --weights-dtype f32 --kv-quantize int8`, rotation auto) to lie within
[min − 2·spread, max + 2·spread] of those three, spread = max − min: three orders sample the
scatter sparsely (docs/eval/ref-exact.md has the measurement). The fp32 cache must agree to 1e-4 relative (no boundaries to flip;
measured 3e-7).

usage: python tests/kivi_int8_oracle.py --gguf SmolLM2-135M-Instruct.Q4_1.gguf \\
           --bin target/release/tinygpt-cpu [--tokens 64]
needs: numpy, gguf.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

import numpy as np


def load(path):
    import gguf

    r = gguf.GGUFReader(path)
    w = {}
    for t in r.tensors:
        a = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
        shape = [int(x) for x in reversed(t.shape)]
        w[t.name] = a.reshape(shape)
    return w


def unpermute(w, heads):
    """llama.cpp stores Q/K rows permuted for adjacent-pair RoPE; back to rotate_half order."""
    rows, cols = w.shape
    hd = rows // heads
    return w.reshape(heads, hd // 2, 2, cols).swapaxes(1, 2).reshape(rows, cols)


def hadamard(d):
    h = np.array([[1.0]])
    while h.shape[0] < d:
        h = np.block([[h, h], [h, -h]])
    return h / np.sqrt(d)


QMIN, QMAX = -128, 127


def fake_quant(x, axis):
    """int8 KIVI round trip of x over `axis`, parameters rounded to f16 (design §2.3)."""
    x32 = x.astype(np.float32)
    lo = x32.min(axis=axis, keepdims=True)
    hi = x32.max(axis=axis, keepdims=True)
    scale = np.maximum(np.float32(1e-5), (hi - lo) / np.float32(QMAX - QMIN))
    scale = scale.astype(np.float16).astype(np.float32)
    zero = lo.astype(np.float16).astype(np.float32)
    q = np.clip(np.round((x32 - zero) / scale + QMIN), QMIN, QMAX)
    return ((q - QMIN).astype(np.float32) * scale + zero).astype(x.dtype)


class Forward:
    L, H, KV, HD, EPS, THETA = 30, 9, 3, 64, 1e-5, 100000.0
    PREFIX, G = 4, 32

    def __init__(self, w, dtype, reverse):
        self.dt, self.reverse = dtype, reverse
        c = lambda a: a.astype(dtype)
        self.emb = c(w["token_embd.weight"])
        self.norm = c(w["output_norm.weight"])
        self.layers = []
        for l in range(self.L):
            p = f"blk.{l}."
            self.layers.append(
                dict(
                    an=c(w[p + "attn_norm.weight"]),
                    q=c(unpermute(w[p + "attn_q.weight"], self.H)),
                    k=c(unpermute(w[p + "attn_k.weight"], self.KV)),
                    v=c(w[p + "attn_v.weight"]),
                    o=c(w[p + "attn_output.weight"]),
                    fn=c(w[p + "ffn_norm.weight"]),
                    g=c(w[p + "ffn_gate.weight"]),
                    u=c(w[p + "ffn_up.weight"]),
                    d=c(w[p + "ffn_down.weight"]),
                )
            )
        half = self.HD // 2
        self.inv = (1.0 / self.THETA ** (np.arange(half, dtype=np.float64) * 2 / self.HD)).astype(np.float32)
        self.hm = hadamard(self.HD).astype(dtype)

    def mv(self, w, x):
        if self.reverse:
            return w[:, ::-1] @ x[::-1]
        return w @ x

    def rms(self, x, g):
        return x / np.sqrt((x * x).mean() + self.dt(self.EPS)) * g

    def rope(self, x, pos):
        ang = np.float32(pos) * self.inv
        c, s = np.cos(ang).astype(self.dt), np.sin(ang).astype(self.dt)
        a, b = x[..., : self.HD // 2], x[..., self.HD // 2 :]
        return np.concatenate([a * c - b * s, b * c + a * s], axis=-1)

    def nll(self, ids, quant, rotate):
        caches = [dict(k=[], v=[], kq=[], vq=[]) for _ in range(self.L)]
        out = []
        for pos, tok in enumerate(ids[:-1]):
            x = self.emb[tok].copy()
            for l, lw in enumerate(self.layers):
                c = caches[l]
                h = self.rms(x, lw["an"])
                q = self.rope(self.mv(lw["q"], h).reshape(self.H, self.HD), pos)
                k = self.rope(self.mv(lw["k"], h).reshape(self.KV, self.HD), pos)
                v = self.mv(lw["v"], h).reshape(self.KV, self.HD)
                if rotate:
                    q, k, v = q @ self.hm.T, k @ self.hm.T, v @ self.hm.T
                c["k"].append(k)
                c["v"].append(v)
                t = len(c["k"])
                # V: quantised per token (per KV head) at its append, after the prefix.
                c["vq"].append(fake_quant(v, 1) if quant and t > self.PREFIX else v)
                # K: per channel over each complete group of G rows after the prefix.
                c["kq"].append(k)
                if quant and t > self.PREFIX and (t - self.PREFIX) % self.G == 0:
                    grp = np.stack(c["k"][t - self.G : t])  # (G, KV, HD)
                    c["kq"][t - self.G : t] = list(fake_quant(grp, 0))
                K, V = np.stack(c["kq"]), np.stack(c["vq"])  # (T, KV, HD)
                att = np.empty((self.H, self.HD), self.dt)
                for hh in range(self.H):
                    kv = hh // (self.H // self.KV)
                    s = (K[:, kv, :] @ q[hh]) / self.dt(np.sqrt(self.HD))
                    e = np.exp(s - s.max())
                    att[hh] = (e / e.sum()) @ V[:, kv, :]
                if rotate:
                    att = att @ self.hm.T
                x = x + self.mv(lw["o"], att.reshape(-1))
                h = self.rms(x, lw["fn"])
                g = self.mv(lw["g"], h)
                x = x + self.mv(lw["d"], g / (1 + np.exp(-g)) * self.mv(lw["u"], h))
            lg = (self.emb @ self.rms(x, self.norm)).astype(np.float64)
            lg -= lg.max()
            out.append(np.log(np.exp(lg).sum()) - lg[ids[pos + 1]])
        return out


def engine_ppl(binary, gguf_path, text, n, kv):
    cmd = [binary, "perplexity", gguf_path, "--text", text, "--max-tokens", str(n),
           "--weights-dtype", "f32", "--kv-quantize", kv, "--json"]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return json.loads(out)["ppl"]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--gguf", default=os.environ.get("TINYGPT_SMOLLM2"))
    ap.add_argument("--bin", default="target/release/tinygpt-cpu")
    ap.add_argument("--case", type=int, default=2852)
    ap.add_argument("--tokens", type=int, default=64)
    a = ap.parse_args()
    if not a.gguf or not os.path.isfile(a.gguf):
        print(f"skipping: SmolLM2 GGUF not found ({a.gguf}); run scripts/fetch-smollm2.sh")
        return 0
    cases = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "fixtures", "golden",
                         "smollm2_tokenizer_cases.json")
    case = json.load(open(cases, encoding="utf-8"))["cases"][a.case]
    ids = [int(x) for x in case["ids"].split()][: a.tokens]
    assert len(ids) == a.tokens, f"case {a.case} has fewer than {a.tokens} ids"
    text = tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False, encoding="utf-8")
    text.write(case["text"])
    text.close()
    w = load(a.gguf)
    runs = {}
    for name, dt, rev in [("f32", np.float32, False), ("f32-reversed", np.float32, True), ("f64", np.float64, False)]:
        f = Forward(w, dt, rev)
        runs[name] = {"int8": float(np.exp(np.mean(f.nll(ids, quant=True, rotate=True))))}
        if name == "f32":
            runs[name]["fp32"] = float(np.exp(np.mean(f.nll(ids, quant=False, rotate=False))))
        fp32 = f"fp32 {runs[name]['fp32']:.6f}" if "fp32" in runs[name] else " " * 14
        print(f"oracle {name:<13} {fp32}  int8 {runs[name]['int8']:.6f}", flush=True)
    eng = {kv: engine_ppl(a.bin, a.gguf, text.name, a.tokens, kv) for kv in ["fp32", "int8"]}
    os.unlink(text.name)
    print(f"engine               fp32 {eng['fp32']:.6f}  int8 {eng['int8']:.6f}")
    ok = True
    rel = abs(eng["fp32"] / runs["f32"]["fp32"] - 1)
    print(f"fp32: engine vs oracle rel {rel:.2e} (bound 1e-4)")
    ok &= rel < 1e-4
    vals = [r["int8"] for r in runs.values()]
    lo, hi = min(vals), max(vals)
    spread = hi - lo
    print(f"int8: oracle scatter [{lo:.6f}, {hi:.6f}] (spread {spread / lo:.2e} rel); engine {eng['int8']:.6f}")
    ok &= lo - 2 * spread <= eng["int8"] <= hi + 2 * spread
    print("OK" if ok else "FAILED: the engine is outside the oracle's scatter")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
