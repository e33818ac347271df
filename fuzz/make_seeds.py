#!/usr/bin/env python3
"""Writes the fuzzer's seed files (fuzz/seeds/*.gguf) with the `gguf` package (llama.cpp's
gguf-py): tiny llama models, v3 and v2, with F32/F16/Q8_0 tensors and a byte-level tokenizer.
Run from the repository root: python fuzz/make_seeds.py"""
import numpy as np
import gguf

def write(path, n_layers=1, hidden=32, heads=2, kv=1, ffn=32, tok=True, version=3):
    w = gguf.GGUFWriter(path, "llama")
    w.add_block_count(n_layers)
    w.add_context_length(64)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(ffn)
    w.add_head_count(heads)
    w.add_head_count_kv(kv)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_dimension_count(hidden // heads)
    tokens = ["<s>", "</s>", "a", "b", "ab", "Ġ", "Ġa"]
    vocab = len(tokens)
    if tok:
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre("smollm")
        w.add_token_list(tokens)
        w.add_token_types([3, 3, 1, 1, 1, 1, 1])
        w.add_token_merges(["a b", "Ġ a"])
        w.add_bos_token_id(0)
        w.add_eos_token_id(1)
        w.add_add_bos_token(True)
        w.add_chat_template("{% for m in messages %}{{ m['content'].strip() }}{% endfor %}")
    rng = np.random.default_rng(0)
    hd = hidden // heads
    def q8(shape):
        return gguf.quants.quantize(rng.standard_normal(shape).astype(np.float32), gguf.GGMLQuantizationType.Q8_0)
    w.add_tensor("token_embd.weight", rng.standard_normal((vocab, hidden)).astype(np.float16))
    w.add_tensor("output_norm.weight", np.ones(hidden, np.float32))
    for i in range(n_layers):
        w.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(hidden, np.float32))
        w.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(hidden, np.float32))
        w.add_tensor(f"blk.{i}.attn_q.weight", q8((heads * hd, hidden)), raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        w.add_tensor(f"blk.{i}.attn_k.weight", q8((kv * hd, hidden)), raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        w.add_tensor(f"blk.{i}.attn_v.weight", rng.standard_normal((kv * hd, hidden)).astype(np.float32))
        w.add_tensor(f"blk.{i}.attn_output.weight", rng.standard_normal((hidden, heads * hd)).astype(np.float32))
        w.add_tensor(f"blk.{i}.ffn_gate.weight", q8((ffn, hidden)), raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        w.add_tensor(f"blk.{i}.ffn_up.weight", rng.standard_normal((ffn, hidden)).astype(np.float16))
        w.add_tensor(f"blk.{i}.ffn_down.weight", rng.standard_normal((hidden, ffn)).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    if version != 3:
        with open(path, "r+b") as f:
            f.seek(4)
            f.write(version.to_bytes(4, "little"))

write("fuzz/seeds/tiny_v3.gguf")
write("fuzz/seeds/tiny_v2.gguf", version=2)
write("fuzz/seeds/no_tokenizer_2layers.gguf", n_layers=2, tok=False)
