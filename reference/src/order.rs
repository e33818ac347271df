//! The canonical order of every float reduction (docs/design.md §2.1), written out as
//! plain scalar loops so that the reference computes the engine's bits exactly.
//!
//! f32 addition is not associative, so "the sum" of a dot product is only defined once its
//! order is. The engine keeps eight partial sums ("lanes") in one vector register and
//! reduces them at the end; the reference does the same with an array of eight `f32`:
//!
//! * [`dot8`] — weight rows (every f32 matvec): lane `l` accumulates `w_i · x_i` for
//!   `i ≡ l (mod 8)` in increasing `i` with one multiply-add each ([`madd`]), the lanes are
//!   added as the tree [`tree8`] `((l0+l1)+(l2+l3))+((l4+l5)+(l6+l7))`, then the tail
//!   `Σ_{i ≥ n8} x_i · w_i` (summed from zero, multiply then add) is added.
//! * [`dot_norm`] — the sum of squares of RMSNorm: four such 8-lane accumulators over
//!   blocks of 32, added lane-wise as `(a0+a1)+(a2+a3)`, reduced by [`reduce_add`]
//!   (the vector library's horizontal sum), then the tail added element by element.
//! * [`dot_score`] — an attention score against a stored float key: two 8-lane
//!   accumulators over alternating chunks of 8, added lane-wise, reduced by [`tree8`],
//!   plus the tail.
//! * [`dot_score_pairs`] — a score against a key rotated at read time (pre-RoPE keys, or
//!   `cache` positions mode): one 8-lane accumulator that takes, for each chunk `i` of the
//!   first half, the chunk `i` and then the chunk `half + i`; [`tree8`].
//! * [`exp`] — the vector library's `exp` (a degree-5 polynomial after a two-step
//!   range reduction), written out per value: it differs from `f32::exp` in the last bit
//!   for some inputs, and the engine uses it in SwiGLU and softmax.
//!
//! **Fused or not.** [`FUSED`] says whether a multiply-add is one rounding
//! (`f32::mul_add`) or two: the engine's vectors fuse on x86_64 builds with FMA and
//! nowhere else, so the reference follows the same build flag.

// Index loops say which lane an element goes to; the constants are the library's own
// spelling of its f32 values.
#![allow(clippy::needless_range_loop, clippy::excessive_precision)]

/// Whether the engine's vector multiply-adds are fused (one rounding): x86_64 builds with
/// FMA enabled (`target-cpu=native` on any FMA CPU). Elsewhere they multiply, round, add.
pub const FUSED: bool = cfg!(all(target_arch = "x86_64", target_feature = "fma"));

/// `a · b + c`, fused iff [`FUSED`].
#[inline]
pub fn madd(a: f32, b: f32, c: f32) -> f32 {
    if FUSED {
        a.mul_add(b, c)
    } else {
        a * b + c
    }
}

/// `c − a · b`, fused iff [`FUSED`] (one rounding of the exact `c − a·b`).
#[inline]
pub fn msub(a: f32, b: f32, c: f32) -> f32 {
    if FUSED {
        (-a).mul_add(b, c)
    } else {
        c - a * b
    }
}

/// Element `d` of `acc += a · x` over a row of `n` values as the engine's vector axpy
/// does it: a multiply-add ([`madd`]) for the first `n − n % 8` elements, a multiply
/// then an add for the tail.
#[inline]
pub fn axpy_term(x: f32, a: f32, acc: f32, d: usize, n: usize) -> f32 {
    if d < n - n % 8 {
        madd(x, a, acc)
    } else {
        acc + a * x
    }
}

/// The fixed lane tree: `((l0 + l1) + (l2 + l3)) + ((l4 + l5) + (l6 + l7))`.
#[inline]
pub fn tree8(l: [f32; 8]) -> f32 {
    ((l[0] + l[1]) + (l[2] + l[3])) + ((l[4] + l[5]) + (l[6] + l[7]))
}

/// The vector library's horizontal sum of eight lanes: with AVX, the two halves added
/// lane-wise, then pairs, then the last two, i.e.
/// `((l0 + l4) + (l2 + l6)) + ((l1 + l5) + (l3 + l7))`; without, each half summed in
/// order and the two sums added.
#[inline]
pub fn reduce_add(l: [f32; 8]) -> f32 {
    if cfg!(target_feature = "avx") {
        let s = [l[0] + l[4], l[1] + l[5], l[2] + l[6], l[3] + l[7]];
        (s[0] + s[2]) + (s[1] + s[3])
    } else {
        (((l[0] + l[1]) + l[2]) + l[3]) + (((l[4] + l[5]) + l[6]) + l[7])
    }
}

/// `Σ_{i ≥ from} a_i · b_i`, summed from zero in increasing `i`, multiply then add.
#[inline]
fn tail(a: &[f32], b: &[f32], from: usize) -> f32 {
    let mut t = 0.0f32;
    for i in from..a.len() {
        t += b[i] * a[i];
    }
    t
}

/// A weight row times a vector in the engine's matvec order (module docs).
pub fn dot8(w: &[f32], x: &[f32]) -> f32 {
    assert_eq!(w.len(), x.len(), "dot8 lengths");
    let n8 = w.len() - w.len() % 8;
    let mut lanes = [0.0f32; 8];
    // Element `i` goes to lane `i % 8`, chunk after chunk (written per chunk so that the
    // compiler keeps the lanes in registers; the order is the same).
    for (wc, xc) in w[..n8].chunks_exact(8).zip(x[..n8].chunks_exact(8)) {
        for l in 0..8 {
            lanes[l] = madd(wc[l], xc[l], lanes[l]);
        }
    }
    tree8(lanes) + tail(w, x, n8)
}

/// `Σ a_i · b_i` in the order of RMSNorm's sum of squares (module docs).
pub fn dot_norm(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len(), "dot_norm lengths");
    let n = a.len();
    let mut acc = [[0.0f32; 8]; 4];
    let mut i = 0;
    while i + 32 <= n {
        for (j, lanes) in acc.iter_mut().enumerate() {
            for l in 0..8 {
                let k = i + 8 * j + l;
                lanes[l] = madd(a[k], b[k], lanes[l]);
            }
        }
        i += 32;
    }
    while i + 8 <= n {
        for l in 0..8 {
            acc[0][l] = madd(a[i + l], b[i + l], acc[0][l]);
        }
        i += 8;
    }
    let v: [f32; 8] = std::array::from_fn(|l| (acc[0][l] + acc[1][l]) + (acc[2][l] + acc[3][l]));
    let mut s = reduce_add(v);
    while i < n {
        s += a[i] * b[i];
        i += 1;
    }
    s
}

/// A query times a stored float key in the order of the engine's attention scores
/// (module docs): chunks of 8 alternate between two lane accumulators (an odd last chunk
/// goes to the first), the two are added lane by lane, then [`tree8`], then the tail.
pub fn dot_score(q: &[f32], k: &[f32]) -> f32 {
    assert_eq!(q.len(), k.len(), "dot_score lengths");
    let n = q.len();
    let mut a = [[0.0f32; 8]; 2];
    let mut i = 0;
    while i + 8 <= n {
        let acc = &mut a[(i / 8) % 2];
        for l in 0..8 {
            acc[l] = madd(k[i + l], q[i + l], acc[l]);
        }
        i += 8;
    }
    let mut t = 0.0f32;
    for j in i..n {
        t += q[j] * k[j];
    }
    tree8(std::array::from_fn(|l| a[0][l] + a[1][l])) + t
}

/// A query times a key rotated at read time, in the order of the engine's fused
/// rotate-and-dot (module docs): for each chunk `i` of 8 of the first half, the
/// products of chunk `i`, then of chunk `half + i`, into one set of lanes; [`tree8`].
/// `k` is the rotated key. For `half` not a multiple of 8 the engine rotates first and
/// scores with one accumulator plus a tail ([`dot_score_block`]).
pub fn dot_score_pairs(q: &[f32], k: &[f32]) -> f32 {
    assert_eq!(q.len(), k.len(), "dot_score_pairs lengths");
    let half = q.len() / 2;
    if !half.is_multiple_of(8) {
        return dot_score_block(q, k);
    }
    let mut lanes = [0.0f32; 8];
    for i in (0..half).step_by(8) {
        for l in 0..8 {
            lanes[l] = madd(k[i + l], q[i + l], lanes[l]);
        }
        for l in 0..8 {
            lanes[l] = madd(k[half + i + l], q[half + i + l], lanes[l]);
        }
    }
    tree8(lanes)
}

/// A query times a rebuilt key with one 8-lane accumulator, [`tree8`], then the tail.
pub fn dot_score_block(q: &[f32], k: &[f32]) -> f32 {
    let n = q.len();
    let n8 = n - n % 8;
    let mut lanes = [0.0f32; 8];
    // element `i` into lane `i % 8`, chunk after chunk (as in [`dot8`])
    for (kc, qc) in k[..n8].chunks_exact(8).zip(q[..n8].chunks_exact(8)) {
        for l in 0..8 {
            lanes[l] = madd(kc[l], qc[l], lanes[l]);
        }
    }
    let mut t = 0.0f32;
    for j in n8..n {
        t += q[j] * k[j];
    }
    tree8(lanes) + t
}

/// `e^x` as the engine's vector library computes it, one value at a time:
///
/// ```text
/// r = round_ties_even(x · log2 e)
/// t = (x − r · 0.693359375) − r · (−2.12194440e-4)        two multiply-subtracts
/// p = ((c3 t + c2) t² + ((c5 t + c4) t⁴ + (c1 t + c0)))    c_k = 1/(k+2)!
/// e = (p t² + t + 1) · 2^r                                  2^r built from the bits
/// ```
///
/// and 0 where `|x| ≥ 87.3` or `x` is not finite (so `exp(−inf) = 0`; callers cap large
/// positive arguments).
pub fn exp(x: f32) -> f32 {
    let (c0, c1, c2, c3, c4, c5) = (
        1.0f32 / 2.0,
        1.0f32 / 6.0,
        1.0f32 / 24.0,
        1.0f32 / 120.0,
        1.0f32 / 720.0,
        1.0f32 / 5040.0,
    );
    let r = (x * std::f32::consts::LOG2_E).round_ties_even();
    let t = msub(r, 0.693359375, x);
    let t = msub(r, -2.12194440e-4, t);
    let t2 = t * t;
    let t4 = t2 * t2;
    let p = madd(
        madd(c3, t, c2),
        t2,
        madd(madd(c5, t, c4), t4, madd(c1, t, c0)),
    );
    let z = madd(p, t2, t);
    // 2^r: r + (127 + 2^23) holds r + 127 in its low mantissa bits; shift them into the
    // exponent field.
    let pow2 = f32::from_bits(((r + 8388735.0).to_bits() as i32).wrapping_shl(23) as u32);
    let e = (z + 1.0) * pow2;
    if x.abs() < 87.3 && x.is_finite() {
        e
    } else {
        0.0
    }
}

/// SwiGLU's gate in the engine's form: `g / (1 + e^(−g))` with [`exp`] over the first
/// `n − n % 8` elements (argument capped at 87) and `f32::exp` over the tail.
pub fn silu_at(g: f32, i: usize, n: usize) -> f32 {
    if i < n - n % 8 {
        g / (1.0 + exp(f32::min(-g, 87.0)))
    } else {
        g / (1.0 + (-g).exp())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Lanes then tree: with one huge value per lane the tree order shows.
    #[test]
    fn dot8_is_eight_lanes_then_a_tree_then_the_tail() {
        // lane 0 holds 1e8 and then +1 (lost); lane 1 holds −1e8; the other lanes 1 each.
        let mut w = vec![1.0f32; 17];
        w[0] = 1e8;
        w[1] = -1e8;
        let x = vec![1.0f32; 17];
        // lanes: l0 = 1e8 + 1 = 1e8, l1 = −1e8 + 1 = −1e8 + 1 (rounds to −1e8), l2..l7 = 2
        // tree: (1e8 + −1e8) + (2 + 2) + ((2 + 2) + (2 + 2)) = 12, tail 1
        assert_eq!(dot8(&w, &x), 13.0);
    }

    #[test]
    fn exp_is_close_to_libm_and_zero_out_of_range() {
        for i in -870..870 {
            let x = i as f32 * 0.1;
            let (a, b) = (exp(x), x.exp());
            assert!((a - b).abs() <= 4.0 * f32::EPSILON * b, "{x}: {a} vs {b}");
        }
        assert_eq!(exp(f32::NEG_INFINITY), 0.0);
        assert_eq!(exp(-100.0), 0.0);
        assert_eq!(exp(0.0), 1.0);
    }
}
