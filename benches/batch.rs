//! Batched products over GGML-block weights (issue 14: a serve step or a prefill chunk
//! pushes several tokens through every matrix at once).
//!
//! * `matmul_q/{rows}x{cols}/{dtype}-{n}tok-1t-cpu`: `ops::matmul` of `n` tokens (for
//!   `n ≥ 2`: tokens quantised once, the multi-token kernel, each weight block unpacked
//!   once per four tokens; `n = 1` is the decode matvec);
//! * `matvec_each/{rows}x{cols}/{dtype}-{n}tok-1t-cpu`: the same `n` tokens as `n` separate
//!   one-token matvecs (what the batch costs without the multi-token kernel).
//!
//! Throughput is counted in tokens, so tokens/s of the two ids compare directly; one
//! thread, the thread's CPU-time clock (reproducible on a shared machine). Shapes are
//! SmolLM2-135M's: `1536x576` (gate/up) and `576x1536` (down), Q4_1 and Q8_0 (its
//! embedding / LM head dtype), active kernel variant (`TINYGPT_KERNEL` forces one).

mod common;

use common::{pool, quantize_q4_1, quantize_q8_0, uniform, Clock};
use criterion::{black_box, criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use std::time::Duration;
use tinygpt_cpu::dtype::DType;
use tinygpt_cpu::ops::{matmul, matvec, Matrix};
use tinygpt_cpu::wkernels;

fn matrix(dtype: DType, rows: usize, cols: usize, w: &[f32]) -> Matrix {
    let bytes = match dtype {
        DType::Q8_0 => quantize_q8_0(w),
        DType::Q4_1 => quantize_q4_1(w),
        other => unreachable!("not benchmarked: {other}"),
    };
    common::matrix_of(dtype, rows, cols, &bytes, bench_kernel())
}

fn bench_batched(c: &mut Criterion) {
    let one = pool(1);
    let mut rng = ChaCha8Rng::seed_from_u64(14);
    println!("kernel variant: {}", bench_kernel().name());
    for (rows, cols) in [(1536usize, 576usize), (576, 1536)] {
        let w = uniform(&mut rng, rows * cols, 0.1);
        let xs = uniform(&mut rng, 256 * cols, 1.0);
        for dtype in [DType::Q4_1, DType::Q8_0] {
            let m = matrix(dtype, rows, cols, &w);
            for (name, each) in [("matmul_q", false), ("matvec_each", true)] {
                let mut g = c.benchmark_group(format!("{name}/{rows}x{cols}"));
                for n in [1usize, 4, 16, 64, 256] {
                    if each && n > 16 {
                        continue;
                    }
                    g.throughput(Throughput::Elements(n as u64));
                    let mut out = vec![0.0f32; n * rows];
                    let x = &xs[..n * cols];
                    let id = format!("{dtype}-{n}tok-1t-cpu");
                    g.bench_function(BenchmarkId::from_parameter(id), |b| {
                        b.iter_custom(|iters| {
                            one.install(|| {
                                let t0 = Clock::ThreadCpu.now();
                                for _ in 0..iters {
                                    if each {
                                        for (xt, ot) in
                                            x.chunks_exact(cols).zip(out.chunks_exact_mut(rows))
                                        {
                                            matvec(&m, black_box(xt), ot);
                                        }
                                    } else {
                                        matmul(&m, black_box(x), n, &mut out);
                                    }
                                }
                                black_box(&out);
                                Clock::ThreadCpu.now() - t0
                            })
                        })
                    });
                }
                g.finish();
            }
        }
    }
}

criterion_group! {
    name = benches;
    config = Criterion::default()
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(2))
        .sample_size(10);
    targets = bench_batched
}
criterion_main!(benches);

/// The weight kernel variant this bench runs: the one `TINYGPT_KERNEL` names if this CPU
/// has it (this bench's own knob; the engine takes `--kernel`), else the fastest.
fn bench_kernel() -> wkernels::Kernel {
    std::env::var("TINYGPT_KERNEL")
        .ok()
        .and_then(|s| wkernels::Kernel::from_name(s.trim()))
        .filter(|k| k.is_supported())
        .unwrap_or_else(wkernels::Kernel::best)
}
