//! Compute kernels: SIMD through `wide` (NEON on aarch64, SSE/AVX on x86_64) with scalar
//! tails, parallel across independent outputs with rayon (never across a float
//! reduction, so results do not depend on the thread count).

/// Calls `$body` with `$dtype` as a literal constant in each arm, one arm per code type
/// of the 8-row packing: the always-inlined per-block steps then fold every `dtype` branch
/// (a copy of the loop per type). With the type a run-time value the AVX2 loop kept its
/// branches and spilled the unpacked codes to the stack, and the NEON one called its
/// unpacking as a function per block. Shared by `x86` and `aarch64` (defined before them).
#[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
macro_rules! per_code_type {
    ($dtype:expr, $body:expr, ( $($arg:expr),* )) => {
        match $dtype {
            DType::Q4_0 => $body(DType::Q4_0, $($arg),*),
            DType::Q4_1 => $body(DType::Q4_1, $($arg),*),
            DType::Q5_0 => $body(DType::Q5_0, $($arg),*),
            DType::Q8_0 => $body(DType::Q8_0, $($arg),*),
            DType::IQ4_NL => $body(DType::IQ4_NL, $($arg),*),
            other => unreachable!("packed {other}"),
        }
    };
}

#[cfg(target_arch = "aarch64")]
mod aarch64;
pub mod float_dot;
#[cfg(target_arch = "x86_64")]
mod float_x86;
pub mod kquant;
pub mod kquant_low;
#[cfg(target_arch = "aarch64")]
mod kquant_neon;
mod kquant_portable;
pub mod matvec;
mod portable;
pub mod qdot;
pub mod simd;
#[cfg(target_arch = "x86_64")]
mod x86;

pub use matvec::{matmul, matmul_many, matmul_rows, matvec, matvec_many, Matrix};
use wide::f32x8;

/// RMSNorm: `out = weight · x / sqrt(mean(x²) + eps)`.
pub fn rmsnorm(x: &[f32], weight: &[f32], eps: f32, out: &mut [f32]) {
    debug_assert_eq!(x.len(), weight.len());
    debug_assert_eq!(x.len(), out.len());
    let ss = simd::dot(x, x);
    let inv = 1.0 / (ss / x.len() as f32 + eps).sqrt();
    for ((o, &xi), &w) in out.iter_mut().zip(x).zip(weight) {
        *o = w * (xi * inv);
    }
}

/// Per-head RMSNorm in place (Qwen3's q/k norms): each `weight.len()`-wide chunk of `x` (one
/// head) is normalised as [`rmsnorm`] does and scaled by `weight`.
pub fn head_rmsnorm(x: &mut [f32], weight: &[f32], eps: f32) {
    debug_assert_eq!(x.len() % weight.len(), 0);
    for head in x.chunks_exact_mut(weight.len()) {
        let ss = simd::dot(head, head);
        let inv = 1.0 / (ss / head.len() as f32 + eps).sqrt();
        for (o, &w) in head.iter_mut().zip(weight) {
            *o = w * (*o * inv);
        }
    }
}

/// GeGLU in place with tanh-approximated GELU (Gemma): `gate[i] = gelu_tanh(gate[i]) · up[i]`,
/// scalar, as the reference computes it.
pub fn geglu_tanh(gate: &mut [f32], up: &[f32]) {
    debug_assert_eq!(gate.len(), up.len());
    for (g, &u) in gate.iter_mut().zip(up) {
        *g = tinygpt_reference::model::gelu_tanh(*g) * u;
    }
}

/// SwiGLU in place: `gate[i] = silu(gate[i]) · up[i]`, `silu(g) = g / (1 + e^(−g))`.
///
/// Eight lanes at a time with `wide`'s `exp`, whose argument is capped at 87 (its range
/// ends at 87.3, where it returns 0): for `g < −87` that gives `g / (1 + 6e37) ≈ 0`, as
/// the exact value (below 1e-35) is. Differs from the reference's scalar `exp` by
/// rounding only.
pub fn swiglu(gate: &mut [f32], up: &[f32]) {
    debug_assert_eq!(gate.len(), up.len());
    let n = gate.len();
    let n8 = n - n % 8;
    let (one, cap) = (f32x8::ONE, f32x8::splat(87.0));
    for (g, u) in gate[..n8].chunks_exact_mut(8).zip(up.chunks_exact(8)) {
        let gv = simd::load8(g);
        let e = (-gv).min(cap).exp();
        simd::store8(g, gv / (one + e) * simd::load8(u));
    }
    for (g, &u) in gate[n8..].iter_mut().zip(&up[n8..]) {
        *g = *g / (1.0 + (-*g).exp()) * u;
    }
}

/// `x += y`.
pub fn add_assign(x: &mut [f32], y: &[f32]) {
    for (a, &b) in x.iter_mut().zip(y) {
        *a += b;
    }
}

/// Index of the largest value; the first one on ties (as `torch.argmax`). NaN never wins.
pub fn argmax(x: &[f32]) -> usize {
    let mut best = 0;
    let mut best_v = f32::NEG_INFINITY;
    for (i, &v) in x.iter().enumerate() {
        if v > best_v {
            best_v = v;
            best = i;
        }
    }
    best
}
