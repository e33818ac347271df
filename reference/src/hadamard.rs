//! The normalised Walsh–Hadamard rotation of one head (docs/design.md §2.5), written as
//! a matrix product.
//!
//! For a head dimension `d = 2^m`, `H[i][j] = (−1)^popcount(i & j) / √d` (Sylvester's
//! construction, normalised). `H` is symmetric and orthogonal, so `H·H = I`: the same
//! function rotates and un-rotates.
//!
//! ## The summation order (part of the contract)
//! `y_i = s · P(0, d)` with `s = 1/√d` rounded once to f32, where `P(lo, hi)` is the
//! *pairwise* sum of the signed terms `± x_j`, `j ∈ [lo, hi)`:
//!
//! ```text
//!     P(j, j + 1) = ±x_j            (the sign of H[i][j]; exact)
//!     P(lo, hi)   = P(lo, mid) + P(mid, hi)      mid = (lo + hi) / 2
//! ```
//!
//! This is the order in which a fast Walsh–Hadamard transform (butterflies of span 1, 2,
//! 4, …, `d/2`) adds, because f32 rounding is symmetric in sign (`−(a + b)` rounds as
//! `(−a) + (−b)`). The engine uses such a transform (`tinygpt_cpu::attention`), so the
//! two give identical bits.

/// Whether `d` has a Hadamard matrix here (a power of two, at least 2): the cache
/// configuration's rule (`tinygpt-types`), which decides whether `auto` rotates.
pub use tinygpt_types::kv::hadamard_supported as supported;

/// The sign of `H[i][j]` (before normalisation): `+1` or `−1`.
pub fn sign(i: usize, j: usize) -> f32 {
    if (i & j).count_ones().is_multiple_of(2) {
        1.0
    } else {
        -1.0
    }
}

/// `1/√d` as the f32 every rotation multiplies by.
pub fn norm(d: usize) -> f32 {
    (1.0 / (d as f64).sqrt()) as f32
}

/// Pairwise sum of `terms` in the order of the module docs.
fn pairwise(terms: &[f32]) -> f32 {
    if terms.len() == 1 {
        return terms[0];
    }
    let mid = terms.len() / 2;
    pairwise(&terms[..mid]) + pairwise(&terms[mid..])
}

/// `H · x` for one head `x` of `d = x.len()` values.
///
/// # Panics
/// If `d` is not [`supported`] (the engine refuses such configurations first).
pub fn rotate(x: &[f32]) -> Vec<f32> {
    let d = x.len();
    assert!(
        supported(d),
        "Hadamard rotation needs a power-of-two head_dim, got {d}"
    );
    let s = norm(d);
    (0..d)
        .map(|i| {
            let terms: Vec<f32> = (0..d).map(|j| sign(i, j) * x[j]).collect();
            s * pairwise(&terms)
        })
        .collect()
}

/// Rotates every head of a concatenated `(heads, head_dim)` vector in place.
pub fn rotate_heads(x: &mut [f32], head_dim: usize) {
    for head in x.chunks_exact_mut(head_dim) {
        let y = rotate(head);
        head.copy_from_slice(&y);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `H` is orthogonal and its own inverse, to rounding (f64 product of the matrix).
    #[test]
    fn rotation_is_an_involution() {
        for d in [2usize, 4, 8, 32, 64, 128, 256] {
            let x: Vec<f32> = (0..d).map(|i| ((i * 37 % 11) as f32 - 5.0) * 0.3).collect();
            let back = rotate(&rotate(&x));
            for (a, b) in x.iter().zip(&back) {
                assert!((a - b).abs() < 1e-5, "d={d}: {a} vs {b}");
            }
            let n0: f32 = x.iter().map(|v| v * v).sum();
            let n1: f32 = rotate(&x).iter().map(|v| v * v).sum();
            assert!(
                (n0 - n1).abs() < 1e-4 * n0.max(1.0),
                "d={d}: norm {n0} vs {n1}"
            );
        }
    }

    /// A one-hot vector rotates to a column of `H`: all entries `±1/√d`.
    #[test]
    fn one_hot_gives_a_column() {
        let d = 16;
        let mut x = vec![0.0f32; d];
        x[5] = 1.0;
        let y = rotate(&x);
        for (i, v) in y.iter().enumerate() {
            assert_eq!(*v, sign(i, 5) * 0.25);
        }
    }

    /// The pairwise order is observable: f32 values near 1e8 are 8 apart, so a sequential
    /// sum `((1e8 + 3) + 3) + 3` stays at 1e8 while the pairwise `(1e8 + 3) + (3 + 3)`
    /// reaches 1e8 + 8.
    #[test]
    fn sums_pairwise() {
        let x = [1e8f32, 3.0, 3.0, 3.0];
        let y = rotate(&x);
        assert_eq!(y[0], 0.5 * (1e8f32 + 8.0));
        assert_ne!(y[0], 0.5 * 1e8f32);
    }
}
