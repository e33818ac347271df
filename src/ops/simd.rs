//! Vector primitives over `wide::f32x8`, each with a scalar tail.

use wide::f32x8;

const W: usize = 8;

#[inline(always)]
fn load(s: &[f32]) -> f32x8 {
    let a: [f32; W] = s[..W].try_into().expect("8 lanes");
    f32x8::from(a)
}

/// `Σ a[i]·b[i]` with four vector accumulators (lane order fixed, so deterministic).
#[inline]
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    debug_assert_eq!(a.len(), b.len());
    let n = a.len();
    let mut acc = [f32x8::ZERO; 4];
    let mut i = 0;
    while i + 4 * W <= n {
        for (j, acc_j) in acc.iter_mut().enumerate() {
            let o = i + j * W;
            *acc_j = load(&a[o..]).mul_add(load(&b[o..]), *acc_j);
        }
        i += 4 * W;
    }
    while i + W <= n {
        acc[0] = load(&a[i..]).mul_add(load(&b[i..]), acc[0]);
        i += W;
    }
    let v = (acc[0] + acc[1]) + (acc[2] + acc[3]);
    let mut s = v.reduce_add();
    while i < n {
        s += a[i] * b[i];
        i += 1;
    }
    s
}

/// `y[i] += alpha · x[i]`.
#[inline]
pub fn axpy(alpha: f32, x: &[f32], y: &mut [f32]) {
    debug_assert_eq!(x.len(), y.len());
    let n = x.len();
    let a = f32x8::splat(alpha);
    let mut i = 0;
    while i + W <= n {
        let r = load(&x[i..]).mul_add(a, load(&y[i..]));
        y[i..i + W].copy_from_slice(&r.to_array());
        i += W;
    }
    while i < n {
        y[i] += alpha * x[i];
        i += 1;
    }
}

/// Scalar twin of [`dot`] (sequential sum), for tests.
pub fn dot_scalar(a: &[f32], b: &[f32]) -> f32 {
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}
