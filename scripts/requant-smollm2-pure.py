#!/usr/bin/env python3
"""Re-quantises SmolLM2-135M-Instruct with llama.cpp's own quantiser
(`llama_model_quantize` through llama-cpp-python) in its `--pure` mode: every tensor that
can be gets the base type. SmolLM2's 576-wide rows cannot be K-quants, so in Q2_K_pure and
Q3_K_S_pure the 30 `ffn_down` matrices (1536 wide) are Q2_K / Q3_K and the others fall
back to Q4_0 — the only SmolLM2 files with Q2_K tensors (llama.cpp's Q2_K mix makes them
Q3_K), for docs/eval/quant-types.md. The usual mixes: scripts/requant-smollm2.py.

    python3 scripts/requant-smollm2-pure.py [TYPE ...]

Source: the Q4_1 file of scripts/fetch-smollm2.sh (re-quantised, `allow_requantize`).
Output: $TINYGPT_CACHE/requant/SmolLM2-135M-Instruct.TYPE.gguf (default cache
~/.cache/tinygpt-cpu); files already there are kept. TYPE is a llama.cpp file type with
the suffix `_pure` (default: Q2_K_pure Q3_K_S_pure). Exits 2 with a message when
llama-cpp-python is absent.
"""
import os
import sys

try:
    import llama_cpp
except ImportError:
    print("skipped: llama-cpp-python is not installed (pip install llama-cpp-python)")
    sys.exit(2)

DEFAULT = ["Q2_K_pure", "Q3_K_S_pure"]


def main():
    cache = os.environ.get("TINYGPT_CACHE", os.path.expanduser("~/.cache/tinygpt-cpu"))
    src = os.path.join(cache, "smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")
    if not os.path.exists(src):
        sys.exit(f"{src}: not found (run scripts/fetch-smollm2.sh first)")
    out_dir = os.path.join(cache, "requant")
    os.makedirs(out_dir, exist_ok=True)
    for name in sys.argv[1:] or DEFAULT:
        if not name.endswith("_pure"):
            sys.exit(f"{name}: expected TYPE_pure (the mixes: scripts/requant-smollm2.py)")
        base = name[: -len("_pure")]
        ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{base}", None)
        if ftype is None:
            sys.exit(f"{name}: not a llama.cpp file type")
        out = os.path.join(out_dir, f"SmolLM2-135M-Instruct.{name}.gguf")
        if os.path.exists(out):
            print(out)
            continue
        params = llama_cpp.llama_model_quantize_default_params()
        params.ftype = ftype
        params.allow_requantize = True
        params.pure = True
        params.nthread = 1
        part = out + ".part"
        rc = llama_cpp.llama_model_quantize(src.encode(), part.encode(), params)
        if rc != 0:
            sys.exit(f"{name}: llama_model_quantize returned {rc}")
        os.replace(part, out)
        print(out)


main()
