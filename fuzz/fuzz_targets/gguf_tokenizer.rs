//! Fuzzes the tokenizer-from-GGUF builder (`gguf::tokenizer::build`) with structured
//! `tokenizer.ggml.*` metadata (a token list, merges, token types, special ids, flags),
//! which reaches deeper than raw GGUF bytes do; a tokenizer that builds encodes and decodes.
#![no_main]

use libfuzzer_sys::arbitrary::{self, Arbitrary};
use libfuzzer_sys::fuzz_target;
use std::collections::BTreeMap;
use std::path::Path;
use tinygpt_cpu::gguf::{GgufArray, GgufValue};

#[derive(Arbitrary, Debug)]
struct Meta {
    model: u8,
    tokens: Vec<String>,
    merges: Vec<String>,
    types: Option<Vec<i32>>,
    pre: Option<String>,
    bos: Option<u32>,
    eos: Option<u32>,
    unk: Option<u32>,
    add_bos: Option<bool>,
    add_eos: Option<bool>,
    text: String,
    ids: Vec<u32>,
}

fuzz_target!(|m: Meta| {
    let mut meta = BTreeMap::new();
    let model = match m.model % 4 {
        0 | 1 => "gpt2",
        2 => "llama",
        _ => "",
    };
    meta.insert("tokenizer.ggml.model".to_string(), GgufValue::String(model.into()));
    meta.insert(
        "tokenizer.ggml.tokens".to_string(),
        GgufValue::Array(GgufArray::String(m.tokens)),
    );
    meta.insert(
        "tokenizer.ggml.merges".to_string(),
        GgufValue::Array(GgufArray::String(m.merges)),
    );
    if let Some(t) = m.types {
        meta.insert(
            "tokenizer.ggml.token_type".to_string(),
            GgufValue::Array(GgufArray::I32(t)),
        );
    }
    if let Some(p) = m.pre {
        meta.insert("tokenizer.ggml.pre".to_string(), GgufValue::String(p));
    }
    for (k, v) in [("bos", m.bos), ("eos", m.eos), ("unknown", m.unk)] {
        if let Some(v) = v {
            meta.insert(format!("tokenizer.ggml.{k}_token_id"), GgufValue::U32(v));
        }
    }
    for (k, v) in [("bos", m.add_bos), ("eos", m.add_eos)] {
        if let Some(v) = v {
            meta.insert(format!("tokenizer.ggml.add_{k}_token"), GgufValue::Bool(v));
        }
    }
    let Ok(tok) = tinygpt_cpu::gguf::tokenizer::build(&meta, Path::new("fuzz.gguf")) else {
        return;
    };
    if let Ok(enc) = tok.encode(m.text.as_str(), true) {
        let _ = tok.decode(enc.get_ids(), true);
    }
    let _ = tok.decode(&m.ids, false);
});
