//! Every float-weight kernel variant this CPU supports (`wkernels::Kernel::supported`, the
//! type table's resolution shared with the quantised kernels) against the scalar twin, bit for bit,
//! for f32, f16 and bf16 rows: odd lengths (columns not a multiple of 8 or 16, fewer than
//! 8), odd row counts and offsets (partial 8-row blocks, rows past a 2-row pair), both
//! ways of walking the rows (interleaved and streamed), extreme f16 values (±65504,
//! subnormals, ±0) and extreme bf16 values (largest finite, smallest normal, subnormals),
//! with no NaN or infinity among the weights.
//!
//! The scalar twin itself is held to the order written in `src/wkernels/float.rs`, computed
//! here independently from the widened weights, and the engine's `matvec` on a `Matrix`
//! to the active variant.

use half::{bf16, f16};
use proptest::prelude::*;
use tinygpt_cpu::dtype::DType;
use tinygpt_cpu::ops::{matvec, Matrix};
use tinygpt_cpu::weights::{Tensor, TensorBytes};
use tinygpt_cpu::wkernels::{self, FloatRows, Kernel, Kernels};

/// `out[j] = row (r0 + j) · x` through `k`'s float kernels for `dtype` (the type table's).
#[allow(clippy::too_many_arguments)]
fn rows_with(
    k: Kernel,
    dtype: DType,
    w: FloatRows,
    cols: usize,
    r0: usize,
    x: &[f32],
    out: &mut [f32],
    streamed: bool,
) {
    let bytes: &[u8] = match w {
        FloatRows::F32(v) => bytemuck::cast_slice(v),
        FloatRows::F16(v) => bytemuck::cast_slice(v),
        FloatRows::Bf16(v) => bytemuck::cast_slice(v),
    };
    Kernels::new(k, dtype).float_rows(bytes, cols, r0, x, out, streamed);
}

fn cfg() -> ProptestConfig {
    ProptestConfig {
        cases: 300,
        failure_persistence: None,
        rng_algorithm: proptest::test_runner::RngAlgorithm::ChaCha,
        ..ProptestConfig::default()
    }
}

/// Finite f16 bit patterns: ordinary, ±0, subnormal, ±65504, anything finite.
fn f16_bits() -> impl Strategy<Value = u16> {
    prop_oneof![
        4 => 0x2000u16..0x3C00,
        1 => Just(0x0000u16),
        2 => 0x0001u16..0x0400,
        1 => Just(0x7BFFu16),
        2 => 0u16..0x7C00,
    ]
    .prop_flat_map(|b| prop_oneof![Just(b), Just(b | 0x8000)])
}

/// Finite bf16 bit patterns: ordinary, ±0, subnormal, smallest normal, largest finite,
/// anything finite.
fn bf16_bits() -> impl Strategy<Value = u16> {
    prop_oneof![
        4 => 0x3800u16..0x4000,
        1 => Just(0x0000u16),
        1 => 0x0001u16..0x0080,
        1 => Just(0x0080u16),
        1 => Just(0x7F7Fu16),
        2 => 0u16..0x7F80,
    ]
    .prop_flat_map(|b| prop_oneof![Just(b), Just(b | 0x8000)])
}

/// Activations: ordinary, large, tiny (products become subnormal), or zero.
fn acts(n: usize) -> impl Strategy<Value = Vec<f32>> {
    prop_oneof![
        3 => prop::collection::vec(-4.0f32..4.0, n),
        1 => prop::collection::vec(-1e30f32..1e30, n),
        1 => prop::collection::vec(-1e-30f32..1e-30, n),
        1 => Just(vec![0.0f32; n]),
    ]
}

/// Equal bits, or both NaN (sums of extreme products may overflow: ∞ − ∞).
fn same(a: f32, b: f32) -> bool {
    a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan())
}

/// The documented order, written out here from f32 weights: eight lane sums with one
/// multiply-add per term, the fixed lane tree, the tail from zero.
fn documented(w: &[f32], x: &[f32]) -> f32 {
    let n8 = w.len() - w.len() % 8;
    let mut lane = [0.0f32; 8];
    // Fused where `wide`'s `mul_add` is (x86_64 built with FMA), else multiply then add.
    let fused = cfg!(all(target_arch = "x86_64", target_feature = "fma"));
    for i in 0..n8 {
        let l = &mut lane[i % 8];
        *l = if fused {
            w[i].mul_add(x[i], *l)
        } else {
            w[i] * x[i] + *l
        };
    }
    let l = lane;
    let mut t = 0.0f32;
    for i in n8..w.len() {
        t += x[i] * w[i];
    }
    (((l[0] + l[1]) + (l[2] + l[3])) + ((l[4] + l[5]) + (l[6] + l[7]))) + t
}

/// One case: `rows × cols` weights (as bits for f16/bf16, as values for f32), the rows
/// `r0..r0 + n` computed with every variant and both walks.
fn check(
    dtype: DType,
    bits: &[u16],
    vals: &[f32],
    (rows, cols, r0, n): (usize, usize, usize, usize),
    x: &[f32],
) -> Result<(), TestCaseError> {
    let h: Vec<f16> = bits.iter().map(|&b| f16::from_bits(b)).collect();
    let b: Vec<bf16> = bits.iter().map(|&b| bf16::from_bits(b)).collect();
    let (w, widened): (FloatRows, Vec<f32>) = match dtype {
        DType::F16 => (FloatRows::F16(&h), h.iter().map(|v| v.to_f32()).collect()),
        DType::BF16 => (
            FloatRows::Bf16(&b),
            // bf16 is the top half of an f32, independently of `half`.
            bits.iter()
                .map(|&v| f32::from_bits((v as u32) << 16))
                .collect(),
        ),
        _ => (FloatRows::F32(vals), vals.to_vec()),
    };
    let mut want = vec![0.0f32; n];
    rows_with(Kernel::Scalar, dtype, w, cols, r0, x, &mut want, false);
    for (j, &v) in want.iter().enumerate() {
        let r = r0 + j;
        let d = documented(&widened[r * cols..(r + 1) * cols], x);
        prop_assert!(
            same(v, d),
            "scalar twin vs order: {dtype} {rows}x{cols} row {r}: {v} vs {d}"
        );
    }
    for k in Kernel::supported() {
        for streamed in [false, true] {
            let mut got = vec![f32::NAN; n];
            rows_with(k, dtype, w, cols, r0, x, &mut got, streamed);
            for j in 0..n {
                prop_assert!(
                    same(got[j], want[j]),
                    "{} {dtype} {rows}x{cols} rows {r0}+{j} streamed={streamed}: {} vs {}",
                    k.name(),
                    got[j],
                    want[j]
                );
            }
        }
    }
    Ok(())
}

/// `(rows, cols, r0, n)`: `r0 + n <= rows`.
fn shape() -> impl Strategy<Value = (usize, usize, usize, usize)> {
    (1usize..20, 1usize..80).prop_flat_map(|(rows, cols)| {
        (0..rows).prop_flat_map(move |r0| (1..=rows - r0).prop_map(move |n| (rows, cols, r0, n)))
    })
}

proptest! {
    #![proptest_config(cfg())]

    #[test]
    fn f16_variants_equal_scalar_twin(
        (s, bits, x) in shape().prop_flat_map(|s| {
            (Just(s), prop::collection::vec(f16_bits(), s.0 * s.1), acts(s.1))
        })
    ) {
        check(DType::F16, &bits, &[], s, &x)?;
    }

    #[test]
    fn bf16_variants_equal_scalar_twin(
        (s, bits, x) in shape().prop_flat_map(|s| {
            (Just(s), prop::collection::vec(bf16_bits(), s.0 * s.1), acts(s.1))
        })
    ) {
        check(DType::BF16, &bits, &[], s, &x)?;
    }

    #[test]
    fn f32_variants_equal_scalar_twin(
        (s, vals, x) in shape().prop_flat_map(|s| {
            (Just(s), prop::collection::vec(-1e6f32..1e6, s.0 * s.1), acts(s.1))
        })
    ) {
        check(DType::F32, &[], &vals, s, &x)?;
    }
}

/// The engine's `matvec` (whichever variant `wkernels::default_kernel` picked, rows split across
/// threads) equals the scalar twin, on a matrix large enough to be split, for each float
/// dtype, interleaved and streamed.
#[test]
fn engine_matvec_equals_scalar_twin() {
    println!("active kernel: {}", wkernels::default_kernel().name());
    let (rows, cols) = (203usize, 581usize);
    let mut s = 0x2545_F491_4F6C_DD1Du64;
    let mut next = || {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        (s >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0
    };
    let w: Vec<f32> = (0..rows * cols).map(|_| next()).collect();
    let x: Vec<f32> = (0..cols).map(|_| next() * 3.0).collect();
    for dtype in [DType::F32, DType::F16, DType::BF16] {
        let bytes: Vec<u8> = match dtype {
            DType::F16 => w
                .iter()
                .flat_map(|&v| f16::from_f32(v).to_le_bytes())
                .collect(),
            DType::BF16 => w
                .iter()
                .flat_map(|&v| bf16::from_f32(v).to_le_bytes())
                .collect(),
            _ => bytemuck::cast_slice(&w).to_vec(),
        };
        let mut m = Matrix::from_tensor(
            &Tensor {
                name: "w".into(),
                dtype,
                shape: vec![rows, cols],
                data: TensorBytes::owned(&bytes),
            },
            wkernels::default_kernel(),
        );
        let h: Vec<f16> = bytemuck::pod_collect_to_vec(&bytes);
        let b: Vec<bf16> = bytemuck::pod_collect_to_vec(&bytes);
        let fw = match dtype {
            DType::F16 => FloatRows::F16(&h),
            DType::BF16 => FloatRows::Bf16(&b),
            _ => FloatRows::F32(&w),
        };
        let mut want = vec![0.0f32; rows];
        rows_with(Kernel::Scalar, dtype, fw, cols, 0, &x, &mut want, false);
        for streamed in [false, true] {
            m.set_streamed(streamed);
            let mut got = vec![0.0f32; rows];
            matvec(&m, &x, &mut got);
            for r in 0..rows {
                assert_eq!(
                    got[r].to_bits(),
                    want[r].to_bits(),
                    "{dtype} row {r} streamed={streamed}"
                );
            }
        }
    }
}
