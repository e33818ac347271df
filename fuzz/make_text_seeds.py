#!/usr/bin/env python3
"""Writes the seeds of the safetensors_load and config_json fuzz targets (standard library
only): a 1-layer .tinygpt model small enough for fast iterations (F32, F16 and BF16
variants, tied and untied), and the config.json files of the test fixtures.
Run from the repository root: python3 fuzz/make_text_seeds.py"""
import json, os, shutil, struct, glob

OUT_ST = "fuzz/seeds_safetensors_load"
OUT_CFG = "fuzz/seeds_config_json"
os.makedirs(OUT_ST, exist_ok=True)
os.makedirs(OUT_CFG, exist_ok=True)

VOCAB = ["a", "b", "ab", "Ġ", "Ġa", "<s>", "</s>", "c"]
TOKENIZER = {
    "version": "1.0", "truncation": None, "padding": None,
    "added_tokens": [
        {"id": 5, "content": "<s>", "single_word": False, "lstrip": False, "rstrip": False, "normalized": False, "special": True},
        {"id": 6, "content": "</s>", "single_word": False, "lstrip": False, "rstrip": False, "normalized": False, "special": True},
    ],
    "normalizer": None,
    "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True},
    "post_processor": None,
    "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
    "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
              "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False,
              "vocab": {t: i for i, t in enumerate(VOCAB)}, "merges": [["a", "b"], ["Ġ", "a"]]},
}

def tensor_bytes(dtype, n, seed):
    vals = [((i * 7 + seed) % 13 - 6) / 8.0 for i in range(n)]
    if dtype == "F32":
        return struct.pack(f"<{n}f", *vals)
    if dtype == "F16":
        return struct.pack(f"<{n}e", *vals)
    # BF16: the top half of the f32 bits.
    return b"".join(struct.pack("<I", struct.unpack("<I", struct.pack("<f", v))[0])[2:] for v in vals)

def write(name, dtype="F32", tied=True, hidden=8, heads=2, kv=1, ffn=8):
    vocab = len(VOCAB)
    hd = hidden // heads
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": vocab,
           "hidden_size": hidden, "num_hidden_layers": 1, "num_attention_heads": heads,
           "num_key_value_heads": kv, "intermediate_size": ffn, "max_position_embeddings": 64,
           "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": tied,
           "bos_token_id": 5, "eos_token_id": 6}
    shapes = {
        "model.embed_tokens.weight": [vocab, hidden],
        "model.norm.weight": [hidden],
        "model.layers.0.input_layernorm.weight": [hidden],
        "model.layers.0.post_attention_layernorm.weight": [hidden],
        "model.layers.0.self_attn.q_proj.weight": [heads * hd, hidden],
        "model.layers.0.self_attn.k_proj.weight": [kv * hd, hidden],
        "model.layers.0.self_attn.v_proj.weight": [kv * hd, hidden],
        "model.layers.0.self_attn.o_proj.weight": [hidden, heads * hd],
        "model.layers.0.mlp.gate_proj.weight": [ffn, hidden],
        "model.layers.0.mlp.up_proj.weight": [ffn, hidden],
        "model.layers.0.mlp.down_proj.weight": [hidden, ffn],
    }
    if not tied:
        shapes["lm_head.weight"] = [vocab, hidden]
    header = {"__metadata__": {"tinygpt.config": json.dumps(cfg), "tinygpt.tokenizer": json.dumps(TOKENIZER)}}
    data = b""
    for i, (n, shp) in enumerate(sorted(shapes.items())):
        numel = 1
        for d in shp:
            numel *= d
        b = tensor_bytes(dtype, numel, i)
        header[n] = {"dtype": dtype, "shape": shp, "data_offsets": [len(data), len(data) + len(b)]}
        data += b
    h = json.dumps(header, separators=(",", ":")).encode()
    with open(os.path.join(OUT_ST, name), "wb") as f:
        f.write(struct.pack("<Q", len(h)) + h + data)

write("tiny_f32_tied.tinygpt")
write("tiny_f16_untied.tinygpt", dtype="F16", tied=False)
write("tiny_bf16_gqa.tinygpt", dtype="BF16", heads=4, kv=2)
for p in ["fixtures/tiny/config.json"] + sorted(glob.glob("fixtures/unseen/*/config.json")):
    name = p.split("/")[-2] + ".json"
    shutil.copy(p, os.path.join(OUT_CFG, name))
print("wrote", sorted(os.listdir(OUT_ST)), sorted(os.listdir(OUT_CFG)))
