//! The batched drivers of a serve step against the one-token matvec, bit for bit:
//! `matmul_many` (several matrices sharing one quantisation of the tokens and one parallel
//! region: `q/k/v`, `gate/up`) and `matmul_rows` (each token's output in a slice of its
//! own: the LM head writing every sequence's logits in place). Random shapes whose row
//! counts are not multiples of the 8-row groups, token counts that leave a partial
//! 8-token tile, and 1, 2 and 3 threads (so the row-group split differs).

use half::f16;
use proptest::prelude::*;
use tinygpt_cpu::dtype::DType;
use tinygpt_cpu::ops::{matmul_many, matmul_rows, matvec, Matrix};
use tinygpt_cpu::weights::{Tensor, TensorBytes};

fn matrix(dtype: DType, rows: usize, cols: usize, bytes: Vec<u8>) -> Matrix {
    Matrix::from_tensor(
        &Tensor {
            name: "w".into(),
            dtype,
            shape: vec![rows, cols],
            data: TensorBytes::owned(&bytes),
        },
        tinygpt_cpu::wkernels::default_kernel(),
    )
}

/// xorshift bytes; block scales kept small and positive.
fn weights(dtype: DType, rows: usize, cols: usize, seed: u64) -> Vec<u8> {
    let mut s = seed | 1;
    let mut byte = || {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        (s >> 32) as u8
    };
    let mut out = Vec::new();
    if dtype == DType::F32 {
        for _ in 0..rows * cols {
            let v = (byte() as f32 - 128.0) / 64.0;
            out.extend_from_slice(&v.to_le_bytes());
        }
        return out;
    }
    for _ in 0..rows * cols / 32 {
        let d = f16::from_f32((byte() as f32 + 1.0) / 4096.0);
        out.extend_from_slice(&d.to_le_bytes());
        match dtype {
            DType::Q8_0 => (0..32).for_each(|_| out.push(byte())),
            DType::Q4_0 => (0..16).for_each(|_| out.push(byte())),
            DType::Q4_1 => {
                let m = f16::from_f32((byte() as f32 - 128.0) / 1024.0);
                out.extend_from_slice(&m.to_le_bytes());
                (0..16).for_each(|_| out.push(byte()))
            }
            _ => unreachable!(),
        }
    }
    out
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|f| f.to_bits()).collect()
}

const DTYPES: [DType; 4] = [DType::Q8_0, DType::Q4_1, DType::Q4_0, DType::F32];

#[test]
fn batched_drivers_equal_one_token_matvec() {
    let cfg = ProptestConfig {
        cases: 24,
        failure_persistence: None,
        rng_algorithm: proptest::test_runner::RngAlgorithm::ChaCha,
        ..ProptestConfig::default()
    };
    let pools: Vec<rayon::ThreadPool> = [1, 2, 3]
        .iter()
        .map(|&n| {
            rayon::ThreadPoolBuilder::new()
                .num_threads(n)
                .build()
                .unwrap()
        })
        .collect();
    let mut runner = proptest::test_runner::TestRunner::new(cfg);
    let shape = (
        prop::collection::vec((1usize..300, 0usize..4), 1..4), // (rows, dtype) per matrix
        1usize..6,                                             // blocks of 32 columns
        1usize..40,                                            // tokens
        any::<u64>(),
    );
    runner
        .run(&shape, |(spec, nblk, ntok, seed)| {
            let cols = nblk * 32;
            let mats: Vec<Matrix> = spec
                .iter()
                .enumerate()
                .map(|(i, &(rows, d))| {
                    let dtype = DTYPES[d];
                    matrix(
                        dtype,
                        rows,
                        cols,
                        weights(dtype, rows, cols, seed ^ i as u64),
                    )
                })
                .collect();
            let mut s = seed.rotate_left(17) | 1;
            let xs: Vec<f32> = (0..ntok * cols)
                .map(|_| {
                    s ^= s << 13;
                    s ^= s >> 7;
                    s ^= s << 17;
                    ((s >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * 3.0
                })
                .collect();
            // What each token gets alone.
            let want: Vec<Vec<f32>> = mats
                .iter()
                .map(|m| {
                    let mut o = vec![0.0f32; ntok * m.rows];
                    for (x, r) in xs.chunks_exact(cols).zip(o.chunks_exact_mut(m.rows)) {
                        matvec(m, x, r);
                    }
                    o
                })
                .collect();
            let refs: Vec<&Matrix> = mats.iter().collect();
            for pool in &pools {
                let t = pool.current_num_threads();
                let mut got: Vec<Vec<f32>> =
                    mats.iter().map(|m| vec![f32::NAN; ntok * m.rows]).collect();
                let mut outs: Vec<&mut [f32]> = got.iter_mut().map(|g| &mut g[..]).collect();
                pool.install(|| matmul_many(&refs, &xs, ntok, &mut outs));
                for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                    prop_assert_eq!(
                        bits(g),
                        bits(w),
                        "matmul_many: matrix {} of {:?}, {} threads",
                        i,
                        spec,
                        t
                    );
                }
                for (m, w) in mats.iter().zip(&want) {
                    // Rows in separate buffers, as the sessions' logits are.
                    let mut rows: Vec<Vec<f32>> =
                        (0..ntok).map(|_| vec![f32::NAN; m.rows]).collect();
                    let mut outs: Vec<&mut [f32]> = rows.iter_mut().map(|r| &mut r[..]).collect();
                    pool.install(|| matmul_rows(m, &xs, &mut outs));
                    prop_assert_eq!(
                        bits(&rows.concat()),
                        bits(w),
                        "matmul_rows: {} {}x{}, {} threads",
                        m.dtype,
                        m.rows,
                        cols,
                        t
                    );
                }
            }
            Ok(())
        })
        .unwrap();
}
