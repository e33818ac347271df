//! Grouped-query attention: the multi-query KIVI kernels (`dot_codes_groups_multi_with`,
//! `axpy_codes_rows_multi_with`), which unpack each code once for all the query heads of
//! one KV head, against
//!
//! * the single-query kernel of the same variant, head by head: **bit for bit** (the
//!   multi-query forms keep every head's operations and their order; only the unpacking is
//!   shared), and also the single-query call with all heads at once;
//! * the scalar twins (`fold_channels_scalar` + `dot_codes_scalar`, `axpy_codes_scalar`)
//!   and an f64 sum of the same folded terms, within the f32 summation-order bound
//!   `2·n·2⁻²⁴·Σ|terms|` (a wrong lane, row or head shows up as an O(1) error).
//!
//! Every variant this CPU supports; group sizes 1–8 and beyond (split into calls of at
//! most `MULTI_MAX` heads); head dims the AVX-512 kernels take (32/64/128/256) and
//! fallback ones (96, 48, 16, 8); int8/int4/int2; runs starting mid-group, one row, row
//! counts at and around block and group boundaries; constant channels, extreme parameters
//! (±65504), zero probabilities and signed-zero accumulators.

use half::f16;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use tinygpt_cpu::kivi::{
    axpy_codes_rows_multi_with, axpy_codes_rows_with, axpy_codes_scalar,
    dot_codes_groups_multi_with, dot_codes_groups_with, dot_codes_scalar, fold_channels_scalar,
    get, Bits, KRun, KvKernel, VRun, MULTI_MAX,
};

const U: f64 = f32::EPSILON as f64 / 2.0;

fn big(rng: &mut ChaCha8Rng) -> f32 {
    if rng.gen_bool(0.5) {
        65504.0
    } else {
        -65504.0
    }
}

/// `(scale, zero)` pairs of one shape.
fn params(rng: &mut ChaCha8Rng, n: usize, shape: &str) -> (Vec<f16>, Vec<f16>) {
    (0..n)
        .map(|_| match shape {
            "constant" => (f16::from_f32(1e-5), f16::from_f32(-0.5)),
            "extreme" => (f16::from_f32(big(rng).abs() / 4.0), f16::from_f32(big(rng))),
            _ => (
                f16::from_f32(rng.gen_range(1e-3..0.5f32)),
                f16::from_f32(rng.gen_range(-2.0..2.0f32)),
            ),
        })
        .unzip()
}

fn bits_eq(a: &[f32], b: &[f32]) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits())
}

struct Case<'a> {
    kernel: KvKernel,
    bits: Bits,
    hd: usize,
    rows: usize,
    nq: usize,
    shape: &'a str,
    /// K group size and the run's offset into its first group.
    group: (usize, usize),
}

impl Case<'_> {
    fn name(&self) -> String {
        format!(
            "{} bits={:?} hd={} rows={} nq={} {} group={:?}",
            self.kernel.name(),
            self.bits,
            self.hd,
            self.rows,
            self.nq,
            self.shape,
            self.group
        )
    }
}

fn check_keys(c: &Case, rng: &mut ChaCha8Rng) {
    let (hd, rows, nq, bits) = (c.hd, c.rows, c.nq, c.bits);
    let pk = bits.packed_len(hd);
    let codes: Vec<u8> = match c.shape {
        "constant" => vec![0u8; rows * pk],
        _ => (0..rows * pk).map(|_| rng.gen()).collect(),
    };
    let (g, offset) = c.group;
    let groups = (offset + rows).div_ceil(g);
    let (ks, kz) = params(rng, groups * hd, c.shape);
    let q: Vec<f32> = (0..nq * hd)
        .map(|_| match c.shape {
            "extreme" => big(rng) * rng.gen_range(0.0..1.0f32),
            _ => rng.gen_range(-2.0..2.0f32),
        })
        .collect();
    let stride = rows + 3;
    let run = |multi: bool, q: &[f32]| {
        let n = q.len() / hd;
        let mut out = vec![f32::NAN; n * stride];
        let mut fold = vec![0.0f32; n * hd];
        let f = if multi {
            dot_codes_groups_multi_with
        } else {
            dot_codes_groups_with
        };
        let run = KRun {
            codes: &codes,
            hd,
            scale: &ks,
            zero: &kz,
            group: g,
            offset,
            bits,
        };
        f(c.kernel, &run, q, &mut fold, &mut out, stride);
        out
    };
    let multi = run(true, &q);
    let ctx = c.name();
    // Padding between heads' score rows is left alone.
    for j in 0..nq {
        assert!(
            multi[j * stride + rows..(j + 1) * stride]
                .iter()
                .all(|x| x.is_nan()),
            "{ctx} dot: wrote past row {rows} of head {j}"
        );
    }
    assert!(
        bits_eq(&multi, &run(false, &q)),
        "{ctx} dot: multi != single (all heads)"
    );
    for j in 0..nq {
        let one = run(false, &q[j * hd..(j + 1) * hd]);
        let got = &multi[j * stride..j * stride + rows];
        assert!(
            bits_eq(got, &one[..rows]),
            "{ctx} dot j={j}: multi != single head"
        );
        let qj = &q[j * hd..(j + 1) * hd];
        let mut fold = vec![0.0f32; hd];
        for (r, &got) in got.iter().enumerate() {
            let k = (offset + r) / g;
            let (s, z) = (&ks[k * hd..(k + 1) * hd], &kz[k * hd..(k + 1) * hd]);
            let term = |ch: usize| {
                let qs = qj[ch] * s[ch].to_f32();
                let u = get(&codes[r * pk..], ch, bits) as f64;
                (qs as f64 * u, qj[ch] as f64 * z[ch].to_f32() as f64)
            };
            let exact: f64 = (0..hd).map(|ch| term(ch).0 + term(ch).1).sum();
            let mag: f64 = (0..hd).map(|ch| term(ch).0.abs() + term(ch).1.abs()).sum();
            let bound = 2.0 * (hd + 2) as f64 * U * mag;
            assert!(got.is_finite(), "{ctx} dot j={j} r={r}: {got}");
            assert!(
                (got as f64 - exact).abs() <= bound,
                "{ctx} dot j={j} r={r}: {got} vs {exact}"
            );
            let bias = fold_channels_scalar(qj, s, z, &mut fold);
            let twin = dot_codes_scalar(&codes[r * pk..(r + 1) * pk], &fold, bits) + bias;
            assert!(
                (got as f64 - twin as f64).abs() <= 2.0 * bound,
                "{ctx} dot j={j} r={r}: {got} vs scalar twin {twin}"
            );
        }
    }
}

fn check_values(c: &Case, rng: &mut ChaCha8Rng) {
    let (hd, rows, nq, bits) = (c.hd, c.rows, c.nq, c.bits);
    let pk = bits.packed_len(hd);
    let codes: Vec<u8> = match c.shape {
        "constant" => vec![0u8; rows * pk],
        _ => (0..rows * pk).map(|_| rng.gen()).collect(),
    };
    let (vs, vz) = params(rng, rows, c.shape);
    let stride = rows + 5;
    // Zero weights: scattered, a whole row for every head (index 2), and a head with none.
    let probs: Vec<f32> = (0..nq * stride)
        .map(|i| {
            let (j, r) = (i / stride, i % stride);
            if i % 7 == 3 || r == 2 || j == 1 {
                0.0
            } else {
                rng.gen_range(0.0..1.0f32)
            }
        })
        .collect();
    let acc0: Vec<f32> = (0..nq * hd)
        .map(|i| match i % 11 {
            0 => -0.0,
            1 => 0.0,
            _ => rng.gen_range(-1.0..1.0f32),
        })
        .collect();
    let bias0: Vec<f32> = (0..nq).map(|j| [0.5, -0.0, 0.0][j % 3]).collect();
    let run = |multi: bool, p: &[f32], acc: &[f32], bias: &[f32]| {
        let (mut acc, mut bias) = (acc.to_vec(), bias.to_vec());
        let f = if multi {
            axpy_codes_rows_multi_with
        } else {
            axpy_codes_rows_with
        };
        let run = VRun {
            codes: &codes,
            scale: &vs,
            zero: &vz,
            bits,
        };
        f(c.kernel, &run, p, stride, &mut acc, &mut bias);
        (acc, bias)
    };
    let (acc, bias) = run(true, &probs, &acc0, &bias0);
    let ctx = c.name();
    let (sa, sb) = run(false, &probs, &acc0, &bias0);
    assert!(
        bits_eq(&acc, &sa) && bits_eq(&bias, &sb),
        "{ctx} axpy: multi != single (all heads)"
    );
    for j in 0..nq {
        let (one_a, one_b) = run(
            false,
            &probs[j * stride..],
            &acc0[j * hd..(j + 1) * hd],
            &bias0[j..j + 1],
        );
        let got = &acc[j * hd..(j + 1) * hd];
        assert!(
            bits_eq(got, &one_a) && bits_eq(&bias[j..j + 1], &one_b),
            "{ctx} axpy j={j}: multi != single head"
        );
        let p = |r: usize| probs[j * stride + r];
        let mut twin = acc0[j * hd..(j + 1) * hd].to_vec();
        for r in 0..rows {
            axpy_codes_scalar(
                p(r) * vs[r].to_f32(),
                &codes[r * pk..(r + 1) * pk],
                &mut twin,
                bits,
            );
        }
        for ch in 0..hd {
            let term =
                |r: usize| (p(r) * vs[r].to_f32()) as f64 * get(&codes[r * pk..], ch, bits) as f64;
            let exact = acc0[j * hd + ch] as f64 + (0..rows).map(term).sum::<f64>();
            let mag =
                acc0[j * hd + ch].abs() as f64 + (0..rows).map(|r| term(r).abs()).sum::<f64>();
            let bound = 2.0 * (rows + 1) as f64 * U * mag;
            let g = got[ch] as f64;
            assert!(g.is_finite(), "{ctx} axpy j={j} c={ch}: {g}");
            assert!(
                (g - exact).abs() <= bound,
                "{ctx} axpy j={j} c={ch}: {g} vs {exact}"
            );
            assert!(
                (g - twin[ch] as f64).abs() <= 2.0 * bound,
                "{ctx} axpy j={j} c={ch}: {g} vs scalar twin {}",
                twin[ch]
            );
        }
        let pz = |r: usize| p(r) as f64 * vz[r].to_f32() as f64;
        let zsum: f64 = bias0[j] as f64 + (0..rows).map(pz).sum::<f64>();
        let zmag: f64 = bias0[j].abs() as f64 + (0..rows).map(|r| pz(r).abs()).sum::<f64>();
        let got = bias[j] as f64;
        assert!(
            (got - zsum).abs() <= 2.0 * (rows + 1) as f64 * U * zmag,
            "{ctx} axpy bias j={j}: {got} vs {zsum}"
        );
    }
}

#[test]
fn multi_query_kernels_equal_single_query_bit_for_bit_and_match_scalar_twins() {
    let kernels = KvKernel::supported();
    eprintln!(
        "multi-query KIVI kernels tested: {:?}",
        kernels.iter().map(|k| k.name()).collect::<Vec<_>>()
    );
    assert_eq!(MULTI_MAX, 8);
    let mut rng = ChaCha8Rng::seed_from_u64(0x6751_6751);
    let mut cases = 0usize;
    for kernel in kernels {
        for bits in [Bits::Int8, Bits::Int4, Bits::Int2] {
            for hd in [32usize, 64, 128, 256, 96, 48, 16, 8] {
                for (i, rows) in [1usize, 2, 7, 15, 16, 17, 32, 33, 64, 65, 100]
                    .into_iter()
                    .enumerate()
                {
                    for nq in [1usize, 2, 3, 4, 5, 6, 7, 8, 9, 11] {
                        // Big shapes only for the common group sizes (time).
                        if (hd > 128 || rows > 64) && ![1, 3, 8, 9].contains(&nq) {
                            continue;
                        }
                        for shape in ["random", "constant", "extreme"] {
                            // Runs starting at, and in the middle of, a K group; groups of
                            // 32 (rows 32/64 end on a boundary), 7, 16 and 1.
                            let group = [(32, 0), (32, 5), (7, 3), (1, 0), (16, 15)][(i + nq) % 5];
                            let c = Case {
                                kernel,
                                bits,
                                hd,
                                rows,
                                nq,
                                shape,
                                group,
                            };
                            check_keys(&c, &mut rng);
                            check_values(&c, &mut rng);
                            cases += 1;
                        }
                    }
                }
            }
        }
    }
    eprintln!("{cases} cases");
}

/// Long runs (many K groups, many 256-row super-blocks of the AVX-512 value kernel, many
/// 64-row chunks of the portable one), SmolLM2's shape (head dim 64, 3 heads per KV head)
/// and group sizes 2, 5 and 8, bit for bit against the single-query kernel.
#[test]
fn long_run_gqa_shape_bit_for_bit() {
    let mut rng = ChaCha8Rng::seed_from_u64(77);
    for kernel in KvKernel::supported() {
        for (bits, hd, rows, nq) in [
            (Bits::Int4, 64usize, 4099usize, 3usize),
            (Bits::Int2, 64, 4099, 3),
            (Bits::Int8, 64, 4099, 3),
            (Bits::Int4, 128, 1000, 2),
            (Bits::Int2, 32, 777, 5),
            (Bits::Int8, 128, 600, 8),
            (Bits::Int4, 32, 530, 8),
        ] {
            let pk = bits.packed_len(hd);
            let codes: Vec<u8> = (0..rows * pk).map(|_| rng.gen()).collect();
            let (g, offset) = (32, 4);
            let groups = (offset + rows).div_ceil(g);
            let (ks, kz) = params(&mut rng, groups * hd, "random");
            let q: Vec<f32> = (0..nq * hd).map(|_| rng.gen_range(-2.0..2.0f32)).collect();
            let mut fold = vec![0.0f32; nq * hd];
            let (mut a, mut b) = (vec![0.0f32; nq * rows], vec![0.0f32; nq * rows]);
            let run = KRun {
                codes: &codes,
                hd,
                scale: &ks,
                zero: &kz,
                group: g,
                offset,
                bits,
            };
            dot_codes_groups_multi_with(kernel, &run, &q, &mut fold, &mut a, rows);
            dot_codes_groups_with(kernel, &run, &q, &mut fold, &mut b, rows);
            let ctx = format!("{} {bits:?} hd={hd} rows={rows} nq={nq}", kernel.name());
            assert!(bits_eq(&a, &b), "{ctx} long dot");
            let (vs, vz) = params(&mut rng, rows, "random");
            let p: Vec<f32> = (0..nq * rows)
                .map(|_| rng.gen_range(0.0..1e-3f32))
                .collect();
            let (mut a, mut b) = (vec![0.0f32; nq * hd], vec![0.0f32; nq * hd]);
            let (mut ba, mut bb) = (vec![0.0f32; nq], vec![0.0f32; nq]);
            let run = VRun {
                codes: &codes,
                scale: &vs,
                zero: &vz,
                bits,
            };
            axpy_codes_rows_multi_with(kernel, &run, &p, rows, &mut a, &mut ba);
            axpy_codes_rows_with(kernel, &run, &p, rows, &mut b, &mut bb);
            assert!(
                bits_eq(&a, &b) && bits_eq(&ba, &bb),
                "{} {bits:?} long axpy",
                kernel.name()
            );
        }
    }
}
