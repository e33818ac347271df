//! The engine's dequantisers (`tinygpt_cpu::wkernels::dequant`) against the scalar
//! reference's (`tinygpt_reference::ggml`), bit for bit: every type, random blocks, extreme
//! scales and minimums (zero, subnormal, ±65504, ±Inf, NaN) at every f16 field of a block,
//! extreme codes (Q8_0 −128/127, nibbles 0/15, all-zero and all-one bytes), and odd row
//! counts; and the two must reject the same malformed lengths. Also the exact rewrites of
//! Q5_0 / IQ4_NL blocks as Q8_0 blocks against the reference's.

use proptest::prelude::*;
use tinygpt_cpu::dtype::DType;
use tinygpt_cpu::wkernels::dequant;
use tinygpt_reference::{ggml, ggml_more};

const TYPES: [DType; DType::ALL.len()] = DType::ALL;

fn cfg() -> ProptestConfig {
    ProptestConfig {
        cases: 1000,
        failure_persistence: None,
        rng_algorithm: proptest::test_runner::RngAlgorithm::ChaCha,
        ..ProptestConfig::default()
    }
}

/// f16 bit patterns for a block's scale or minimum.
fn half_bits() -> impl Strategy<Value = u16> {
    prop_oneof![
        4 => 0x2000u16..0x4C00,      // ordinary
        1 => Just(0x0000u16),        // zero
        1 => 0x0001u16..0x0400,      // subnormal
        1 => Just(0x7BFFu16),        // 65504
        1 => Just(0x7C00u16),        // Inf
        1 => Just(0x7E00u16),        // NaN
        2 => any::<u16>(),
    ]
    .prop_flat_map(|b| prop_oneof![Just(b), Just(b | 0x8000)])
}

/// Code bytes of one block: random, or all at an extreme.
fn codes(n: usize) -> impl Strategy<Value = Vec<u8>> {
    prop_oneof![
        4 => prop::collection::vec(any::<u8>(), n),
        1 => Just(vec![0x80u8; n]),
        1 => Just(vec![0x7Fu8; n]),
        1 => Just(vec![0xFFu8; n]),
        1 => Just(vec![0x00u8; n]),
    ]
}

/// Byte offsets of the f16 fields (scales, minimums) of a block of `ty` (none for plain
/// types), as the block layouts place them (`reference/src/ggml_more.rs`).
fn half_fields(ty: DType) -> &'static [usize] {
    match ty {
        DType::F32 | DType::F16 | DType::BF16 => &[],
        DType::Q8_0 | DType::Q4_0 | DType::Q5_0 | DType::IQ4_NL | DType::IQ4_XS => &[0],
        DType::Q4_1 | DType::Q5_1 | DType::Q4_K | DType::Q5_K => &[0, 2],
        DType::Q2_K => &[80, 82],
        DType::Q3_K => &[108],
        DType::Q6_K => &[208],
    }
}

/// One block of `ty` (one element for plain types): code bytes random or at an extreme,
/// every f16 field from [`half_bits`].
fn block(ty: DType) -> BoxedStrategy<Vec<u8>> {
    let fields = half_fields(ty);
    if fields.is_empty() {
        return prop::collection::vec(any::<u8>(), ty.block_bytes()).boxed();
    }
    (
        prop::collection::vec(half_bits(), fields.len()),
        codes(ty.block_bytes()),
    )
        .prop_map(move |(h, mut b)| {
            for (&at, x) in fields.iter().zip(h) {
                b[at..at + 2].copy_from_slice(&x.to_le_bytes());
            }
            b
        })
        .boxed()
}

/// A row: `ty`, 1..=9 blocks (odd counts included), and its bytes.
fn row() -> impl Strategy<Value = (DType, usize, Vec<u8>)> {
    (0..TYPES.len(), 1usize..=9).prop_flat_map(|(t, n)| {
        let ty = TYPES[t];
        // Plain types: an odd number of elements up to 9 × 33.
        let blocks = if ty.is_quantized() { n } else { n * 33 };
        prop::collection::vec(block(ty), blocks)
            .prop_map(move |bs| (ty, blocks * ty.block_len(), bs.concat()))
    })
}

fn same_bits(ty: DType, ours: &[f32], theirs: &[f32]) {
    for (i, (a, b)) in ours.iter().zip(theirs).enumerate() {
        assert!(
            a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan()),
            "{ty} element {i}: engine {a} ({:#010x}), reference {b} ({:#010x})",
            a.to_bits(),
            b.to_bits()
        );
    }
}

proptest! {
    #![proptest_config(cfg())]

    #[test]
    fn rows_equal_the_reference((ty, n, bytes) in row()) {
        let mut theirs = vec![f32::from_bits(0xDEAD_BEEF); n];
        ggml::dequantize_row(ty, &bytes, &mut theirs).unwrap();
        let mut ours = vec![f32::from_bits(0x1234_5678); n];
        dequant::dequantize_row(ty, &bytes, &mut ours).unwrap();
        same_bits(ty, &ours, &theirs);
        // The unchecked form the kernels use gives the same values.
        let mut unchecked = vec![0.0f32; n];
        dequant::dequantize_into(ty, &bytes, &mut unchecked);
        same_bits(ty, &unchecked, &theirs);
    }

    /// The loader's finiteness check reads only the f16 fields of block types: the element
    /// it names must be the first non-finite value the reference dequantiser gives, and it
    /// must find none exactly when the reference gives none.
    #[test]
    fn the_finiteness_scan_finds_the_reference_first_non_finite((ty, n, bytes) in row()) {
        let mut theirs = vec![0.0f32; n];
        ggml::dequantize_row(ty, &bytes, &mut theirs).unwrap();
        let first = theirs.iter().position(|v| !v.is_finite());
        prop_assert_eq!(tinygpt_cpu::weights::first_non_finite(ty, &bytes), first, "{}", ty);
    }

    #[test]
    fn matrices_of_odd_row_counts_equal_the_reference(
        (ty, cols, bytes) in row(),
        rows in prop::sample::select(vec![1usize, 3, 5, 7]),
    ) {
        // `rows` copies of a row with one byte changed per row, dequantised as one tensor.
        let mut all = Vec::new();
        for r in 0..rows {
            let mut b = bytes.clone();
            let last = b.len() - 1;
            b[last] = b[last].wrapping_add(r as u8 * 37);
            all.extend(b);
        }
        let mut theirs = vec![0.0f32; rows * cols];
        ggml::dequantize_row(ty, &all, &mut theirs).unwrap();
        let mut ours = vec![0.0f32; rows * cols];
        dequant::dequantize_row(ty, &all, &mut ours).unwrap();
        same_bits(ty, &ours, &theirs);
    }

    #[test]
    fn q8_0_rewrites_equal_the_reference((ty, _n, bytes) in row()) {
        let ours = dequant::q8_0_rewrite(ty).map(|f| f(&bytes));
        let theirs = match ty {
            DType::Q5_0 => Some(ggml_more::q5_0_to_q8_0(&bytes)),
            DType::IQ4_NL => Some(ggml_more::iq4_nl_to_q8_0(&bytes)),
            _ => None,
        };
        prop_assert_eq!(ours, theirs);
    }

    #[test]
    fn malformed_lengths_are_rejected_alike(t in 0..TYPES.len(), n in 0usize..100, len in 0usize..200) {
        let ty = TYPES[t];
        let bytes = vec![0u8; len];
        let mut a = vec![0.0f32; n];
        let mut b = vec![0.0f32; n];
        prop_assert_eq!(
            dequant::dequantize_row(ty, &bytes, &mut a),
            ggml::dequantize_row(ty, &bytes, &mut b)
        );
    }
}
