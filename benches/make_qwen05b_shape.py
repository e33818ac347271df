#!/usr/bin/env python3
"""Writes a GGUF with exactly Qwen2.5-0.5B-Instruct's shapes and random weights, then has
llama.cpp's own quantiser make the file types people download from it (issue 45).

    python benches/make_qwen05b_shape.py [--out DIR] [--types Q4_K_M] [--seed 0]
        [--tokenizer-from SMOLLM2.gguf]

Decode speed depends on the shapes and the tensor types, not on the weights' values, so a
file of the real model's shapes stands in for the real model (which no registry here
carries) in speed and memory measurements, never in quality ones. The shapes: qwen2
architecture, 24 layers, hidden 896, 14 query heads and 2 KV heads of 64, feed-forward
4864, vocabulary 151,936, untied output head, biases on q/k/v, RoPE base 1e6, RMS-norm eps
1e-6, context 32,768. Weights are N(0, 0.02) (biases N(0, 0.02), norms 1), written as F16
(norms and biases F32), which `llama_model_quantize` (llama-cpp-python, as
`benches/requirements-llamacpp.txt` installs it) turns into each --types file with its
usual mix (Q4_K_M: 896-wide rows are not a multiple of 256, so llama.cpp falls back to
Q5_0 for them, as in the real file).

The tokenizer has Qwen2.5's sizes, since loading one costs time in proportion to them:
151,643 byte-level BPE tokens and as many merges less the 256 bytes' tokens, 22 control
tokens, and unused padding entries up to 151,936 (as llama.cpp's converter writes them).
Its first 49,152 tokens and their merges are SmolLM2's (read from the file of
scripts/fetch-smollm2.sh), so prompts encode to a realistic number of tokens; the rest are
merges of two tokens already present, drawn at random. Prints one output path per line; the F16 source
stays beside them (about 1 GB) unless --drop-f16.
"""
import argparse
import os
import subprocess
import sys

import numpy as np

VOCAB, HIDDEN, LAYERS, HEADS, KV_HEADS, HEAD_DIM, FFN = 151_936, 896, 24, 14, 2, 64, 4864
TYPES = {
    "Q4_K_M": "LLAMA_FTYPE_MOSTLY_Q4_K_M",
    "Q4_0": "LLAMA_FTYPE_MOSTLY_Q4_0",
    "Q8_0": "LLAMA_FTYPE_MOSTLY_Q8_0",
    "Q6_K": "LLAMA_FTYPE_MOSTLY_Q6_K",
    "Q5_K_M": "LLAMA_FTYPE_MOSTLY_Q5_K_M",
}


def smollm2_tokenizer(path):
    """SmolLM2's token strings and merges, from its GGUF."""
    import gguf

    r = gguf.GGUFReader(path)

    def strings(key):
        f = r.fields[key]
        return [bytes(f.parts[i]).decode("utf-8") for i in f.data]

    types = [int(r.fields["tokenizer.ggml.token_type"].parts[i][0]) for i in r.fields["tokenizer.ggml.token_type"].data]
    return strings("tokenizer.ggml.tokens"), types, strings("tokenizer.ggml.merges")


NORMAL_TOKENS, CONTROL_TOKENS = 151_643, 22


def qwen_sized(tokens, types, merges, seed):
    """SmolLM2's vocabulary grown to Qwen2.5's sizes (module docs): tokens, types, merges."""
    import gguf

    rng = np.random.default_rng(seed + 1)
    tokens, types, merges = list(tokens), list(types), list(merges)
    normal = [t for t, ty in zip(tokens, types) if ty == gguf.TokenType.NORMAL and " " not in t]
    have = set(tokens)
    while len(tokens) < NORMAL_TOKENS:
        a, b = normal[rng.integers(len(normal))], normal[rng.integers(len(normal))]
        t = a + b
        if len(t) > 24 or t in have:
            continue
        have.add(t)
        tokens.append(t)
        types.append(gguf.TokenType.NORMAL)
        merges.append(f"{a} {b}")
        normal.append(t)
    for i in range(CONTROL_TOKENS):
        tokens.append(f"<|control_{i}|>")
        types.append(gguf.TokenType.CONTROL)
    for i in range(len(tokens), VOCAB):
        tokens.append(f"[PAD{i}]")
        types.append(gguf.TokenType.UNUSED)
    return tokens, types, merges


def write_f16(path, tokens, types, merges, seed):
    import gguf

    rng = np.random.default_rng(seed)

    def normal(*shape, dtype=np.float16):
        return (rng.standard_normal(shape, dtype=np.float32) * 0.02).astype(dtype)

    w = gguf.GGUFWriter(path, "qwen2")
    w.add_name("qwen2.5-0.5b-shape-random")
    w.add_block_count(LAYERS)
    w.add_context_length(32_768)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(FFN)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(1_000_000.0)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_add_bos_token(False)
    w.add_tensor("token_embd.weight", normal(VOCAB, HIDDEN))
    for i in range(LAYERS):
        b = f"blk.{i}."
        w.add_tensor(b + "attn_norm.weight", np.ones(HIDDEN, np.float32))
        w.add_tensor(b + "attn_q.weight", normal(HEADS * HEAD_DIM, HIDDEN))
        w.add_tensor(b + "attn_q.bias", normal(HEADS * HEAD_DIM, dtype=np.float32))
        w.add_tensor(b + "attn_k.weight", normal(KV_HEADS * HEAD_DIM, HIDDEN))
        w.add_tensor(b + "attn_k.bias", normal(KV_HEADS * HEAD_DIM, dtype=np.float32))
        w.add_tensor(b + "attn_v.weight", normal(KV_HEADS * HEAD_DIM, HIDDEN))
        w.add_tensor(b + "attn_v.bias", normal(KV_HEADS * HEAD_DIM, dtype=np.float32))
        w.add_tensor(b + "attn_output.weight", normal(HIDDEN, HEADS * HEAD_DIM))
        w.add_tensor(b + "ffn_norm.weight", np.ones(HIDDEN, np.float32))
        w.add_tensor(b + "ffn_gate.weight", normal(FFN, HIDDEN))
        w.add_tensor(b + "ffn_up.weight", normal(FFN, HIDDEN))
        w.add_tensor(b + "ffn_down.weight", normal(HIDDEN, FFN))
    w.add_tensor("output_norm.weight", np.ones(HIDDEN, np.float32))
    w.add_tensor("output.weight", normal(VOCAB, HIDDEN))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def main() -> int:
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.path.expanduser("~/.cache/tinygpt-cpu/qwen05b-shape"))
    ap.add_argument("--types", default="Q4_K_M", help="comma-separated, of: " + ", ".join(TYPES))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tokenizer-from", help="SmolLM2 GGUF (default: scripts/fetch-smollm2.sh)")
    ap.add_argument("--drop-f16", action="store_true", help="delete the F16 source afterwards")
    args = ap.parse_args()
    try:
        import llama_cpp
    except ImportError:
        sys.exit("llama-cpp-python is not installed: pip install -r benches/requirements-llamacpp.txt")
    types = [t.strip() for t in args.types.split(",") if t.strip()]
    bad = [t for t in types if t not in TYPES]
    if bad:
        sys.exit(f"--types: unknown {', '.join(bad)} (known: {', '.join(TYPES)})")
    src = args.tokenizer_from
    if src is None:
        fetch = os.path.join(root, "scripts", "fetch-smollm2.sh")
        src = subprocess.run([fetch], check=True, capture_output=True, text=True).stdout.strip().splitlines()[-1]
    os.makedirs(args.out, exist_ok=True)
    f16 = os.path.join(args.out, "qwen2.5-0.5b-shape.F16.gguf")
    if not os.path.isfile(f16):
        tokens, token_types, merges = qwen_sized(*smollm2_tokenizer(src), args.seed)
        assert len(tokens) == VOCAB, len(tokens)
        write_f16(f16 + ".part", tokens, token_types, merges, args.seed)
        os.replace(f16 + ".part", f16)
    for name in types:
        out = os.path.join(args.out, f"qwen2.5-0.5b-shape.{name}.gguf")
        if not os.path.isfile(out):
            params = llama_cpp.llama_model_quantize_default_params()
            params.ftype = getattr(llama_cpp, TYPES[name])
            rc = llama_cpp.llama_model_quantize(f16.encode(), (out + ".part").encode(), params)
            if rc != 0:
                sys.exit(f"llama_model_quantize failed for {name} (code {rc})")
            os.replace(out + ".part", out)
        print(out)
    if args.drop_f16:
        os.remove(f16)
    return 0


if __name__ == "__main__":
    sys.exit(main())
