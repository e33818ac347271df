//! f16/bf16 weight files, sharded checkpoints, and `--weights-dtype` conversions.

mod common;
use common::*;
use half::{bf16, f16};
use std::collections::HashMap;
use std::path::Path;
use tinygpt_cpu::generate::{EngineRun, ReferenceRun};
use tinygpt_cpu::kv_cache::KvConfig;
use tinygpt_cpu::model::{reference_model, Model, WeightsDType};
use tinygpt_cpu::weights::ModelFiles;

/// Writes a copy of fixtures/tiny whose weights are `dtype`, split into `shards` files.
fn write_variant(dir: &Path, dtype: safetensors::Dtype, shards: usize) {
    let src = fixtures().join("tiny");
    for f in ["config.json", "tokenizer.json", "tokenizer_config.json"] {
        std::fs::copy(src.join(f), dir.join(f)).unwrap();
    }
    let bytes = std::fs::read(src.join("model.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let mut converted: Vec<(String, Vec<usize>, Vec<u8>)> = Vec::new();
    for (name, view) in st.tensors() {
        let f32s: Vec<f32> = view
            .data()
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect();
        let data: Vec<u8> = match dtype {
            safetensors::Dtype::F16 => f32s
                .iter()
                .flat_map(|&x| f16::from_f32(x).to_le_bytes())
                .collect(),
            safetensors::Dtype::BF16 => f32s
                .iter()
                .flat_map(|&x| bf16::from_f32(x).to_le_bytes())
                .collect(),
            _ => view.data().to_vec(),
        };
        converted.push((name, view.shape().to_vec(), data));
    }
    converted.sort_by(|a, b| a.0.cmp(&b.0));
    let per = converted.len().div_ceil(shards);
    let mut weight_map = serde_json::Map::new();
    for (i, chunk) in converted.chunks(per).enumerate() {
        let fname = if shards == 1 {
            "model.safetensors".to_string()
        } else {
            format!("model-{:05}-of-{:05}.safetensors", i + 1, shards)
        };
        let views: Vec<(String, safetensors::tensor::TensorView)> = chunk
            .iter()
            .map(|(n, s, d)| {
                weight_map.insert(n.clone(), serde_json::Value::String(fname.clone()));
                (
                    n.clone(),
                    safetensors::tensor::TensorView::new(dtype, s.clone(), d).unwrap(),
                )
            })
            .collect();
        safetensors::serialize_to_file(views, None::<HashMap<String, String>>, &dir.join(&fname))
            .unwrap();
    }
    if shards > 1 {
        let index = serde_json::json!({"metadata": {}, "weight_map": weight_map});
        std::fs::write(dir.join("model.safetensors.index.json"), index.to_string()).unwrap();
    }
}

fn engine_greedy(files: &ModelFiles, w: WeightsDType, prompt: &[u32], n: usize) -> Greedy {
    let m = Model::load(files, w).unwrap();
    let mut e = EngineRun::new(&m, &KvConfig::default());
    greedy(&mut e, prompt, n)
}

fn reference_greedy(files: &ModelFiles, w: WeightsDType, prompt: &[u32], n: usize) -> Greedy {
    let m = reference_model(files, w).unwrap();
    let mut r = ReferenceRun::new(&m, &KvConfig::default());
    greedy(&mut r, prompt, n)
}

#[test]
fn f16_and_bf16_files_load_and_match_the_reference() {
    let g = golden("tiny.json");
    let prompt = ids(&g["prompts"][0]["prompt_ids"]);
    let golden_logits = floats(&g["prompts"][0]["last_logits"]);
    for (dtype, tol_vs_f32) in [
        (safetensors::Dtype::F16, 0.02f32),
        (safetensors::Dtype::BF16, 0.25),
    ] {
        let d = tempfile::tempdir().unwrap();
        write_variant(d.path(), dtype, 1);
        let files = ModelFiles::open(Some(d.path())).unwrap();
        let want = format!("{dtype:?}");
        assert!(
            files.dtype_summary().contains_key(want.as_str()),
            "{:?}",
            files.dtype_summary()
        );
        let e = engine_greedy(&files, WeightsDType::Native, &prompt, 40);
        let r = reference_greedy(&files, WeightsDType::Native, &prompt, 40);
        assert_eq!(e.ids, r.ids, "{dtype:?}: engine vs reference greedy ids");
        for (a, b) in e.logits.iter().zip(&r.logits) {
            assert!(
                max_abs_diff(a, b) < 1e-4,
                "{dtype:?}: engine vs reference logits"
            );
        }
        let err = max_abs_diff(&e.logits[0], &golden_logits);
        assert!(
            err < tol_vs_f32,
            "{dtype:?} weights: logits off the f32 golden by {err}"
        );
    }
}

#[test]
fn sharded_checkpoint_equals_single_file() {
    let d = tempfile::tempdir().unwrap();
    write_variant(d.path(), safetensors::Dtype::F32, 3);
    assert!(d.path().join("model.safetensors.index.json").is_file());
    let sharded = ModelFiles::open(Some(d.path())).unwrap();
    let single = ModelFiles::open(Some(&fixtures().join("tiny"))).unwrap();
    let prompt = ids(&golden("tiny.json")["prompts"][2]["prompt_ids"]);
    let a = engine_greedy(&sharded, WeightsDType::Native, &prompt, 20);
    let b = engine_greedy(&single, WeightsDType::Native, &prompt, 20);
    assert_eq!(a.logits, b.logits);
}

#[test]
fn weights_dtype_conversions() {
    let files = ModelFiles::open(Some(&fixtures().join("tiny"))).unwrap();
    let prompt = ids(&golden("tiny.json")["prompts"][0]["prompt_ids"]);
    let native = engine_greedy(&files, WeightsDType::Native, &prompt, 30);
    let f32w = engine_greedy(&files, WeightsDType::F32, &prompt, 30);
    assert_eq!(
        native.logits, f32w.logits,
        "f32 file + f32 conversion must be identical"
    );
    let bf = engine_greedy(&files, WeightsDType::Bf16, &prompt, 30);
    let bf_ref = reference_greedy(&files, WeightsDType::Bf16, &prompt, 30);
    assert_eq!(bf.ids, bf_ref.ids);
    let err = max_abs_diff(&bf.logits[0], &native.logits[0]);
    assert!(
        err > 0.0,
        "bf16 conversion changed nothing: was it applied?"
    );
    assert!(err < 0.25, "bf16 weights moved logits by {err}");
}

/// The bundled model's header is padded (fixtures/make_fixtures.py) and the binary's copy
/// is 64-byte aligned, so every weight row starts on a cache line: SIMD loads of the
/// 128-float rows never straddle two lines.
#[test]
fn bundled_weights_are_cache_line_aligned_and_not_copied() {
    let files = ModelFiles::open(None).unwrap();
    for t in files.tensors.values() {
        assert!(t.data.is_mapped(), "{} was copied at load", t.name);
        let addr = t.data.bytes().as_ptr() as usize;
        assert_eq!(addr % 64, 0, "{} starts at {addr:#x}", t.name);
    }
}

#[test]
fn f32_weights_are_memory_mapped_not_copied() {
    let files = ModelFiles::open(Some(&fixtures().join("tiny"))).unwrap();
    for t in files.tensors.values() {
        assert!(t.data.is_mapped(), "{} was copied at load", t.name);
    }
}
