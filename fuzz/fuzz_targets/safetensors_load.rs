//! Fuzzes the safetensors loader behind `.tinygpt` files and Hugging Face directories:
//! header checks, tensor table, dtype/shape/offset checks, the config and tokenizer held in
//! the metadata, the config-against-tensors checks and the NaN/Inf scan. Any byte string
//! must give `Ok` or an `Err`, never a panic or an unbounded allocation. A model that loads
//! is run for two tokens.
#![no_main]

use libfuzzer_sys::fuzz_target;
use std::path::Path;
use tinygpt_cpu::weights::ModelFiles;

fuzz_target!(|data: &[u8]| {
    let Ok(files) = ModelFiles::from_tinygpt_bytes(data, Path::new("fuzz.tinygpt")) else {
        return;
    };
    let _ = files.tokenizer().map(|t| t.encode("hello world"));
    if let Ok(model) = tinygpt_cpu::model::Model::load(&files, tinygpt_cpu::model::WeightsDType::Native) {
        let kv = tinygpt_cpu::kv_cache::KvConfig {
            precision: tinygpt_cpu::kv_cache::Precision::Int4,
            group_size: 2,
            sink: 1,
            window: Some(2),
            positions: tinygpt_cpu::kv_cache::PositionsMode::Original,
        };
        let mut s = model.session(&kv);
        for pos in 0..2 {
            if model.forward(&mut s, 0, pos).is_err() {
                break;
            }
        }
    }
});
