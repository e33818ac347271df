//! Each SIMD kernel against its scalar twin (the reference crate), at random sizes that
//! are not multiples of the vector width. Fixed seeds; failures print the parameters.

use half::{bf16, f16};
use proptest::prelude::*;
use tinygpt_cpu::dtype::DType;
use tinygpt_cpu::ops::{self, matmul, matvec, simd, Matrix};
use tinygpt_cpu::weights::{Tensor, TensorBytes};
use tinygpt_cpu::wkernels::{self, QuantizedActs};
use tinygpt_reference::ggml_dot;

const LENGTHS: [usize; 10] = [1, 3, 7, 8, 17, 33, 64, 100, 257, 1000];

fn cfg() -> ProptestConfig {
    ProptestConfig {
        cases: 64,
        failure_persistence: None,
        rng_algorithm: proptest::test_runner::RngAlgorithm::ChaCha,
        ..ProptestConfig::default()
    }
}

fn vecf(n: usize, scale: f32) -> impl Strategy<Value = Vec<f32>> {
    prop::collection::vec(-1.0f32..1.0, n)
        .prop_map(move |v| v.into_iter().map(|x| x * scale).collect())
}

/// |a − b| ≤ tol · Σ|terms| (+ a tiny absolute floor).
fn close(a: f32, b: f32, mag: f32, tol: f32) -> bool {
    (a - b).abs() <= tol * mag + 1e-6
}

#[test]
fn dot_and_axpy_at_odd_lengths() {
    let mut runner = proptest::test_runner::TestRunner::new(cfg());
    for &n in &LENGTHS {
        runner
            .run(
                &(vecf(n, 10.0), vecf(n, 10.0), -3.0f32..3.0),
                |(a, b, alpha)| {
                    let mag: f32 = a.iter().zip(&b).map(|(x, y)| (x * y).abs()).sum();
                    let (d, s) = (simd::dot(&a, &b), simd::dot_scalar(&a, &b));
                    prop_assert!(close(d, s, mag, 1e-5), "n={n}: {d} vs {s}");
                    let mut y1 = b.clone();
                    simd::axpy(alpha, &a, &mut y1);
                    for i in 0..n {
                        let want = b[i] + alpha * a[i];
                        prop_assert!(
                            (y1[i] - want).abs() <= 1e-5 * want.abs().max(1.0),
                            "n={n} i={i}"
                        );
                    }
                    Ok(())
                },
            )
            .unwrap();
    }
}

fn matrix(dtype: DType, rows: usize, cols: usize, bytes: Vec<u8>) -> Matrix {
    Matrix::from_tensor(
        &Tensor {
            name: "w".into(),
            dtype,
            shape: vec![rows, cols],
            data: TensorBytes::owned(&bytes),
        },
        wkernels::default_kernel(),
    )
}

fn to_bytes(dtype: DType, w: &[f32]) -> (Vec<u8>, Vec<f32>) {
    match dtype {
        DType::F32 => (bytemuck::cast_slice(w).to_vec(), w.to_vec()),
        DType::F16 => {
            let h: Vec<f16> = w.iter().map(|&x| f16::from_f32(x)).collect();
            (
                bytemuck::cast_slice(&h).to_vec(),
                h.iter().map(|x| x.to_f32()).collect(),
            )
        }
        DType::BF16 => {
            let h: Vec<bf16> = w.iter().map(|&x| bf16::from_f32(x)).collect();
            (
                bytemuck::cast_slice(&h).to_vec(),
                h.iter().map(|x| x.to_f32()).collect(),
            )
        }
        _ => unreachable!(),
    }
}

#[test]
fn float_matvec_matches_reference_and_matmul_matches_matvec() {
    let mut runner = proptest::test_runner::TestRunner::new(cfg());
    let shapes = (
        1usize..70,
        prop::sample::select(LENGTHS.to_vec()),
        1usize..15,
    );
    runner
        .run(&(shapes, any::<u64>()), |((rows, cols, ntok), seed)| {
            let mut rng = seed;
            let mut next = || {
                rng ^= rng << 13;
                rng ^= rng >> 7;
                rng ^= rng << 17;
                (rng >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0
            };
            let w: Vec<f32> = (0..rows * cols).map(|_| next()).collect();
            let xs: Vec<f32> = (0..ntok * cols).map(|_| next() * 4.0).collect();
            for dtype in [DType::F32, DType::F16, DType::BF16] {
                let (bytes, wq) = to_bytes(dtype, &w);
                let m = matrix(dtype, rows, cols, bytes);
                let mut batched = vec![0.0f32; ntok * rows];
                matmul(&m, &xs, ntok, &mut batched);
                for t in 0..ntok {
                    let x = &xs[t * cols..(t + 1) * cols];
                    let mut got = vec![0.0f32; rows];
                    matvec(&m, x, &mut got);
                    // Rows streamed one at a time (DRAM-sized models) give the same bits.
                    let mut streamed = m.clone();
                    streamed.set_streamed(true);
                    let mut got_streamed = vec![0.0f32; rows];
                    matvec(&streamed, x, &mut got_streamed);
                    let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
                    prop_assert_eq!(
                        bits(&got),
                        bits(&got_streamed),
                        "{} {}x{}",
                        dtype,
                        rows,
                        cols
                    );
                    let mut want = vec![0.0f32; rows];
                    tinygpt_reference::model::matvec(&wq, x, &mut want);
                    for r in 0..rows {
                        let mag: f32 = (0..cols).map(|c| (wq[r * cols + c] * x[c]).abs()).sum();
                        prop_assert!(
                            close(got[r], want[r], mag, 1e-5),
                            "{dtype} {rows}x{cols} r={r}: {} vs {}",
                            got[r],
                            want[r]
                        );
                        prop_assert_eq!(
                            got[r].to_bits(),
                            batched[t * rows + r].to_bits(),
                            "matmul != matvec: {} {}x{} t={} r={}",
                            dtype,
                            rows,
                            cols,
                            t,
                            r
                        );
                    }
                }
            }
            Ok(())
        })
        .unwrap();
}

/// Random GGML blocks with finite, modest f16 scales.
fn random_blocks(dtype: DType, rows: usize, cols: usize, seed: u64) -> Vec<u8> {
    let mut s = seed | 1;
    let mut byte = || {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        (s >> 32) as u8
    };
    let nb = rows * cols / 32;
    let mut out = Vec::new();
    for _ in 0..nb {
        let d = f16::from_f32((byte() as f32 + 1.0) / 4096.0);
        let m = f16::from_f32((byte() as f32 - 128.0) / 1024.0);
        out.extend_from_slice(&d.to_le_bytes());
        match dtype {
            DType::Q8_0 => (0..32).for_each(|_| out.push(byte())),
            DType::Q4_0 => (0..16).for_each(|_| out.push(byte())),
            DType::Q4_1 => {
                out.extend_from_slice(&m.to_le_bytes());
                (0..16).for_each(|_| out.push(byte()))
            }
            _ => unreachable!(),
        }
    }
    out
}

#[test]
fn quantised_dots_match_scalar_twins() {
    let mut runner = proptest::test_runner::TestRunner::new(cfg());
    runner
        .run(
            &(
                1usize..9,
                1usize..12,
                any::<u64>(),
                vecf(32 * 11, 8.0),
                1usize..4,
            ),
            |(rows, nblk, seed, xv, ntok)| {
                let cols = nblk * 32;
                let xs: Vec<f32> = (0..ntok)
                    .flat_map(|t| xv[..cols].iter().map(move |v| v * (t as f32 + 1.0)))
                    .collect();
                for dtype in [DType::Q8_0, DType::Q4_0, DType::Q4_1] {
                    let bytes = random_blocks(dtype, rows, cols, seed);
                    let m = matrix(dtype, rows, cols, bytes.clone());
                    let rb = dtype.bytes_for(cols).unwrap();
                    let mut batched = vec![0.0f32; ntok * rows];
                    matmul(&m, &xs, ntok, &mut batched);
                    for t in 0..ntok {
                        let x = &xs[t * cols..(t + 1) * cols];
                        let ra = ggml_dot::quantize_acts(x);
                        let ea = QuantizedActs::from_f32(x);
                        prop_assert_eq!(&ra.d, &ea.d);
                        prop_assert_eq!(&ra.q, &ea.q);
                        prop_assert_eq!(&ra.s, &ea.s);
                        let mut got = vec![0.0f32; rows];
                        matvec(&m, x, &mut got);
                        for r in 0..rows {
                            let row = &bytes[r * rb..(r + 1) * rb];
                            let want = match dtype {
                                DType::Q8_0 => ggml_dot::dot_q8_0(row, &ra),
                                DType::Q4_0 => ggml_dot::dot_q4_0(row, &ra),
                                _ => ggml_dot::dot_q4_1(row, &ra),
                            };
                            // bit for bit: exact integer sums, the twin's float order
                            prop_assert_eq!(
                                got[r].to_bits(),
                                want.to_bits(),
                                "{} rows={} cols={} r={}: {} vs {}",
                                dtype,
                                rows,
                                cols,
                                r,
                                got[r],
                                want
                            );
                            let mut wf = vec![0.0f32; cols];
                            wkernels::dequantize_into(dtype, row, &mut wf);
                            let mag: f32 = wf.iter().zip(x).map(|(a, b)| (a * b).abs()).sum();
                            prop_assert_eq!(got[r].to_bits(), batched[t * rows + r].to_bits());
                            // and 8-bit activations stay close to the exact product
                            let exact: f32 = wf.iter().zip(x).map(|(a, b)| a * b).sum();
                            prop_assert!(
                                close(got[r], exact, mag, 2e-2),
                                "{dtype}: {} vs exact {exact}",
                                got[r]
                            );
                        }
                    }
                }
                Ok(())
            },
        )
        .unwrap();
}

#[test]
fn zero_activation_block_gives_zero_scale_not_nan() {
    let a = QuantizedActs::from_f32(&[0.0; 64]);
    assert!(a.d.iter().all(|&d| d == 0.0));
    let bytes = random_blocks(DType::Q4_1, 1, 64, 5);
    let mut v = [1.0f32];
    matvec(&matrix(DType::Q4_1, 1, 64, bytes), &[0.0; 64], &mut v);
    assert_eq!(v[0], 0.0);
}

#[test]
fn rmsnorm_swiglu_argmax_match_reference() {
    for &n in &LENGTHS {
        let x: Vec<f32> = (0..n).map(|i| ((i * 37 % 11) as f32 - 5.0) * 0.7).collect();
        let w: Vec<f32> = (0..n).map(|i| 1.0 + (i % 3) as f32 * 0.1).collect();
        let mut a = vec![0.0; n];
        let mut b = vec![0.0; n];
        ops::rmsnorm(&x, &w, 1e-5, &mut a);
        tinygpt_reference::model::rmsnorm(&x, &w, 1e-5, &mut b);
        for i in 0..n {
            assert!(
                (a[i] - b[i]).abs() <= 1e-5 * b[i].abs().max(1.0),
                "rmsnorm n={n} i={i}"
            );
        }
        let mut g = x.clone();
        ops::swiglu(&mut g, &w);
        for i in 0..n {
            let want = tinygpt_reference::model::silu(x[i]) * w[i];
            assert!((g[i] - want).abs() <= 1e-6 * want.abs().max(1.0));
        }
    }
    // Extreme gates: beyond the SIMD exp's range (|g| > 87) on both sides, tiny values,
    // signed zeros; every length around the 8-lane boundary.
    let extremes = [
        -1000.0f32, -200.0, -88.5, -87.5, -87.0, -86.9, -30.0, -1e-30, -0.0, 0.0, 1e-30, 30.0,
        86.9, 87.5, 88.5, 200.0, 1000.0,
    ];
    for n in 1..=extremes.len() {
        let x = &extremes[..n];
        let up: Vec<f32> = (0..n).map(|i| 0.5 + i as f32 * 0.25).collect();
        let mut g = x.to_vec();
        ops::swiglu(&mut g, &up);
        for i in 0..n {
            let want = tinygpt_reference::model::silu(x[i]) * up[i];
            assert!(
                (g[i] - want).abs() <= 1e-6 * want.abs() + 1e-30,
                "swiglu({}) * {}: {} vs {}",
                x[i],
                up[i],
                g[i],
                want
            );
        }
    }
    assert_eq!(
        ops::argmax(&[1.0, 3.0, 3.0, 2.0]),
        1,
        "first maximum wins, as torch.argmax"
    );
    assert_eq!(ops::argmax(&[f32::NAN, 1.0]), 1);
}
