//! The normalised Walsh–Hadamard rotation of a head (docs/design.md §2.5), the cache's
//! rotation of keys and values before they are quantised, as a fast transform: `log2(d)`
//! rounds of butterflies `(a, b) → (a + b, a − b)` of span 1, 2, 4, …, `d/2`, then one
//! multiply by `1/√d`. It adds in the pairwise order the reference states
//! (`tinygpt_reference::hadamard`, a matrix product), so the two give identical bits
//! (`tests/kv_rotation.rs`; [`norm`] and [`supported`] against their twins in `tests`
//! below). `O(d log d)` instead of the matrix product's `O(d²)`.

/// Whether `d` has a Hadamard matrix here (a power of two, at least 2).
#[inline]
pub fn supported(d: usize) -> bool {
    d >= 2 && d.is_power_of_two()
}

/// `1/√d` as the f32 every rotation multiplies by (computed in f64, rounded once).
#[inline]
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

#[cfg(test)]
mod tests {
    use super::*;
    use tinygpt_reference::hadamard as reference;

    /// [`supported`] and [`norm`] equal the reference's for every width up to 2^16 and
    /// every power of two beyond (the f32 bits of the norm, not just its value).
    #[test]
    fn norm_and_supported_equal_the_reference() {
        let widths = (0..=1usize << 16).chain((17..usize::BITS).map(|m| 1usize << m));
        for d in widths {
            assert_eq!(supported(d), reference::supported(d), "d={d}");
            assert_eq!(norm(d).to_bits(), reference::norm(d).to_bits(), "d={d}");
        }
    }
}
