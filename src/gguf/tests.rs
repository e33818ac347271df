//! Unit tests of the GGUF loader's private parts: tensor-name mapping and Q/K
//! un-permutation (`names.rs`), Gemma 3's `query_pre_attn_scalar` and final logit
//! soft-capping (`metadata.rs`).

use super::metadata::gemma3_query_pre_attn_scalar as qpas;
use super::names::{hf_name, unpermute_qk_rows, Permuted};
use super::{GgufFile, GgufValue};
use crate::config::Config;
use crate::error::Result;
use std::collections::BTreeMap;
use std::path::Path;

#[test]
fn names_map_to_hugging_face() {
    let cases = [
        ("token_embd.weight", "model.embed_tokens.weight"),
        ("output_norm.weight", "model.norm.weight"),
        ("output.weight", "lm_head.weight"),
        (
            "blk.0.attn_norm.weight",
            "model.layers.0.input_layernorm.weight",
        ),
        (
            "blk.12.attn_q.weight",
            "model.layers.12.self_attn.q_proj.weight",
        ),
        ("blk.3.attn_k.bias", "model.layers.3.self_attn.k_proj.bias"),
        (
            "blk.3.attn_v.weight",
            "model.layers.3.self_attn.v_proj.weight",
        ),
        (
            "blk.3.attn_output.weight",
            "model.layers.3.self_attn.o_proj.weight",
        ),
        (
            "blk.3.ffn_norm.weight",
            "model.layers.3.post_attention_layernorm.weight",
        ),
        (
            "blk.3.ffn_gate.weight",
            "model.layers.3.mlp.gate_proj.weight",
        ),
        ("blk.3.ffn_up.weight", "model.layers.3.mlp.up_proj.weight"),
        (
            "blk.3.ffn_down.weight",
            "model.layers.3.mlp.down_proj.weight",
        ),
    ];
    for (g, h) in cases {
        assert_eq!(hf_name(g).map(|x| x.0).as_deref(), Some(h), "{g}");
    }
    assert_eq!(hf_name("blk.0.attn_q.weight").unwrap().1, Permuted::Q);
    assert_eq!(hf_name("blk.0.attn_k.weight").unwrap().1, Permuted::K);
    assert_eq!(hf_name("blk.0.attn_v.weight").unwrap().1, Permuted::No);
    for bad in [
        "blk.x.attn_q.weight",
        "blk.01.attn_q.weight",
        "blk.0.attn_q",
        "blk.0.ssm_a",
        "rope_freqs.weight",
        "blk.0.attn_norm.bias",
    ] {
        assert!(hf_name(bad).is_none(), "{bad}");
    }
}

#[test]
fn unpermute_moves_whole_rows() {
    // 1 head of 4 rows, 2 bytes per row: file rows [r0, r2, r1, r3] in HF terms.
    let file = [0, 0, 2, 2, 1, 1, 3, 3];
    assert_eq!(
        unpermute_qk_rows(&file, 4, 1).unwrap(),
        vec![0, 0, 1, 1, 2, 2, 3, 3]
    );
    assert!(unpermute_qk_rows(&file, 4, 3).is_err());
    assert!(unpermute_qk_rows(&file, 0, 1).is_err());
    assert!(unpermute_qk_rows(&file[..7], 4, 1).is_err());
}

#[test]
fn only_27b_takes_embd_over_heads() {
    // Gemma 3 27B: 5376 / 32 = 168 (its Hugging Face config's value), head_dim 128.
    assert_eq!(qpas(62, 5376, 32), Some(168.0));
    // 270M, 1B (1152 / 4 = 288, yet scaled by head_dim 256), 4B, 12B.
    for (layers, hidden, heads) in [(18, 640, 4), (26, 1152, 4), (34, 2560, 8), (48, 3840, 16)] {
        assert_eq!(qpas(layers, hidden, heads), None);
    }
}

/// The tiny Gemma 3 GGUF fixture (`fixtures/make_gguf_archs.py`), with `edit` applied to
/// its metadata, then its config.
fn gemma3_config(edit: impl FnOnce(&mut BTreeMap<String, GgufValue>)) -> Result<Config> {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures/archs/gemma3/gemma3.gguf");
    let mut f = GgufFile::open(&path).unwrap();
    edit(&mut f.parsed.metadata);
    f.config()
}

#[test]
fn final_logit_softcapping_is_read() {
    assert_eq!(
        gemma3_config(|_| {}).unwrap().gemma.final_logit_softcapping,
        None
    );
    for (v, want) in [
        (GgufValue::F32(30.0), 30.0f32),
        (GgufValue::F32(0.25), 0.25),
        // llama.cpp writes f32; any number is read
        (GgufValue::F64(5.0), 5.0),
        (GgufValue::U32(7), 7.0),
    ] {
        let c = gemma3_config(|m| {
            m.insert("gemma3.final_logit_softcapping".into(), v.clone());
        })
        .unwrap();
        assert_eq!(c.gemma.final_logit_softcapping, Some(want), "{v:?}");
    }
}

#[test]
fn bad_softcapping_values_are_refused_naming_key_and_file() {
    let key = "gemma3.final_logit_softcapping";
    for v in [
        GgufValue::F32(0.0),
        GgufValue::F32(-0.0),
        GgufValue::F32(-5.0),
        GgufValue::F32(f32::NAN),
        GgufValue::F32(f32::INFINITY),
        GgufValue::F64(1e300),  // infinite as f32, the type it is applied in
        GgufValue::F64(1e-300), // 0 as f32
        GgufValue::I32(-1),
    ] {
        let e = gemma3_config(|m| {
            m.insert(key.into(), v.clone());
        })
        .unwrap_err()
        .to_string();
        assert!(
            e.contains("gemma3.gguf") && e.contains(key) && e.contains("> 0"),
            "{v:?}: {e}"
        );
    }
    let e = gemma3_config(|m| {
        m.insert(key.into(), GgufValue::String("30".into()));
    })
    .unwrap_err()
    .to_string();
    assert!(e.contains(key) && e.contains("must be a number"), "{e}");
    let attn = "gemma3.attn_logit_softcapping";
    let e = gemma3_config(|m| {
        m.insert(attn.into(), GgufValue::F32(50.0));
    })
    .unwrap_err()
    .to_string();
    assert!(
        e.contains("gemma3.gguf") && e.contains(attn) && e.contains("not supported"),
        "{e}"
    );
}
