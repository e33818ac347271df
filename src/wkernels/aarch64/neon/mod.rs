//! The `neon-dotprod` variant (NEON + `sdot`, every Apple M-series core and Armv8.4+):
//! the interleaved groups ([`group`]), the whole-row K-quant, IQ4_XS and Q5_1 rows
//! ([`kquant`]) and the Q2_K / Q3_K rows ([`low`]). What they share is here: `sdot`, the
//! lane folds, the f16 reads.

use half::f16;
use std::arch::aarch64::*;

pub mod group;
pub mod kquant;
pub mod low;

pub use group::{group_dot, group_tokens};
pub use kquant::{iq4_xs_row, k4_row, q5_1_row, q6_k_row};
pub use low::{q2_k_row, q3_k_row};

/// `acc + (four-product sums of a · b)` per lane: the `sdot` instruction. Written as
/// inline assembly because `vdotq_s32` is not yet a stable intrinsic. Also used by
/// the row kernels ([`kquant`], [`low`]).
#[inline(always)]
pub(super) fn sdot(acc: int32x4_t, a: int8x16_t, b: int8x16_t) -> int32x4_t {
    let mut acc = acc;
    // SAFETY: `sdot` reads three vector registers and writes the first; no memory, no
    // stack, no flags. Only reached from this folder's kernels, which require `dotprod`
    // (detected at run time when their table entry is resolved).
    unsafe {
        std::arch::asm!(
            "sdot {acc:v}.4s, {a:v}.16b, {b:v}.16b",
            acc = inout(vreg) acc,
            a = in(vreg) a,
            b = in(vreg) b,
            options(pure, nomem, nostack, preserves_flags)
        );
    }
    acc
}

#[inline(always)]
pub(super) fn f16_at(b: &[u8], at: usize) -> f32 {
    f16::from_le_bytes([b[at], b[at + 1]]).to_f32()
}

/// The four lanes of each of `p[0..4]` summed: `[Σ p0, Σ p1, Σ p2, Σ p3]` (exact).
#[target_feature(enable = "neon")]
#[inline]
pub(super) fn fold4(p: [int32x4_t; 4]) -> int32x4_t {
    vpaddq_s32(vpaddq_s32(p[0], p[1]), vpaddq_s32(p[2], p[3]))
}

/// Four signed scales as 32-bit lanes.
#[target_feature(enable = "neon")]
#[inline]
pub(super) fn lanes(s: [i32; 4]) -> int32x4_t {
    // SAFETY: `s` is four i32s.
    unsafe { vld1q_s32(s.as_ptr()) }
}
