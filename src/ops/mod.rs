//! The float operations of the forward pass (norms, activations) and the matrix products
//! ([`matvec`]: a [`Matrix`] holds its weights and the kernels resolved for them, from
//! [`crate::wkernels`]): SIMD through `wide` (NEON on aarch64, SSE/AVX on x86_64) with
//! scalar tails, parallel across independent outputs with rayon (never across a float
//! reduction, so results do not depend on the thread count).

pub mod matvec;
pub mod simd;

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

/// GELU, tanh approximation (`gelu_pytorch_tanh`):
/// `0.5 · x · (1 + tanh(√(2/π) · (x + 0.044715 · x³)))` in f32, each operation rounded
/// in that order (`√(2/π)` itself computed in f32), as the reference's `gelu_tanh`.
pub fn gelu_tanh(x: f32) -> f32 {
    let k = (2.0f32 / std::f32::consts::PI).sqrt();
    let inner = k * (x + 0.044715 * x * x * x);
    0.5 * x * (1.0 + inner.tanh())
}

/// GeGLU in place with tanh-approximated GELU (Gemma): `gate[i] = gelu_tanh(gate[i]) · up[i]`,
/// scalar, as the reference computes it.
pub fn geglu_tanh(gate: &mut [f32], up: &[f32]) {
    debug_assert_eq!(gate.len(), up.len());
    for (g, &u) in gate.iter_mut().zip(up) {
        *g = gelu_tanh(*g) * u;
    }
}

/// Final logit soft-capping of one logit (Gemma's `final_logit_softcapping`):
/// `cap · tanh(x / cap)` in f32 — a division, `f32::tanh`, a multiplication, each rounded
/// once, as the reference's `soft_cap`.
pub fn soft_cap(x: f32, cap: f32) -> f32 {
    cap * (x / cap).tanh()
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

#[cfg(test)]
mod tests {
    use super::*;
    use tinygpt_reference::model as r;

    /// Values across the ranges the activations and logits take, and the edges: zeros,
    /// subnormals, huge, infinite, NaN.
    fn values() -> Vec<f32> {
        let mut v: Vec<f32> = (-4000..=4000).map(|i| i as f32 * 0.0037).collect();
        v.extend((0..200).map(|i| f32::from_bits(0x3F80_0000 ^ (i * 0x0001_2345))));
        v.extend([
            0.0,
            -0.0,
            1e-40,
            -1e-40,
            1e30,
            -1e30,
            f32::MAX,
            f32::MIN,
            f32::INFINITY,
            f32::NEG_INFINITY,
            f32::NAN,
        ]);
        v
    }

    fn same(a: f32, b: f32) -> bool {
        a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan())
    }

    #[test]
    fn gelu_tanh_equals_the_reference() {
        for x in values() {
            assert!(same(gelu_tanh(x), r::gelu_tanh(x)), "gelu_tanh({x})");
        }
    }

    #[test]
    fn soft_cap_equals_the_reference() {
        for cap in [30.0f32, 50.0, 1.0, 1e-3] {
            for x in values() {
                assert!(
                    same(soft_cap(x, cap), r::soft_cap(x, cap)),
                    "soft_cap({x}, {cap})"
                );
            }
        }
    }
}
