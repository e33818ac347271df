//! The stored-row probe of issue 24 on SmolLM2-135M (f32 weights): where do the engine's
//! and the reference's K/V rows first differ, and why (tests/common/probe.rs)? Run by
//! hand, it prints its findings:
//!
//! ```sh
//! cargo test --release --test ref_probe -- --ignored --nocapture
//! ```
//!
//! `TINYGPT_PROBE_TOKENS` sets the tokens (default 16).

mod common;
use common::probe::probe;
use common::*;
use tinygpt_cpu::kv_cache::{KvConfig, KvRotation, Precision};
use tinygpt_cpu::model::{reference_model, Model, WeightsDType};
use tinygpt_cpu::weights::ModelFiles;

#[test]
#[ignore = "prints a report; run by hand (slow: the scalar reference on SmolLM2)"]
fn probe_smollm2_stored_rows() {
    let Some(p) = smollm2_path() else { return };
    let n: usize = std::env::var("TINYGPT_PROBE_TOKENS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(16);
    let files = ModelFiles::open(Some(&p)).unwrap();
    let engine = Model::load(&files, WeightsDType::F32).unwrap();
    let reference = reference_model(&files, WeightsDType::F32).unwrap();
    let text = std::fs::read_to_string(fixtures().join("heldout.txt")).unwrap();
    let mut toks = files.tokenizer().unwrap().encode(&text).unwrap();
    toks.truncate(n);
    let only = std::env::var("TINYGPT_PROBE_MODES").ok();
    for (name, precision, rotation) in [
        ("fp32", Precision::Fp32, KvRotation::Auto),
        ("int8", Precision::Int8, KvRotation::Auto),
        ("int8+norot", Precision::Int8, KvRotation::None),
        ("int4", Precision::Int4, KvRotation::Auto),
        ("int4+norot", Precision::Int4, KvRotation::None),
    ] {
        if only
            .as_deref()
            .is_some_and(|o| !o.split(',').any(|m| m == name))
        {
            continue;
        }
        let kv = KvConfig {
            precision,
            rotation,
            ..KvConfig::default()
        };
        let rep = probe(&engine, &reference, &kv, &toks);
        eprintln!("== {name}, {n} tokens\n{rep}\n");
    }
}
