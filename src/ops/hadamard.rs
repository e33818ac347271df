//! The normalised Walsh–Hadamard rotation of a head (docs/design.md §2.5), as a fast
//! transform: `log2(d)` rounds of butterflies `(a, b) → (a + b, a − b)` of span 1, 2, 4,
//! …, `d/2`, then one multiply by `1/√d`. It adds in the pairwise order the reference
//! states (`tinygpt_reference::hadamard`), so the two give identical bits
//! (`tests/kv_rotation.rs`). `O(d log d)` instead of the matrix product's `O(d²)`.

/// Whether a head dimension has a rotation (a power of two, at least 2): the cache
/// configuration's rule.
pub use tinygpt_types::kv::hadamard_supported as supported;

/// `1/√d` as the f32 every rotation multiplies by (computed in f64, rounded once, as the
/// reference's `hadamard::norm`).
pub fn norm(d: usize) -> f32 {
    (1.0 / (d as f64).sqrt()) as f32
}

/// `x ← H·x` for one head (`x.len()` a power of two).
#[inline]
pub fn rotate(x: &mut [f32]) {
    let d = x.len();
    debug_assert!(supported(d), "Hadamard rotation of width {d}");
    let mut h = 1;
    while h < d {
        for blk in x.chunks_exact_mut(2 * h) {
            let (lo, hi) = blk.split_at_mut(h);
            for (a, b) in lo.iter_mut().zip(hi.iter_mut()) {
                let (x0, x1) = (*a, *b);
                *a = x0 + x1;
                *b = x0 - x1;
            }
        }
        h *= 2;
    }
    let s = norm(d);
    x.iter_mut().for_each(|v| *v *= s);
}

/// Rotates every head of a concatenated `(heads, head_dim)` vector in place.
#[inline]
pub fn rotate_heads(x: &mut [f32], head_dim: usize) {
    for head in x.chunks_exact_mut(head_dim) {
        rotate(head);
    }
}
