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

/// The code width and its ranges are types shared with the reference (one definition);
/// every computation below is the engine's own.
pub use tinygpt_reference::quant::{
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

// ---------------------------------------------------------------------------------------
// Multi-query forms (grouped-query attention). The query heads that share one KV head
// (`nq` of them) read every code once: a block of codes is unpacked once and applied to
// each head (K: one dot per head and row with that head's folded query; V: one
// accumulator per head with that head's probability). Per head the arithmetic and its
// order are exactly those of the single-query kernel of the same variant, so every head's
// result equals `dot_codes_groups_with` / `axpy_codes_rows_with` bit for bit
// (`tests/kv_gqa.rs`). Heads are taken `MULTI_MAX` at a time. Every variant has a
// multi-query form (AVX-512, AVX2 and NEON for the head dims their single-query kernels
// take, the portable one for the rest; an unsupported variant runs the portable one, as
// in the single-query dispatch).
// ---------------------------------------------------------------------------------------

/// The most query heads one multi-query kernel call serves (more are split into calls of
/// at most this many; group sizes of common GQA models are 1 to 8).
pub const MULTI_MAX: usize = 8;

/// Calls `$f::<W, HD, G>(args)` with `G` the run-time group size `$g` (2 ..= 8).
macro_rules! by_group {
    ($g:expr, $($f:ident)::+ <$w:ident, $h:ident> ($($a:expr),* $(,)?)) => {
        match $g {
            2 => $($f)::+::<$w, $h, 2>($($a),*),
            3 => $($f)::+::<$w, $h, 3>($($a),*),
            4 => $($f)::+::<$w, $h, 4>($($a),*),
            5 => $($f)::+::<$w, $h, 5>($($a),*),
            6 => $($f)::+::<$w, $h, 6>($($a),*),
            7 => $($f)::+::<$w, $h, 7>($($a),*),
            8 => $($f)::+::<$w, $h, 8>($($a),*),
            g => unreachable!("multi-query group of {g} heads"),
        }
    };
}

/// [`dot_codes_groups`] with every code unpacked once for all `q.len() / hd` queries
/// (the heads of one KV head under grouped-query attention). Each query's scores equal
/// [`dot_codes_groups`]'s bit for bit.
pub fn dot_codes_groups_multi(
    run: &KRun<'_>,
    q: &[f32],
    fold: &mut [f32],
    out: &mut [f32],
    stride: usize,
) {
    dot_codes_groups_multi_with(kv_kernel(), run, q, fold, out, stride)
}

/// [`dot_codes_groups_multi`] with a chosen variant; each query's scores equal
/// [`dot_codes_groups_with`]'s for the same variant bit for bit.
pub fn dot_codes_groups_multi_with(
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
    let nq = q.len() / hd;
    let p = bits.packed_len(hd);
    let n = codes.len() / p;
    let mut j0 = 0;
    while j0 < nq {
        let g = (nq - j0).min(MULTI_MAX);
        let q = &q[j0 * hd..(j0 + g) * hd];
        let out = &mut out[j0 * stride..];
        j0 += g;
        if g == 1 {
            dot_codes_groups_with(kernel, run, q, fold, out, stride);
            continue;
        }
        #[cfg(target_arch = "x86_64")]
        if kernel == KvKernel::Avx512 && avx512_takes(hd) {
            // SAFETY: AVX-512 F/BW/VL and F16C are available (checked by `avx512_takes`).
            unsafe { by_blocks!(bits, hd, dot_multi_avx512(g, run, q, out, stride)) };
            continue;
        }
        #[cfg(target_arch = "x86_64")]
        if kernel == KvKernel::Avx2 && avx2_takes(hd) {
            // SAFETY: AVX2, FMA and F16C are available (checked by `avx2_takes`).
            unsafe { by_blocks!(bits, hd, dot_multi_avx2(g, run, q, out, stride)) };
            continue;
        }
        #[cfg(target_arch = "aarch64")]
        if kernel == KvKernel::Neon && neon_takes(hd) {
            // SAFETY: NEON is available (checked by `neon_takes`).
            unsafe { by_blocks!(bits, hd, dot_multi_neon(g, run, q, out, stride)) };
            continue;
        }
        // Portable: per group, every head's fold (as `dot_codes_groups_with`), then the
        // group's rows against all of them.
        let mut bias = [0.0f32; MULTI_MAX];
        let (fold, bias) = (&mut fold[..g * hd], &mut bias[..g]);
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
            let (codes, out) = (&codes[a * p..b * p], &mut out[a..]);
            by_shape!(bits, hd, dot_rows_multi(g, codes, fold, bias, out, stride));
        }
    }
}

/// Defines `$name::<W, HD>(g, args)`: the multi-query kernel `$f::<W, HD, G>(args)` for
/// `G = g` (2 ..= 8) heads.
#[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
macro_rules! multi_by_group {
    ($arch:literal, $name:ident, $($f:ident)::+, ($($a:ident: $t:ty),*)) => {
        #[doc = concat!("`", stringify!($($f)::+), "` for `g` (2 ..= 8) heads.")]
        ///
        /// # Safety
        /// As the kernel's: the CPU features it needs are available.
        #[cfg(target_arch = $arch)]
        unsafe fn $name<const W: u8, const HD: usize>(g: usize, $($a: $t),*) {
            // SAFETY: the caller checked the CPU features; lengths are asserted inside.
            unsafe { by_group!(g, $($f)::+ <W, HD> ($($a),*)) }
        }
    };
}
multi_by_group!("x86_64", dot_multi_avx512, x86::dot_codes_groups_multi, (run: &KRun<'_>, q: &[f32], out: &mut [f32], stride: usize));
multi_by_group!("x86_64", dot_multi_avx2, x86::avx2::dot_codes_groups_multi, (run: &KRun<'_>, q: &[f32], out: &mut [f32], stride: usize));
multi_by_group!("aarch64", dot_multi_neon, aarch64::dot_codes_groups_multi, (run: &KRun<'_>, q: &[f32], out: &mut [f32], stride: usize));
multi_by_group!("x86_64", axpy_multi_avx512, x86::axpy_codes_rows_multi, (run: &VRun<'_>, p: &[f32], stride: usize, acc: &mut [f32], bias: &mut [f32]));
multi_by_group!("x86_64", axpy_multi_avx2, x86::avx2::axpy_codes_rows_multi, (run: &VRun<'_>, p: &[f32], stride: usize, acc: &mut [f32], bias: &mut [f32]));
multi_by_group!("aarch64", axpy_multi_neon, aarch64::axpy_codes_rows_multi, (run: &VRun<'_>, p: &[f32], stride: usize, acc: &mut [f32], bias: &mut [f32]));

/// [`dot_codes_rows_multi_k`] for `g` (2 ..= 8) heads.
fn dot_rows_multi<const W: u8, const HD: usize>(
    g: usize,
    codes: &[u8],
    qs: &[f32],
    bias: &[f32],
    out: &mut [f32],
    stride: usize,
) {
    by_group!(
        g,
        dot_codes_rows_multi_k < W,
        HD > (codes, qs, bias, out, stride)
    )
}

/// [`dot_codes_rows_k`] for exactly `G` folded queries (`qs`: `(G, hd)`): each block of 8
/// rows is unpacked once into floats (the exact values `codes16` / `codes8` / `code_at`
/// give), then every head runs `dot_codes_rows_k`'s block on them ([`dot_lanes_f`]: the
/// same FMAs in the same order), so head `j`'s scores equal it bit for bit.
fn dot_codes_rows_multi_k<const W: u8, const HD: usize, const G: usize>(
    codes: &[u8],
    qs: &[f32],
    bias: &[f32],
    out: &mut [f32],
    stride: usize,
) {
    let hd = if HD != 0 { HD } else { qs.len() / G };
    let p = packed::<W>(hd);
    let rows = codes.len() / p;
    assert!(qs.len() == G * hd && bias.len() == G && out.len() >= (G - 1) * stride + rows);
    let mut stack = [0.0f32; 8 * 128];
    let mut heap = Vec::new();
    let u: &mut [f32] = if hd <= 128 {
        &mut stack[..8 * hd]
    } else {
        heap.resize(8 * hd, 0.0);
        &mut heap
    };
    for r0 in (0..rows).step_by(8) {
        let m = (rows - r0).min(8);
        for (k, u) in u.chunks_exact_mut(hd).take(m).enumerate() {
            unpack_row::<W, HD>(&codes[(r0 + k) * p..], u);
        }
        for (j, (q, &b)) in qs.chunks_exact(hd).zip(bias).enumerate() {
            // Rows past the run pad with zeros, as in `dot_codes_rows_k`.
            let part: [(f32x8, f32); 8] = std::array::from_fn(|k| {
                if k < m {
                    dot_lanes_f::<HD>(&u[k * hd..(k + 1) * hd], q)
                } else {
                    (f32x8::ZERO, 0.0)
                }
            });
            let scores = (reduce8(part) + f32x8::splat(b)).to_array();
            out[j * stride + r0..j * stride + r0 + m].copy_from_slice(&scores[..m]);
        }
    }
}

/// The offset codes of one row as floats (`u.len()` of them), by the same steps as
/// [`dot_lanes`] reads them.
#[inline(always)]
fn unpack_row<const W: u8, const HD: usize>(codes: &[u8], u: &mut [f32]) {
    let n = if HD != 0 { HD } else { u.len() };
    let codes = &codes[..packed::<W>(n)];
    let mut e = 0;
    while e + 16 <= n {
        let (x0, x1) = codes16::<W>(codes, e);
        store8(&mut u[e..], x0);
        store8(&mut u[e + 8..], x1);
        e += 16;
    }
    if e + 8 <= n {
        store8(&mut u[e..], codes8::<W>(codes, e));
        e += 8;
    }
    for (j, x) in u[..n].iter_mut().enumerate().skip(e) {
        *x = code_at::<W>(codes, j);
    }
}

/// [`dot_lanes`] on codes already unpacked to floats (`u` from [`unpack_row`]): the same
/// FMAs, accumulators and tail, so the same bits.
#[inline(always)]
fn dot_lanes_f<const HD: usize>(u: &[f32], w: &[f32]) -> (f32x8, f32) {
    let n = if HD != 0 { HD } else { w.len() };
    let (u, w) = (&u[..n], &w[..n]);
    let (mut a0, mut a1) = (f32x8::ZERO, f32x8::ZERO);
    let mut e = 0;
    while e + 16 <= n {
        a0 = load8(&u[e..]).mul_add(load8(&w[e..]), a0);
        a1 = load8(&u[e + 8..]).mul_add(load8(&w[e + 8..]), a1);
        e += 16;
    }
    if e + 8 <= n {
        a0 = load8(&u[e..]).mul_add(load8(&w[e..]), a0);
        e += 8;
    }
    let mut tail = 0.0f32;
    for (&x, &wj) in u.iter().zip(w).skip(e) {
        tail += x * wj;
    }
    (a0 + a1, tail)
}

/// [`axpy_codes_rows`] with every code unpacked once for all `bias.len()` queries. Each
/// query's accumulator and bias equal [`axpy_codes_rows`]'s bit for bit.
pub fn axpy_codes_rows_multi(
    run: &VRun<'_>,
    p: &[f32],
    stride: usize,
    acc: &mut [f32],
    bias: &mut [f32],
) {
    axpy_codes_rows_multi_with(kv_kernel(), run, p, stride, acc, bias)
}

/// [`axpy_codes_rows_multi`] with a chosen variant; each query's result equals
/// [`axpy_codes_rows_with`]'s for the same variant bit for bit.
pub fn axpy_codes_rows_multi_with(
    kernel: KvKernel,
    run: &VRun<'_>,
    p: &[f32],
    stride: usize,
    acc: &mut [f32],
    bias: &mut [f32],
) {
    let bits = run.bits;
    let nq = bias.len();
    if nq == 0 {
        return;
    }
    let hd = acc.len() / nq;
    let mut j0 = 0;
    while j0 < nq {
        let g = (nq - j0).min(MULTI_MAX);
        let p = &p[j0 * stride..];
        let acc = &mut acc[j0 * hd..(j0 + g) * hd];
        let bias = &mut bias[j0..j0 + g];
        j0 += g;
        if g == 1 {
            axpy_codes_rows_with(kernel, run, p, stride, acc, bias);
            continue;
        }
        #[cfg(target_arch = "x86_64")]
        if kernel == KvKernel::Avx512 && avx512_takes(hd) {
            // SAFETY: AVX-512 F/BW/VL and F16C are available (checked by `avx512_takes`).
            unsafe { by_blocks!(bits, hd, axpy_multi_avx512(g, run, p, stride, acc, bias)) };
            continue;
        }
        #[cfg(target_arch = "x86_64")]
        if kernel == KvKernel::Avx2 && avx2_takes(hd) {
            // SAFETY: AVX2, FMA and F16C are available (checked by `avx2_takes`).
            unsafe { by_blocks!(bits, hd, axpy_multi_avx2(g, run, p, stride, acc, bias)) };
            continue;
        }
        #[cfg(target_arch = "aarch64")]
        if kernel == KvKernel::Neon && neon_takes(hd) {
            // SAFETY: NEON is available (checked by `neon_takes`).
            unsafe { by_blocks!(bits, hd, axpy_multi_neon(g, run, p, stride, acc, bias)) };
            continue;
        }
        by_shape!(bits, hd, axpy_rows_multi(g, run, p, stride, acc, bias));
    }
}

/// [`axpy_codes_rows_multi_k`] for `g` (2 ..= 8) heads.
fn axpy_rows_multi<const W: u8, const HD: usize>(
    g: usize,
    run: &VRun<'_>,
    p: &[f32],
    stride: usize,
    acc: &mut [f32],
    bias: &mut [f32],
) {
    by_group!(
        g,
        axpy_codes_rows_multi_k < W,
        HD > (run, p, stride, acc, bias)
    )
}

/// [`axpy_codes_rows_k`] for exactly `G` queries, each row's codes unpacked once for all
/// of them (its register form; head dims without one run the single-query kernel head by
/// head). Head `j` gets exactly `axpy_codes_rows_k`'s operations, including skipping rows
/// whose weight is zero.
fn axpy_codes_rows_multi_k<const W: u8, const HD: usize, const G: usize>(
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
    let hd = if HD != 0 { HD } else { acc.len() / G };
    let rows = scale.len();
    assert!(acc.len() == G * hd && bias.len() == G);
    if HD == 0 || !HD.is_multiple_of(16) || HD / 8 > MAX_LANES {
        for (j, (a, b)) in acc
            .chunks_exact_mut(hd)
            .zip(bias.chunks_exact_mut(1))
            .enumerate()
        {
            axpy_codes_rows_k::<W, HD>(run, &p[j * stride..], stride, a, b);
        }
        return;
    }
    assert!(p.len() >= (G - 1) * stride + rows);
    let lanes = HD / 8;
    let pk = packed::<W>(HD);
    let (mut s, mut z) = ([0.0f32; CHUNK], [0.0f32; CHUNK]);
    let mut r0 = 0;
    while r0 < rows {
        let m = (rows - r0).min(CHUNK);
        scale[r0..r0 + m].convert_to_f32_slice(&mut s[..m]);
        zero[r0..r0 + m].convert_to_f32_slice(&mut z[..m]);
        let codes = &codes[r0 * pk..(r0 + m) * pk];
        let mut regs = [[f32x8::ZERO; MAX_LANES]; G];
        for (j, rj) in regs.iter_mut().enumerate() {
            for (c, v) in rj.iter_mut().enumerate().take(lanes) {
                *v = load8(&acc[j * HD + c * 8..]);
            }
        }
        for (r, row) in codes.chunks_exact(pk).enumerate() {
            let w: [f32; G] = std::array::from_fn(|j| p[j * stride + r0 + r]);
            if w.iter().all(|&x| x == 0.0) {
                continue;
            }
            let ws: [f32x8; G] = std::array::from_fn(|j| f32x8::splat(w[j] * s[r]));
            for e in (0..HD).step_by(16) {
                let (x0, x1) = codes16::<W>(row, e);
                for j in 0..G {
                    if w[j] != 0.0 {
                        regs[j][e / 8] = x0.mul_add(ws[j], regs[j][e / 8]);
                        regs[j][e / 8 + 1] = x1.mul_add(ws[j], regs[j][e / 8 + 1]);
                    }
                }
            }
            for j in 0..G {
                if w[j] != 0.0 {
                    bias[j] += w[j] * z[r];
                }
            }
        }
        for (j, rj) in regs.iter().enumerate() {
            for (c, v) in rj.iter().enumerate().take(lanes) {
                store8(&mut acc[j * HD + c * 8..], *v);
            }
        }
        r0 += m;
    }
}

#[cfg(test)]
mod tests {
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
                            let b2 = fold_channels_scalar(
                                &q[r.clone()],
                                &scale,
                                &zero,
                                &mut qs2[r.clone()],
                            );
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
}
