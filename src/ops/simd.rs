//! Vector primitives over `wide::f32x8`, each with a scalar tail.

use wide::f32x8;

const W: usize = 8;

/// The first 8 values of `s` as a vector (`s.len() >= 8`, checked by the slice).
#[inline(always)]
pub fn load8(s: &[f32]) -> f32x8 {
    let a: [f32; W] = s[..W].try_into().expect("slice of 8");
    f32x8::from(a)
}

/// Writes `v` to the first 8 values of `x`.
#[inline(always)]
pub fn store8(x: &mut [f32], v: f32x8) {
    x[..W].copy_from_slice(&v.to_array());
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
            *acc_j = load8(&a[o..]).mul_add(load8(&b[o..]), *acc_j);
        }
        i += 4 * W;
    }
    while i + W <= n {
        acc[0] = load8(&a[i..]).mul_add(load8(&b[i..]), acc[0]);
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
        let r = load8(&x[i..]).mul_add(a, load8(&y[i..]));
        store8(&mut y[i..], r);
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
