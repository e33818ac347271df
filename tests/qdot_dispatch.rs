//! Every quantised-weight kernel variant this CPU supports (`wkernels::Kernel::supported`;
//! `scalar` and the `wide`-based `portable` run on every machine, so they are always
//! among them) against the scalar twin in the reference crate, bit for bit: odd row counts (partial
//! row groups), 1 to 9 blocks per row, extreme codes (Q8_0 −128 and 127, Q4 nibbles 0
//! and 15, Q5_0 codes 0 and 31, IQ4_NL levels −127 and 113), extreme f16 scales (0, subnormal, ±65504) and extreme activations (zero
//! blocks, 1e30, subnormal values, one large value among tiny ones).
//!
//! The multi-token kernels (`Kernels::group_tokens`, one weight block unpacked for
//! several tokens) are held to the same twin for every token, at odd token counts, and
//! the batched product `ops::matmul` on GGML blocks (its parallel, multi-token path) to
//! the one-token `ops::matvec`, bit for bit.
//!
//! Q5_0 and IQ4_NL are checked packed both ways: as their own blocks (`Packed::new`; every
//! variant has code for them) and rewritten as Q8_0, each read by every variant, against
//! `ggml_dot::dot_q5_0` / `dot_iq4_nl` (each equal to `dot_q8_0` on the rewrite: the
//! reference's tests).

use half::f16;
use proptest::prelude::*;
use tinygpt_cpu::dtype::DType;
use tinygpt_cpu::wkernels::{self, ActsTile, Kernel, Kernels, Packed, QuantizedActs, GROUP, TILE};

/// The GGML block types of the interleaved layout.
const TYPES: [DType; 5] = [
    DType::Q8_0,
    DType::Q4_0,
    DType::Q4_1,
    DType::Q5_0,
    DType::IQ4_NL,
];

/// The packed forms of a matrix to test: the engine's (`Packed::new`), and for Q5_0 and
/// IQ4_NL both their forms (as their own blocks, and rewritten exactly as Q8_0 blocks).
fn packings(dtype: DType, rows: usize, cols: usize, bytes: &[u8]) -> Vec<Packed> {
    if matches!(dtype, DType::Q5_0 | DType::IQ4_NL) {
        let native = Packed::new(dtype, rows, cols, bytes);
        let rewrite = match dtype {
            DType::Q5_0 => tinygpt_reference::ggml_more::q5_0_to_q8_0(bytes),
            _ => tinygpt_reference::ggml_more::iq4_nl_to_q8_0(bytes),
        };
        let q8 = Packed::new(DType::Q8_0, rows, cols, &rewrite);
        assert_eq!((native.dtype, q8.dtype), (dtype, DType::Q8_0));
        vec![native, q8]
    } else {
        vec![Packed::new(dtype, rows, cols, bytes)]
    }
}
use tinygpt_cpu::ops::{matmul, matvec, matvec_many, Matrix};
use tinygpt_cpu::weights::{Tensor, TensorBytes};
use tinygpt_reference::ggml_dot;

fn cfg() -> ProptestConfig {
    ProptestConfig {
        cases: 200,
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

/// Code bytes: random, or all at an extreme.
fn code_bytes(n: usize) -> impl Strategy<Value = Vec<u8>> {
    prop_oneof![
        4 => prop::collection::vec(any::<u8>(), n),
        1 => Just(vec![0x80u8; n]),
        1 => Just(vec![0x7Fu8; n]),
        1 => Just(vec![0xFFu8; n]),
        1 => Just(vec![0x00u8; n]),
    ]
}

/// Activations: ordinary, huge, subnormal, zero blocks, or one spike among tiny values.
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

/// GGML rows built from code bytes and scale patterns.
fn rows_bytes(dtype: DType, rows: usize, nb: usize, codes: &[u8], scales: &[u16]) -> Vec<u8> {
    let mut out = Vec::new();
    let ncode = dtype.block_bytes() - if dtype == DType::Q4_1 { 4 } else { 2 };
    for blk in 0..rows * nb {
        out.extend_from_slice(&scales[2 * blk].to_le_bytes());
        if dtype == DType::Q4_1 {
            out.extend_from_slice(&scales[2 * blk + 1].to_le_bytes());
        }
        out.extend_from_slice(&codes[blk * ncode..(blk + 1) * ncode]);
    }
    out
}

fn reference_row(dtype: DType, row: &[u8], a: &ggml_dot::QuantizedActs) -> f32 {
    match dtype {
        DType::Q8_0 => ggml_dot::dot_q8_0(row, a),
        DType::Q4_0 => ggml_dot::dot_q4_0(row, a),
        DType::Q5_0 => ggml_dot::dot_q5_0(row, a),
        DType::IQ4_NL => ggml_dot::dot_iq4_nl(row, a),
        _ => ggml_dot::dot_q4_1(row, a),
    }
}

/// Group `g` of `p` through kernel `k` against the reference twin row by row (`bytes`: the
/// file's `rows` rows): the first row whose bits differ, as a message.
#[allow(clippy::too_many_arguments)]
fn check_group(
    k: Kernel,
    p: &Packed,
    g: usize,
    ea: &QuantizedActs,
    ra: &ggml_dot::QuantizedActs,
    dtype: DType,
    bytes: &[u8],
    rows: usize,
) -> Result<(), String> {
    let rb = bytes.len() / rows;
    let mut out = [0.0f32; GROUP];
    Kernels::new(k, p.dtype).group_dot(p, g, ea, &mut out);
    for (j, &got) in out.iter().enumerate().take(rows - g * GROUP) {
        let r = g * GROUP + j;
        let want = reference_row(dtype, &bytes[r * rb..(r + 1) * rb], ra);
        if got.to_bits() != want.to_bits() {
            return Err(format!("{} {dtype} row {r}: {got} vs {want}", k.name()));
        }
    }
    Ok(())
}

#[test]
fn reports_supported_variants() {
    let s = Kernel::supported();
    println!(
        "supported kernels: {:?}; active: {}",
        s.iter().map(|k| k.name()).collect::<Vec<_>>(),
        wkernels::default_kernel().name()
    );
    assert_eq!(s[0], Kernel::Scalar);
    // the portable variant runs (and is tested) everywhere
    assert_eq!(s[1], Kernel::Portable);
    assert!(Kernel::Portable.is_supported());
    assert!(s.contains(&wkernels::default_kernel()));
    for k in Kernel::ALL {
        assert_eq!(Kernel::from_name(k.name()), Some(k));
    }
}

#[test]
fn every_variant_equals_the_scalar_twin_bit_for_bit() {
    let kernels = Kernel::supported();
    let mut runner = proptest::test_runner::TestRunner::new(cfg());
    let strat = (1usize..20, 1usize..10).prop_flat_map(|(rows, nb)| {
        (
            Just(rows),
            Just(nb),
            code_bytes(rows * nb * 32),
            prop::collection::vec(scale(), rows * nb * 2),
            acts(nb * 32),
        )
    });
    runner
        .run(&strat, |(rows, nb, codes, scales, x)| {
            let ra = ggml_dot::quantize_acts(&x);
            let ea = QuantizedActs::from_f32(&x);
            prop_assert_eq!(&ra.q, &ea.q);
            prop_assert_eq!(&ra.d, &ea.d);
            for dtype in TYPES {
                let bytes = rows_bytes(dtype, rows, nb, &codes, &scales);
                for p in packings(dtype, rows, nb * 32, &bytes) {
                    // the packed copy gives the file's rows back (in the packed type)
                    let file = match (p.dtype, dtype) {
                        (a, b) if a == b => bytes.clone(),
                        (_, DType::Q5_0) => tinygpt_reference::ggml_more::q5_0_to_q8_0(&bytes),
                        _ => tinygpt_reference::ggml_more::iq4_nl_to_q8_0(&bytes),
                    };
                    let rb = p.dtype.block_bytes() * nb;
                    let mut back = vec![0u8; rb];
                    for r in 0..rows {
                        p.row_bytes(r, &mut back);
                        prop_assert_eq!(&back[..], &file[r * rb..(r + 1) * rb]);
                    }
                    for &k in &kernels {
                        for g in 0..p.groups() {
                            let r = check_group(k, &p, g, &ea, &ra, dtype, &bytes, rows);
                            prop_assert!(r.is_ok(), "rows={} nb={} {}: {:?}", rows, nb, p.dtype, r);
                        }
                    }
                }
            }
            Ok(())
        })
        .unwrap();
}

/// The largest integer sums a block can produce (Q8_0 −128 × −127 everywhere, Q4 15 ×
/// 127, IQ4_NL −127 × −127) and their negatives, with scales that keep the float result finite.
#[test]
fn saturating_extremes_stay_exact() {
    let nb = 3;
    let x_pos = vec![1.0f32; nb * 32];
    let x_neg = vec![-1.0f32; nb * 32];
    for x in [&x_pos, &x_neg] {
        let ra = ggml_dot::quantize_acts(x);
        let ea = QuantizedActs::from_f32(x);
        for dtype in TYPES {
            for code in [0x80u8, 0x7F, 0xFF, 0x00, 0x88] {
                let rows = 9;
                let codes = vec![code; rows * nb * 32];
                let scales = vec![f16::from_f32(0.5).to_bits(); rows * nb * 2];
                let bytes = rows_bytes(dtype, rows, nb, &codes, &scales);
                for p in packings(dtype, rows, nb * 32, &bytes) {
                    for k in Kernel::supported() {
                        for g in 0..p.groups() {
                            let r = check_group(k, &p, g, &ea, &ra, dtype, &bytes, rows);
                            assert!(r.is_ok(), "code {code:#x} {}: {r:?}", p.dtype);
                        }
                    }
                }
            }
        }
    }
}

/// Every variant's multi-token kernels (`dot_group_tokens`, and `dot_group_tile` over
/// interleaved tiles of 8): each token's eight rows equal the reference twin (hence the
/// one-token kernel) bit for bit, for 1 to 19 tokens (short last tiles), odd row counts
/// and the extreme codes, scales and activations above.
#[test]
fn multi_token_kernels_equal_the_scalar_twin_for_every_token() {
    let kernels = Kernel::supported();
    let mut runner = proptest::test_runner::TestRunner::new(ProptestConfig {
        cases: 120,
        ..cfg()
    });
    let strat = (1usize..20, 1usize..8, 1usize..20).prop_flat_map(|(rows, nb, ntok)| {
        (
            Just(rows),
            Just(nb),
            code_bytes(rows * nb * 32),
            prop::collection::vec(scale(), rows * nb * 2),
            prop::collection::vec(acts(nb * 32), ntok),
        )
    });
    runner
        .run(&strat, |(rows, nb, codes, scales, xs)| {
            let ras: Vec<_> = xs.iter().map(|x| ggml_dot::quantize_acts(x)).collect();
            let eas: Vec<_> = xs.iter().map(|x| QuantizedActs::from_f32(x)).collect();
            let refs: Vec<&QuantizedActs> = eas.iter().collect();
            for (dtype, p) in TYPES.into_iter().flat_map(|dtype| {
                let bytes = rows_bytes(dtype, rows, nb, &codes, &scales);
                packings(dtype, rows, nb * 32, &bytes)
                    .into_iter()
                    .map(move |p| (dtype, p))
            }) {
                let bytes = rows_bytes(dtype, rows, nb, &codes, &scales);
                let rb = dtype.block_bytes() * nb;
                for &k in &kernels {
                    for g in 0..p.groups() {
                        let mut out = vec![[f32::NAN; GROUP]; xs.len()];
                        let kernels = Kernels::new(k, p.dtype);
                        kernels.group_tokens(&p, g, &refs, &mut out);
                        for (t, (o, ra)) in out.iter().zip(&ras).enumerate() {
                            let mut one = [0.0f32; GROUP];
                            kernels.group_dot(&p, g, &eas[t], &mut one);
                            for (j, &got) in o.iter().enumerate().take(rows - g * GROUP) {
                                let r = g * GROUP + j;
                                let want = reference_row(dtype, &bytes[r * rb..(r + 1) * rb], ra);
                                prop_assert_eq!(
                                    got.to_bits(),
                                    want.to_bits(),
                                    "{} {} as {} rows={} nb={} tokens={} t={} r={}: {} vs {}",
                                    k.name(),
                                    dtype,
                                    p.dtype,
                                    rows,
                                    nb,
                                    xs.len(),
                                    t,
                                    r,
                                    got,
                                    want
                                );
                                prop_assert_eq!(got.to_bits(), one[j].to_bits());
                            }
                        }
                        // the tile path (interleaved activations; AVX-512's own kernel)
                        let mut tiled = vec![[f32::NAN; GROUP]; xs.len()];
                        for (ch, o) in refs.chunks(TILE).zip(tiled.chunks_mut(TILE)) {
                            kernels.group_tile(&p, g, &ActsTile::new(ch), o, g % 2 == 0);
                        }
                        for (t, (o, w)) in tiled.iter().zip(&out).enumerate() {
                            for j in 0..rows.min(g * GROUP + GROUP) - g * GROUP {
                                prop_assert_eq!(
                                    o[j].to_bits(),
                                    w[j].to_bits(),
                                    "tile {} {} as {} rows={} nb={} tokens={} t={} j={}",
                                    k.name(),
                                    dtype,
                                    p.dtype,
                                    rows,
                                    nb,
                                    xs.len(),
                                    t,
                                    j
                                );
                            }
                        }
                    }
                }
            }
            Ok(())
        })
        .unwrap();
}

/// The multi-token kernels at the integer extremes (largest block sums of either sign),
/// for a token count that is not a multiple of the tile.
#[test]
fn multi_token_extremes_stay_exact() {
    let nb = 3;
    let xs: Vec<Vec<f32>> = [1.0f32, -1.0, 1.0, 1.0, -1.0]
        .iter()
        .map(|&v| vec![v; nb * 32])
        .collect();
    let ras: Vec<_> = xs.iter().map(|x| ggml_dot::quantize_acts(x)).collect();
    let eas: Vec<_> = xs.iter().map(|x| QuantizedActs::from_f32(x)).collect();
    let refs: Vec<&QuantizedActs> = eas.iter().collect();
    for dtype in TYPES {
        for code in [0x80u8, 0x7F, 0xFF, 0x00, 0x88] {
            let rows = 9;
            let codes = vec![code; rows * nb * 32];
            let scales = vec![f16::from_f32(0.5).to_bits(); rows * nb * 2];
            let bytes = rows_bytes(dtype, rows, nb, &codes, &scales);
            let rb = dtype.block_bytes() * nb;
            for (p, k) in packings(dtype, rows, nb * 32, &bytes)
                .iter()
                .flat_map(|p| Kernel::supported().into_iter().map(move |k| (p, k)))
            {
                for g in 0..p.groups() {
                    let mut out = vec![[0.0f32; GROUP]; xs.len()];
                    let kernels = Kernels::new(k, p.dtype);
                    kernels.group_tokens(p, g, &refs, &mut out);
                    let mut tiled = vec![[0.0f32; GROUP]; xs.len()];
                    kernels.group_tile(p, g, &ActsTile::new(&refs), &mut tiled, true);
                    for (o, ra) in out.iter().chain(&tiled).zip(ras.iter().cycle()) {
                        for (j, &got) in o.iter().enumerate().take(rows - g * GROUP) {
                            let r = g * GROUP + j;
                            let want = reference_row(dtype, &bytes[r * rb..(r + 1) * rb], ra);
                            assert_eq!(
                                got.to_bits(),
                                want.to_bits(),
                                "{} {dtype} as {} code {code:#x}: {got} vs {want}",
                                k.name(),
                                p.dtype
                            );
                        }
                    }
                }
            }
        }
    }
}

/// `matmul` on GGML blocks (tokens quantised once, rows split across threads, the
/// multi-token kernel, token tiles of 64) gives every token exactly what `matvec` gives
/// it alone: token counts around the tile sizes, a row count that leaves a partial group,
/// shapes large enough for the parallel path, in a 2-thread and a 3-thread pool.
#[test]
fn batched_quantised_matmul_equals_one_token_matvec() {
    let (rows, cols) = (203, 320);
    let mut s = 0x9E37_79B9_7F4A_7C15u64;
    let mut next = move || {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        s
    };
    for dtype in TYPES {
        let nb = rows * cols / 32;
        let codes: Vec<u8> = (0..nb * 32).map(|_| next() as u8).collect();
        let scales: Vec<u16> = (0..nb * 2)
            .map(|_| f16::from_f32((next() % 2000) as f32 / 1e4 - 0.1).to_bits())
            .collect();
        let bytes = rows_bytes(dtype, rows, cols / 32, &codes, &scales);
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
                    for r in 0..rows {
                        assert_eq!(
                            batched[t * rows + r].to_bits(),
                            one[r].to_bits(),
                            "{dtype} threads={threads} tokens={ntok} t={t} r={r}"
                        );
                    }
                }
            }
        }
    }
}

/// `matvec_many` (the decode step's fused `q/k/v` and `gate/up` products: rows of several
/// matrices cut into tasks of equal work, a task may span two matrices) gives each matrix
/// exactly what `matvec` gives it alone on one thread: matrices of unequal, odd row counts
/// (cuts inside and across matrices, partial row groups), float and GGML dtypes in one
/// call, pools of 1, 2, 3 and 5 threads.
#[test]
fn matvec_many_equals_one_matvec_per_matrix_at_any_thread_count() {
    let cols = 320;
    let mut s = 0x2545_F491_4F6C_DD1Du64;
    let mut next = move || {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        s
    };
    let mut make = |dtype: DType, rows: usize| {
        let bytes = match dtype {
            DType::F32 => (0..rows * cols)
                .flat_map(|_| ((next() % 2001) as f32 / 1e4 - 0.1).to_le_bytes())
                .collect(),
            _ => {
                let nb = rows * cols / 32;
                let codes: Vec<u8> = (0..nb * 32).map(|_| next() as u8).collect();
                let scales: Vec<u16> = (0..nb * 2)
                    .map(|_| f16::from_f32((next() % 2000) as f32 / 1e4 - 0.1).to_bits())
                    .collect();
                rows_bytes(dtype, rows, cols / 32, &codes, &scales)
            }
        };
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
    let sets: Vec<Vec<Matrix>> = vec![
        vec![
            make(DType::Q4_1, 203),
            make(DType::Q4_1, 67),
            make(DType::Q4_1, 67),
        ],
        vec![make(DType::Q8_0, 77), make(DType::F32, 301)],
        vec![
            make(DType::Q4_0, 9),
            make(DType::Q8_0, 250),
            make(DType::F32, 1),
        ],
        vec![
            make(DType::Q5_0, 131),
            make(DType::Q5_0, 17),
            make(DType::Q4_1, 40),
        ],
        vec![
            make(DType::IQ4_NL, 131),
            make(DType::IQ4_NL, 17),
            make(DType::Q5_0, 40),
        ],
    ];
    let x: Vec<f32> = (0..cols)
        .map(|_| (next() % 20001) as f32 / 1e4 - 1.0)
        .collect();
    let one = rayon::ThreadPoolBuilder::new()
        .num_threads(1)
        .build()
        .unwrap();
    for mats in &sets {
        let want: Vec<Vec<f32>> = mats
            .iter()
            .map(|m| {
                let mut o = vec![0.0f32; m.rows];
                one.install(|| matvec(m, &x, &mut o));
                o
            })
            .collect();
        let refs: Vec<&Matrix> = mats.iter().collect();
        for threads in [1, 2, 3, 5] {
            let pool = rayon::ThreadPoolBuilder::new()
                .num_threads(threads)
                .build()
                .unwrap();
            let mut got: Vec<Vec<f32>> = mats.iter().map(|m| vec![f32::NAN; m.rows]).collect();
            let mut outs: Vec<&mut [f32]> = got.iter_mut().map(|o| o.as_mut_slice()).collect();
            pool.install(|| matvec_many(&refs, &x, &mut outs));
            for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                for (r, (a, b)) in g.iter().zip(w).enumerate() {
                    assert_eq!(
                        a.to_bits(),
                        b.to_bits(),
                        "threads={threads} matrix {i} ({:?}) row {r}",
                        mats[i]
                    );
                }
            }
        }
    }
}

/// The 8-lane activation quantiser against the reference twin on the values where
/// rounding and clamping are delicate: exact halves (`k + 0.5` after scaling, either
/// sign), the float just below a half, NaN, ±∞, ±0, subnormals, and random blocks
/// mixing them.
#[test]
fn activation_quantiser_equals_the_reference_on_special_values() {
    let below_half = f32::from_bits(0.5f32.to_bits() - 1);
    let mut blocks: Vec<Vec<f32>> = vec![
        // amax 127 gives id = 1: values are their own codes
        (0..32).map(|i| i as f32 - 15.5).collect(),
        (0..32)
            .map(|i| {
                if i == 0 {
                    127.0
                } else {
                    (i as f32) * 3.5 - 60.0
                }
            })
            .collect(),
        (0..32)
            .map(|i| {
                if i == 0 {
                    127.0
                } else {
                    below_half * (i as f32 - 16.0)
                }
            })
            .collect(),
        vec![0.0; 32],
        vec![-0.0; 32],
        vec![f32::NAN; 32],
        (0..32)
            .map(|i| if i % 5 == 0 { f32::NAN } else { i as f32 })
            .collect(),
        (0..32)
            .map(|i| if i == 3 { f32::INFINITY } else { i as f32 })
            .collect(),
        (0..32)
            .map(|i| {
                if i == 7 {
                    f32::NEG_INFINITY
                } else {
                    -(i as f32)
                }
            })
            .collect(),
        (0..32)
            .map(|i| f32::from_bits(i + 1) * if i % 2 == 0 { 1.0 } else { -1.0 })
            .collect(),
        (0..32)
            .map(|i| f32::MAX * (i as f32 - 16.0) / 16.0)
            .collect(),
    ];
    let specials = [
        0.5f32,
        -0.5,
        1.5,
        -2.5,
        below_half,
        -below_half,
        f32::NAN,
        f32::INFINITY,
        f32::MIN_POSITIVE,
        1e-45,
        126.5,
        -126.5,
        127.0,
    ];
    let mut s = 0x1234_5678_9ABC_DEF1u64;
    for _ in 0..500 {
        blocks.push(
            (0..32)
                .map(|_| {
                    s ^= s << 13;
                    s ^= s >> 7;
                    s ^= s << 17;
                    if s.is_multiple_of(3) {
                        specials[(s >> 8) as usize % specials.len()]
                    } else {
                        ((s >> 16) % 2001) as f32 / 8.0 - 125.0
                    }
                })
                .collect(),
        );
    }
    for blk in &blocks {
        let ra = ggml_dot::quantize_acts(blk);
        let ea = QuantizedActs::from_f32(blk);
        assert_eq!(ra.q, ea.q, "codes of {blk:?}");
        assert_eq!(
            ra.d.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
            ea.d.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
            "scales of {blk:?}"
        );
        assert_eq!(
            ra.s.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
            ea.s.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
            "sums of {blk:?}"
        );
    }
}

/// A matrix past `wkernels::STREAM_PREFETCH_BYTES`, whose one-token kernels prefetch ahead
/// (up to 16 blocks past a group's last, into the next group or past the buffer's end):
/// every variant still equals the scalar twin on its first and last groups.
#[test]
fn prefetching_kernels_on_a_dram_sized_matrix_equal_the_scalar_twin() {
    for dtype in [DType::Q4_1, DType::Q5_0, DType::IQ4_NL] {
        prefetching_on_a_dram_sized_matrix(dtype);
    }
}

fn prefetching_on_a_dram_sized_matrix(dtype: DType) {
    let nb = 256; // 8192 columns
    let rows = (wkernels::STREAM_PREFETCH_BYTES / (nb * dtype.block_bytes())) + 3;
    let mut bytes = vec![0u8; rows * nb * dtype.block_bytes()];
    let mut seed = 0x9E37_79B9u32;
    for b in bytes.iter_mut() {
        seed ^= seed << 13;
        seed ^= seed >> 17;
        seed ^= seed << 5;
        *b = seed as u8;
    }
    // Finite scales and minimums: every block's d (and Q4_1's m) as small f16 values.
    let bb = dtype.block_bytes();
    for blk in bytes.chunks_exact_mut(bb) {
        blk[..2].copy_from_slice(&f16::from_f32(0.01).to_bits().to_le_bytes());
        if dtype == DType::Q4_1 {
            blk[2..4].copy_from_slice(&f16::from_f32(-0.05).to_bits().to_le_bytes());
        }
    }
    let x: Vec<f32> = (0..nb * 32)
        .map(|i| ((i * 37) % 101) as f32 - 50.0)
        .collect();
    let (ra, ea) = (ggml_dot::quantize_acts(&x), QuantizedActs::from_f32(&x));
    // one packing for every variant (Q5_0, IQ4_NL: as their blocks)
    let p = Packed::new(dtype, rows, nb * 32, &bytes);
    assert!(p.byte_len() >= wkernels::STREAM_PREFETCH_BYTES);
    for k in Kernel::supported() {
        for g in [0, 1, p.groups() - 1] {
            let r = check_group(k, &p, g, &ea, &ra, dtype, &bytes, rows);
            assert!(r.is_ok(), "{dtype} group {g}: {r:?}");
        }
    }
}

/// Q5_0 and IQ4_NL are kept as blocks (22 and 18 bytes per 32 weights, not Q8_0's 34), and
/// every variant this CPU supports runs its own code for them (the type table resolves no
/// other variant's): fails if a change silently falls back to a rewrite as Q8_0 or to
/// another variant's code. A model matrix (`Matrix::from_tensor`, for any variant) holds
/// the blocks.
#[test]
fn q5_0_and_iq4_nl_stay_blocks_for_the_variants_with_code() {
    for dtype in [DType::Q5_0, DType::IQ4_NL] {
        for k in Kernel::supported() {
            assert_eq!(Kernels::new(k, dtype).code(), k, "{dtype} {}", k.name());
        }
        stays_blocks(dtype);
    }
}

fn stays_blocks(dtype: DType) {
    let (rows, nb) = (19, 18); // 576 columns, as SmolLM2's
    let bs = dtype.block_bytes();
    let bytes: Vec<u8> = (0..rows * nb * bs).map(|i| (i * 7 % 251) as u8).collect();
    let p = Packed::new(dtype, rows, nb * 32, &bytes);
    assert_eq!(p.dtype, dtype);
    // eight rows' blocks (with their scales) per group, padded to 64 bytes
    let group = (nb * bs * GROUP).next_multiple_of(64);
    assert_eq!(p.byte_len(), p.groups() * group, "{dtype}");
    let tensor = Tensor {
        name: "w".into(),
        dtype,
        shape: vec![rows, nb * 32],
        data: TensorBytes::owned(&bytes),
    };
    for k in Kernel::supported() {
        let m = Matrix::from_tensor(&tensor, k);
        assert_eq!(m.packed_dtype(), Some(dtype), "{dtype} {}", k.name());
    }
    let m = Matrix::from_tensor(&tensor, wkernels::default_kernel());
    assert_eq!(m.dtype, dtype);
    // the embedding lookup reads the packed copy: the file's values either way
    let mut row = vec![0.0f32; nb * 32];
    let mut want_row = vec![0.0f32; nb * 32];
    for r in [0, 8, rows - 1] {
        m.row_f32(r, &mut row);
        tinygpt_reference::ggml::dequantize_row(
            dtype,
            &bytes[r * nb * bs..(r + 1) * nb * bs],
            &mut want_row,
        )
        .unwrap();
        assert_eq!(
            row.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
            want_row.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
            "{dtype} row {r}"
        );
    }
}
