//! Q2_K, Q3_K, Q4_K, Q5_K, Q6_K and IQ4_XS weights through every kernel variant this CPU supports
//! (`wkernels::Kernel::supported`), against the scalar twins in the reference crate
//! (`tinygpt_reference::ggml_kdot`), bit for bit: odd row counts (partial row groups), 1 to
//! 4 super-blocks per row, random and extreme code bytes (every byte 0x00, 0xFF, 0x80),
//! extreme f16 scales (0, subnormal, ±65504) and extreme activations (zero, 1e30,
//! subnormal, one spike among tiny values). The engine's Q8_K activations equal the
//! reference's; the multi-token kernels equal the twin for every token; the batched
//! product (`ops::matmul`) equals the one-token `ops::matvec`.

use half::f16;
use proptest::prelude::*;
use tinygpt_cpu::dtype::DType;
use tinygpt_cpu::ops::{matmul, matvec, Matrix};
use tinygpt_cpu::weights::{Tensor, TensorBytes};
use tinygpt_cpu::wkernels::{self, ActsTile, Kernel, Kernels, Packed, QuantizedActs, GROUP, TILE};
use tinygpt_reference::ggml_kdot::{self, Q8K};

const QK_K: usize = 256;

fn cfg() -> ProptestConfig {
    ProptestConfig {
        cases: 150,
        failure_persistence: None,
        rng_algorithm: proptest::test_runner::RngAlgorithm::ChaCha,
        ..ProptestConfig::default()
    }
}

/// f16 scale bit patterns: ordinary, zero, subnormal, largest finite, either sign.
fn scale() -> impl Strategy<Value = u16> {
    prop_oneof![
        4 => 0x2000u16..0x3C00,
        1 => Just(0x0000u16),
        1 => 0x0001u16..0x0400,
        1 => Just(0x7BFFu16),
        1 => 0u16..0x7C00,
    ]
    .prop_flat_map(|b| prop_oneof![Just(b), Just(b | 0x8000)])
}

/// Block bytes: random, or every byte at an extreme.
fn code_bytes(n: usize) -> impl Strategy<Value = Vec<u8>> {
    prop_oneof![
        4 => prop::collection::vec(any::<u8>(), n),
        1 => Just(vec![0x80u8; n]),
        1 => Just(vec![0x7Fu8; n]),
        1 => Just(vec![0xFFu8; n]),
        1 => Just(vec![0x00u8; n]),
    ]
}

/// Activations: ordinary, huge, subnormal, zero, or one spike among tiny values.
fn acts(n: usize) -> impl Strategy<Value = Vec<f32>> {
    prop_oneof![
        3 => prop::collection::vec(-4.0f32..4.0, n),
        1 => prop::collection::vec(-1e30f32..1e30, n),
        1 => prop::collection::vec(-1e-38f32..1e-38, n),
        1 => Just(vec![0.0f32; n]),
        1 => (0..n, -1e6f32..1e6).prop_map(move |(i, v)| {
            let mut x: Vec<f32> = (0..n).map(|j| (j as f32 - 7.0) * 1e-7).collect();
            x[i] = v;
            x
        }),
    ]
}

/// Rows of super-blocks from raw bytes, with the f16 scale fields set from `scales`
/// (Q4_K, Q5_K, Q2_K: `d`, `dmin`; Q6_K, IQ4_XS, Q3_K: `d`).
fn rows_bytes(dtype: DType, blocks: usize, raw: &[u8], scales: &[u16]) -> Vec<u8> {
    let bb = dtype.block_bytes();
    let mut out = raw[..blocks * bb].to_vec();
    for (b, blk) in out.chunks_exact_mut(bb).enumerate() {
        if dtype == DType::Q2_K {
            blk[80..82].copy_from_slice(&scales[2 * b].to_le_bytes());
            blk[82..84].copy_from_slice(&scales[2 * b + 1].to_le_bytes());
        } else if dtype == DType::Q3_K {
            blk[108..110].copy_from_slice(&scales[2 * b].to_le_bytes());
        } else if dtype == DType::IQ4_XS {
            blk[0..2].copy_from_slice(&scales[2 * b].to_le_bytes());
        } else if dtype != DType::Q6_K {
            blk[0..2].copy_from_slice(&scales[2 * b].to_le_bytes());
            blk[2..4].copy_from_slice(&scales[2 * b + 1].to_le_bytes());
        } else {
            blk[208..210].copy_from_slice(&scales[2 * b].to_le_bytes());
        }
    }
    out
}

fn reference_row(dtype: DType, row: &[u8], a: &Q8K) -> f32 {
    match dtype {
        DType::Q2_K => ggml_kdot::dot_q2_k(row, a),
        DType::Q3_K => ggml_kdot::dot_q3_k(row, a),
        DType::Q4_K => ggml_kdot::dot_q4_k(row, a),
        DType::Q5_K => ggml_kdot::dot_q5_k(row, a),
        DType::IQ4_XS => ggml_kdot::dot_iq4_xs(row, a),
        _ => ggml_kdot::dot_q6_k(row, a),
    }
}

fn packed(dtype: DType, rows: usize, nb: usize, bytes: &[u8]) -> Packed {
    Packed::new(dtype, rows, nb * QK_K, bytes)
}

fn bits_eq(got: f32, want: f32) -> bool {
    got.to_bits() == want.to_bits()
}

fn case() -> impl Strategy<Value = (DType, usize, usize, Vec<u8>, Vec<u16>, Vec<f32>)> {
    (
        prop_oneof![
            Just(DType::Q2_K),
            Just(DType::Q3_K),
            Just(DType::Q4_K),
            Just(DType::Q5_K),
            Just(DType::Q6_K),
            Just(DType::IQ4_XS)
        ],
        1usize..20,
        1usize..9,
    )
        .prop_flat_map(|(dtype, rows, nb)| {
            let blocks = rows * nb;
            (
                Just(dtype),
                Just(rows),
                Just(nb),
                code_bytes(blocks * dtype.block_bytes()),
                prop::collection::vec(scale(), 2 * blocks),
                acts(nb * QK_K),
            )
        })
}

proptest! {
    #![proptest_config(cfg())]

    #[test]
    fn every_variant_equals_the_scalar_twin_bit_for_bit(
        (dtype, rows, nb, raw, scales, x) in case()
    ) {
        let bytes = rows_bytes(dtype, rows * nb, &raw, &scales);
        let p = packed(dtype, rows, nb, &bytes);
        let ea = QuantizedActs::from_f32(&x);
        let ra = ggml_kdot::quantize_q8_k(&x);
        prop_assert_eq!(
            (&ea.k.d, &ea.k.q, &ea.k.bsums),
            (&ra.d, &ra.q, &ra.bsums),
            "engine Q8_K vs reference"
        );
        let rb = bytes.len() / rows;
        for k in Kernel::supported() {
            for g in 0..rows.div_ceil(GROUP) {
                let mut out = [0.0f32; GROUP];
                Kernels::new(k, dtype).group_dot(&p, g, &ea, &mut out);
                for (j, &got) in out.iter().enumerate().take(rows - g * GROUP) {
                    let r = g * GROUP + j;
                    let want = reference_row(dtype, &bytes[r * rb..(r + 1) * rb], &ra);
                    prop_assert!(
                        bits_eq(got, want),
                        "{} {dtype} row {r}: {got} vs {want}", k.name()
                    );
                }
            }
        }
        // The file's rows come back out of the packed copy (embedding lookups).
        let mut back = vec![0u8; rb];
        for r in 0..rows {
            p.row_bytes(r, &mut back);
            prop_assert_eq!(&back[..], &bytes[r * rb..(r + 1) * rb]);
        }
    }

    #[test]
    fn multi_token_kernels_equal_the_twin_for_every_token(
        (dtype, rows, nb, raw, scales, x) in case(),
        ntok in 1usize..8,
        seed in any::<u32>(),
    ) {
        let bytes = rows_bytes(dtype, rows * nb, &raw, &scales);
        let p = packed(dtype, rows, nb, &bytes);
        let n = nb * QK_K;
        // Token t: the drawn activations scaled and rotated, so tokens differ.
        let xs: Vec<Vec<f32>> = (0..ntok)
            .map(|t| {
                let s = 1.0 + ((seed as usize + t) % 7) as f32;
                (0..n).map(|i| x[(i + 37 * t) % n] * s).collect()
            })
            .collect();
        let eas: Vec<QuantizedActs> = xs.iter().map(|x| QuantizedActs::from_f32(x)).collect();
        let ras: Vec<Q8K> = xs.iter().map(|x| ggml_kdot::quantize_q8_k(x)).collect();
        let refs: Vec<&QuantizedActs> = eas.iter().collect();
        let tile = ActsTile::new(&refs[..ntok.min(TILE)]);
        let rb = bytes.len() / rows;
        for k in Kernel::supported() {
            for g in 0..rows.div_ceil(GROUP) {
                let kernels = Kernels::new(k, dtype);
                let mut out = vec![[0.0f32; GROUP]; ntok];
                kernels.group_tokens(&p, g, &refs, &mut out);
                let mut tiled = vec![[0.0f32; GROUP]; tile.len()];
                kernels.group_tile(&p, g, &tile, &mut tiled, true);
                for (t, o) in out.iter().enumerate() {
                    for (j, &got) in o.iter().enumerate().take(rows - g * GROUP) {
                        let r = g * GROUP + j;
                        let want = reference_row(dtype, &bytes[r * rb..(r + 1) * rb], &ras[t]);
                        prop_assert!(
                            bits_eq(got, want),
                            "{} {dtype} token {t} row {r}: {got} vs {want}", k.name()
                        );
                        if t < tiled.len() {
                            prop_assert!(bits_eq(tiled[t][j], want), "tile {} token {t}", k.name());
                        }
                    }
                }
            }
        }
    }
}

/// The SIMD K-quant code this CPU should run is the code the dispatch runs: on aarch64
/// with the dot-product extension (every build of `scripts/test-aarch64.sh`, under qemu)
/// `neon-dotprod` is a supported variant and multiplies every K-quant type and Q5_1 with
/// its NEON rows; on x86_64 with AVX2 `avx2` does; `portable` runs its `wide` kernels
/// everywhere; `scalar` never claims SIMD rows; and no supported variant but `scalar` runs
/// the scalar twins for any type (the type table's resolution, `Kernels::code`). (Fails if
/// a variant's dispatch falls back to the scalar loops.)
#[test]
fn simd_kquant_rows_run_where_the_cpu_has_them() {
    let has_simd_kquant = |k: Kernel, t: DType| Kernels::new(k, t).code() != Kernel::Scalar;
    let types = [
        DType::Q2_K,
        DType::Q3_K,
        DType::Q4_K,
        DType::Q5_K,
        DType::Q6_K,
        DType::IQ4_XS,
        DType::Q5_1,
    ];
    #[cfg(target_arch = "aarch64")]
    {
        #[cfg(target_feature = "dotprod")]
        assert!(
            Kernel::supported().contains(&Kernel::NeonDotprod),
            "built with dotprod but neon-dotprod is not a supported variant"
        );
        if Kernel::NeonDotprod.is_supported() {
            for t in types {
                assert!(has_simd_kquant(Kernel::NeonDotprod, t), "neon-dotprod {t}");
            }
        }
    }
    #[cfg(target_arch = "x86_64")]
    if Kernel::Avx2.is_supported() {
        for t in types {
            assert!(has_simd_kquant(Kernel::Avx2, t), "avx2 {t}");
        }
    }
    // `portable` runs its `wide` kernels on every CPU (kquant_portable).
    for t in types {
        assert!(!has_simd_kquant(Kernel::Scalar, t));
        assert!(has_simd_kquant(Kernel::Portable, t), "portable {t}");
    }
    // Every type: only `scalar` runs the scalar twins.
    for k in Kernel::supported() {
        for t in DType::ALL {
            assert_eq!(
                has_simd_kquant(k, t),
                k != Kernel::Scalar,
                "{} {t}",
                k.name()
            );
        }
    }
    eprintln!(
        "kernels here: {:?}",
        Kernel::supported()
            .iter()
            .map(|k| (k.name(), has_simd_kquant(*k, DType::Q4_K)))
            .collect::<Vec<_>>()
    );
}

/// Every weight byte at 0xFF (largest codes, scales and mins) with the largest f16
/// scales, against activations at ±127 codes: the 16-bit pair sums and 32-bit totals
/// stay exact in every variant.
#[test]
fn saturating_extremes_stay_exact() {
    for dtype in [
        DType::Q2_K,
        DType::Q3_K,
        DType::Q4_K,
        DType::Q5_K,
        DType::Q6_K,
        DType::IQ4_XS,
    ] {
        for fill in [0xFFu8, 0x00, 0x80, 0x7F] {
            let nb = 3;
            let rows = 9;
            let raw = vec![fill; rows * nb * dtype.block_bytes()];
            let scales = vec![0x7BFFu16; 2 * rows * nb];
            let bytes = rows_bytes(dtype, rows * nb, &raw, &scales);
            let p = packed(dtype, rows, nb, &bytes);
            for x in [
                vec![-1.0f32; nb * QK_K],
                vec![1.0f32; nb * QK_K],
                (0..nb * QK_K)
                    .map(|i| if i % 2 == 0 { 1.0 } else { -1.0 })
                    .collect(),
            ] {
                let ea = QuantizedActs::from_f32(&x);
                let ra = ggml_kdot::quantize_q8_k(&x);
                let rb = bytes.len() / rows;
                for k in Kernel::supported() {
                    for g in 0..rows.div_ceil(GROUP) {
                        let mut out = [0.0f32; GROUP];
                        Kernels::new(k, dtype).group_dot(&p, g, &ea, &mut out);
                        for (j, &got) in out.iter().enumerate().take(rows - g * GROUP) {
                            let r = g * GROUP + j;
                            let want = reference_row(dtype, &bytes[r * rb..(r + 1) * rb], &ra);
                            assert!(
                                bits_eq(got, want),
                                "{} {dtype} fill {fill:#x} row {r}: {got} vs {want}",
                                k.name()
                            );
                        }
                    }
                }
            }
        }
    }
}

/// The batched (prefill / serve) product over K-quant blocks equals the one-token matvec
/// bit for bit, at 2 and 3 threads and odd token counts.
#[test]
fn batched_kquant_matmul_equals_one_token_matvec() {
    let (rows, cols) = (203, 512);
    let mut s = 0x9E37_79B9_7F4A_7C15u64;
    let mut next = move || {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        s
    };
    for dtype in [
        DType::Q2_K,
        DType::Q3_K,
        DType::Q4_K,
        DType::Q5_K,
        DType::Q6_K,
        DType::IQ4_XS,
    ] {
        let blocks = rows * cols / QK_K;
        let raw: Vec<u8> = (0..blocks * dtype.block_bytes())
            .map(|_| next() as u8)
            .collect();
        let scales: Vec<u16> = (0..blocks * 2)
            .map(|_| f16::from_f32((next() % 2000) as f32 / 1e5).to_bits())
            .collect();
        let bytes = rows_bytes(dtype, blocks, &raw, &scales);
        let m = Matrix::from_tensor(
            &Tensor {
                name: "w".into(),
                dtype,
                shape: vec![rows, cols],
                data: TensorBytes::owned(&bytes),
            },
            wkernels::default_kernel(),
        );
        for threads in [2, 3] {
            let pool = rayon::ThreadPoolBuilder::new()
                .num_threads(threads)
                .build()
                .unwrap();
            for ntok in [2usize, 3, 5, 16, 67] {
                let xs: Vec<f32> = (0..ntok * cols)
                    .map(|_| (next() % 20001) as f32 / 1e4 - 1.0)
                    .collect();
                let mut batched = vec![f32::NAN; ntok * rows];
                pool.install(|| matmul(&m, &xs, ntok, &mut batched));
                for t in 0..ntok {
                    let mut one = vec![0.0f32; rows];
                    matvec(&m, &xs[t * cols..(t + 1) * cols], &mut one);
                    let ra = ggml_kdot::quantize_q8_k(&xs[t * cols..(t + 1) * cols]);
                    let rb = bytes.len() / rows;
                    for r in 0..rows {
                        assert_eq!(
                            batched[t * rows + r].to_bits(),
                            one[r].to_bits(),
                            "{dtype} threads={threads} tokens={ntok} t={t} r={r}"
                        );
                        let want = reference_row(dtype, &bytes[r * rb..(r + 1) * rb], &ra);
                        assert_eq!(one[r].to_bits(), want.to_bits(), "{dtype} row {r}");
                    }
                }
            }
        }
    }
}

/// One product over a K-quant and a 32-block matrix together (`matvec_many`, `matmul_many`:
/// the input is quantised once into both forms) gives each matrix exactly its own
/// `matvec`; a product over float or 32-block matrices alone leaves the Q8_K form out and
/// one over K-quants alone the 32-block form (`quantized_forms`).
#[test]
fn mixed_block_types_in_one_product_equal_their_own_matvec() {
    use tinygpt_cpu::ops::matvec::quantized_forms;
    use tinygpt_cpu::ops::{matmul_many, matvec_many};
    use tinygpt_cpu::wkernels::ActsForms;
    let cols = 512;
    let mut s = 0x1234_5678_9ABC_DEF0u64;
    let mut next = move || {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        s
    };
    let mut mk = |dtype: DType, rows: usize| {
        let n = rows * cols / dtype.block_len() * dtype.block_bytes();
        let mut bytes: Vec<u8> = (0..n).map(|_| next() as u8).collect();
        // Sane f16 scales at the start of every block (and Q6_K's at its end).
        for blk in bytes.chunks_exact_mut(dtype.block_bytes()) {
            let h = f16::from_f32(0.01).to_le_bytes();
            match dtype {
                DType::Q6_K => blk[208..210].copy_from_slice(&h),
                DType::Q3_K => blk[108..110].copy_from_slice(&h),
                DType::Q2_K => {
                    blk[80..82].copy_from_slice(&h);
                    blk[82..84].copy_from_slice(&h);
                }
                DType::Q4_K | DType::Q5_K => {
                    blk[0..2].copy_from_slice(&h);
                    blk[2..4].copy_from_slice(&h);
                }
                _ => blk[0..2].copy_from_slice(&h),
            }
        }
        Matrix::from_tensor(
            &Tensor {
                name: "w".into(),
                dtype,
                shape: vec![rows, cols],
                data: TensorBytes::owned(&bytes),
            },
            wkernels::default_kernel(),
        )
    };
    let a = mk(DType::Q4_K, 37);
    let b = mk(DType::Q8_0, 21);
    let c = mk(DType::Q6_K, 16);
    let d = mk(DType::Q2_K, 9);
    let e = mk(DType::Q3_K, 11);
    assert_eq!(
        quantized_forms(&[&a]),
        ActsForms {
            q8_0: false,
            q8_k: true
        }
    );
    assert_eq!(
        quantized_forms(&[&b]),
        ActsForms {
            q8_0: true,
            q8_k: false
        }
    );
    assert_eq!(quantized_forms(&[&a, &b]), ActsForms::ALL);
    let ntok = 5;
    let xs: Vec<f32> = (0..ntok * cols)
        .map(|_| (next() % 20001) as f32 / 1e4 - 1.0)
        .collect();
    let mats = [&a, &b, &c, &d, &e];
    for threads in [1, 2, 3] {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .unwrap();
        let mut outs: Vec<Vec<f32>> = mats.iter().map(|m| vec![f32::NAN; m.rows]).collect();
        {
            let mut refs: Vec<&mut [f32]> = outs.iter_mut().map(|o| &mut o[..]).collect();
            pool.install(|| matvec_many(&mats, &xs[..cols], &mut refs));
        }
        let mut batched: Vec<Vec<f32>> =
            mats.iter().map(|m| vec![f32::NAN; ntok * m.rows]).collect();
        {
            let mut refs: Vec<&mut [f32]> = batched.iter_mut().map(|o| &mut o[..]).collect();
            pool.install(|| matmul_many(&mats, &xs, ntok, &mut refs));
        }
        for (i, m) in mats.iter().enumerate() {
            for t in 0..ntok {
                let mut one = vec![0.0f32; m.rows];
                matvec(m, &xs[t * cols..(t + 1) * cols], &mut one);
                if t == 0 {
                    for r in 0..m.rows {
                        assert_eq!(outs[i][r].to_bits(), one[r].to_bits(), "many {i} row {r}");
                    }
                }
                for r in 0..m.rows {
                    assert_eq!(
                        batched[i][t * m.rows + r].to_bits(),
                        one[r].to_bits(),
                        "batched threads={threads} matrix {i} token {t} row {r}"
                    );
                }
            }
        }
    }
}

fn q5_1_case() -> impl Strategy<Value = (usize, usize, Vec<u8>, Vec<u16>, Vec<f32>)> {
    (1usize..20, 1usize..10).prop_flat_map(|(rows, nb)| {
        (
            Just(rows),
            Just(nb),
            code_bytes(rows * nb * 24),
            prop::collection::vec(scale(), 2 * rows * nb),
            acts(nb * 32),
        )
    })
}

proptest! {
    #![proptest_config(cfg())]

    /// Q5_1 (kept as whole rows, read against the 8-bit blocks of 32 as Q4_1): every
    /// variant, one token and several, equals `ggml_dot::dot_q5_1` bit for bit.
    #[test]
    fn q5_1_equals_its_twin_for_every_variant_and_token(
        (rows, nb, raw, scales, x) in q5_1_case(),
        ntok in 1usize..7,
    ) {
        use tinygpt_reference::ggml_dot;
        let mut bytes = raw.clone();
        for (b, blk) in bytes.chunks_exact_mut(24).enumerate() {
            blk[0..2].copy_from_slice(&scales[2 * b].to_le_bytes());
            blk[2..4].copy_from_slice(&scales[2 * b + 1].to_le_bytes());
        }
        let p = Packed::new(DType::Q5_1, rows, nb * 32, &bytes);
        let n = nb * 32;
        let xs: Vec<Vec<f32>> = (0..ntok)
            .map(|t| (0..n).map(|i| x[(i + 13 * t) % n] * (1.0 + t as f32)).collect())
            .collect();
        let eas: Vec<QuantizedActs> = xs.iter().map(|x| QuantizedActs::from_f32(x)).collect();
        let ras: Vec<_> = xs.iter().map(|x| ggml_dot::quantize_acts(x)).collect();
        let refs: Vec<&QuantizedActs> = eas.iter().collect();
        let rb = nb * 24;
        for k in Kernel::supported() {
            for g in 0..rows.div_ceil(GROUP) {
                let mut one = [0.0f32; GROUP];
                let kernels = Kernels::new(k, DType::Q5_1);
                kernels.group_dot(&p, g, &eas[0], &mut one);
                let mut many = vec![[0.0f32; GROUP]; ntok];
                kernels.group_tokens(&p, g, &refs, &mut many);
                for j in 0..(rows - g * GROUP).min(GROUP) {
                    let r = g * GROUP + j;
                    let row = &bytes[r * rb..(r + 1) * rb];
                    let want = ggml_dot::dot_q5_1(row, &ras[0]);
                    prop_assert!(bits_eq(one[j], want), "{} row {r}: {} vs {want}", k.name(), one[j]);
                    for (t, m) in many.iter().enumerate() {
                        let want = ggml_dot::dot_q5_1(row, &ras[t]);
                        prop_assert!(bits_eq(m[j], want), "{} token {t} row {r}", k.name());
                    }
                }
            }
        }
    }
}
