//! Fuzzes the GGUF reader: any byte string must give `Ok` or an `Err`, never a panic, a hang
//! or an unbounded allocation. When a file parses, everything built from it is exercised too
//! (config and shape checks, Hugging Face tensors with Q/K un-permutation and dequantisation,
//! tokenizer, chat template).
#![no_main]

use libfuzzer_sys::fuzz_target;
use std::path::Path;
use tinygpt_cpu::gguf::GgufFile;

fuzz_target!(|data: &[u8]| {
    let Ok(f) = GgufFile::from_bytes(data.to_vec(), Path::new("fuzz.gguf")) else {
        return;
    };
    let _ = f.config();
    if let Ok(tensors) = f.hf_tensors() {
        for t in &tensors {
            let _ = t.to_f32();
        }
    }
    let _ = f.tokenizer();
    if let Some(t) = f.chat_template() {
        let _ = tinygpt_cpu::chat::render_chat(t, "hi", "<s>", "</s>");
    }
});
