//! The `scalar` variant: the engine's scalar twins of every kernel, plain loops in the
//! reference's order, one row at a time. What the others are tested against in the
//! engine's own tests, and themselves tested bit for bit against the reference's twins
//! (`tinygpt_reference::ggml_dot`, `ggml_kdot`: `tests/qdot_dispatch.rs`,
//! `tests/kquant_dispatch.rs`, `tests/float_dispatch.rs`). Not a speed target.
//!
//! * interleaved types (Q8_0, Q4_0, Q4_1, Q5_0, IQ4_NL): [`group_dot`], [`group_tokens`];
//! * row types against Q8_K (the K-quants, IQ4_XS): [`k4_row`] (Q4_K, Q5_K), [`q6_k_row`],
//!   [`iq4_xs_row`], [`q2_k_row`], [`q3_k_row`]: per super-block the exact integer sums
//!   `isum = Σ_k s_k · Σ_i c_i · q8_i` (and `msum = Σ_k m_k · bsums_k` for the types with
//!   minimums), then `acc += isum·(d_w·d_x)` (`− msum·(dmin_w·d_x)`), separate f32
//!   multiplies and adds;
//! * Q5_1 against the 8-bit blocks of 32: [`q5_1_row`];
//! * floats: [`float_rows`] in the order of [`super::float`] ([`float_row`]: one row).

use super::blocks::{
    f16_at, iq4_xs_scale, k4_codes, nibbles, q3_k_codes, q3_k_scales, q5_codes, q6_k_codes,
    scale_min_k4, IQ4_VALUES, QK_K,
};
use super::float::{finish, madd, tail};
use super::packed::{code_pos, q5_bits_pos, qs_bytes};
use super::{Group, QuantizedActs, GROUP, Q8K, QK, TOKENS};
use crate::dtype::DType;
use crate::ops::simd::Elem;

/// The eight rows' codes of one 8-row block as signed values (Q4_0: `nibble − 8`;
/// Q5_0: `(nibble | fifth bit << 4) − 16`; IQ4_NL: the level `K[nibble]`).
#[inline(always)]
fn unpack_block(dtype: DType, qs: &[u8], w: &mut [[i8; QK]; GROUP]) {
    for (k, wk) in w.iter_mut().enumerate() {
        match dtype {
            DType::Q8_0 => {
                for (i, v) in wk.iter_mut().enumerate() {
                    *v = qs[code_pos(dtype, k, i)] as i8;
                }
            }
            DType::Q5_0 => {
                for (i, v) in wk.iter_mut().enumerate() {
                    let byte = qs[code_pos(dtype, k, i)];
                    let nib = if i < 16 { byte & 0x0F } else { byte >> 4 };
                    let at = q5_bits_pos(k, i / 16);
                    let bits = u16::from_le_bytes([qs[at], qs[at + 1]]);
                    let fifth = ((bits >> (i % 16)) & 1) as u8;
                    *v = (nib | (fifth << 4)) as i8 - 16;
                }
            }
            DType::IQ4_NL => {
                let base = code_pos(dtype, k, 0);
                let (lo, hi) = wk.split_at_mut(16);
                for ((l, h), &byte) in lo.iter_mut().zip(hi).zip(&qs[base..base + 16]) {
                    *l = IQ4_VALUES[(byte & 0x0F) as usize];
                    *h = IQ4_VALUES[(byte >> 4) as usize];
                }
            }
            DType::Q4_0 | DType::Q4_1 => {
                let off = if dtype == DType::Q4_0 { 8 } else { 0 };
                let base = code_pos(dtype, k, 0);
                let (lo, hi) = wk.split_at_mut(16);
                for ((l, h), &byte) in lo.iter_mut().zip(hi).zip(&qs[base..base + 16]) {
                    *l = (byte & 0x0F) as i8 - off;
                    *h = (byte >> 4) as i8 - off;
                }
            }
            rows_or_float!() => unreachable!("{dtype} is not interleaved"),
        }
    }
}

/// The interleaved types, eight rows × one token: per row, per block, the reference's
/// steps (`tinygpt_reference::ggml_dot`) in plain loops.
pub fn group_dot(dtype: DType, g: &Group, a: &QuantizedActs, out: &mut [f32; 8]) {
    let qsb = qs_bytes(dtype);
    let mut acc = [0.0f32; GROUP];
    let mut w = [[0i8; QK]; GROUP];
    for b in 0..g.nb {
        unpack_block(dtype, &g.qs[b * qsb..(b + 1) * qsb], &mut w);
        let q: &[i8; QK] = a.q[b * QK..(b + 1) * QK].try_into().expect("one block");
        for (k, acc_k) in acc.iter_mut().enumerate() {
            let isum: i32 = w[k]
                .iter()
                .zip(q)
                .map(|(&wi, &qi)| wi as i32 * qi as i32)
                .sum();
            let dw = f16_at(g.d, b * 16 + k * 2);
            let t = isum as f32 * (dw * a.d[b]);
            *acc_k += if dtype == DType::Q4_1 {
                t + f16_at(g.m, b * 16 + k * 2) * a.s[b]
            } else {
                t
            };
        }
    }
    *out = acc;
}

/// The interleaved types, eight rows × [`TOKENS`] tokens: [`group_dot`]'s steps for every
/// token, each 8-row block unpacked once for all of them (equal to [`group_dot`] per
/// token, bit for bit).
pub fn group_tokens(
    dtype: DType,
    g: &Group,
    acts: &[&QuantizedActs; TOKENS],
    out: &mut [[f32; GROUP]; TOKENS],
    n: usize,
) {
    by_live_tokens!(n, acts, |T, sub| { tokens::<T>(dtype, g, sub, out) })
}

/// [`group_tokens`] for its first `T` tokens (results in `out[..T]`).
fn tokens<const T: usize>(
    dtype: DType,
    g: &Group,
    acts: &[&QuantizedActs; T],
    out: &mut [[f32; GROUP]; TOKENS],
) {
    let qsb = qs_bytes(dtype);
    let mut acc = [[0.0f32; GROUP]; T];
    let mut w = [[0i8; QK]; GROUP];
    for b in 0..g.nb {
        unpack_block(dtype, &g.qs[b * qsb..(b + 1) * qsb], &mut w);
        for (a, acc_t) in acts.iter().zip(acc.iter_mut()) {
            let q: &[i8; QK] = a.q[b * QK..(b + 1) * QK].try_into().expect("one block");
            for (k, acc_k) in acc_t.iter_mut().enumerate() {
                let isum: i32 = w[k]
                    .iter()
                    .zip(q)
                    .map(|(&wi, &qi)| wi as i32 * qi as i32)
                    .sum();
                let dw = f16_at(g.d, b * 16 + k * 2);
                let t = isum as f32 * (dw * a.d[b]);
                *acc_k += if dtype == DType::Q4_1 {
                    t + f16_at(g.m, b * 16 + k * 2) * a.s[b]
                } else {
                    t
                };
            }
        }
    }
    out[..T].copy_from_slice(&acc);
}

/// A super-block of a row type as the scalar rows read it: signed codes in value order,
/// each sub-block's integer scale (and minimum), and the f16 scales widened.
struct SuperBlock {
    codes: [i8; QK_K],
    /// Values per sub-block: 16 or 32.
    sub: usize,
    scales: [i32; 16],
    /// The sub-blocks' minimums, met by the activation's group sums (`bsums`).
    mins: Option<[i32; 16]>,
    d: f32,
    dmin: f32,
}

/// One row of `dtype` super-blocks (decoded by `decode`) against `T` tokens' Q8_K
/// activations (each with as many super-blocks: asserted).
fn super_rows<const T: usize>(
    dtype: DType,
    row: &[u8],
    ks: &[&Q8K; T],
    decode: fn(&[u8]) -> SuperBlock,
) -> [f32; T] {
    let bytes = dtype.block_bytes();
    let nb = row.len() / bytes;
    assert_eq!(row.len(), nb * bytes, "whole super-blocks");
    for k in ks {
        assert!(k.d.len() >= nb && k.q.len() >= nb * QK_K && k.bsums.len() >= nb * 16);
    }
    let mut acc = [0.0f32; T];
    for (b, blk) in row.chunks_exact(bytes).enumerate() {
        let sb = decode(blk);
        for (acc, k) in acc.iter_mut().zip(ks) {
            let q8 = &k.q[b * QK_K..(b + 1) * QK_K];
            let bsums = &k.bsums[b * 16..(b + 1) * 16];
            let (mut isum, mut msum) = (0i32, 0i32);
            let subs = sb.codes.chunks_exact(sb.sub).zip(q8.chunks_exact(sb.sub));
            for (j, (c, q)) in subs.enumerate() {
                let s: i32 = c.iter().zip(q).map(|(&c, &q)| c as i32 * q as i32).sum();
                isum += sb.scales[j] * s;
                if let Some(m) = &sb.mins {
                    let per = sb.sub / 16;
                    let bs: i32 = bsums[j * per..(j + 1) * per]
                        .iter()
                        .map(|&s| s as i32)
                        .sum();
                    msum += m[j] * bs;
                }
            }
            let dx = k.d[b];
            *acc += match sb.mins {
                Some(_) => isum as f32 * (sb.d * dx) - msum as f32 * (sb.dmin * dx),
                None => isum as f32 * (sb.d * dx),
            };
        }
    }
    acc
}

/// Q4_K (`FIVE = false`) or Q5_K (`FIVE = true`) row · `T` tokens: eight sub-blocks of 32
/// with six-bit scales and minimums.
pub fn k4_row<const T: usize, const FIVE: bool>(row: &[u8], ks: &[&Q8K; T]) -> [f32; T] {
    let dtype = if FIVE { DType::Q5_K } else { DType::Q4_K };
    super_rows(dtype, row, ks, |blk| {
        let (mut scales, mut mins) = ([0i32; 16], [0i32; 16]);
        for j in 0..8 {
            let (s, m) = scale_min_k4(j, &blk[4..16]);
            (scales[j], mins[j]) = (s.into(), m.into());
        }
        SuperBlock {
            codes: k4_codes(blk, FIVE).map(|c| c as i8),
            sub: 32,
            scales,
            mins: Some(mins),
            d: f16_at(blk, 0),
            dmin: f16_at(blk, 2),
        }
    })
}

/// Q6_K row · `T` tokens: sixteen sub-blocks of 16, signed eight-bit scales, codes − 32.
pub fn q6_k_row<const T: usize>(row: &[u8], ks: &[&Q8K; T]) -> [f32; T] {
    super_rows(DType::Q6_K, row, ks, |blk| SuperBlock {
        codes: q6_k_codes(blk).map(|c| c as i8 - 32),
        sub: 16,
        scales: std::array::from_fn(|k| (blk[192 + k] as i8).into()),
        mins: None,
        d: f16_at(blk, 208),
        dmin: 0.0,
    })
}

/// IQ4_XS row · `T` tokens: eight sub-blocks of 32, scales `ls − 32`, the IQ4 levels.
pub fn iq4_xs_row<const T: usize>(row: &[u8], ks: &[&Q8K; T]) -> [f32; T] {
    super_rows(DType::IQ4_XS, row, ks, |blk| {
        let mut codes = [0i8; QK_K];
        for (ib, c) in codes.chunks_exact_mut(32).enumerate() {
            for (c, n) in c.iter_mut().zip(nibbles(&blk[8 + 16 * ib..])) {
                *c = IQ4_VALUES[n as usize];
            }
        }
        let mut scales = [0i32; 16];
        for (ib, s) in scales[..8].iter_mut().enumerate() {
            *s = iq4_xs_scale(blk, ib) - 32;
        }
        SuperBlock {
            codes,
            sub: 32,
            scales,
            mins: None,
            d: f16_at(blk, 0),
            dmin: 0.0,
        }
    })
}

/// Q2_K row · `T` tokens: sixteen sub-blocks of 16, four-bit scales (low nibble of
/// `scales[k]`) and minimums (high nibble), two-bit codes.
pub fn q2_k_row<const T: usize>(row: &[u8], ks: &[&Q8K; T]) -> [f32; T] {
    super_rows(DType::Q2_K, row, ks, |blk| SuperBlock {
        codes: super::blocks::two_bit_codes(&blk[16..80]).map(|c| c as i8),
        sub: 16,
        scales: std::array::from_fn(|k| (blk[k] & 0x0F).into()),
        mins: Some(std::array::from_fn(|k| (blk[k] >> 4).into())),
        d: f16_at(blk, 80),
        dmin: f16_at(blk, 82),
    })
}

/// Q3_K row · `T` tokens: sixteen sub-blocks of 16, signed six-bit scales, codes −4..4.
pub fn q3_k_row<const T: usize>(row: &[u8], ks: &[&Q8K; T]) -> [f32; T] {
    super_rows(DType::Q3_K, row, ks, |blk| SuperBlock {
        codes: q3_k_codes(blk),
        sub: 16,
        scales: q3_k_scales(&blk[96..108]),
        mins: None,
        d: f16_at(blk, 108),
        dmin: 0.0,
    })
}

/// Q5_1 row · `T` tokens' 8-bit blocks of 32 (each with as many blocks: asserted):
/// `acc += isum·(d_w·d_x) + m_w·s_x` per block.
pub fn q5_1_row<const T: usize>(row: &[u8], acts: &[&QuantizedActs; T]) -> [f32; T] {
    let bytes = DType::Q5_1.block_bytes();
    let nb = row.len() / bytes;
    for a in acts {
        assert!(a.d.len() >= nb && a.s.len() >= nb && a.q.len() >= nb * QK);
    }
    std::array::from_fn(|t| {
        let a = acts[t];
        let mut acc = 0.0f32;
        for (b, blk) in row.chunks_exact(bytes).enumerate() {
            let q = &a.q[b * QK..(b + 1) * QK];
            let isum: i32 = q5_codes(blk, 4)
                .iter()
                .zip(q)
                .map(|(&c, &q)| c as i32 * q as i32)
                .sum();
            acc += isum as f32 * (f16_at(blk, 0) * a.d[b]) + f16_at(blk, 2) * a.s[b];
        }
        acc
    })
}

/// `out[j] = row (r0 + j) · x` for float rows of `cols` values in `w`: [`float_row`] per
/// row (`streamed` changes nothing here).
pub fn float_rows<E: Elem>(
    w: &[E],
    cols: usize,
    r0: usize,
    x: &[f32],
    out: &mut [f32],
    _streamed: bool,
) {
    for (j, o) in out.iter_mut().enumerate() {
        let r = r0 + j;
        *o = float_row(&w[r * cols..(r + 1) * cols], x);
    }
}

/// One float row's dot product in the order of [`super::float`], with plain loops.
pub fn float_row<E: Elem>(row: &[E], x: &[f32]) -> f32 {
    let cols = row.len();
    let n8 = cols - cols % 8;
    let mut l = [0.0f32; 8];
    for (wc, xc) in row[..n8].chunks_exact(8).zip(x[..n8].chunks_exact(8)) {
        for ((li, wi), xi) in l.iter_mut().zip(wc).zip(xc) {
            *li = madd(wi.to_f32(), *xi, *li);
        }
    }
    finish(l, tail(row, x, n8))
}
