//! Kernel tests against the scalar reference (`tinygpt_reference::quant`) and the scalar twins.

use super::*;
use tinygpt_reference::quant as r;

fn rbits(b: Bits) -> r::Bits {
    match b {
        Bits::Int8 => r::Bits::Int8,
        Bits::Int4 => r::Bits::Int4,
        Bits::Int2 => r::Bits::Int2,
    }
}

#[test]
fn constants_match_reference() {
    assert_eq!(MIN_SCALE, r::MIN_SCALE);
    assert_eq!((INT8_QMIN, INT8_QMAX), (-128, 127));
    assert_eq!((INT4_QMIN, INT4_QMAX), (-8, 7));
    assert_eq!((INT2_QMIN, INT2_QMAX), (-2, 1));
}

#[test]
fn int4_layout_literal_bytes() {
    // q = [-8, 7, 0, -1, 3, 5] → u = [0, 15, 8, 7, 11, 13]: low nibble = even element.
    let x = [-8.0f32, 7.0, 0.0, -1.0, 3.0, 5.0];
    let s = [1.0f32; 6];
    let z = [-8.0f32; 6];
    let mut out = [0xAAu8; 3];
    quantize_channels(&x, &s, &z, Bits::Int4, &mut out);
    assert_eq!(out, [0xF0, 0x78, 0xDB]);
    let mut back = [0.0f32; 6];
    dequantize_channels(&out, &s, &z, Bits::Int4, &mut back);
    assert_eq!(back, x);
}

#[test]
fn int2_layout_literal_bytes() {
    // q = [-2, 1, 0, -1, 1, -2, 0, 0] → u = [0, 3, 2, 1, 3, 0, 2, 2]: element 4j + i in
    // bits 2i..2i+2 of byte j → byte 0 = 0 | 3<<2 | 2<<4 | 1<<6 = 0x6C,
    // byte 1 = 3 | 0<<2 | 2<<4 | 2<<6 = 0xA3.
    let x = [-2.0f32, 1.0, 0.0, -1.0, 1.0, -2.0, 0.0, 0.0];
    let s = [1.0f32; 8];
    let z = [-2.0f32; 8];
    let mut out = [0x55u8; 2];
    quantize_channels(&x, &s, &z, Bits::Int2, &mut out);
    assert_eq!(out, [0x6C, 0xA3]);
    let mut back = [0.0f32; 8];
    dequantize_channels(&out, &s, &z, Bits::Int2, &mut back);
    assert_eq!(back, x);
    let mut simd = [0.0f32; 8];
    dequantize_channels_simd(&out, &s, &z, Bits::Int2, &mut simd);
    assert_eq!(simd, x);
    // A partial last byte keeps its unused bit pairs zero.
    let mut out = [0xFFu8; 2];
    quantize_channels(&x[..6], &s[..6], &z[..6], Bits::Int2, &mut out);
    assert_eq!(out, [0x6C, 0x03]);
}

#[test]
fn crumb_identity_all_codes_all_positions() {
    for u in 0..4u8 {
        for pos in 0..4usize {
            let mut b = [0xFFu8; 1];
            put(&mut b, pos, u, Bits::Int2);
            for other in 0..4 {
                let want = if other == pos { u } else { 3 };
                assert_eq!(get(&b, other, Bits::Int2), want, "u={u} pos={pos}");
            }
        }
    }
}

#[test]
fn nibble_identity_all_codes_both_positions() {
    for u in 0..16u8 {
        for other in 0..16u8 {
            let mut b = [0u8; 1];
            put(&mut b, 0, u, Bits::Int4);
            put(&mut b, 1, other, Bits::Int4);
            assert_eq!((get(&b, 0, Bits::Int4), get(&b, 1, Bits::Int4)), (u, other));
            assert_eq!(b[0], u | (other << 4));
        }
    }
}

#[test]
fn matches_reference_bitwise_on_odd_lengths() {
    let mut seed = 0x1234_5678u32;
    let mut rnd = || {
        seed ^= seed << 13;
        seed ^= seed >> 17;
        seed ^= seed << 5;
        (seed as f32 / u32::MAX as f32) * 8.0 - 4.0
    };
    for bits in [Bits::Int8, Bits::Int4, Bits::Int2] {
        for n in [1usize, 2, 3, 7, 17, 32, 33] {
            let x: Vec<f32> = (0..n).map(|_| rnd()).collect();
            let mut out = vec![0u8; bits.packed_len(n)];
            let (s, z) = quantize_token(&x, bits, &mut out);
            let (codes, a) = r::quantize_row(&x, rbits(bits));
            assert_eq!((s, z), (a.scale, a.zero), "bits={bits:?} n={n}");
            assert_eq!(
                out,
                r::pack_codes(&codes, rbits(bits)),
                "bits={bits:?} n={n}"
            );
            let mut back = vec![0.0f32; n];
            dequantize_token(&out, s, z, bits, &mut back);
            for j in 0..n {
                let want = a.dequantize(codes[j], rbits(bits));
                assert_eq!(
                    back[j].to_bits(),
                    want.to_bits(),
                    "bits={bits:?} n={n} j={j}"
                );
            }
        }
    }
}

fn xorshift(seed: u32) -> impl FnMut() -> u32 {
    let mut s = seed;
    move || {
        s ^= s << 13;
        s ^= s >> 17;
        s ^= s << 5;
        s
    }
}

/// Every fused kernel against its scalar twin at odd lengths, all codes and both
/// nibble positions exercised (random bytes hit all 16/256 codes at these sizes).
#[test]
fn fused_kernels_match_scalar_twins() {
    let mut rnd = xorshift(0x9e37_79b9);
    for bits in [Bits::Int8, Bits::Int4, Bits::Int2] {
        for n in [
            1usize, 2, 3, 6, 7, 8, 9, 15, 16, 17, 18, 24, 31, 32, 33, 34, 48, 64, 65,
        ] {
            let p = bits.packed_len(n);
            let mut codes: Vec<u8> = (0..p).map(|_| rnd() as u8).collect();
            if bits == Bits::Int4 && n % 2 == 1 {
                codes[p - 1] &= 0x0f; // as the quantiser writes it
            }
            if bits == Bits::Int2 && n % 4 != 0 {
                codes[p - 1] &= (1u8 << (2 * (n % 4))) - 1;
            }
            let w: Vec<f32> = (0..n)
                .map(|_| rnd() as f32 / u32::MAX as f32 - 0.5)
                .collect();
            let ctx = format!("bits={bits:?} n={n}");
            // dot: f64 oracle, then the scalar twin within a summation-order bound.
            let exact: f64 = (0..n)
                .map(|j| get(&codes, j, bits) as f64 * w[j] as f64)
                .sum();
            let mag: f64 = (0..n)
                .map(|j| (get(&codes, j, bits) as f64 * w[j] as f64).abs())
                .sum();
            let bound = 1e-6 * mag.max(1.0);
            let (fused, scalar) = (
                dot_codes(&codes, &w, bits),
                dot_codes_scalar(&codes, &w, bits),
            );
            assert!(
                (fused as f64 - exact).abs() <= bound,
                "{ctx}: {fused} vs {exact}"
            );
            assert!(
                (scalar as f64 - exact).abs() <= bound,
                "{ctx}: {scalar} vs {exact}"
            );
            // axpy: one FMA per element either way, so equal up to FMA rounding.
            let acc0: Vec<f32> = (0..n).map(|j| j as f32 * 0.25 - 1.0).collect();
            let (mut a, mut b) = (acc0.clone(), acc0.clone());
            axpy_codes(0.37, &codes, &mut a, bits);
            axpy_codes_scalar(0.37, &codes, &mut b, bits);
            for j in 0..n {
                let want = acc0[j] as f64 + 0.37f32 as f64 * get(&codes, j, bits) as f64;
                assert!(
                    (a[j] as f64 - want).abs() <= 1e-6 * want.abs().max(1.0),
                    "{ctx} j={j}"
                );
                assert!(
                    (a[j] - b[j]).abs() <= 1e-6 * b[j].abs().max(1.0),
                    "{ctx} j={j}"
                );
            }
            // dequantise: bit-identical to the scalar path.
            let s: Vec<f32> = (0..n).map(|j| 0.01 + j as f32 * 1e-3).collect();
            let z: Vec<f32> = (0..n).map(|j| -1.0 + j as f32 * 0.1).collect();
            let (mut d0, mut d1) = (vec![0.0f32; n], vec![0.0f32; n]);
            dequantize_channels(&codes, &s, &z, bits, &mut d0);
            dequantize_channels_simd(&codes, &s, &z, bits, &mut d1);
            let bitsv = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
            assert_eq!(bitsv(&d0), bitsv(&d1), "{ctx}");
        }
    }
}

/// `dot_codes(row, fold(q)) + bias` equals `q · dequantise(row)` up to summation order.
#[test]
fn folded_dot_matches_dequantised_dot() {
    let mut rnd = xorshift(0x0bad_cafe);
    let mut f = move || rnd() as f32 / u32::MAX as f32 * 2.0 - 1.0;
    for bits in [Bits::Int8, Bits::Int4, Bits::Int2] {
        for n in [2usize, 6, 18, 32, 34] {
            let x: Vec<f32> = (0..n)
                .map(|c| f() + if c == 1 { 12.0 } else { 0.0 })
                .collect();
            let q: Vec<f32> = (0..n).map(|_| f() * 1.5).collect();
            let (scale, zero): (Vec<f16>, Vec<f16>) =
                (0..n).map(|c| params(x[c] - 0.7, x[c] + 0.4, bits)).unzip();
            let (s32, z32): (Vec<f32>, Vec<f32>) = scale
                .iter()
                .zip(&zero)
                .map(|(s, z)| (s.to_f32(), z.to_f32()))
                .unzip();
            let mut codes = vec![0u8; bits.packed_len(n)];
            quantize_channels(&x, &s32, &z32, bits, &mut codes);
            let mut k = vec![0.0f32; n];
            dequantize_channels(&codes, &s32, &z32, bits, &mut k);
            let want: f64 = q.iter().zip(&k).map(|(a, b)| *a as f64 * *b as f64).sum();
            let mag: f64 = q
                .iter()
                .zip(&k)
                .map(|(a, b)| (*a as f64 * *b as f64).abs())
                .sum();
            let mut qs = vec![0.0f32; n];
            let bias = fold_channels(&q, &scale, &zero, &mut qs);
            let got = dot_codes(&codes, &qs, bits) + bias;
            assert!(
                (got as f64 - want).abs() <= 1e-6 * mag.max(1.0),
                "bits={bits:?} n={n}: {got} vs {want}"
            );
        }
    }
}

/// The run-level kernels (head dims 32/64/128 compile to their own specialisations,
/// the rest to the generic one) against per-row scalar twins: full and partial
/// blocks of 8 (scores) and 4 (values), zero weights, several queries.
#[test]
fn run_kernels_match_scalar_twins() {
    let mut rnd = xorshift(0x1357_9bdf);
    let mut f = move || rnd() as f32 / u32::MAX as f32 * 2.0 - 1.0;
    for bits in [Bits::Int8, Bits::Int4, Bits::Int2] {
        for hd in [2usize, 6, 18, 32, 34, 64, 128] {
            let p = bits.packed_len(hd);
            for rows in [1usize, 3, 4, 7, 8, 9, 16, 19] {
                for nq in [1usize, 3] {
                    let ctx = format!("bits={bits:?} hd={hd} rows={rows} nq={nq}");
                    let codes: Vec<u8> =
                        (0..rows * p).map(|_| (f() * 1000.0) as i32 as u8).collect();
                    // Keys: fold a group's parameters into nq queries, then score.
                    let (scale, zero): (Vec<f16>, Vec<f16>) = (0..hd)
                        .map(|_| {
                            (
                                f16::from_f32(0.01 + f().abs() * 0.1),
                                f16::from_f32(f() * 5.0),
                            )
                        })
                        .unzip();
                    let q: Vec<f32> = (0..nq * hd).map(|_| f() * 1.5).collect();
                    let (mut qs, mut qs2) = (vec![0.0f32; nq * hd], vec![0.0f32; nq * hd]);
                    let mut bias = vec![0.0f32; nq];
                    for (j, bj) in bias.iter_mut().enumerate() {
                        let r = j * hd..(j + 1) * hd;
                        *bj = fold_channels(&q[r.clone()], &scale, &zero, &mut qs[r.clone()]);
                        let b2 =
                            fold_channels_scalar(&q[r.clone()], &scale, &zero, &mut qs2[r.clone()]);
                        assert_eq!(qs[r.clone()], qs2[r.clone()], "{ctx}");
                        let mag: f32 = q[r.clone()]
                            .iter()
                            .zip(&zero)
                            .map(|(a, z)| (a * z.to_f32()).abs())
                            .sum();
                        assert!((*bj - b2).abs() <= 1e-6 * mag.max(1.0), "{ctx}");
                    }
                    let stride = rows + 5;
                    let mut out = vec![f32::NAN; nq * stride];
                    dot_codes_rows(&codes, &qs, &bias, bits, &mut out, stride);
                    for j in 0..nq {
                        for r in 0..rows {
                            let row = &codes[r * p..(r + 1) * p];
                            let w = &qs[j * hd..(j + 1) * hd];
                            let want = dot_codes_scalar(row, w, bits) + bias[j];
                            let mag: f32 = (0..hd)
                                .map(|c| (get(row, c, bits) as f32 * w[c]).abs())
                                .sum::<f32>()
                                + bias[j].abs();
                            let got = out[j * stride + r];
                            assert!(
                                (got - want).abs() <= 1e-6 * mag.max(1.0),
                                "{ctx} j={j} r={r}: {got} vs {want}"
                            );
                        }
                    }
                    // Values: per-row (scale, zero), some zero weights.
                    let (vs, vz): (Vec<f16>, Vec<f16>) = (0..rows)
                        .map(|_| {
                            (
                                f16::from_f32(0.01 + f().abs() * 0.3),
                                f16::from_f32(f() * 2.0),
                            )
                        })
                        .unzip();
                    let probs: Vec<f32> = (0..nq * stride)
                        .map(|i| if i % 5 == 2 { 0.0 } else { f().abs() })
                        .collect();
                    let mut acc = vec![0.0f32; nq * hd];
                    let mut vb = vec![0.0f32; nq];
                    axpy_codes_rows(
                        &VRun {
                            codes: &codes,
                            scale: &vs,
                            zero: &vz,
                            bits,
                        },
                        &probs,
                        stride,
                        &mut acc,
                        &mut vb,
                    );
                    for j in 0..nq {
                        let mut want = vec![0.0f64; hd];
                        let mut mag = vec![0.0f64; hd];
                        for r in 0..rows {
                            let pw = probs[j * stride + r] as f64;
                            for c in 0..hd {
                                let x = get(&codes[r * p..], c, bits) as f64
                                    * vs[r].to_f32() as f64
                                    + vz[r].to_f32() as f64;
                                want[c] += pw * x;
                                mag[c] += (pw * x).abs() + (pw * vz[r].to_f32() as f64).abs();
                            }
                        }
                        for c in 0..hd {
                            let got = (acc[j * hd + c] + vb[j]) as f64;
                            assert!(
                                (got - want[c]).abs() <= 1e-5 * mag[c].max(1.0),
                                "{ctx} j={j} c={c}: {got} vs {}",
                                want[c]
                            );
                        }
                    }
                }
            }
        }
    }
}
