//! KIVI affine quantisation kernels (docs/design.md §2); the scalar oracle is
//! `tinygpt_reference::quant`, and these must agree with it bit for bit.
//!
//! ```text
//!     scale = f16(max(1e-5, (hi - lo) / (qmax - qmin)))     zero = f16(lo)   (saturating)
//!     q     = clamp(round_ties_even((x - zero) / scale + qmin), qmin, qmax)
//!     x'    = (q - qmin) * scale + zero                     (f32, no FMA)
//! ```
//!
//! ## Code layout
//! Codes are stored offset-binary, `u = q - qmin` (int8: one byte, `u ∈ [0, 255]`;
//! int4: one nibble, `u ∈ [0, 15]`), so dequantisation is `u * scale + zero`.
//! int4 packs along the head dimension: element `2j` is the **low** nibble of byte `j`,
//! element `2j + 1` the **high** nibble. int2 (`u ∈ [0, 3]`) packs four per byte: element
//! `4j + i` is bits `2i..2i + 2` of byte `j`. A slice of `n` codes takes
//! [`Bits::packed_len`]`(n)` bytes.
//!
//! Scale and zero are kept as `f16` and converted to f32 before any arithmetic. Values
//! beyond f16's range saturate the parameters to `±65504` instead of overflowing (see
//! the reference's module docs for the full list of edge cases).

use half::{f16, slice::HalfFloatSliceExt};
use wide::{f32x8, i32x8, u16x8, u32x8, u8x16};

/// The code width and its ranges are types shared with the reference (one definition,
/// `tinygpt-types`); every computation below is the engine's own.
pub use tinygpt_types::kv::{
    Bits, INT2_QMAX, INT2_QMIN, INT4_QMAX, INT4_QMIN, INT8_QMAX, INT8_QMIN,
};
/// Lower bound of every scale, before the f16 rounding.
pub const MIN_SCALE: f32 = 1e-5;

pub use crate::ops::simd::f16_saturating;

/// Stored `(scale, zero)` for a slice with minimum `lo` and maximum `hi`.
#[inline]
pub fn params(lo: f32, hi: f32, bits: Bits) -> (f16, f16) {
    let levels = (bits.qmax() - bits.qmin()) as f32;
    let scale = f32::max(MIN_SCALE, (hi - lo) / levels);
    (f16_saturating(scale), f16_saturating(lo))
}

/// `(min, max)` of a slice (NaNs ignored).
#[inline]
pub fn min_max(x: &[f32]) -> (f32, f32) {
    x.iter()
        .fold((f32::INFINITY, f32::NEG_INFINITY), |(lo, hi), &v| {
            (lo.min(v), hi.max(v))
        })
}

/// Offset code `u = q - qmin` of one value, given f32 copies of the stored parameters.
#[inline]
fn code(x: f32, scale: f32, zero: f32, bits: Bits) -> u8 {
    let qmin = bits.qmin() as f32;
    let q = ((x - zero) / scale + qmin).round_ties_even();
    (q.clamp(qmin, bits.qmax() as f32) - qmin) as u8
}

/// Writes code `u` (already offset) at element `j` of a packed row.
#[inline]
fn put(out: &mut [u8], j: usize, u: u8, bits: Bits) {
    match bits {
        Bits::Int8 => out[j] = u,
        Bits::Int4 => {
            let b = &mut out[j / 2];
            if j.is_multiple_of(2) {
                *b = (*b & 0xf0) | u;
            } else {
                *b = (*b & 0x0f) | (u << 4);
            }
        }
        Bits::Int2 => {
            let shift = 2 * (j % 4);
            let b = &mut out[j / 4];
            *b = (*b & !(0x03 << shift)) | (u << shift);
        }
    }
}

/// Offset code of element `j` of a packed row.
#[inline]
pub fn get(codes: &[u8], j: usize, bits: Bits) -> u8 {
    match bits {
        Bits::Int8 => codes[j],
        Bits::Int4 => {
            let b = codes[j / 2];
            if j.is_multiple_of(2) {
                b & 0x0f
            } else {
                b >> 4
            }
        }
        Bits::Int2 => (codes[j / 4] >> (2 * (j % 4))) & 0x03,
    }
}

/// Clears the last byte of a packed row whose codes do not fill it, so the unused high
/// bits are zero (as [`pack_codes`](tinygpt_reference::quant::pack_codes) leaves them).
#[inline]
fn clear_partial_byte(out: &mut [u8], n: usize, bits: Bits) {
    let partial = match bits {
        Bits::Int8 => false,
        Bits::Int4 => !n.is_multiple_of(2),
        Bits::Int2 => !n.is_multiple_of(4),
    };
    if partial {
        out[n / if bits == Bits::Int4 { 2 } else { 4 }] = 0;
    }
}

/// Quantises one token slice (a V row of one KV head) with parameters fitted to it.
/// `out` holds `bits.packed_len(x.len())` bytes.
pub fn quantize_token(x: &[f32], bits: Bits, out: &mut [u8]) -> (f16, f16) {
    debug_assert_eq!(out.len(), bits.packed_len(x.len()));
    let (lo, hi) = min_max(x);
    let (scale, zero) = params(lo, hi, bits);
    let (s, z) = (scale.to_f32(), zero.to_f32());
    clear_partial_byte(out, x.len(), bits);
    for (j, &v) in x.iter().enumerate() {
        put(out, j, code(v, s, z, bits), bits);
    }
    (scale, zero)
}

/// Quantises one row with per-element parameters (a K row of one KV head: one
/// `(scale, zero)` per channel). `scale`/`zero` are f32 copies of the stored f16 values.
pub fn quantize_channels(x: &[f32], scale: &[f32], zero: &[f32], bits: Bits, out: &mut [u8]) {
    debug_assert_eq!(scale.len(), x.len());
    debug_assert_eq!(zero.len(), x.len());
    debug_assert_eq!(out.len(), bits.packed_len(x.len()));
    clear_partial_byte(out, x.len(), bits);
    for j in 0..x.len() {
        put(out, j, code(x[j], scale[j], zero[j], bits), bits);
    }
}

/// Dequantises a token slice: `out[j] = u_j * scale + zero`.
pub fn dequantize_token(codes: &[u8], scale: f16, zero: f16, bits: Bits, out: &mut [f32]) {
    debug_assert_eq!(codes.len(), bits.packed_len(out.len()));
    let (s, z) = (scale.to_f32(), zero.to_f32());
    match bits {
        Bits::Int8 => {
            for (o, &u) in out.iter_mut().zip(codes) {
                *o = u as f32 * s + z;
            }
        }
        Bits::Int4 => {
            let mut pairs = out.chunks_exact_mut(2);
            for (o, &b) in (&mut pairs).zip(codes) {
                o[0] = (b & 0x0f) as f32 * s + z;
                o[1] = (b >> 4) as f32 * s + z;
            }
            if let [last] = pairs.into_remainder() {
                *last = (codes[codes.len() - 1] & 0x0f) as f32 * s + z;
            }
        }
        Bits::Int2 => {
            for (j, o) in out.iter_mut().enumerate() {
                *o = get(codes, j, bits) as f32 * s + z;
            }
        }
    }
}

/// Dequantises a row with per-element parameters (f32 copies of the stored f16 values).
pub fn dequantize_channels(codes: &[u8], scale: &[f32], zero: &[f32], bits: Bits, out: &mut [f32]) {
    debug_assert_eq!(codes.len(), bits.packed_len(out.len()));
    debug_assert_eq!(scale.len(), out.len());
    debug_assert_eq!(zero.len(), out.len());
    match bits {
        Bits::Int8 => {
            for j in 0..out.len() {
                out[j] = codes[j] as f32 * scale[j] + zero[j];
            }
        }
        Bits::Int4 | Bits::Int2 => {
            for j in 0..out.len() {
                out[j] = get(codes, j, bits) as f32 * scale[j] + zero[j];
            }
        }
    }
}

// ---------------------------------------------------------------------------------------
// Fused kernels: attention reads codes through these, without a dequantised copy.
//
// Each expands 16 codes at a time into two f32x8 in natural element order (int8: 16
// bytes zero-extended; int4: two groups of 4 bytes, each broadcast to every lane and
// shifted by 4 bits per lane, see `nibbles8`), then a step of 8, then a scalar tail.
// The scalar twins (`*_scalar`) are the executable definition.

/// Packed bytes of `n` codes of width `W`.
#[inline(always)]
const fn packed<const W: u8>(n: usize) -> usize {
    match W {
        4 => n.div_ceil(2),
        2 => n.div_ceil(4),
        _ => n,
    }
}

/// The [`Bits`] of code width `W`.
#[inline(always)]
const fn bits_of<const W: u8>() -> Bits {
    match W {
        4 => Bits::Int4,
        2 => Bits::Int2,
        _ => Bits::Int8,
    }
}

/// Codes of elements `[e, e + 16)` as two f32x8 (`e` a multiple of 8).
#[inline(always)]
fn codes16<const W: u8>(codes: &[u8], e: usize) -> (f32x8, f32x8) {
    match W {
        4 => (
            nibbles8(&codes[e / 2..e / 2 + 4]),
            nibbles8(&codes[e / 2 + 4..e / 2 + 8]),
        ),
        2 => {
            // One broadcast serves both halves: lanes shift by 2k and by 16 + 2k.
            let word = u32::from_le_bytes(codes[e / 4..e / 4 + 4].try_into().expect("4 bytes"));
            let w = u32x8::splat(word);
            let lo = u32x8::new([0, 2, 4, 6, 8, 10, 12, 14]);
            let hi = u32x8::new([16, 18, 20, 22, 24, 26, 28, 30]);
            let mask = u32x8::splat(0x3);
            (
                bytemuck::cast::<u32x8, i32x8>((w >> lo) & mask).round_float(),
                bytemuck::cast::<u32x8, i32x8>((w >> hi) & mask).round_float(),
            )
        }
        _ => {
            let a: [u8; 16] = codes[e..e + 16].try_into().expect("16 codes");
            let bytes = u8x16::new(a);
            (widen_lo(bytes), widen_hi(bytes))
        }
    }
}

/// Codes of elements `[e, e + 8)` as one f32x8 (`e` a multiple of 8).
#[inline(always)]
fn codes8<const W: u8>(codes: &[u8], e: usize) -> f32x8 {
    match W {
        4 => nibbles8(&codes[e / 2..e / 2 + 4]),
        2 => crumbs8(u16::from_le_bytes([codes[e / 4], codes[e / 4 + 1]]) as u32),
        _ => {
            let mut a = [0u8; 16];
            a[..8].copy_from_slice(&codes[e..e + 8]);
            widen_lo(u8x16::new(a))
        }
    }
}

#[inline(always)]
fn code_at<const W: u8>(codes: &[u8], j: usize) -> f32 {
    get(codes, j, bits_of::<W>()) as f32
}

/// 4 packed int4 bytes → their 8 offset codes in element order. Read as a little-endian
/// u32, element `k` is bits `4k..4k + 4` (byte `k / 2`, low nibble first), so one
/// broadcast, a per-lane shift by `4k` and a mask put element `k` in lane `k`.
#[inline(always)]
fn nibbles8(b: &[u8]) -> f32x8 {
    let word = u32::from_le_bytes(b[..4].try_into().expect("4 bytes"));
    let shifts = u32x8::new([0, 4, 8, 12, 16, 20, 24, 28]);
    let codes = (u32x8::splat(word) >> shifts) & u32x8::splat(0xF);
    bytemuck::cast::<u32x8, i32x8>(codes).round_float()
}

/// The low 16 bits of `word` (2 packed int2 bytes, little-endian) → their 8 offset codes
/// in element order: element `k` is bits `2k..2k + 2`, so one broadcast, a per-lane shift
/// by `2k` and a mask put element `k` in lane `k`.
#[inline(always)]
fn crumbs8(word: u32) -> f32x8 {
    let shifts = u32x8::new([0, 2, 4, 6, 8, 10, 12, 14]);
    let codes = (u32x8::splat(word) >> shifts) & u32x8::splat(0x3);
    bytemuck::cast::<u32x8, i32x8>(codes).round_float()
}

#[inline(always)]
fn widen_lo(b: u8x16) -> f32x8 {
    i32x8::from_u16x8(u16x8::from_u8x16_low(b)).round_float()
}

#[inline(always)]
fn widen_hi(b: u8x16) -> f32x8 {
    i32x8::from_u16x8(u16x8::from_u8x16_high(b)).round_float()
}

pub use crate::ops::simd::KvKernel;
use crate::ops::simd::{kv_kernel, load8, reduce8, store8, Elem};

#[cfg(target_arch = "aarch64")]
mod aarch64;
#[cfg(target_arch = "x86_64")]
mod x86;

/// `Σ_j w[j] · u_j` over a packed row of `w.len()` codes (the offset codes themselves,
/// no scale or zero: the caller folded them into `w`).
#[inline]
pub fn dot_codes(codes: &[u8], w: &[f32], bits: Bits) -> f32 {
    debug_assert_eq!(codes.len(), bits.packed_len(w.len()));
    match bits {
        Bits::Int8 => dot_codes_k::<8>(codes, w),
        Bits::Int4 => dot_codes_k::<4>(codes, w),
        Bits::Int2 => dot_codes_k::<2>(codes, w),
    }
}

#[inline(always)]
fn dot_codes_k<const W: u8>(codes: &[u8], w: &[f32]) -> f32 {
    let (v, tail) = dot_lanes::<W, 0>(codes, w);
    v.reduce_add() + tail
}

/// [`dot_codes`] before the final reduction: the lane-wise partial sums of the first
/// `n - n % 8` elements and the scalar sum of the rest. `HD` is the row length when
/// known at compile time (0: `w.len()`), so the common head dims compile to straight
/// code with no loop or bounds checks.
#[inline(always)]
fn dot_lanes<const W: u8, const HD: usize>(codes: &[u8], w: &[f32]) -> (f32x8, f32) {
    let n = if HD != 0 { HD } else { w.len() };
    let w = &w[..n];
    let codes = &codes[..packed::<W>(n)];
    let (mut a0, mut a1) = (f32x8::ZERO, f32x8::ZERO);
    let mut e = 0;
    while e + 16 <= n {
        let (x0, x1) = codes16::<W>(codes, e);
        a0 = x0.mul_add(load8(&w[e..]), a0);
        a1 = x1.mul_add(load8(&w[e + 8..]), a1);
        e += 16;
    }
    if e + 8 <= n {
        a0 = codes8::<W>(codes, e).mul_add(load8(&w[e..]), a0);
        e += 8;
    }
    let mut tail = 0.0f32;
    for (j, &wj) in w.iter().enumerate().skip(e) {
        tail += code_at::<W>(codes, j) * wj;
    }
    (a0 + a1, tail)
}

/// Scalar twin of [`dot_codes`] (sequential sum).
pub fn dot_codes_scalar(codes: &[u8], w: &[f32], bits: Bits) -> f32 {
    let mut s = 0.0f32;
    for (j, &wj) in w.iter().enumerate() {
        s += get(codes, j, bits) as f32 * wj;
    }
    s
}

/// `acc[j] += alpha · u_j` over a packed row of `acc.len()` codes.
#[inline]
pub fn axpy_codes(alpha: f32, codes: &[u8], acc: &mut [f32], bits: Bits) {
    debug_assert_eq!(codes.len(), bits.packed_len(acc.len()));
    match bits {
        Bits::Int8 => axpy_codes_k::<8>(alpha, codes, acc),
        Bits::Int4 => axpy_codes_k::<4>(alpha, codes, acc),
        Bits::Int2 => axpy_codes_k::<2>(alpha, codes, acc),
    }
}

#[inline(always)]
fn axpy_codes_k<const W: u8>(alpha: f32, codes: &[u8], acc: &mut [f32]) {
    let n = acc.len();
    let a = f32x8::splat(alpha);
    let mut e = 0;
    while e + 16 <= n {
        let (x0, x1) = codes16::<W>(codes, e);
        let v = x0.mul_add(a, load8(&acc[e..]));
        store8(&mut acc[e..], v);
        let v = x1.mul_add(a, load8(&acc[e + 8..]));
        store8(&mut acc[e + 8..], v);
        e += 16;
    }
    if e + 8 <= n {
        let v = codes8::<W>(codes, e).mul_add(a, load8(&acc[e..]));
        store8(&mut acc[e..], v);
        e += 8;
    }
    for (j, o) in acc.iter_mut().enumerate().skip(e) {
        *o += alpha * code_at::<W>(codes, j);
    }
}

/// Scalar twin of [`axpy_codes`].
pub fn axpy_codes_scalar(alpha: f32, codes: &[u8], acc: &mut [f32], bits: Bits) {
    for (j, o) in acc.iter_mut().enumerate() {
        *o += alpha * get(codes, j, bits) as f32;
    }
}

/// Folds a K group's per-channel parameters into a query:
/// `q · k = Σ_c (q_c s_c) u_c + Σ_c q_c z_c`. Writes `qs[c] = q_c · s_c` and returns the
/// bias `Σ_c q_c z_c`; the scores of the group's rows are then
/// `dot_codes(row, qs) + bias`. `scale`/`zero` are the stored f16 values.
pub fn fold_channels(q: &[f32], scale: &[f16], zero: &[f16], qs: &mut [f32]) -> f32 {
    let n = q.len();
    debug_assert_eq!(scale.len(), n);
    debug_assert_eq!(zero.len(), n);
    debug_assert_eq!(qs.len(), n);
    let mut acc = f32x8::ZERO;
    let mut c = 0;
    while c + 8 <= n {
        let qv = load8(&q[c..]);
        store8(&mut qs[c..], qv * f16::load8(&scale[c..]));
        acc = qv.mul_add(f16::load8(&zero[c..]), acc);
        c += 8;
    }
    let mut bias = acc.reduce_add();
    for c in c..n {
        qs[c] = q[c] * scale[c].to_f32();
        bias += q[c] * zero[c].to_f32();
    }
    bias
}

/// Scalar twin of [`fold_channels`].
pub fn fold_channels_scalar(q: &[f32], scale: &[f16], zero: &[f16], qs: &mut [f32]) -> f32 {
    let mut bias = 0.0f32;
    for c in 0..q.len() {
        qs[c] = q[c] * scale[c].to_f32();
        bias += q[c] * zero[c].to_f32();
    }
    bias
}

/// Calls `$f::<W, HD>(args)` with `HD` the head dim if it is one of the common ones
/// (compiled as straight-line code), else 0 (any length).
macro_rules! by_shape {
    ($bits:expr, $hd:expr, $f:ident($($a:expr),* $(,)?)) => {
        match ($bits, $hd) {
            (Bits::Int8, 32) => $f::<8, 32>($($a),*),
            (Bits::Int8, 64) => $f::<8, 64>($($a),*),
            (Bits::Int8, 128) => $f::<8, 128>($($a),*),
            (Bits::Int8, _) => $f::<8, 0>($($a),*),
            (Bits::Int4, 32) => $f::<4, 32>($($a),*),
            (Bits::Int4, 64) => $f::<4, 64>($($a),*),
            (Bits::Int4, 128) => $f::<4, 128>($($a),*),
            (Bits::Int4, _) => $f::<4, 0>($($a),*),
            (Bits::Int2, 32) => $f::<2, 32>($($a),*),
            (Bits::Int2, 64) => $f::<2, 64>($($a),*),
            (Bits::Int2, 128) => $f::<2, 128>($($a),*),
            (Bits::Int2, _) => $f::<2, 0>($($a),*),
        }
    };
}

/// Scores of a run of K rows of one group against `nq = bias.len()` folded queries:
/// `out[j * stride + r] = dot_codes(row_r, qs_j) + bias[j]`. `codes`: `(rows, packed)`;
/// `qs`: `(nq, head_dim)` from [`fold_channels`]. Eight rows at a time: their lane sums
/// are transposed and added so one vector store writes eight scores.
pub fn dot_codes_rows(
    codes: &[u8],
    qs: &[f32],
    bias: &[f32],
    bits: Bits,
    out: &mut [f32],
    stride: usize,
) {
    let hd = qs.len() / bias.len();
    debug_assert_eq!(codes.len() % bits.packed_len(hd), 0);
    by_shape!(bits, hd, dot_codes_rows_k(codes, qs, bias, out, stride))
}

/// A run of KIVI K rows of one KV head, as the attention kernels read it: consecutive
/// rows whose per-channel parameters come in groups of `group` rows.
#[derive(Debug, Clone, Copy)]
pub struct KRun<'a> {
    /// The rows' codes, `(rows, bits.packed_len(hd))`.
    pub codes: &'a [u8],
    /// Codes per row (the head dim).
    pub hd: usize,
    /// Per-channel scales (stored f16) of the groups the run touches, `hd` per group: run
    /// row `r` belongs to group `(offset + r) / group`, whose scales are
    /// `scale[k·hd..(k + 1)·hd]`.
    pub scale: &'a [f16],
    /// Per-channel zeros, laid out as `scale`.
    pub zero: &'a [f16],
    /// Rows per K group.
    pub group: usize,
    /// The run's first row's position in its group (`< group`).
    pub offset: usize,
    pub bits: Bits,
}

/// A run of KIVI V rows of one KV head: per-row parameters (one `(scale, zero)` per row,
/// stored f16); the head dim is the caller's accumulator width.
#[derive(Debug, Clone, Copy)]
pub struct VRun<'a> {
    /// The rows' codes, `(rows, bits.packed_len(hd))`.
    pub codes: &'a [u8],
    /// One scale per row.
    pub scale: &'a [f16],
    /// One zero per row.
    pub zero: &'a [f16],
    pub bits: Bits,
}

/// Scores `out[j * stride + r] = q_j · k_r` of a run of KIVI K rows ([`KRun`]: run row
/// `r` belongs to group `(offset + r) / group`, whose per-channel parameters are
/// `scale`/`zero` `[k·hd..(k + 1)·hd]`) against the `q.len() / hd` queries `q`. Per group
/// the scales are folded into the queries once: `q·k = Σ_c (q_c s_c) u_c + Σ_c q_c z_c`. `fold` is `(queries, hd)` scratch.
/// A row's score does not depend on how many groups the run spans or where it starts.
pub fn dot_codes_groups(
    run: &KRun<'_>,
    q: &[f32],
    fold: &mut [f32],
    out: &mut [f32],
    stride: usize,
) {
    dot_codes_groups_with(kv_kernel(), run, q, fold, out, stride)
}

/// [`dot_codes_groups`] with a chosen variant (tests run every supported one; an
/// unsupported variant, or a head dim it does not take, runs the portable kernel).
pub fn dot_codes_groups_with(
    kernel: KvKernel,
    run: &KRun<'_>,
    q: &[f32],
    fold: &mut [f32],
    out: &mut [f32],
    stride: usize,
) {
    let KRun {
        codes,
        hd,
        scale,
        zero,
        group,
        offset,
        bits,
    } = *run;
    let p = bits.packed_len(hd);
    let (nq, n) = (q.len() / hd, codes.len() / p);
    debug_assert_eq!(codes.len(), n * p);
    #[cfg(target_arch = "x86_64")]
    if kernel == KvKernel::Avx512 && avx512_takes(hd) {
        // SAFETY: AVX-512 F/BW/VL and F16C are available (checked by `avx512_takes`).
        unsafe { by_blocks!(bits, hd, x86::dot_codes_groups(run, q, out, stride)) };
        return;
    }
    #[cfg(target_arch = "x86_64")]
    if kernel == KvKernel::Avx512Exact && avx512_takes(hd) {
        // SAFETY: AVX-512 F/BW/VL and F16C are available (checked by `avx512_takes`).
        unsafe { by_blocks!(bits, hd, x86::exact::dot_codes_groups(run, q, out, stride)) };
        return;
    }
    #[cfg(target_arch = "x86_64")]
    if kernel == KvKernel::Avx2 && avx2_takes(hd) {
        // SAFETY: AVX2, FMA and F16C are available (checked by `avx2_takes`).
        unsafe { by_blocks!(bits, hd, x86::avx2::dot_codes_groups(run, q, out, stride)) };
        return;
    }
    #[cfg(target_arch = "aarch64")]
    if kernel == KvKernel::Neon && neon_takes(hd) {
        // SAFETY: NEON is available (checked by `neon_takes`).
        unsafe { by_blocks!(bits, hd, aarch64::dot_codes_groups(run, q, out, stride)) };
        return;
    }
    let _ = kernel;
    let mut bias = [0.0f32; 16];
    let mut heap = Vec::new();
    let bias: &mut [f32] = if nq <= bias.len() {
        &mut bias[..nq]
    } else {
        heap.resize(nq, 0.0);
        &mut heap
    };
    let fold = &mut fold[..nq * hd];
    for k in 0..(offset + n).div_ceil(group) {
        let a = (k * group).saturating_sub(offset);
        let b = ((k + 1) * group - offset).min(n);
        let (s, z) = (&scale[k * hd..(k + 1) * hd], &zero[k * hd..(k + 1) * hd]);
        for ((q, f), b) in q
            .chunks_exact(hd)
            .zip(fold.chunks_exact_mut(hd))
            .zip(bias.iter_mut())
        {
            *b = fold_channels(q, s, z, f);
        }
        dot_codes_rows(
            &codes[a * p..b * p],
            fold,
            bias,
            bits,
            &mut out[a..],
            stride,
        );
    }
}

/// Whether the AVX-512 kernels run here for head dim `hd` (the CPU has the features and
/// `hd` is 32, 64, 128 or 256).
#[cfg(target_arch = "x86_64")]
#[inline]
fn avx512_takes(hd: usize) -> bool {
    x86::takes(hd) && KvKernel::Avx512.is_supported()
}

/// Whether the AVX2 kernels run here for head dim `hd` (the CPU has AVX2, FMA and F16C
/// and `hd` is 32, 64, 128 or 256).
#[cfg(target_arch = "x86_64")]
#[inline]
fn avx2_takes(hd: usize) -> bool {
    x86::avx2::takes(hd) && KvKernel::Avx2.is_supported()
}

/// Whether the NEON kernels run here for head dim `hd` (32, 64, 128 or 256).
#[cfg(target_arch = "aarch64")]
#[inline]
fn neon_takes(hd: usize) -> bool {
    aarch64::takes(hd) && KvKernel::Neon.is_supported()
}

/// Calls `$f::<W, HD>(args)` for the head dims of [`x86::takes`] (and `aarch64::takes`).
#[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
macro_rules! by_blocks {
    ($bits:expr, $hd:expr, $($f:ident)::+($($a:expr),* $(,)?)) => {
        match ($bits, $hd) {
            (Bits::Int8, 32) => $($f)::+::<8, 32>($($a),*),
            (Bits::Int8, 64) => $($f)::+::<8, 64>($($a),*),
            (Bits::Int8, 128) => $($f)::+::<8, 128>($($a),*),
            (Bits::Int8, _) => $($f)::+::<8, 256>($($a),*),
            (Bits::Int4, 32) => $($f)::+::<4, 32>($($a),*),
            (Bits::Int4, 64) => $($f)::+::<4, 64>($($a),*),
            (Bits::Int4, 128) => $($f)::+::<4, 128>($($a),*),
            (Bits::Int4, _) => $($f)::+::<4, 256>($($a),*),
            (Bits::Int2, 32) => $($f)::+::<2, 32>($($a),*),
            (Bits::Int2, 64) => $($f)::+::<2, 64>($($a),*),
            (Bits::Int2, 128) => $($f)::+::<2, 128>($($a),*),
            (Bits::Int2, _) => $($f)::+::<2, 256>($($a),*),
        }
    };
}
#[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
use by_blocks;

fn dot_codes_rows_k<const W: u8, const HD: usize>(
    codes: &[u8],
    qs: &[f32],
    bias: &[f32],
    out: &mut [f32],
    stride: usize,
) {
    let hd = if HD != 0 { HD } else { qs.len() / bias.len() };
    let p = packed::<W>(hd);
    let rows = codes.len() / p;
    for (j, (q, &b)) in qs.chunks_exact(hd).zip(bias).enumerate() {
        let o = &mut out[j * stride..j * stride + rows];
        // Blocks of 8 rows; the last block pads with zeros, so every row is summed in
        // the same order wherever it falls.
        for (blk, o) in o.chunks_mut(8).enumerate() {
            let r0 = blk * 8;
            let part: [(f32x8, f32); 8] = std::array::from_fn(|k| {
                if k < o.len() {
                    dot_lanes::<W, HD>(&codes[(r0 + k) * p..], q)
                } else {
                    (f32x8::ZERO, 0.0)
                }
            });
            let scores = (reduce8(part) + f32x8::splat(b)).to_array();
            o.copy_from_slice(&scores[..o.len()]);
        }
    }
}

/// The probability-weighted sum of a run of V rows ([`VRun`]: each row with its own
/// `(scale, zero)`) for `nq = bias.len()` queries: with `p_jr = p[j * stride + r]`,
/// `acc_j += Σ_r (p_jr s_r) u_r` and `bias[j] += Σ_r p_jr z_r`, so that
/// `acc_j + bias[j]` (added by the caller at the end) is `Σ_r p_jr (u_r s_r + z_r)`.
/// `acc`: `(nq, head_dim)`.
pub fn axpy_codes_rows(
    run: &VRun<'_>,
    p: &[f32],
    stride: usize,
    acc: &mut [f32],
    bias: &mut [f32],
) {
    axpy_codes_rows_with(kv_kernel(), run, p, stride, acc, bias)
}

/// [`axpy_codes_rows`] with a chosen variant (as [`dot_codes_rows_with`]).
pub fn axpy_codes_rows_with(
    kernel: KvKernel,
    run: &VRun<'_>,
    p: &[f32],
    stride: usize,
    acc: &mut [f32],
    bias: &mut [f32],
) {
    let VRun {
        codes, scale, bits, ..
    } = *run;
    let hd = acc.len() / bias.len();
    debug_assert_eq!(codes.len(), scale.len() * bits.packed_len(hd));
    #[cfg(target_arch = "x86_64")]
    if kernel == KvKernel::Avx512 && avx512_takes(hd) {
        // SAFETY: AVX-512 F/BW/VL and F16C are available (checked by `avx512_takes`).
        unsafe { by_blocks!(bits, hd, x86::axpy_codes_rows(run, p, stride, acc, bias)) };
        return;
    }
    #[cfg(target_arch = "x86_64")]
    if kernel == KvKernel::Avx512Exact && avx512_takes(hd) {
        // SAFETY: AVX-512 F/BW/VL and F16C are available (checked by `avx512_takes`).
        unsafe {
            by_blocks!(
                bits,
                hd,
                x86::exact::axpy_codes_rows(run, p, stride, acc, bias)
            )
        };
        return;
    }
    #[cfg(target_arch = "x86_64")]
    if kernel == KvKernel::Avx2 && avx2_takes(hd) {
        // SAFETY: AVX2, FMA and F16C are available (checked by `avx2_takes`).
        unsafe {
            by_blocks!(
                bits,
                hd,
                x86::avx2::axpy_codes_rows(run, p, stride, acc, bias)
            )
        };
        return;
    }
    #[cfg(target_arch = "aarch64")]
    if kernel == KvKernel::Neon && neon_takes(hd) {
        // SAFETY: NEON is available (checked by `neon_takes`).
        unsafe {
            by_blocks!(
                bits,
                hd,
                aarch64::axpy_codes_rows(run, p, stride, acc, bias)
            )
        };
        return;
    }
    let _ = kernel;
    by_shape!(bits, hd, axpy_codes_rows_k(run, p, stride, acc, bias))
}

fn axpy_codes_rows_k<const W: u8, const HD: usize>(
    run: &VRun<'_>,
    p: &[f32],
    stride: usize,
    acc: &mut [f32],
    bias: &mut [f32],
) {
    let VRun {
        codes, scale, zero, ..
    } = *run;
    const CHUNK: usize = 64;
    const MAX_LANES: usize = 16;
    let hd = if HD != 0 { HD } else { acc.len() / bias.len() };
    let pk = packed::<W>(hd);
    let rows = scale.len();
    let (mut s, mut z) = ([0.0f32; CHUNK], [0.0f32; CHUNK]);
    let mut r0 = 0;
    while r0 < rows {
        let m = (rows - r0).min(CHUNK);
        scale[r0..r0 + m].convert_to_f32_slice(&mut s[..m]);
        zero[r0..r0 + m].convert_to_f32_slice(&mut z[..m]);
        let codes = &codes[r0 * pk..(r0 + m) * pk];
        for (j, (a, b)) in acc.chunks_exact_mut(hd).zip(bias.iter_mut()).enumerate() {
            let pj = &p[j * stride + r0..j * stride + r0 + m];
            let rows = pj.iter().zip(codes.chunks_exact(pk)).enumerate();
            if HD == 0 || !HD.is_multiple_of(16) || HD / 8 > MAX_LANES {
                for (r, (&w, row)) in rows {
                    if w != 0.0 {
                        axpy_codes_k::<W>(w * s[r], row, a);
                        *b += w * z[r];
                    }
                }
                continue;
            }
            // Known head dim: the accumulator stays in registers for the whole chunk.
            let lanes = HD / 8;
            let mut regs = [f32x8::ZERO; MAX_LANES];
            for (c, v) in regs.iter_mut().enumerate().take(lanes) {
                *v = load8(&a[c * 8..]);
            }
            for (r, (&w, row)) in rows {
                if w != 0.0 {
                    let ws = f32x8::splat(w * s[r]);
                    for e in (0..HD).step_by(16) {
                        let (x0, x1) = codes16::<W>(row, e);
                        regs[e / 8] = x0.mul_add(ws, regs[e / 8]);
                        regs[e / 8 + 1] = x1.mul_add(ws, regs[e / 8 + 1]);
                    }
                    *b += w * z[r];
                }
            }
            for (c, v) in regs.iter().enumerate().take(lanes) {
                store8(&mut a[c * 8..], *v);
            }
        }
        r0 += m;
    }
}

/// SIMD twin of [`dequantize_channels`], bit-identical to it (multiply, then add: no FMA).
#[inline]
pub fn dequantize_channels_simd(
    codes: &[u8],
    scale: &[f32],
    zero: &[f32],
    bits: Bits,
    out: &mut [f32],
) {
    let n = out.len();
    debug_assert_eq!(codes.len(), bits.packed_len(n));
    debug_assert_eq!(scale.len(), n);
    debug_assert_eq!(zero.len(), n);
    match bits {
        Bits::Int8 => dequantize_channels_k::<8>(codes, scale, zero, out),
        Bits::Int4 => dequantize_channels_k::<4>(codes, scale, zero, out),
        Bits::Int2 => dequantize_channels_k::<2>(codes, scale, zero, out),
    }
}

#[inline(always)]
fn dequantize_channels_k<const W: u8>(codes: &[u8], scale: &[f32], zero: &[f32], out: &mut [f32]) {
    let n = out.len();
    let mut e = 0;
    while e + 16 <= n {
        let (x0, x1) = codes16::<W>(codes, e);
        store8(&mut out[e..], x0 * load8(&scale[e..]) + load8(&zero[e..]));
        store8(
            &mut out[e + 8..],
            x1 * load8(&scale[e + 8..]) + load8(&zero[e + 8..]),
        );
        e += 16;
    }
    if e + 8 <= n {
        let x = codes8::<W>(codes, e);
        store8(&mut out[e..], x * load8(&scale[e..]) + load8(&zero[e..]));
        e += 8;
    }
    for j in e..n {
        out[j] = code_at::<W>(codes, j) * scale[j] + zero[j];
    }
}

// Declared after the macros above, which the multi-query forms use too.
mod multi;
pub use multi::*;

#[cfg(test)]
mod tests;
