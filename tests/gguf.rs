//! GGUF reader tests: small files written by the tiny GGUF writer below (v2 and v3, every
//! metadata value type, a tensor of every supported dtype), malformed files (each must give a
//! one-line error naming the file and, where there is one, the tensor), the Q/K row
//! un-permutation, and the real SmolLM2 file when it is present (see `real_model_path`).

use half::{bf16, f16};
use std::path::{Path, PathBuf};
use tinygpt_cpu::dtype::DType;
use tinygpt_cpu::gguf::{unpermute_qk_rows, GgufArray, GgufFile, GgufValue};
use tinygpt_reference::ggml::{dequantize_row, GgmlType};

// ---------------------------------------------------------------------------------------------
// A tiny GGUF writer (little-endian, v2/v3), written from the format description.

#[derive(Clone, Debug)]
enum V {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    F32(f32),
    Bool(bool),
    Str(String),
    /// element type id, elements
    Arr(u32, Vec<V>),
    U64(u64),
    I64(i64),
    F64(f64),
}

impl V {
    fn type_id(&self) -> u32 {
        match self {
            V::U8(_) => 0,
            V::I8(_) => 1,
            V::U16(_) => 2,
            V::I16(_) => 3,
            V::U32(_) => 4,
            V::I32(_) => 5,
            V::F32(_) => 6,
            V::Bool(_) => 7,
            V::Str(_) => 8,
            V::Arr(..) => 9,
            V::U64(_) => 10,
            V::I64(_) => 11,
            V::F64(_) => 12,
        }
    }
    fn write(&self, out: &mut Vec<u8>) {
        match self {
            V::U8(x) => out.push(*x),
            V::I8(x) => out.extend(x.to_le_bytes()),
            V::U16(x) => out.extend(x.to_le_bytes()),
            V::I16(x) => out.extend(x.to_le_bytes()),
            V::U32(x) => out.extend(x.to_le_bytes()),
            V::I32(x) => out.extend(x.to_le_bytes()),
            V::F32(x) => out.extend(x.to_le_bytes()),
            V::Bool(x) => out.push(*x as u8),
            V::Str(s) => write_str(out, s),
            V::Arr(t, items) => {
                out.extend(t.to_le_bytes());
                out.extend((items.len() as u64).to_le_bytes());
                for it in items {
                    it.write(out);
                }
            }
            V::U64(x) => out.extend(x.to_le_bytes()),
            V::I64(x) => out.extend(x.to_le_bytes()),
            V::F64(x) => out.extend(x.to_le_bytes()),
        }
    }
}

fn write_str(out: &mut Vec<u8>, s: &str) {
    out.extend((s.len() as u64).to_le_bytes());
    out.extend(s.as_bytes());
}

fn strs(items: &[&str]) -> V {
    V::Arr(8, items.iter().map(|s| V::Str(s.to_string())).collect())
}

#[derive(Clone)]
struct Tensor {
    name: String,
    /// GGUF order (ne[0] innermost)
    ne: Vec<u64>,
    ggml_type: u32,
    data: Vec<u8>,
}

#[derive(Clone)]
struct Gguf {
    version: u32,
    alignment: usize,
    kv: Vec<(String, V)>,
    tensors: Vec<Tensor>,
}

impl Gguf {
    fn new(version: u32) -> Self {
        Gguf {
            version,
            alignment: 32,
            kv: vec![("general.architecture".into(), V::Str("llama".into()))],
            tensors: vec![],
        }
    }
    fn kv(mut self, k: &str, v: V) -> Self {
        self.set(k, v);
        self
    }
    fn set(&mut self, k: &str, v: V) {
        if let Some(e) = self.kv.iter_mut().find(|(key, _)| key == k) {
            e.1 = v;
        } else {
            self.kv.push((k.to_string(), v));
        }
    }
    fn remove_tensor(&mut self, name: &str) {
        self.tensors.retain(|t| t.name != name);
    }
    fn tensor_mut(&mut self, name: &str) -> &mut Tensor {
        self.tensors
            .iter_mut()
            .find(|t| t.name == name)
            .expect(name)
    }
    fn bytes(&self) -> Vec<u8> {
        let mut out = b"GGUF".to_vec();
        out.extend(self.version.to_le_bytes());
        out.extend((self.tensors.len() as u64).to_le_bytes());
        out.extend((self.kv.len() as u64).to_le_bytes());
        for (k, v) in &self.kv {
            write_str(&mut out, k);
            out.extend(v.type_id().to_le_bytes());
            v.write(&mut out);
        }
        let mut offset = 0usize;
        let mut offsets = vec![];
        for t in &self.tensors {
            write_str(&mut out, &t.name);
            out.extend((t.ne.len() as u32).to_le_bytes());
            for d in &t.ne {
                out.extend(d.to_le_bytes());
            }
            out.extend(t.ggml_type.to_le_bytes());
            out.extend((offset as u64).to_le_bytes());
            offsets.push(offset);
            offset = (offset + t.data.len()).next_multiple_of(self.alignment);
        }
        let data_start = out.len().next_multiple_of(self.alignment);
        out.resize(data_start, 0);
        for (t, off) in self.tensors.iter().zip(offsets) {
            out.resize(data_start + off, 0);
            out.extend(&t.data);
        }
        out
    }
}

fn open(g: &Gguf) -> tinygpt_cpu::Result<GgufFile> {
    GgufFile::from_bytes(g.bytes(), Path::new("test.gguf"))
}

fn open_err(g: &Gguf) -> String {
    match open(g).and_then(|f| f.config().map(|_| f)) {
        Ok(_) => panic!("expected an error"),
        Err(e) => {
            let s = e.to_string();
            assert!(!s.contains('\n'), "error must be one line: {s:?}");
            assert!(s.contains("test.gguf"), "error must name the file: {s}");
            s
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Encoders for tensor data (the inverse of the documented block layouts).

fn enc_f32(x: &[f32]) -> Vec<u8> {
    x.iter().flat_map(|v| v.to_le_bytes()).collect()
}
fn enc_f16(x: &[f32]) -> Vec<u8> {
    x.iter()
        .flat_map(|v| f16::from_f32(*v).to_le_bytes())
        .collect()
}
fn enc_bf16(x: &[f32]) -> Vec<u8> {
    x.iter()
        .flat_map(|v| bf16::from_f32(*v).to_le_bytes())
        .collect()
}
/// Q8_0 with d = 1/8 and q = the given integers (exact for |q| <= 127).
fn enc_q8_0(q: &[i8]) -> Vec<u8> {
    let mut out = vec![];
    for blk in q.chunks(32) {
        out.extend(f16::from_f32(0.125).to_le_bytes());
        out.extend(blk.iter().map(|&v| v as u8));
    }
    out
}
/// Q4_0 with d = 0.5 and nibbles q (0..16): x = 0.5 (q - 8).
fn enc_q4_0(q: &[u8]) -> Vec<u8> {
    let mut out = vec![];
    for blk in q.chunks(32) {
        out.extend(f16::from_f32(0.5).to_le_bytes());
        for j in 0..16 {
            out.push(blk[j] | (blk[j + 16] << 4));
        }
    }
    out
}
/// Q4_1 with d = 0.25, m = -1: x = 0.25 q - 1.
fn enc_q4_1(q: &[u8]) -> Vec<u8> {
    let mut out = vec![];
    for blk in q.chunks(32) {
        out.extend(f16::from_f32(0.25).to_le_bytes());
        out.extend(f16::from_f32(-1.0).to_le_bytes());
        for j in 0..16 {
            out.push(blk[j] | (blk[j + 16] << 4));
        }
    }
    out
}

/// llama.cpp's `permute(W, n_head)` (convert_hf_to_gguf.py), from its definition:
/// `W.reshape(n_head, 2, rows / n_head / 2, cols).swapaxes(1, 2).reshape(rows, cols)`.
/// Output row (h, j, half) — flat `h·hd + 2j + half` — is input row (h, half, j) —
/// flat `h·hd + half·hd/2 + j`.
fn llama_cpp_permute(rows: &[Vec<u8>], n_head: usize) -> Vec<Vec<u8>> {
    let n = rows.len();
    let hd = n / n_head;
    let mut out = vec![vec![]; n];
    for h in 0..n_head {
        for half in 0..2 {
            for j in 0..hd / 2 {
                out[h * hd + j * 2 + half] = rows[h * hd + half * (hd / 2) + j].clone();
            }
        }
    }
    out
}

// ---------------------------------------------------------------------------------------------
// A tiny llama model: hidden 64, 2 heads of 32 (q 64), 1 KV head (kv 32), ffn 96, 2 layers,
// a 262-token byte-level vocabulary. One tensor of each supported dtype.

const HIDDEN: usize = 64;
const HEADS: usize = 2;
const KV_HEADS: usize = 1;
const HEAD_DIM: usize = 32;
const FFN: usize = 96;
const LAYERS: usize = 2;

fn byte_alphabet() -> Vec<String> {
    tinygpt_cpu::gguf::tokenizer::bytes_to_unicode()
        .iter()
        .map(|c| c.to_string())
        .collect()
}

/// Vocabulary: 3 specials, the 256 byte symbols, then the merges' results.
fn tiny_vocab() -> (Vec<String>, Vec<String>, Vec<i32>) {
    let mut tokens: Vec<String> = vec![
        "<|endoftext|>".into(),
        "<|im_start|>".into(),
        "<|im_end|>".into(),
    ];
    let mut types = vec![3, 3, 3];
    for c in byte_alphabet() {
        tokens.push(c);
        types.push(1);
    }
    let merges: Vec<String> = ["h e", "l l", "he ll", "hell o", "Ġ w"]
        .iter()
        .map(|s| s.to_string())
        .collect();
    for m in &merges {
        tokens.push(m.replace(' ', ""));
        types.push(1);
    }
    (tokens, merges, types)
}

fn tiny_model(version: u32) -> Gguf {
    let (tokens, merges, types) = tiny_vocab();
    let vocab = tokens.len();
    let mut g = Gguf::new(version)
        .kv("general.name", V::Str("tiny".into()))
        .kv("llama.block_count", V::U32(LAYERS as u32))
        .kv("llama.context_length", V::U32(256))
        .kv("llama.embedding_length", V::U32(HIDDEN as u32))
        .kv("llama.feed_forward_length", V::U32(FFN as u32))
        .kv("llama.attention.head_count", V::U32(HEADS as u32))
        .kv("llama.attention.head_count_kv", V::U32(KV_HEADS as u32))
        .kv("llama.rope.freq_base", V::F32(100000.0))
        .kv("llama.attention.layer_norm_rms_epsilon", V::F32(1e-5))
        .kv("llama.rope.dimension_count", V::U32(HEAD_DIM as u32))
        .kv("tokenizer.ggml.model", V::Str("gpt2".into()))
        .kv("tokenizer.ggml.pre", V::Str("smollm".into()))
        .kv("tokenizer.ggml.tokens", V::Arr(8, tokens.iter().map(|t| V::Str(t.clone())).collect()))
        .kv("tokenizer.ggml.token_type", V::Arr(5, types.iter().map(|&t| V::I32(t)).collect()))
        .kv("tokenizer.ggml.merges", V::Arr(8, merges.iter().map(|t| V::Str(t.clone())).collect()))
        .kv("tokenizer.ggml.bos_token_id", V::U32(1))
        .kv("tokenizer.ggml.eos_token_id", V::U32(2))
        .kv("tokenizer.ggml.add_bos_token", V::Bool(false))
        .kv(
            "tokenizer.chat_template",
            V::Str("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}".into()),
        );
    let mut add = |name: &str, shape_hf: &[usize], ty: u32, data: Vec<u8>| {
        g.tensors.push(Tensor {
            name: name.into(),
            ne: shape_hf.iter().rev().map(|&d| d as u64).collect(),
            ggml_type: ty,
            data,
        });
    };
    let q8: Vec<i8> = (0..vocab * HIDDEN)
        .map(|i| ((i * 7) % 255) as i32 as i8)
        .collect();
    add("token_embd.weight", &[vocab, HIDDEN], 8, enc_q8_0(&q8));
    add(
        "output_norm.weight",
        &[HIDDEN],
        0,
        enc_f32(&vec![1.0; HIDDEN]),
    );
    for l in 0..LAYERS {
        let b = |s: &str| format!("blk.{l}.{s}");
        let nib = |n: usize, salt: usize| -> Vec<u8> {
            (0..n).map(|i| ((i * 5 + salt) % 16) as u8).collect()
        };
        let vals = |n: usize| -> Vec<f32> { (0..n).map(|i| (i as f32 - 7.0) * 0.5).collect() };
        add(
            &b("attn_norm.weight"),
            &[HIDDEN],
            0,
            enc_f32(&vec![1.0; HIDDEN]),
        );
        add(
            &b("ffn_norm.weight"),
            &[HIDDEN],
            0,
            enc_f32(&vec![0.5; HIDDEN]),
        );
        add(
            &b("attn_q.weight"),
            &[HEADS * HEAD_DIM, HIDDEN],
            2,
            enc_q4_0(&nib(HEADS * HEAD_DIM * HIDDEN, l)),
        );
        add(
            &b("attn_k.weight"),
            &[KV_HEADS * HEAD_DIM, HIDDEN],
            3,
            enc_q4_1(&nib(KV_HEADS * HEAD_DIM * HIDDEN, 3)),
        );
        add(
            &b("attn_v.weight"),
            &[KV_HEADS * HEAD_DIM, HIDDEN],
            1,
            enc_f16(&vals(KV_HEADS * HEAD_DIM * HIDDEN)),
        );
        add(
            &b("attn_output.weight"),
            &[HIDDEN, HEADS * HEAD_DIM],
            30,
            enc_bf16(&vals(HIDDEN * HEADS * HEAD_DIM)),
        );
        add(
            &b("ffn_gate.weight"),
            &[FFN, HIDDEN],
            8,
            enc_q8_0(&vec![3; FFN * HIDDEN]),
        );
        add(
            &b("ffn_up.weight"),
            &[FFN, HIDDEN],
            2,
            enc_q4_0(&nib(FFN * HIDDEN, 1)),
        );
        add(
            &b("ffn_down.weight"),
            &[HIDDEN, FFN],
            0,
            enc_f32(&vals(HIDDEN * FFN)),
        );
    }
    g
}

// ---------------------------------------------------------------------------------------------
// Parsing

fn all_value_types() -> Vec<(String, V)> {
    vec![
        ("t.u8".into(), V::U8(200)),
        ("t.i8".into(), V::I8(-100)),
        ("t.u16".into(), V::U16(60000)),
        ("t.i16".into(), V::I16(-30000)),
        ("t.u32".into(), V::U32(4_000_000_000)),
        ("t.i32".into(), V::I32(-2_000_000_000)),
        ("t.f32".into(), V::F32(1.5)),
        ("t.bool".into(), V::Bool(true)),
        ("t.str".into(), V::Str("héllo 🤖".into())),
        ("t.u64".into(), V::U64(u64::MAX)),
        ("t.i64".into(), V::I64(i64::MIN)),
        ("t.f64".into(), V::F64(-2.25)),
        ("t.arr_u8".into(), V::Arr(0, vec![V::U8(1), V::U8(2)])),
        ("t.arr_i8".into(), V::Arr(1, vec![V::I8(-1)])),
        ("t.arr_u16".into(), V::Arr(2, vec![V::U16(7)])),
        ("t.arr_i16".into(), V::Arr(3, vec![V::I16(-7)])),
        (
            "t.arr_u32".into(),
            V::Arr(4, vec![V::U32(1), V::U32(2), V::U32(3)]),
        ),
        ("t.arr_i32".into(), V::Arr(5, vec![V::I32(-3)])),
        (
            "t.arr_f32".into(),
            V::Arr(6, vec![V::F32(0.25), V::F32(-0.5)]),
        ),
        (
            "t.arr_bool".into(),
            V::Arr(7, vec![V::Bool(true), V::Bool(false)]),
        ),
        ("t.arr_str".into(), strs(&["a", "", "ccc"])),
        ("t.arr_u64".into(), V::Arr(10, vec![V::U64(9)])),
        ("t.arr_i64".into(), V::Arr(11, vec![V::I64(-9)])),
        ("t.arr_f64".into(), V::Arr(12, vec![V::F64(0.125)])),
        ("t.arr_empty".into(), V::Arr(4, vec![])),
        (
            "t.nested".into(),
            V::Arr(
                9,
                vec![
                    V::Arr(4, vec![V::U32(1), V::U32(2)]),
                    V::Arr(8, vec![V::Str("x".into())]),
                ],
            ),
        ),
    ]
}

#[test]
fn parses_every_value_type_v2_and_v3() {
    for version in [2, 3] {
        let mut g = Gguf::new(version);
        for (k, v) in all_value_types() {
            g.set(&k, v);
        }
        let f = open(&g).unwrap();
        assert_eq!(f.version(), version);
        let m = f.metadata();
        assert_eq!(m["t.u8"], GgufValue::U8(200));
        assert_eq!(m["t.i8"], GgufValue::I8(-100));
        assert_eq!(m["t.u16"], GgufValue::U16(60000));
        assert_eq!(m["t.i16"], GgufValue::I16(-30000));
        assert_eq!(m["t.u32"], GgufValue::U32(4_000_000_000));
        assert_eq!(m["t.i32"], GgufValue::I32(-2_000_000_000));
        assert_eq!(m["t.f32"], GgufValue::F32(1.5));
        assert_eq!(m["t.bool"], GgufValue::Bool(true));
        assert_eq!(m["t.str"].as_str(), Some("héllo 🤖"));
        assert_eq!(m["t.u64"], GgufValue::U64(u64::MAX));
        assert_eq!(m["t.i64"], GgufValue::I64(i64::MIN));
        assert_eq!(m["t.f64"], GgufValue::F64(-2.25));
        assert_eq!(m["t.arr_u8"], GgufValue::Array(GgufArray::U8(vec![1, 2])));
        assert_eq!(m["t.arr_i8"], GgufValue::Array(GgufArray::I8(vec![-1])));
        assert_eq!(m["t.arr_u16"], GgufValue::Array(GgufArray::U16(vec![7])));
        assert_eq!(m["t.arr_i16"], GgufValue::Array(GgufArray::I16(vec![-7])));
        assert_eq!(
            m["t.arr_u32"],
            GgufValue::Array(GgufArray::U32(vec![1, 2, 3]))
        );
        assert_eq!(m["t.arr_i32"], GgufValue::Array(GgufArray::I32(vec![-3])));
        assert_eq!(
            m["t.arr_f32"],
            GgufValue::Array(GgufArray::F32(vec![0.25, -0.5]))
        );
        assert_eq!(
            m["t.arr_bool"],
            GgufValue::Array(GgufArray::Bool(vec![true, false]))
        );
        assert_eq!(
            m["t.arr_str"],
            GgufValue::Array(GgufArray::String(vec!["a".into(), "".into(), "ccc".into()]))
        );
        assert_eq!(m["t.arr_u64"], GgufValue::Array(GgufArray::U64(vec![9])));
        assert_eq!(m["t.arr_i64"], GgufValue::Array(GgufArray::I64(vec![-9])));
        assert_eq!(
            m["t.arr_f64"],
            GgufValue::Array(GgufArray::F64(vec![0.125]))
        );
        assert!(m["t.arr_empty"].as_array().unwrap().is_empty());
        assert_eq!(
            m["t.nested"],
            GgufValue::Array(GgufArray::Array(vec![
                GgufArray::U32(vec![1, 2]),
                GgufArray::String(vec!["x".into()])
            ]))
        );
        // accessors
        assert_eq!(m["t.u16"].as_u64(), Some(60000));
        assert_eq!(m["t.i8"].as_u64(), None);
        assert_eq!(m["t.i8"].as_f64(), Some(-100.0));
        assert_eq!(
            m["t.arr_u32"].as_array().unwrap().to_i64s(),
            Some(vec![1, 2, 3])
        );
    }
}

#[test]
fn tensors_of_every_dtype_with_alignment() {
    for alignment in [32usize, 64, 8] {
        let mut g = tiny_model(3);
        g.alignment = alignment;
        if alignment != 32 {
            g.set("general.alignment", V::U32(alignment as u32));
        }
        let f = open(&g).unwrap();
        assert_eq!(f.alignment(), alignment);
        assert_eq!(f.data_offset() % alignment, 0);
        let dtypes: std::collections::BTreeSet<String> = f
            .tensors()
            .iter()
            .map(|t| t.dtype.name().to_string())
            .collect();
        assert_eq!(dtypes.len(), 6, "{dtypes:?}");
        for t in f.tensors() {
            let want = &g.tensors.iter().find(|x| x.name == t.name).unwrap().data;
            assert_eq!(f.tensor_data(t), &want[..], "{}", t.name);
        }
    }
}

#[test]
fn config_from_metadata() {
    for version in [2, 3] {
        let f = open(&tiny_model(version)).unwrap();
        let c = f.config().unwrap();
        assert_eq!(c.n_layers, LAYERS);
        assert_eq!(c.hidden_size, HIDDEN);
        assert_eq!(c.n_heads, HEADS);
        assert_eq!(c.n_kv_heads, KV_HEADS);
        assert_eq!(c.head_dim, HEAD_DIM);
        assert_eq!(c.intermediate_size, FFN);
        assert_eq!(c.vocab_size, tiny_vocab().0.len());
        assert_eq!(c.rope_theta, 100000.0);
        assert_eq!(c.rms_norm_eps, 1e-5);
        assert_eq!(c.max_position_embeddings, 256);
        assert!(c.tie_word_embeddings, "no output.weight: tied");
        assert_eq!(c.bos_token_id, Some(1));
        assert_eq!(c.eos_token_ids, vec![2]);
        assert_eq!(c.rope_scaling, tinygpt_cpu::config::RopeScaling::None);
        assert!(!c.attention_bias);
    }
    // untied, linear rope scaling, no rope.dimension_count
    let mut g = tiny_model(3);
    let vocab = tiny_vocab().0.len();
    g.tensors.push(Tensor {
        name: "output.weight".into(),
        ne: vec![HIDDEN as u64, vocab as u64],
        ggml_type: 0,
        data: enc_f32(&vec![0.0; vocab * HIDDEN]),
    });
    g.set("llama.rope.scaling.type", V::Str("linear".into()));
    g.set("llama.rope.scaling.factor", V::F32(4.0));
    g.kv.retain(|(k, _)| k != "llama.rope.dimension_count");
    let c = open(&g).unwrap().config().unwrap();
    assert!(!c.tie_word_embeddings);
    assert_eq!(c.head_dim, HEAD_DIM);
    assert_eq!(
        c.rope_scaling,
        tinygpt_cpu::config::RopeScaling::Linear { factor: 4.0 }
    );
    let out = open(&g).unwrap();
    let hf = out.hf_tensors().unwrap();
    assert!(hf
        .iter()
        .any(|t| t.name == "lm_head.weight" && t.shape == vec![vocab, HIDDEN]));
}

#[test]
fn hf_tensors_names_shapes_and_borrowing() {
    let g = tiny_model(3);
    let f = open(&g).unwrap();
    let hf = f.hf_tensors().unwrap();
    assert_eq!(hf.len(), g.tensors.len());
    let get = |n: &str| {
        hf.iter()
            .find(|t| t.name == n)
            .unwrap_or_else(|| panic!("{n}"))
    };
    let vocab = tiny_vocab().0.len();
    let emb = get("model.embed_tokens.weight");
    assert_eq!(
        (emb.dtype, emb.shape.clone()),
        (DType::Q8_0, vec![vocab, HIDDEN])
    );
    assert!(matches!(emb.data, std::borrow::Cow::Borrowed(_)));
    assert_eq!(get("model.norm.weight").shape, vec![HIDDEN]);
    let q = get("model.layers.1.self_attn.q_proj.weight");
    assert_eq!(
        (q.dtype, q.shape.clone()),
        (DType::Q4_0, vec![HEADS * HEAD_DIM, HIDDEN])
    );
    assert!(matches!(q.data, std::borrow::Cow::Owned(_)));
    let k = get("model.layers.0.self_attn.k_proj.weight");
    assert_eq!(
        (k.dtype, k.shape.clone()),
        (DType::Q4_1, vec![KV_HEADS * HEAD_DIM, HIDDEN])
    );
    assert_eq!(
        get("model.layers.0.self_attn.v_proj.weight").dtype,
        DType::F16
    );
    let o = get("model.layers.0.self_attn.o_proj.weight");
    assert_eq!(
        (o.dtype, o.shape.clone()),
        (DType::BF16, vec![HIDDEN, HEADS * HEAD_DIM])
    );
    assert_eq!(
        get("model.layers.0.mlp.down_proj.weight").shape,
        vec![HIDDEN, FFN]
    );
    assert_eq!(
        get("model.layers.0.mlp.gate_proj.weight").shape,
        vec![FFN, HIDDEN]
    );
    assert_eq!(
        get("model.layers.0.mlp.up_proj.weight").shape,
        vec![FFN, HIDDEN]
    );
    assert_eq!(
        get("model.layers.0.input_layernorm.weight").shape,
        vec![HIDDEN]
    );
    assert_eq!(
        get("model.layers.0.post_attention_layernorm.weight").shape,
        vec![HIDDEN]
    );

    // Dequantised values of a few tensors, through the reference dequantiser.
    let deq = |t: &tinygpt_cpu::gguf::GgufTensor, ty: GgmlType| {
        let n: usize = t.shape.iter().product();
        let mut out = vec![0.0f32; n];
        dequantize_row(ty, &t.data, &mut out).unwrap();
        out
    };
    let e = deq(emb, GgmlType::Q8_0);
    for i in [0usize, 1, 100, vocab * HIDDEN - 1] {
        assert_eq!(
            e[i],
            0.125 * (((i * 7) % 255) as i32 as i8) as f32,
            "embedding element {i}"
        );
    }
    assert_eq!(emb.to_f32().unwrap(), e);
    let v = deq(get("model.layers.0.self_attn.v_proj.weight"), GgmlType::F16);
    assert_eq!(v[9], 1.0);
    let o = deq(o, GgmlType::BF16);
    assert_eq!(o[3], -2.0);
}

#[test]
fn qk_unpermute_inverts_llama_cpp_permutation() {
    // Hugging Face rows with distinct content, quantised as Q4_0 (2 blocks of 18 bytes per row).
    for (n_head, hd) in [(1usize, 4usize), (2, 32), (3, 8), (4, 64)] {
        let rows = n_head * hd;
        let hf_rows: Vec<Vec<u8>> = (0..rows)
            .map(|r| (0..36).map(|b| ((r * 31 + b * 7) % 251) as u8).collect())
            .collect();
        let file_rows = llama_cpp_permute(&hf_rows, n_head);
        assert_ne!(file_rows, hf_rows, "the permutation must move rows");
        let file: Vec<u8> = file_rows.concat();
        let back = unpermute_qk_rows(&file, rows, n_head).unwrap();
        assert_eq!(back, hf_rows.concat(), "n_head {n_head}, head_dim {hd}");
    }

    // Through the whole reader: q_proj permuted with n_head, k_proj with n_head_kv.
    let mut g = tiny_model(3);
    let row_bytes = HIDDEN / 32 * 18;
    let q_hf: Vec<Vec<u8>> = (0..HEADS * HEAD_DIM)
        .map(|r| {
            let nib: Vec<u8> = (0..HIDDEN).map(|i| ((r + i) % 16) as u8).collect();
            enc_q4_0(&nib)
        })
        .collect();
    assert_eq!(q_hf[0].len(), row_bytes);
    g.tensor_mut("blk.0.attn_q.weight").data = llama_cpp_permute(&q_hf, HEADS).concat();
    let k_hf: Vec<Vec<u8>> = (0..KV_HEADS * HEAD_DIM)
        .map(|r| {
            enc_q4_1(
                &(0..HIDDEN)
                    .map(|i| ((r * 3 + i) % 16) as u8)
                    .collect::<Vec<_>>(),
            )
        })
        .collect();
    g.tensor_mut("blk.0.attn_k.weight").data = llama_cpp_permute(&k_hf, KV_HEADS).concat();
    let f = open(&g).unwrap();
    let hf = f.hf_tensors().unwrap();
    let q = hf
        .iter()
        .find(|t| t.name == "model.layers.0.self_attn.q_proj.weight")
        .unwrap();
    assert_eq!(&q.data[..], &q_hf.concat()[..]);
    let k = hf
        .iter()
        .find(|t| t.name == "model.layers.0.self_attn.k_proj.weight")
        .unwrap();
    assert_eq!(&k.data[..], &k_hf.concat()[..]);
}

// ---------------------------------------------------------------------------------------------
// Bad input: one-line errors naming the file (and the tensor).

#[test]
fn unknown_and_unsupported_versions() {
    for (v, needle) in [
        (7u32, "unknown GGUF version 7"),
        (1, "version 1"),
        (0, "version 0"),
        (3u32.swap_bytes(), "big-endian"),
    ] {
        let mut g = tiny_model(3);
        g.version = v;
        let e = open_err(&g);
        assert!(e.contains(needle), "{e}");
    }
    let mut bytes = tiny_model(3).bytes();
    bytes[0] = b'X';
    let e = GgufFile::from_bytes(bytes, Path::new("test.gguf"))
        .err()
        .unwrap()
        .to_string();
    assert!(
        e.contains("test.gguf") && e.contains("not a GGUF file"),
        "{e}"
    );
}

#[test]
fn every_truncation_is_an_error_not_a_panic() {
    let g = tiny_model(2);
    let bytes = g.bytes();
    let f = open(&g).unwrap();
    let last_tensor_end = f
        .tensors()
        .iter()
        .map(|t| t.start + t.n_bytes)
        .max()
        .unwrap();
    // Every prefix up to the end of the metadata and tensor table, then a sample of the data.
    let table_end = f.data_offset();
    let cuts = (0..table_end).chain((table_end..last_tensor_end).step_by(97));
    for cut in cuts {
        let r = GgufFile::from_bytes(bytes[..cut].to_vec(), Path::new("test.gguf"));
        let e = r
            .err()
            .unwrap_or_else(|| panic!("a file cut at {cut} bytes must not open"))
            .to_string();
        assert!(e.contains("test.gguf") && !e.contains('\n'), "{e}");
        if cut >= table_end {
            assert!(e.contains("past the end of the file"), "cut {cut}: {e}");
        } else {
            // inside the header/metadata/table: "truncated"; inside the padding before the
            // data section: the first tensor's data is past the end
            assert!(
                e.contains("truncated") || e.contains("past the end"),
                "cut {cut}: {e}"
            );
        }
    }
}

#[test]
fn unsupported_tensor_type_names_tensor_and_type() {
    let mut g = tiny_model(3);
    g.tensor_mut("blk.0.attn_q.weight").ggml_type = 17; // IQ2_XS
    let e = open_err(&g);
    assert!(
        e.contains("tensor 'blk.0.attn_q.weight' has type IQ2_XS, which is not supported (supported: F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_NL, IQ4_XS)"),
        "{e}"
    );
    g.tensor_mut("blk.0.attn_q.weight").ggml_type = 999;
    let e = open_err(&g);
    assert!(
        e.contains("blk.0.attn_q.weight") && e.contains("#999"),
        "{e}"
    );
}

#[test]
fn wrong_architecture() {
    let g = tiny_model(3).kv("general.architecture", V::Str("mamba".into()));
    let e = open_err(&g);
    assert!(
        e.contains("general.architecture 'mamba' is not supported")
            && e.contains("llama, qwen2, qwen3"),
        "{e}"
    );
    let mut g = tiny_model(3);
    g.kv.retain(|(k, _)| k != "general.architecture");
    assert!(open_err(&g).contains("general.architecture"));
}

/// `tiny_model` as architecture `arch`: every `llama.*` key renamed to `<arch>.*`.
fn as_arch(g: Gguf, arch: &str) -> Gguf {
    let mut g = g.kv("general.architecture", V::Str(arch.into()));
    for (k, _) in g.kv.iter_mut() {
        if let Some(rest) = k.strip_prefix("llama.") {
            *k = format!("{arch}.{rest}");
        }
    }
    g
}

#[test]
fn qwen2_keys_and_no_qk_unpermute() {
    let g = as_arch(tiny_model(3), "qwen2");
    let f = open(&g).unwrap();
    assert_eq!(f.arch().name, "qwen2");
    let c = f.config().unwrap();
    assert_eq!(
        (
            c.n_layers,
            c.hidden_size,
            c.n_heads,
            c.n_kv_heads,
            c.head_dim
        ),
        (LAYERS, HIDDEN, HEADS, KV_HEADS, HEAD_DIM)
    );
    assert_eq!(c.rope_theta, 100000.0);
    assert!(!c.qk_norm && !c.attention_bias);
    // NEOX-style RoPE: llama.cpp stores qwen2's Q/K in Hugging Face row order, so they are
    // borrowed as they are (a llama file's are un-permuted into owned copies).
    let hf = f.hf_tensors().unwrap();
    for (name, gguf) in [
        (
            "model.layers.1.self_attn.q_proj.weight",
            "blk.1.attn_q.weight",
        ),
        (
            "model.layers.0.self_attn.k_proj.weight",
            "blk.0.attn_k.weight",
        ),
    ] {
        let t = hf.iter().find(|t| t.name == name).unwrap();
        assert!(matches!(t.data, std::borrow::Cow::Borrowed(_)), "{name}");
        let file = g.tensors.iter().find(|t| t.name == gguf).unwrap();
        assert_eq!(&t.data[..], &file.data[..], "{name}");
    }
    // A llama key in a qwen2 file is not read: the qwen2 one is missing.
    let mut g2 = g.clone();
    g2.kv.retain(|(k, _)| k != "qwen2.block_count");
    let e = open(&g2).unwrap().config().unwrap_err().to_string();
    assert!(e.contains("'qwen2.block_count'"), "{e}");
    // q/k/v biases
    let mut g3 = g.clone();
    for l in 0..LAYERS {
        for (n, d) in [
            ("q", HEADS * HEAD_DIM),
            ("k", KV_HEADS * HEAD_DIM),
            ("v", KV_HEADS * HEAD_DIM),
        ] {
            g3.tensors.push(Tensor {
                name: format!("blk.{l}.attn_{n}.bias"),
                ne: vec![d as u64],
                ggml_type: 0,
                data: enc_f32(&vec![0.25; d]),
            });
        }
    }
    let f3 = open(&g3).unwrap();
    assert!(f3.config().unwrap().attention_bias);
    let hf = f3.hf_tensors().unwrap();
    assert!(hf
        .iter()
        .any(|t| t.name == "model.layers.1.self_attn.v_proj.bias"));
    // a qwen3 file needs its per-head q/k norms
    let g4 = as_arch(tiny_model(3), "qwen3");
    let e = open(&g4).unwrap().config().unwrap_err().to_string();
    assert!(e.contains("_norm.weight") && e.contains("missing"), "{e}");
}

#[test]
fn shapes_contradicting_metadata_name_the_tensor() {
    // attn_k with n_head rows instead of n_head_kv rows
    let mut g = tiny_model(3);
    let t = g.tensor_mut("blk.1.attn_k.weight");
    t.ne = vec![HIDDEN as u64, (HEADS * HEAD_DIM) as u64];
    t.data = enc_q4_1(&vec![0; HEADS * HEAD_DIM * HIDDEN]);
    let e = open_err(&g);
    assert!(
        e.contains("tensor 'blk.1.attn_k.weight'")
            && e.contains("[64, 64]")
            && e.contains("[32, 64]"),
        "{e}"
    );

    // head count that does not divide the q rows
    let g = tiny_model(3)
        .kv("llama.attention.head_count", V::U32(4))
        .kv("llama.rope.dimension_count", V::U32(16));
    let e = open_err(&g);
    assert!(
        e.contains("blk.0.attn_k.weight") || e.contains("blk.0.attn_q.weight"),
        "{e}"
    );

    // block_count larger than the blocks present
    let g = tiny_model(3).kv("llama.block_count", V::U32(3));
    let e = open_err(&g);
    assert!(e.contains("blk.2.") && e.contains("missing"), "{e}");

    // block_count smaller than the blocks present
    let g = tiny_model(3).kv("llama.block_count", V::U32(1));
    let e = open_err(&g);
    assert!(
        e.contains("blk.1.") && e.contains("layer 1 does not exist"),
        "{e}"
    );

    // embedding width
    let g = tiny_model(3).kv("llama.embedding_length", V::U32(128));
    let e = open_err(&g);
    assert!(e.contains("tensor '"), "{e}");

    // vocabulary size vs token_embd
    let g = tiny_model(3).kv("llama.vocab_size", V::U32(1000));
    let e = open_err(&g);
    assert!(e.contains("tensor 'token_embd.weight'"), "{e}");

    // a tensor the llama architecture does not have
    let mut g = tiny_model(3);
    g.tensors.push(Tensor {
        name: "blk.0.ssm_a".into(),
        ne: vec![4],
        ggml_type: 0,
        data: enc_f32(&[0.0; 4]),
    });
    let e = open_err(&g);
    assert!(e.contains("tensor 'blk.0.ssm_a'"), "{e}");

    // missing required metadata, and a key with the wrong type
    let mut g = tiny_model(3);
    g.kv.retain(|(k, _)| k != "llama.embedding_length");
    assert!(open_err(&g).contains("llama.embedding_length"));
    let g = tiny_model(3).kv("llama.block_count", V::Str("thirty".into()));
    assert!(open_err(&g).contains("llama.block_count"));
    // a missing tensor
    let mut g = tiny_model(3);
    g.remove_tensor("blk.1.ffn_up.weight");
    let e = open_err(&g);
    assert!(
        e.contains("tensor 'blk.1.ffn_up.weight'") && e.contains("missing"),
        "{e}"
    );
}

#[test]
fn hostile_counts_and_offsets() {
    // An array claiming 2^62 elements: an error, not an allocation.
    let mut bytes = b"GGUF".to_vec();
    bytes.extend(3u32.to_le_bytes());
    bytes.extend(0u64.to_le_bytes()); // tensors
    bytes.extend(1u64.to_le_bytes()); // metadata pairs
    write_str(&mut bytes, "huge");
    bytes.extend(9u32.to_le_bytes());
    bytes.extend(4u32.to_le_bytes());
    bytes.extend((1u64 << 62).to_le_bytes());
    let e = GgufFile::from_bytes(bytes, Path::new("test.gguf"))
        .err()
        .unwrap()
        .to_string();
    assert!(e.contains("test.gguf") && e.contains("huge"), "{e}");

    // A string of length u64::MAX.
    let mut bytes = b"GGUF".to_vec();
    bytes.extend(3u32.to_le_bytes());
    bytes.extend(0u64.to_le_bytes());
    bytes.extend(1u64.to_le_bytes());
    bytes.extend(u64::MAX.to_le_bytes());
    assert!(GgufFile::from_bytes(bytes, Path::new("test.gguf")).is_err());

    // Arrays nested 100 deep.
    let mut v = V::Arr(4, vec![V::U32(1)]);
    for _ in 0..100 {
        v = V::Arr(9, vec![v]);
    }
    let e = open_err(&Gguf::new(3).kv("deep", v));
    assert!(e.contains("nested"), "{e}");

    // Tensor count far beyond what the file holds.
    let mut bytes = Gguf::new(3).bytes();
    bytes[8..16].copy_from_slice(&u64::MAX.to_le_bytes());
    assert!(GgufFile::from_bytes(bytes, Path::new("test.gguf")).is_err());

    // Misaligned and overflowing tensor offsets, bad dims, partial blocks, duplicates.
    let g = tiny_model(3);
    let f = open(&g).unwrap();
    let mut bytes = g.bytes();
    let first = &f.tensors()[0];
    // locate the first tensor info's offset field: it is the 8 bytes before the second
    // tensor's name; simpler: search for the name and walk the record.
    let name = first.name.as_bytes();
    let pos = bytes.windows(name.len()).position(|w| w == name).unwrap() + name.len();
    let n_dims = u32::from_le_bytes(bytes[pos..pos + 4].try_into().unwrap()) as usize;
    let off_pos = pos + 4 + 8 * n_dims + 4;
    for (bad, needle) in [
        (1u64, "not a multiple of the alignment"),
        (u64::MAX - 31, "overflows"),
        (1u64 << 40, "past the end"),
    ] {
        let mut b = bytes.clone();
        b[off_pos..off_pos + 8].copy_from_slice(&bad.to_le_bytes());
        let e = GgufFile::from_bytes(b, Path::new("test.gguf"))
            .err()
            .unwrap()
            .to_string();
        assert!(e.contains(needle) && e.contains(&first.name), "{e}");
    }
    bytes[pos..pos + 4].copy_from_slice(&9u32.to_le_bytes());
    let e = GgufFile::from_bytes(bytes, Path::new("test.gguf"))
        .err()
        .unwrap()
        .to_string();
    assert!(e.contains("dimensions"), "{e}");

    let mut g = tiny_model(3);
    g.tensor_mut("output_norm.weight").ggml_type = 8; // Q8_0 with 64-element rows is fine...
    g.tensor_mut("output_norm.weight").ne = vec![33]; // ...33 is not whole blocks
    let e = open_err(&g);
    assert!(
        e.contains("output_norm.weight") && e.contains("block"),
        "{e}"
    );

    let mut g = tiny_model(3);
    let dup = g.tensors[0].clone();
    g.tensors.push(dup);
    assert!(open_err(&g).contains("duplicate tensor"));
    let mut g = tiny_model(3);
    g.kv.push(("general.name".into(), V::Str("again".into())));
    assert!(open_err(&g).contains("duplicate metadata key 'general.name'"));
    let g = tiny_model(3).kv("general.alignment", V::U32(24));
    assert!(open_err(&g).contains("alignment"));
}

#[test]
fn open_reads_from_disk_and_names_missing_files() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("tiny.gguf");
    std::fs::write(&p, tiny_model(3).bytes()).unwrap();
    let f = GgufFile::open(&p).unwrap();
    assert_eq!(f.config().unwrap().n_layers, LAYERS);
    assert_eq!(f.path(), p.as_path());
    let e = GgufFile::open(&dir.path().join("nope.gguf"))
        .err()
        .unwrap()
        .to_string();
    assert!(e.contains("nope.gguf"), "{e}");
}

// ---------------------------------------------------------------------------------------------
// Tokenizer and chat template from metadata

#[test]
fn tokenizer_from_tiny_metadata() {
    let f = open(&tiny_model(3)).unwrap();
    let tok = f.tokenizer().unwrap();
    let id = |t: &str| tok.token_to_id(t).unwrap_or_else(|| panic!("{t}"));
    let enc = tok.encode("hello world", true).unwrap();
    assert_eq!(
        enc.get_ids(),
        &[id("hello"), id("Ġw"), id("o"), id("r"), id("l"), id("d")]
    );
    // control tokens are matched whole, even inside words; no BOS is added
    let enc = tok.encode("<|im_start|>hello<|im_end|>", true).unwrap();
    assert_eq!(enc.get_ids(), &[1, id("hello"), 2]);
    assert_eq!(tok.decode(&[1, id("hello"), 2], true).unwrap(), "hello");
    // bytes outside ASCII go through the byte alphabet
    let enc = tok.encode("é", true).unwrap();
    assert_eq!(enc.get_ids(), &[id("Ã"), id("©")]);
    assert_eq!(tok.decode(enc.get_ids(), false).unwrap(), "é");

    // add_bos_token = true prepends BOS
    let g = tiny_model(3).kv("tokenizer.ggml.add_bos_token", V::Bool(true));
    let tok = open(&g).unwrap().tokenizer().unwrap();
    assert_eq!(
        tok.encode("hello", true).unwrap().get_ids(),
        &[1, id("hello")]
    );
    assert_eq!(
        tok.encode("hello", false).unwrap().get_ids(),
        &[id("hello")]
    );

    // a known pre-tokenizer kind with its own regex (Llama 3's splits digits in threes)
    let g = tiny_model(3).kv("tokenizer.ggml.pre", V::Str("llama-bpe".into()));
    let tok = open(&g).unwrap().tokenizer().unwrap();
    assert_eq!(tok.encode("hello", true).unwrap().get_ids(), &[id("hello")]);

    // qwen2's regex isolates every digit
    let g = tiny_model(3).kv("tokenizer.ggml.pre", V::Str("qwen2".into()));
    let tok = open(&g).unwrap().tokenizer().unwrap();
    assert_eq!(
        tok.encode("hello 12", true).unwrap().get_ids(),
        &[id("hello"), id("Ġ"), id("1"), id("2")]
    );

    // an unknown pre-tokenizer kind is an error naming the key and the value
    let g = tiny_model(3).kv("tokenizer.ggml.pre", V::Str("made-up".into()));
    let e = open(&g).unwrap().tokenizer().unwrap_err().to_string();
    assert!(
        e.contains("tokenizer.ggml.pre") && e.contains("'made-up'") && e.contains("qwen2"),
        "{e}"
    );

    // unsupported kinds are named
    let g = tiny_model(3).kv("tokenizer.ggml.model", V::Str("t5".into()));
    let e = open(&g).unwrap().tokenizer().unwrap_err().to_string();
    assert!(
        e.contains("test.gguf") && e.contains("'t5'") && e.contains("not supported"),
        "{e}"
    );
    // SentencePiece needs its scores
    let g = tiny_model(3).kv("tokenizer.ggml.model", V::Str("llama".into()));
    let e = open(&g).unwrap().tokenizer().unwrap_err().to_string();
    assert!(
        e.contains("test.gguf") && e.contains("tokenizer.ggml.scores"),
        "{e}"
    );
    let mut g = tiny_model(3);
    g.set("tokenizer.ggml.merges", strs(&["h e x"]));
    let e = open(&g).unwrap().tokenizer().unwrap_err().to_string();
    assert!(e.contains("merge #0"), "{e}");
}

#[test]
fn chat_template_from_metadata() {
    let f = open(&tiny_model(3)).unwrap();
    let t = f.chat_template().unwrap();
    let s = tinygpt_cpu::chat::render_chat(t, "hi", "<|im_start|>", "<|im_end|>").unwrap();
    assert_eq!(s, "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n");
    let mut g = tiny_model(3);
    g.kv.retain(|(k, _)| k != "tokenizer.chat_template");
    assert!(open(&g).unwrap().chat_template().is_none());
}

// ---------------------------------------------------------------------------------------------
// The real SmolLM2-135M-Instruct file (scripts/fetch-smollm2.sh)

/// `TINYGPT_SMOLLM2`, else the fetch script's default cache path. When the file is absent the
/// test is skipped with a message, except under CI (env `CI` set), where it fails.
fn real_model_path() -> Option<PathBuf> {
    let p = match std::env::var_os("TINYGPT_SMOLLM2") {
        Some(p) => PathBuf::from(p),
        None => {
            let cache = std::env::var_os("TINYGPT_CACHE")
                .map(PathBuf::from)
                .or_else(|| {
                    std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache/tinygpt-cpu"))
                })?;
            cache.join("smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
        }
    };
    if p.exists() {
        return Some(p);
    }
    if std::env::var_os("CI").is_some() {
        panic!(
            "{} not found: CI must run scripts/fetch-smollm2.sh first",
            p.display()
        );
    }
    eprintln!(
        "skipping: run scripts/fetch-smollm2.sh ({} not found)",
        p.display()
    );
    None
}

fn repo_file(rel: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join(rel)
}

#[test]
fn smollm2_config_and_tensors() {
    let Some(p) = real_model_path() else { return };
    let f = GgufFile::open(&p).unwrap();
    assert_eq!(f.version(), 3);
    let c = f.config().unwrap();
    assert_eq!(
        (c.n_layers, c.n_heads, c.n_kv_heads, c.head_dim),
        (30, 9, 3, 64)
    );
    assert_eq!(
        (c.hidden_size, c.intermediate_size, c.vocab_size),
        (576, 1536, 49152)
    );
    assert_eq!(c.max_position_embeddings, 8192);
    assert_eq!(c.rope_theta, 100000.0);
    assert_eq!(c.rms_norm_eps, 1e-5);
    assert!(c.tie_word_embeddings);
    assert_eq!(
        (c.bos_token_id, c.eos_token_ids.clone()),
        (Some(1), vec![2])
    );
    let hf = f.hf_tensors().unwrap();
    assert_eq!(hf.len(), 2 + 30 * 9);
    let emb = hf
        .iter()
        .find(|t| t.name == "model.embed_tokens.weight")
        .unwrap();
    assert_eq!(
        (emb.dtype, emb.shape.clone()),
        (DType::Q8_0, vec![49152, 576])
    );
    let q = hf
        .iter()
        .find(|t| t.name == "model.layers.29.self_attn.q_proj.weight")
        .unwrap();
    assert_eq!((q.dtype, q.shape.clone()), (DType::Q4_1, vec![576, 576]));
    let k = hf
        .iter()
        .find(|t| t.name == "model.layers.0.self_attn.k_proj.weight")
        .unwrap();
    assert_eq!(k.shape, vec![192, 576]);
    assert!(!hf.iter().any(|t| t.name == "lm_head.weight"));
}

#[test]
fn smollm2_tokenizer_parity_with_transformers() {
    let Some(p) = real_model_path() else { return };
    let f = GgufFile::open(&p).unwrap();
    let tok = f.tokenizer().unwrap();
    let path = repo_file("fixtures/golden/smollm2_tokenizer_cases.json");
    let text = std::fs::read_to_string(&path).unwrap();
    let golden: serde_json::Value = serde_json::from_str(&text).unwrap();
    let cases = golden["cases"].as_array().unwrap();
    assert!(cases.len() >= 2000, "{} cases", cases.len());
    let mut mismatches = vec![];
    for (i, c) in cases.iter().enumerate() {
        let line = c["text"].as_str().unwrap();
        let want: Vec<u32> = c["ids"]
            .as_str()
            .unwrap()
            .split_whitespace()
            .map(|x| x.parse().unwrap())
            .collect();
        let got = tok.encode(line, true).unwrap().get_ids().to_vec();
        if got != want {
            mismatches.push(format!(
                "case {i} {line:?}: got {got:?}, transformers {want:?}"
            ));
        }
    }
    assert!(
        mismatches.is_empty(),
        "{} of {} cases differ:\n{}",
        mismatches.len(),
        cases.len(),
        mismatches
            .iter()
            .take(20)
            .cloned()
            .collect::<Vec<_>>()
            .join("\n")
    );
    // The golden prompts too.
    let g: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(repo_file("fixtures/golden/smollm2.json")).unwrap(),
    )
    .unwrap();
    for p in g["prompts"].as_array().unwrap() {
        let want: Vec<u32> = p["prompt_ids"]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_u64().unwrap() as u32)
            .collect();
        assert_eq!(
            tok.encode(p["text"].as_str().unwrap(), true)
                .unwrap()
                .get_ids(),
            &want[..]
        );
    }
}

#[test]
fn smollm2_chat_template_renders() {
    let Some(p) = real_model_path() else { return };
    let f = GgufFile::open(&p).unwrap();
    let t = f.chat_template().expect("SmolLM2 has a chat template");
    let g: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(repo_file("fixtures/golden/smollm2.json")).unwrap(),
    )
    .unwrap();
    let chat = g["prompts"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["name"] == "chat")
        .unwrap();
    let rendered = tinygpt_cpu::chat::render_chat(
        t,
        chat["chat_user_message"].as_str().unwrap(),
        "<|im_start|>",
        "<|im_end|>",
    )
    .unwrap();
    assert_eq!(
        rendered,
        chat["text"].as_str().unwrap(),
        "same text as transformers' apply_chat_template"
    );
    let tok = f.tokenizer().unwrap();
    let ids = tok
        .encode(rendered.as_str(), true)
        .unwrap()
        .get_ids()
        .to_vec();
    let want: Vec<u32> = chat["prompt_ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect();
    assert_eq!(ids, want);
}

#[test]
fn files_written_by_gguf_py_parse() {
    // fuzz/seeds/*.gguf are written by llama.cpp's own Python writer (fuzz/make_seeds.py):
    // a third-party check of the reader, besides the writer in this file.
    let dir = repo_file("fuzz/seeds");
    let mut n = 0;
    for entry in std::fs::read_dir(&dir).unwrap() {
        let p = entry.unwrap().path();
        let f = GgufFile::open(&p).unwrap_or_else(|e| panic!("{e}"));
        let c = f.config().unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(
            (c.hidden_size, c.n_heads, c.n_kv_heads, c.head_dim),
            (32, 2, 1, 16)
        );
        let hf = f.hf_tensors().unwrap();
        assert_eq!(hf.len(), 2 + 9 * c.n_layers);
        if f.metadata().contains_key("tokenizer.ggml.model") {
            let tok = f.tokenizer().unwrap();
            // add_bos_token = true in these files
            assert_eq!(tok.encode("ab a", true).unwrap().get_ids(), &[0, 4, 6]);
        }
        n += 1;
    }
    assert_eq!(n, 3);
}

#[test]
fn huge_block_count_is_an_error_without_allocating() {
    // Found by the fuzzer: a block count of 2^40 used to build a per-layer table first.
    // (Since issue 11 the config's bound on the layer count refuses it before the tensors.)
    let g = tiny_model(3).kv("llama.block_count", V::U64(1 << 40));
    let e = open_err(&g);
    assert!(
        e.contains("num_hidden_layers") && e.contains("1099511627776"),
        "{e}"
    );
    // A count within the bound but beyond the tensors names the first missing tensor.
    let g = tiny_model(3).kv("llama.block_count", V::U64(1000));
    let e = open_err(&g);
    assert!(
        e.contains("tensor 'blk.2.attn_norm.weight'") && e.contains("missing"),
        "{e}"
    );
}

#[test]
fn llama3_rope_freqs_tensor_becomes_llama3_scaling() {
    // convert_hf_to_gguf writes Llama 3.1 scaling as per-frequency divisors in rope_freqs.weight.
    let theta = 500000.0f64;
    let factor = 8.0f64;
    let divisors: Vec<f32> = (0..HEAD_DIM / 2)
        .map(|i| {
            let freq = 1.0 / theta.powf((2 * i) as f64 / HEAD_DIM as f64);
            let wavelen = 2.0 * std::f64::consts::PI / freq;
            if wavelen < 8192.0 / 4.0 {
                1.0
            } else if wavelen > 8192.0 {
                factor as f32
            } else {
                let smooth = (8192.0 / wavelen - 1.0) / 3.0;
                (1.0 / ((1.0 - smooth) / factor + smooth)) as f32
            }
        })
        .collect();
    assert!(
        divisors.iter().any(|&d| d > 1.0 && d < 8.0),
        "some smoothed frequency: {divisors:?}"
    );
    let mut g = tiny_model(3).kv("llama.rope.freq_base", V::F32(theta as f32));
    g.tensors.push(Tensor {
        name: "rope_freqs.weight".into(),
        ne: vec![(HEAD_DIM / 2) as u64],
        ggml_type: 0,
        data: enc_f32(&divisors),
    });
    let f = open(&g).unwrap();
    assert_eq!(
        f.config().unwrap().rope_scaling,
        tinygpt_cpu::config::RopeScaling::Llama3 {
            factor: 8.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position_embeddings: 8192
        }
    );
    assert!(!f
        .hf_tensors()
        .unwrap()
        .iter()
        .any(|t| t.name.contains("rope")));
    // Divisors of another scheme are refused, naming the tensor.
    g.tensor_mut("rope_freqs.weight").data = enc_f32(&[2.0; HEAD_DIM / 2]);
    let e = open_err(&g);
    assert!(e.contains("tensor 'rope_freqs.weight'"), "{e}");
}

#[test]
fn smollm2_weights_dequantise_sanely() {
    // The real Q4_1/Q8_0/F32 tensors dequantise to finite values of a plausible scale, and
    // the un-permuted q_proj holds the same multiset of rows as the file.
    let Some(p) = real_model_path() else { return };
    let f = GgufFile::open(&p).unwrap();
    let hf = f.hf_tensors().unwrap();
    for name in [
        "model.embed_tokens.weight",
        "model.layers.0.self_attn.q_proj.weight",
        "model.layers.0.input_layernorm.weight",
    ] {
        let t = hf.iter().find(|t| t.name == name).unwrap();
        let v = t.to_f32().unwrap();
        assert!(v.iter().all(|x| x.is_finite()), "{name}");
        let rms = (v.iter().map(|x| x * x).sum::<f32>() / v.len() as f32).sqrt();
        assert!(rms > 1e-3 && rms < 10.0, "{name}: rms {rms}");
    }
    let q = hf
        .iter()
        .find(|t| t.name == "model.layers.0.self_attn.q_proj.weight")
        .unwrap();
    let raw = f.tensor_data(f.tensor("blk.0.attn_q.weight").unwrap());
    let row = raw.len() / 576;
    let mut a: Vec<&[u8]> = raw.chunks(row).collect();
    let mut b: Vec<&[u8]> = q.data.chunks(row).collect();
    assert_ne!(a, b);
    a.sort();
    b.sort();
    assert_eq!(a, b);
}

#[test]
fn smollm2_weights_match_transformers() {
    // fixtures/golden/smollm2.json `weights_probe`: values transformers dequantised and
    // un-permuted from the same file. Exact up to the 6-decimal rounding of the fixture.
    let Some(p) = real_model_path() else { return };
    let f = GgufFile::open(&p).unwrap();
    let hf = f.hf_tensors().unwrap();
    let g: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(repo_file("fixtures/golden/smollm2.json")).unwrap(),
    )
    .unwrap();
    let probe = g["weights_probe"].as_object().expect("weights_probe");
    assert!(probe.len() >= 6);
    for (name, rows) in probe {
        let t = hf
            .iter()
            .find(|t| &t.name == name)
            .unwrap_or_else(|| panic!("{name}"));
        let v = t.to_f32().unwrap();
        let cols = *t.shape.last().unwrap();
        for (r, want) in rows.as_object().unwrap() {
            let r: usize = r.parse().unwrap();
            for (c, w) in want.as_array().unwrap().iter().enumerate() {
                let got = v[r * cols + c];
                let w = w.as_f64().unwrap() as f32;
                assert!(
                    (got - w).abs() <= 1e-6 + 1e-6 * w.abs(),
                    "{name}[{r}, {c}]: ours {got}, transformers {w}"
                );
            }
        }
    }
}

/// YOCO sharing and per-layer attention types under llama.cpp's keys
/// (`{arch}.attention.shared_kv_layers`, `.sliding_window_pattern`, `.sliding_window`); a
/// shared layer's attn_k/attn_v may be absent.
#[test]
fn shared_kv_layers_and_sliding_pattern_from_metadata() {
    use tinygpt_cpu::config::AttentionType;
    let mut g = tiny_model(3)
        .kv("llama.attention.shared_kv_layers", V::U32(1))
        .kv("llama.attention.sliding_window", V::U32(8))
        .kv(
            "llama.attention.sliding_window_pattern",
            V::Arr(7, vec![V::Bool(false), V::Bool(false)]),
        );
    let last = LAYERS - 1;
    g.remove_tensor(&format!("blk.{last}.attn_k.weight"));
    g.remove_tensor(&format!("blk.{last}.attn_v.weight"));
    let c = open(&g).unwrap().config().unwrap();
    assert_eq!(c.num_kv_shared_layers, 1);
    assert_eq!(c.layers_with_kv(), LAYERS - 1);
    assert_eq!(c.kv_source(last), Some(last - 1));
    assert_eq!(c.layer_types, vec![AttentionType::Full; LAYERS]);
    assert_eq!(c.sliding_window, None);

    let mut sliding = g.clone();
    sliding.set(
        "llama.attention.sliding_window_pattern",
        V::Arr(7, vec![V::Bool(true), V::Bool(true)]),
    );
    let c = open(&sliding).unwrap().config().unwrap();
    assert_eq!(c.attention_type(0), AttentionType::Sliding { window: 8 });
    assert_eq!(c.kv_source(last), Some(0));

    // Present k/v tensors of a shared layer are accepted (and ignored).
    let with_kv = tiny_model(3).kv("llama.attention.shared_kv_layers", V::U32(1));
    assert!(open(&with_kv).unwrap().config().is_ok());

    // A non-shared layer still needs its k/v.
    let mut missing = tiny_model(3);
    missing.remove_tensor("blk.0.attn_k.weight");
    assert!(open_err(&missing).contains("blk.0.attn_k.weight"));

    for (key, v, needle) in [
        (
            "llama.attention.shared_kv_layers",
            V::U32(LAYERS as u32),
            "num_kv_shared_layers",
        ),
        (
            "llama.attention.sliding_window_pattern",
            V::Arr(7, vec![V::Bool(true)]),
            "sliding_window_pattern",
        ),
        (
            "llama.attention.sliding_window_pattern",
            V::Arr(4, vec![V::U32(1), V::U32(0)]),
            "array of bool",
        ),
        (
            "llama.attention.sliding_window",
            V::U32(0),
            "sliding_window",
        ),
    ] {
        let mut bad = sliding.clone();
        bad.set(key, v);
        let err = open_err(&bad);
        assert!(err.contains(needle), "{key}: {err}");
    }
}

/// The gpt2 tokenizer is built from its parts (the BPE model from the vocabulary and merges
/// directly, the added tokens added after); it must be the tokenizer that loading the whole
/// `tokenizer.json` document gives, field for field: the tiny metadata in each of its
/// variants, every architecture fixture, and SmolLM2 when it is present.
#[test]
fn tokenizer_built_from_parts_equals_the_json_document() {
    use std::str::FromStr;
    let check = |f: &GgufFile, what: &str| {
        let built = f.tokenizer().unwrap();
        let doc = tinygpt_cpu::gguf::tokenizer::tokenizer_json(f.metadata(), f.path()).unwrap();
        let parsed = tokenizers::Tokenizer::from_str(&doc).unwrap();
        assert_eq!(
            built.to_string(false).unwrap(),
            parsed.to_string(false).unwrap(),
            "{what}"
        );
        assert!(built.get_vocab_size(true) > 0, "{what}");
    };
    for v in [2, 3] {
        check(&open(&tiny_model(v)).unwrap(), "tiny");
    }
    let bos = tiny_model(3).kv("tokenizer.ggml.add_bos_token", V::Bool(true));
    check(&open(&bos).unwrap(), "tiny, add_bos_token");
    let mut n = 0;
    for e in std::fs::read_dir(repo_file("fixtures/archs")).unwrap() {
        for f in std::fs::read_dir(e.unwrap().path()).unwrap() {
            let p = f.unwrap().path();
            if p.extension().is_some_and(|x| x == "gguf") {
                check(&GgufFile::open(&p).unwrap(), &p.display().to_string());
                n += 1;
            }
        }
    }
    assert!(n >= 4, "{n} architecture fixtures");
    if let Some(p) = real_model_path() {
        check(&GgufFile::open(&p).unwrap(), "SmolLM2");
    }
}
