//! The K-quant numerics against ggml itself: `fixtures/kdot_cases.json` holds activations
//! quantised by ggml's `quantize_row_q8_K` and ggml's `ggml_vec_dot_{q4_K,q5_K,q6_K,
//! iq4_xs,q2_K,q3_K}_q8_K` (dispatched and `_generic`) of random valid weight rows, taken from the
//! libggml-cpu bundled with llama-cpp-python (`fixtures/make_kdot_cases.py`). Our Q8_K
//! (engine and reference) equals ggml's byte for byte; our dot products (every kernel
//! variant) equal ggml's up to the order of the float additions (ggml's own variants
//! differ there too): within 1e-5 of `Σ |w_i · x_i|`.

use tinygpt_cpu::dtype::DType;
use tinygpt_cpu::wkernels::{Kernel, Kernels, Packed, QuantizedActs, GROUP};
use tinygpt_reference::ggml_kdot::{self, Q8K};

fn hex(s: &str) -> Vec<u8> {
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
        .collect()
}

fn ggml_q8k(b: &[u8]) -> Q8K {
    let mut k = Q8K::default();
    for blk in b.chunks_exact(4 + 256 + 32) {
        k.d.push(f32::from_le_bytes(blk[0..4].try_into().unwrap()));
        k.q.extend(blk[4..260].iter().map(|&c| c as i8));
        k.bsums.extend(
            blk[260..292]
                .chunks_exact(2)
                .map(|c| i16::from_le_bytes([c[0], c[1]])),
        );
    }
    k
}

fn dtype(name: &str) -> DType {
    match name {
        "Q4_K" => DType::Q4_K,
        "Q5_K" => DType::Q5_K,
        "Q6_K" => DType::Q6_K,
        "Q2_K" => DType::Q2_K,
        "Q3_K" => DType::Q3_K,
        "IQ4_XS" => DType::IQ4_XS,
        other => panic!("unknown type {other}"),
    }
}

#[test]
fn q8_k_and_dots_follow_ggml() {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures/kdot_cases.json");
    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    let cases = v["cases"].as_array().unwrap();
    assert_eq!(cases.len(), 54);
    for (i, c) in cases.iter().enumerate() {
        let ty = dtype(c["type"].as_str().unwrap());
        let x: Vec<f32> = hex(c["x"].as_str().unwrap())
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
            .collect();
        let want_q = ggml_q8k(&hex(c["q8k"].as_str().unwrap()));
        let ours = QuantizedActs::from_f32(&x);
        assert_eq!(
            (&ours.k.d, &ours.k.q, &ours.k.bsums),
            (&want_q.d, &want_q.q, &want_q.bsums),
            "case {i}: engine Q8_K vs ggml"
        );
        assert_eq!(
            ggml_kdot::quantize_q8_k(&x),
            want_q,
            "case {i}: reference Q8_K vs ggml"
        );
        let w = hex(c["w"].as_str().unwrap());
        let mut deq = vec![0.0f32; x.len()];
        tinygpt_cpu::wkernels::dequantize_row(ty, &w, &mut deq).unwrap();
        let mag: f64 = deq
            .iter()
            .enumerate()
            .map(|(j, &wj)| (wj as f64 * want_q.d[j / 256] as f64 * want_q.q[j] as f64).abs())
            .sum();
        let reference = match ty {
            DType::Q4_K => ggml_kdot::dot_q4_k(&w, &want_q),
            DType::Q5_K => ggml_kdot::dot_q5_k(&w, &want_q),
            DType::Q6_K => ggml_kdot::dot_q6_k(&w, &want_q),
            DType::Q2_K => ggml_kdot::dot_q2_k(&w, &want_q),
            DType::Q3_K => ggml_kdot::dot_q3_k(&w, &want_q),
            _ => ggml_kdot::dot_iq4_xs(&w, &want_q),
        };
        for key in ["dot", "dot_generic"] {
            let g = c[key].as_f64().unwrap();
            assert!(
                (reference as f64 - g).abs() <= 1e-5 * mag + 1e-30,
                "case {i} {ty}: ours {reference} vs ggml {key} {g} (scale {mag})"
            );
        }
        let p = Packed::new(ty, 1, x.len(), &w);
        for k in Kernel::supported() {
            let mut out = [0.0f32; GROUP];
            Kernels::new(k, ty).group_dot(&p, 0, &ours, &mut out);
            assert_eq!(
                out[0].to_bits(),
                reference.to_bits(),
                "case {i} {}",
                k.name()
            );
        }
    }
}
