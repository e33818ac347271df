#!/usr/bin/env python3
"""Decode tok/s of llama.cpp (via llama-cpp-python) beside tinygpt-cpu on the same GGUF.

Same model file (SmolLM2-135M-Instruct Q4_1 from scripts/fetch-smollm2.sh), same thread
count, same prompt text, greedy, at contexts of about 128, 1K and 4K tokens: the prompt is
`context - decode` tokens of fixtures/heldout.txt, then `decode` (64) tokens are decoded
one at a time and only that decode phase is timed. KV cache: llama.cpp f16/q8_0/q4_0
(flash attention on, which llama.cpp requires for a quantised V cache) against
tinygpt-cpu fp16/int8/int4.

  * llama.cpp: `Llama(model, n_ctx, n_threads, n_threads_batch, type_k, type_v,
    flash_attn)`, `eval(prompt)`, then `decode` times: argmax of the last logits,
    `eval([token])`. The timer covers those steps only.
  * tinygpt-cpu: `target/release/tinygpt-cpu sample MODEL --prompt P --tokens decode+1
    --temperature 0 --ignore-eos --json --threads T --kv-quantize K`; its
    `timing.decode_tok_s` covers the `decode` forward passes after the first sampled
    token (the first comes from the prefill logits, as for llama.cpp).

Each row is run `--repeats` times, alternating the two engines, and the best run of each
is kept (the machine may be shared). `match` is how many of the greedy tokens agree
(a sanity check that both run the same model on the same prompt; quantised caches may
legitimately diverge after a while). `load` is the 1-minute load average after the row:
on a machine busier than its core count, llama.cpp's OpenMP threads spin at barriers
while their partner waits for a core, and multi-threaded llama.cpp collapses (run with
OMP_WAIT_POLICY=passive to see how much of the gap that is; the header prints it).

Usage:
    python3 -m venv /root/benchenv
    CMAKE_ARGS="-DGGML_NATIVE=ON" /root/benchenv/bin/pip install -r benches/requirements-llamacpp.txt
    cargo build --release
    /root/benchenv/bin/python benches/llamacpp_compare.py [--threads 1,2] \
        [--contexts 128,1024,4096] [--repeats 2] [--json rows.json]

Without llama-cpp-python installed the llama.cpp column is left empty (`--ours-only`
does the same on purpose).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
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

    def __init__(self, model: str, binary: str, llama_cls):
        self.model = model
        self.binary = binary
        self.llm = None
        if llama_cls is not None:
            self.llm = llama_cls(model_path=model, vocab_only=True, verbose=False)
        self.chars_per_token = None

    def count(self, text: str) -> int:
        if self.llm is not None:
            return len(self.llm.tokenize(text.encode("utf-8"), add_bos=True, special=False))
        res = run_ours(self.binary, self.model, text, 1, 1, "fp32")
        return len(res["prompt_ids"])

    def prompt_of(self, n_tokens: int, text: str) -> str:
        """The longest prefix of `text`, cut at a space, of at most `n_tokens` tokens."""
        lo, hi = 0, min(len(text), n_tokens * 8)
        if self.llm is None:
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


def run_ours(binary: str, model: str, prompt: str, tokens: int, threads: int, kv: str) -> dict:
    cmd = [
        binary, "sample", model, "--prompt", prompt, "--tokens", str(tokens),
        "--temperature", "0", "--ignore-eos", "--json", "--threads", str(threads),
        "--kv-quantize", kv,
    ]
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd[:3])} ... failed:\n{out.stderr.strip()}")
    return json.loads(out.stdout)


def last_logits(llm):
    """The last evaluated token's logits (a view; `eval` keeps them only in the context
    unless logits_all is set)."""
    import llama_cpp
    import numpy as np

    n_vocab = llm.n_vocab()
    ptr = llama_cpp.llama_get_logits_ith(llm.ctx, -1)
    return np.ctypeslib.as_array(ptr, shape=(n_vocab,))


def run_llama(llama_cls, model: str, prompt: str, ctx: int, decode: int, threads: int,
              kv_type: int, flash_kw: dict) -> dict:
    import numpy as np

    llm = llama_cls(
        model_path=model, n_ctx=ctx, n_batch=512, n_ubatch=512, n_threads=threads,
        n_threads_batch=threads, type_k=kv_type, type_v=kv_type, verbose=False,
        **flash_kw,
    )
    toks = llm.tokenize(prompt.encode("utf-8"), add_bos=True, special=False)
    llm.reset()
    t0 = time.perf_counter()
    llm.eval(toks)
    nxt = int(np.argmax(last_logits(llm)))
    prefill_s = time.perf_counter() - t0
    generated = [nxt]
    t1 = time.perf_counter()
    for _ in range(decode):
        llm.eval([nxt])
        nxt = int(np.argmax(last_logits(llm)))
        generated.append(nxt)
    decode_s = time.perf_counter() - t1
    n_prompt = len(toks)
    if hasattr(llm, "close"):
        llm.close()
    del llm
    return {
        "prompt_tokens": n_prompt,
        "generated_ids": generated,
        "prefill_tok_s": n_prompt / prefill_s,
        "decode_tok_s": decode / decode_s,
    }


def flash_kwargs(llama_cls) -> dict:
    """`flash_attn=True` (needed for a quantised V cache), however this version spells it."""
    import inspect

    params = inspect.signature(llama_cls.__init__).parameters
    if "flash_attn_type" in params:
        return {"flash_attn_type": 1}  # LLAMA_FLASH_ATTN_TYPE_ENABLED
    if "flash_attn" in params:
        return {"flash_attn": True}
    return {}


def prefix_match(a: list, b: list) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="GGUF file (default: scripts/fetch-smollm2.sh)")
    ap.add_argument("--binary", default=str(ROOT / "target" / "release" / "tinygpt-cpu"))
    ap.add_argument("--threads", default=str(os.cpu_count() or 1),
                    help="comma-separated thread counts, e.g. 1,2 (default: all cores)")
    ap.add_argument("--contexts", default="128,1024,4096")
    ap.add_argument("--decode", type=int, default=64, help="decoded tokens per run")
    ap.add_argument("--kv", default="f16,q8_0,q4_0", help="llama.cpp KV types")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--ours-only", action="store_true")
    ap.add_argument("--json", help="also write the rows to this file")
    args = ap.parse_args()

    llama_cls, llama_version, llama_error = None, None, None
    if not args.ours_only:
        try:
            import llama_cpp
            llama_cls, llama_version = llama_cpp.Llama, llama_cpp.__version__
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
    flash_kw = flash_kwargs(llama_cls) if llama_cls else {}

    threads_list = [int(t) for t in args.threads.split(",")]
    print(f"# {time.strftime('%Y-%m-%d %H:%M')}  cpu: {cpu_name()}  ({os.cpu_count()} cores)  "
          f"model: {Path(model).name}", flush=True)
    if args.ours_only:
        llama_state = "skipped (--ours-only)"
    else:
        llama_state = llama_version or f"not available ({llama_error})"
    print(f"# llama-cpp-python: {llama_state}"
          f"  flash-attn args: {flash_kw}  decode: {args.decode} tokens  best of "
          f"{args.repeats}  OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', '(unset)')}",
          flush=True)

    tok = Tokens(model, args.binary, llama_cls)
    text = source_text()
    rows = []
    header = (f"{'threads':>7} {'context':>7} {'prompt':>6} {'kv (llama.cpp/ours)':>20} "
              f"{'llama.cpp tok/s':>15} {'ours tok/s':>10} {'ratio':>6} {'match':>6} {'prefill l/o tok/s':>19} "
              f"{'load':>5}")
    print(header, flush=True)
    prompts = {ctx: tok.prompt_of(ctx - args.decode, text) for ctx in contexts}
    for threads, ctx, k in ((t, c, k) for t in threads_list for c in contexts for k in kvs):
        prompt = prompts[ctx]
        kv_type, ours_kv = KV_TYPES[k]
        best_l, best_o = None, None
        for _ in range(args.repeats):
            if llama_cls is not None:
                r = run_llama(llama_cls, model, prompt, ctx, args.decode, threads,
                              kv_type, flash_kw)
                if best_l is None or r["decode_tok_s"] > best_l["decode_tok_s"]:
                    best_l = r
            r = run_ours(args.binary, model, prompt, args.decode + 1, threads, ours_kv)
            if best_o is None or (r["timing"]["decode_tok_s"]
                                  > best_o["timing"]["decode_tok_s"]):
                best_o = r
        ours = best_o["timing"]["decode_tok_s"]
        row = {
            "context": ctx,
            "prompt_tokens_ours": len(best_o["prompt_ids"]),
            "kv_llama": k,
            "kv_ours": ours_kv,
            "ours_decode_tok_s": ours,
            "ours_prefill_tok_s": best_o["timing"]["prefill_tok_s"],
            "threads": threads,
            "load_avg_1min": os.getloadavg()[0],
        }
        if best_l is not None:
            row.update({
                "prompt_tokens_llama": best_l["prompt_tokens"],
                "llama_decode_tok_s": best_l["decode_tok_s"],
                "llama_prefill_tok_s": best_l["prefill_tok_s"],
                "ratio": ours / best_l["decode_tok_s"],
                "match": prefix_match(best_l["generated_ids"], best_o["generated_ids"]),
            })
        rows.append(row)
        lt = f"{row['llama_decode_tok_s']:.1f}" if best_l else "-"
        ratio = f"{row['ratio']:.2f}" if best_l else "-"
        match = f"{row['match']}/{args.decode + 1}" if best_l else "-"
        lp = f"{row['llama_prefill_tok_s']:.0f}" if best_l else "-"
        print(f"{threads:>7} {ctx:>7} {row['prompt_tokens_ours']:>6} {k + '/' + ours_kv:>20} "
              f"{lt:>15} {ours:>10.1f} {ratio:>6} {match:>6} "
              f"{lp + '/' + format(row['ours_prefill_tok_s'], '.0f'):>19} "
              f"{row['load_avg_1min']:>5.1f}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"cpu": cpu_name(), "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
