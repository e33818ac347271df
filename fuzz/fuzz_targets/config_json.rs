//! Fuzzes config.json parsing and validation (`HfConfig::from_json` + `validate`) and what
//! is derived from a valid config before any weight is read (sizes, the KV-cache memory
//! estimate, the RoPE frequencies). Never a panic, an overflow or a huge allocation.
#![no_main]

use libfuzzer_sys::fuzz_target;
use std::path::Path;
use tinygpt_cpu::config::HfConfig;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let path = Path::new("config.json");
    let Ok(hf) = HfConfig::from_json(text, path) else {
        return;
    };
    let Ok(cfg) = hf.validate(path) else {
        return;
    };
    let _ = (cfg.q_dim(), cfg.kv_dim());
    for p in tinygpt_cpu::kv_cache::Precision::ALL {
        let _ = tinygpt_cpu::memory::kv_bytes_per_token(&cfg, p);
    }
    let _ = tinygpt_cpu::attention::RopeTable::new(&cfg);
});
