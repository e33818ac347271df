#!/usr/bin/env python3
"""Re-quantises SmolLM2-135M-Instruct into the GGUF types small-model users download
(Q2_K, Q3_K_M, Q4_K_M, Q5_K_M, Q6_K, Q8_0, IQ4_NL, IQ4_XS) with llama.cpp's own quantiser
(`llama_model_quantize` through llama-cpp-python, as `benches/requirements-llamacpp.txt`
installs it). The source is the Q4_1 file of `scripts/fetch-smollm2.sh`, so this is a
re-quantisation (`allow_requantize`): the files test the loaders and kernels of each type,
not the best quality each type can reach.

    python scripts/requant-smollm2.py [--src FILE] [--out DIR] [--types Q4_K_M,Q6_K] [--pure]

`--pure` is llama.cpp's pure mode (every tensor that can be gets the base type), written as
`TYPE_pure`: SmolLM2's 576-wide rows cannot be K-quants, so `--pure --types Q2_K,Q3_K_S`
gives files whose 30 `ffn_down` matrices (1536 wide) are Q2_K or Q3_K and every other matrix
Q4_0 — the only SmolLM2 files with Q2_K tensors (llama.cpp's Q2_K mix makes them Q3_K).

Prints one output path per line. Exits 0 with a message on stderr, writing nothing, when
llama-cpp-python is not installed (tests that need the files then skip, saying so).
"""
import argparse
import os
import subprocess
import sys

TYPES = {
    "Q8_0": "LLAMA_FTYPE_MOSTLY_Q8_0",
    "Q6_K": "LLAMA_FTYPE_MOSTLY_Q6_K",
    "Q5_K_M": "LLAMA_FTYPE_MOSTLY_Q5_K_M",
    "Q4_K_M": "LLAMA_FTYPE_MOSTLY_Q4_K_M",
    "Q3_K_M": "LLAMA_FTYPE_MOSTLY_Q3_K_M",
    "Q3_K_S": "LLAMA_FTYPE_MOSTLY_Q3_K_S",
    "Q2_K": "LLAMA_FTYPE_MOSTLY_Q2_K",
    "IQ4_NL": "LLAMA_FTYPE_MOSTLY_IQ4_NL",
    "IQ4_XS": "LLAMA_FTYPE_MOSTLY_IQ4_XS",
}


def main() -> int:
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--src", help="source GGUF (default: scripts/fetch-smollm2.sh)")
    ap.add_argument(
        "--out",
        default=os.path.expanduser("~/.cache/tinygpt-cpu/requant"),
        help="output directory (default: ~/.cache/tinygpt-cpu/requant)",
    )
    ap.add_argument("--types", default=",".join(t for t in TYPES if t != "Q3_K_S"), help="comma-separated, of: " + ", ".join(TYPES))
    ap.add_argument("--pure", action="store_true", help="llama.cpp's pure mode; files named TYPE_pure")
    args = ap.parse_args()
    try:
        import llama_cpp
    except ImportError:
        print("llama-cpp-python is not installed: no re-quantised files made", file=sys.stderr)
        return 0
    src = args.src
    if src is None:
        fetch = os.path.join(root, "scripts", "fetch-smollm2.sh")
        src = subprocess.run([fetch], check=True, capture_output=True, text=True).stdout.strip().splitlines()[-1]
    if not os.path.isfile(src):
        print(f"error: {src}: no such file", file=sys.stderr)
        return 1
    os.makedirs(args.out, exist_ok=True)
    stem = os.path.basename(src).rsplit(".", 2)[0]
    for name in args.types.split(","):
        name = name.strip()
        if name not in TYPES:
            print(f"error: --types: unknown type {name!r} (known: {', '.join(TYPES)})", file=sys.stderr)
            return 2
        out = os.path.join(args.out, f"{stem}.{name}{'_pure' if args.pure else ''}.gguf")
        if not os.path.isfile(out):
            params = llama_cpp.llama_model_quantize_default_params()
            params.ftype = getattr(llama_cpp, TYPES[name])
            params.allow_requantize = True
            params.pure = args.pure
            tmp = out + ".part"
            rc = llama_cpp.llama_model_quantize(src.encode(), tmp.encode(), params)
            if rc != 0:
                print(f"error: llama_model_quantize {name} returned {rc}", file=sys.stderr)
                return 1
            os.replace(tmp, out)
        print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
