//! KIVI: the cache's quantised codes (docs/design.md §2.2–§2.5) — the quantisers, the
//! code layout, the fused attention kernels over codes and the choice among their
//! variants. The engine's own numerics; the scalar oracle is `tinygpt_reference::quant`
//! (and `tinygpt_reference::hadamard` for the rotation), and every function here agrees
//! with its twin there bit for bit (`tests.rs`, `tests/quant.rs`, `tests/kv_rotation.rs`).
//! Not to be confused with the *weight* formats (`crate::wkernels`).
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
//!
//! ## Kernels, one folder per ISA
//! The two fused kernels — scores of K rows against folded queries
//! ([`dot_codes_groups`]) and the probability-weighted sum of V rows
//! ([`axpy_codes_rows`]) — and their multi-query forms (`…_multi`, grouped-query
//! attention) exist in every variant under the same names:
//!
//! | variant ([`KvKernel`]) | module | order of the sums |
//! |---|---|---|
//! | `portable` | `portable/` (`wide`, any CPU and head dim) | the canonical one (§2.3) |
//! | `avx512-exact` | `x86/avx512_exact.rs` | the portable one, bit for bit |
//! | `avx512` | `x86/avx512/` (and its softmax) | its own (fast) |
//! | `avx2` | `x86/avx2.rs` | its own (fast) |
//! | `neon` | `aarch64/neon.rs` | its own (fast) |
//!
//! The functions below are **the one dispatch point**: each calls the chosen variant when
//! the CPU has it and it takes the head dim (32, 64, 128, 256), else the portable kernel.
//! The variant is the `_with` forms' argument: the engine passes each session's
//! ([`crate::exec::ExecOptions::kv_kernel`]; [`KvKernel::best`] maps "exact" / "fast" to a
//! variant), tests run every supported one; the forms without `_with` run
//! [`KvKernel::best`]`(false)`. The
//! Hadamard rotation of keys and values before quantising is [`hadamard`].

use crate::ops::simd::{load8, store8, Elem};
use half::f16;
use wide::f32x8;

/// The code width and its ranges: types shared with the reference (one definition,
/// `tinygpt-types`). Every computation below is the engine's own.
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
/// bits are zero (as the reference's `pack_codes` leaves them).
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

/// Folds a K group's per-channel parameters into a query:
/// `q · k = Σ_c (q_c s_c) u_c + Σ_c q_c z_c`. Writes `qs[c] = q_c · s_c` and returns the
/// bias `Σ_c q_c z_c`; the scores of the group's rows are then
/// `dot_codes(row, qs) + bias`. `scale`/`zero` are the stored f16 values. The canonical
/// fold (the portable order), shared by the `portable` and `avx512-exact` kernels.
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

/// Calls `$f::<W, HD>(args)` for the head dims the ISA kernels take (32, 64, 128, 256).
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

// Declared after the macros above, which the kernels use.
mod kernel;
pub use kernel::KvKernel;
pub mod hadamard;
mod portable;
pub use portable::{
    axpy_codes, axpy_codes_scalar, dequantize_channels_simd, dot_codes, dot_codes_rows,
    dot_codes_scalar,
};
#[cfg(target_arch = "aarch64")]
mod aarch64;
#[cfg(target_arch = "x86_64")]
mod x86;
/// The `avx512` variant's softmax, which attention runs when that variant is chosen.
#[cfg(target_arch = "x86_64")]
pub(crate) use x86::avx512::softmax::softmax as softmax_avx512;

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
    dot_codes_groups_with(KvKernel::best(false), run, q, fold, out, stride)
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
    let (hd, bits) = (run.hd, run.bits);
    debug_assert_eq!(run.codes.len() % bits.packed_len(hd), 0);
    #[cfg(target_arch = "x86_64")]
    if kernel == KvKernel::Avx512 && avx512_takes(hd) {
        // SAFETY: AVX-512 F/BW/VL and F16C are available (checked by `avx512_takes`).
        unsafe { by_blocks!(bits, hd, x86::avx512::dot_codes_groups(run, q, out, stride)) };
        return;
    }
    #[cfg(target_arch = "x86_64")]
    if kernel == KvKernel::Avx512Exact && avx512_takes(hd) {
        // SAFETY: AVX-512 F/BW/VL and F16C are available (checked by `avx512_takes`).
        unsafe {
            by_blocks!(
                bits,
                hd,
                x86::avx512_exact::dot_codes_groups(run, q, out, stride)
            )
        };
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
        unsafe {
            by_blocks!(
                bits,
                hd,
                aarch64::neon::dot_codes_groups(run, q, out, stride)
            )
        };
        return;
    }
    let _ = kernel;
    portable::dot_codes_groups(run, q, fold, out, stride)
}

/// Whether the AVX-512 kernels run here for head dim `hd` (the CPU has the features and
/// `hd` is 32, 64, 128 or 256).
#[cfg(target_arch = "x86_64")]
#[inline]
fn avx512_takes(hd: usize) -> bool {
    x86::avx512::takes(hd) && KvKernel::Avx512.is_supported()
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
    aarch64::neon::takes(hd) && KvKernel::Neon.is_supported()
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
    axpy_codes_rows_with(KvKernel::best(false), run, p, stride, acc, bias)
}

/// [`axpy_codes_rows`] with a chosen variant (as [`dot_codes_groups_with`]).
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
        unsafe {
            by_blocks!(
                bits,
                hd,
                x86::avx512::axpy_codes_rows(run, p, stride, acc, bias)
            )
        };
        return;
    }
    #[cfg(target_arch = "x86_64")]
    if kernel == KvKernel::Avx512Exact && avx512_takes(hd) {
        // SAFETY: AVX-512 F/BW/VL and F16C are available (checked by `avx512_takes`).
        unsafe {
            by_blocks!(
                bits,
                hd,
                x86::avx512_exact::axpy_codes_rows(run, p, stride, acc, bias)
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
                aarch64::neon::axpy_codes_rows(run, p, stride, acc, bias)
            )
        };
        return;
    }
    let _ = kernel;
    portable::axpy_codes_rows(run, p, stride, acc, bias)
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
    dot_codes_groups_multi_with(KvKernel::best(false), run, q, fold, out, stride)
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
    let (hd, bits) = (run.hd, run.bits);
    let nq = q.len() / hd;
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
        if kernel == KvKernel::Avx512Exact && avx512_takes(hd) {
            // SAFETY: AVX-512 F/BW/VL and F16C are available (checked by `avx512_takes`).
            unsafe { by_blocks!(bits, hd, dot_multi_avx512_exact(g, run, q, out, stride)) };
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
        let _ = bits;
        portable::dot_codes_groups_multi(run, q, fold, out, stride);
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
multi_by_group!("x86_64", dot_multi_avx512, x86::avx512::dot_codes_groups_multi, (run: &KRun<'_>, q: &[f32], out: &mut [f32], stride: usize));
multi_by_group!("x86_64", dot_multi_avx512_exact, x86::avx512_exact::dot_codes_groups_multi, (run: &KRun<'_>, q: &[f32], out: &mut [f32], stride: usize));
multi_by_group!("x86_64", dot_multi_avx2, x86::avx2::dot_codes_groups_multi, (run: &KRun<'_>, q: &[f32], out: &mut [f32], stride: usize));
multi_by_group!("aarch64", dot_multi_neon, aarch64::neon::dot_codes_groups_multi, (run: &KRun<'_>, q: &[f32], out: &mut [f32], stride: usize));
multi_by_group!("x86_64", axpy_multi_avx512, x86::avx512::axpy_codes_rows_multi, (run: &VRun<'_>, p: &[f32], stride: usize, acc: &mut [f32], bias: &mut [f32]));
multi_by_group!("x86_64", axpy_multi_avx512_exact, x86::avx512_exact::axpy_codes_rows_multi, (run: &VRun<'_>, p: &[f32], stride: usize, acc: &mut [f32], bias: &mut [f32]));
multi_by_group!("x86_64", axpy_multi_avx2, x86::avx2::axpy_codes_rows_multi, (run: &VRun<'_>, p: &[f32], stride: usize, acc: &mut [f32], bias: &mut [f32]));
multi_by_group!("aarch64", axpy_multi_neon, aarch64::neon::axpy_codes_rows_multi, (run: &VRun<'_>, p: &[f32], stride: usize, acc: &mut [f32], bias: &mut [f32]));

/// [`axpy_codes_rows`] with every code unpacked once for all `bias.len()` queries. Each
/// query's accumulator and bias equal [`axpy_codes_rows`]'s bit for bit.
pub fn axpy_codes_rows_multi(
    run: &VRun<'_>,
    p: &[f32],
    stride: usize,
    acc: &mut [f32],
    bias: &mut [f32],
) {
    axpy_codes_rows_multi_with(KvKernel::best(false), run, p, stride, acc, bias)
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
        if kernel == KvKernel::Avx512Exact && avx512_takes(hd) {
            // SAFETY: AVX-512 F/BW/VL and F16C are available (checked by `avx512_takes`).
            unsafe {
                by_blocks!(
                    bits,
                    hd,
                    axpy_multi_avx512_exact(g, run, p, stride, acc, bias)
                )
            };
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
        let _ = bits;
        portable::axpy_codes_rows_multi(run, p, stride, acc, bias);
    }
}

#[cfg(test)]
mod tests;
