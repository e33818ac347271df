//! Kernel micro-benchmarks (criterion).
//!
//! * `matvec/{shape}/{dtype}-{threads}t`: one matrix-vector product, throughput = bytes of
//!   weights read (so criterion prints GB/s). Shapes: `768x256` (the flagship's gate/up
//!   projection, cache-resident) and `4096x4096` (64 MiB in f32: streams from DRAM).
//!   Q8_0/Q4_1 include quantising the activation to 8 bits per block, as the model does,
//!   and run the active kernel variant (printed first; `TINYGPT_KERNEL=scalar|portable|…`
//!   forces one).
//! * `qdot/{shape}/{dtype}-{kernel}-1t-cpu`: one quantised matvec through each kernel
//!   variant this CPU supports (`wkernels::Kernel::supported`), one thread, CPU-time clock,
//!   throughput = bytes of weights read. `1536x576` is SmolLM2-135M's gate/up projection
//!   (stays in L2); `16384x8192` is 80 MiB in Q4_1 (streams from DRAM: compare with
//!   `read_bandwidth/64MiB-1t-cpu`). Includes quantising the activation.
//! * `matvec_float/{shape}/{dtype}-{kernel}-{walk}-1t-cpu`: f32/f16/bf16 rows through each
//!   float-weight kernel variant this CPU supports (`wkernels::Kernels::float_rows`, the
//!   same type table as `qdot`), one thread, CPU-time clock, throughput = bytes of weights read. `768x256`
//!   stays in L2; `8192x8192` (128 MiB in f16) streams from DRAM and runs both row walks
//!   (`rows8`: eight rows interleaved; `streamed`: what the engine uses from DRAM).
//! * `kv_append/{kv}`: appending one token's K and V rows to one layer of the flagship
//!   shape (8 KV heads × head dim 32), including KIVI quantisation (V per token at append,
//!   K per channel once a 32-token group completes), throughput = tokens (per layer; a
//!   flagship token costs 12 of these).
//! * `attention_16k/{kv}-{threads}t`: one `attend` call (append + scores + softmax +
//!   weighted sum, all 8 heads) over a layer holding 16K rows, throughput = bytes the
//!   cache holds (what attention has to read per step). `{kv}`: every precision (int2
//!   included), plus `int2+r128` (KIVI residual of 128 f32 rows) and `int4+pre` (keys
//!   stored before RoPE, rotated at read time).
//! * `attention_16k/{int8,int4,int2}-kernels-{variant}-1t-cpu`: the two fused KIVI kernels
//!   alone (K scores + V weighted sum, 8 KV heads × 16K rows, no softmax or append), forced
//!   to each variant this CPU supports (`KvKernel`: `portable`, `avx2`, `avx512`, `neon`),
//!   so one run compares them; throughput = bytes of codes and parameters read.
//! * `attention_gqa_16k/{kv}-1t`: the same `attend` call at SmolLM2-135M's attention shape
//!   (9 query heads sharing 3 KV heads, head dim 64: grouped-query attention with groups
//!   of 3) over 16K rows, fp32 / int4 / int2.
//! * `kivi_gqa_16k/{bits}-{k|v}-{form}-1t-cpu`: each KIVI kernel alone for one KV head
//!   of that shape (16K rows, K groups of 32, 3 query heads): K scores or V weighted sum,
//!   `per-head` = the single-query kernels (each code unpacked once per query head),
//!   `multi` = the multi-query kernels (each code unpacked once for the 3 heads), on the
//!   variant this CPU selects (`TINYGPT_KV_KERNEL` forces one).
//!
//! * `roofline/{dtype}-{threads}t`: the engine's `matvec` (activation quantisation, the
//!   row split across the pool's threads, the best kernel variant) over a 32,768 × 4,864
//!   matrix of each type real Q4_K_M / Q4_0 / Q8_0 files carry (Q4_0, Q4_1, Q5_0, Q8_0,
//!   Q4_K, Q6_K; 90–170 MiB, from DRAM), at 1 and all threads, throughput = bytes of
//!   weights read: each kernel's GB/s beside `read_bandwidth/64MiB-thp-{1,N}t` (issue 45).
//! * `read_bandwidth/{size}-{threads}t`: the machine's read bandwidth, independent of our
//!   kernels: summing an f32 buffer with eight f32x8 accumulators (threads split it).
//!   `5.5MiB` is the bundled model's weight size (stays in L3 between passes), `64MiB`
//!   streams from DRAM, `64MiB-thp` the same from a huge-page-advised mapping (as the
//!   packed quantised weights are). The denominators of the bandwidth bound in
//!   benches/README.md.
//!
//! Names ending in `-cpu` are single-threaded runs timed with the thread's CPU-time clock
//! (robust to other processes sharing the machine); the others are wall-clock time.
//!
//! Run: `cargo bench --bench kernels` (about 7 minutes on 2 cores).

mod common;

use common::{
    all_cores, flagship_config_json, kv_config, pool, quantize_q4_1, quantize_q8_0, sum_read,
    uniform, Clock, SyntheticRows, FLAGSHIP_HEAD_DIM, FLAGSHIP_KV_HEADS,
};
use criterion::{black_box, criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use half::{bf16, f16};
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use std::path::Path;
use std::time::Duration;
use tinygpt_cpu::attention::{attend, AttnScratch, RopeTable};
use tinygpt_cpu::config::HfConfig;
use tinygpt_cpu::dtype::DType;
use tinygpt_cpu::kv_cache::{KvCache, LayerKv, Precision};
use tinygpt_cpu::ops::matvec::STREAM_BYTES;
use tinygpt_cpu::ops::{matvec, Matrix};
use tinygpt_cpu::wkernels::{self, ActsForms, Kernel, Kernels, Packed, QuantizedActs, GROUP};

const ATTN_ROWS: usize = 16384;

/// Clocks read for a run on `threads` threads: the wall clock always, and the thread's
/// CPU-time clock too when one thread does all the work (robust to other processes).
fn clocks(threads: usize) -> &'static [Clock] {
    if threads == 1 {
        &[Clock::Wall, Clock::ThreadCpu]
    } else {
        &[Clock::Wall]
    }
}

fn matrix(dtype: DType, rows: usize, cols: usize, w: &[f32]) -> Matrix {
    let bytes: Vec<u8> = match dtype {
        DType::F32 => bytemuck::cast_slice(w).to_vec(),
        DType::F16 => w
            .iter()
            .flat_map(|&x| f16::from_f32(x).to_le_bytes())
            .collect(),
        DType::BF16 => w
            .iter()
            .flat_map(|&x| bf16::from_f32(x).to_le_bytes())
            .collect(),
        DType::Q8_0 => quantize_q8_0(w),
        DType::Q4_1 => quantize_q4_1(w),
        other => unreachable!("not benchmarked: {other}"),
    };
    common::matrix_of(dtype, rows, cols, &bytes, bench_kernel())
}

fn bench_matvec(c: &mut Criterion) {
    // The Q8_0/Q4_1 rows run this variant (`TINYGPT_KERNEL` forces one).
    println!(
        "matvec: quantised-weight kernel variant {}",
        bench_kernel().name()
    );
    let n = all_cores();
    let pools = [(1usize, pool(1)), (n, pool(n))];
    let mut rng = ChaCha8Rng::seed_from_u64(1);
    for (rows, cols) in [(768usize, 256usize), (4096, 4096)] {
        let w = uniform(&mut rng, rows * cols, 0.05);
        let x = uniform(&mut rng, cols, 1.0);
        let mut out = vec![0.0f32; rows];
        let mut g = c.benchmark_group(format!("matvec/{rows}x{cols}"));
        for dtype in [
            DType::F32,
            DType::F16,
            DType::BF16,
            DType::Q8_0,
            DType::Q4_1,
        ] {
            let m = matrix(dtype, rows, cols, &w);
            g.throughput(Throughput::Bytes(m.byte_len() as u64));
            for (t, p) in &pools {
                for &clock in clocks(*t) {
                    let id = format!("{dtype}-{t}t{}", clock.suffix());
                    g.bench_function(BenchmarkId::from_parameter(id), |b| {
                        b.iter_custom(|iters| {
                            p.install(|| {
                                let t0 = clock.now();
                                for _ in 0..iters {
                                    matvec(&m, black_box(&x), &mut out);
                                }
                                clock.now() - t0
                            })
                        })
                    });
                }
            }
        }
        g.finish();
    }
}

/// One thread, CPU-time clock, each float-weight kernel variant this CPU supports
/// (`Kernels::float_rows`, the rows `matvec` runs) on f32, f16 and bf16 weights.
/// `768x256`: cache-resident, rows interleaved eight at a time; `8192x8192`: 128 MiB,
/// streams from DRAM, both walks (`-rows8` interleaved, `-streamed` the walk the engine
/// uses above `STREAM_BYTES`).
fn bench_float_variants(c: &mut Criterion) {
    let one = pool(1);
    let mut rng = ChaCha8Rng::seed_from_u64(3);
    for (rows, cols) in [(768usize, 256usize), (8192, 8192)] {
        let w = uniform(&mut rng, rows * cols, 0.05);
        let x = uniform(&mut rng, cols, 1.0);
        let mut out = vec![0.0f32; rows];
        let h: Vec<f16> = w.iter().map(|&v| f16::from_f32(v)).collect();
        let b: Vec<bf16> = w.iter().map(|&v| bf16::from_f32(v)).collect();
        let (wb, hb, bb): (&[u8], &[u8], &[u8]) = (
            bytemuck::cast_slice(&w),
            bytemuck::cast_slice(&h),
            bytemuck::cast_slice(&b),
        );
        let walks: &[(&str, bool)] = if rows * cols * 2 > STREAM_BYTES {
            &[("rows8", false), ("streamed", true)]
        } else {
            &[("rows8", false)]
        };
        let mut g = c.benchmark_group(format!("matvec_float/{rows}x{cols}"));
        for (dtype, fw) in [(DType::F32, wb), (DType::F16, hb), (DType::BF16, bb)] {
            let width = if dtype == DType::F32 { 4 } else { 2 };
            g.throughput(Throughput::Bytes((rows * cols * width) as u64));
            for k in Kernel::supported() {
                let kernels = Kernels::new(k, dtype);
                for &(walk, streamed) in walks {
                    let id = format!("{dtype}-{}-{walk}-1t-cpu", k.name());
                    g.bench_function(BenchmarkId::from_parameter(id), |bch| {
                        bch.iter_custom(|iters| {
                            one.install(|| {
                                let t0 = Clock::ThreadCpu.now();
                                for _ in 0..iters {
                                    kernels.float_rows(
                                        fw,
                                        cols,
                                        0,
                                        black_box(&x),
                                        &mut out,
                                        streamed,
                                    );
                                }
                                black_box(&out);
                                Clock::ThreadCpu.now() - t0
                            })
                        })
                    });
                }
            }
        }
        g.finish();
    }
}

/// Random GGML blocks (codes uniform, scales ~1e-3): speed does not depend on values.
fn random_blocks(dtype: DType, rows: usize, cols: usize) -> Vec<u8> {
    let mut s = 0x9E37_79B9_7F4A_7C15u64;
    let mut out: Vec<u8> = (0..rows * dtype.bytes_for(cols).expect("whole blocks"))
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            (s >> 24) as u8
        })
        .collect();
    let scale = f16::from_f32(1e-3).to_le_bytes();
    for blk in out.chunks_exact_mut(dtype.block_bytes()) {
        for &at in f16_fields(dtype) {
            blk[at..at + 2].copy_from_slice(&scale);
        }
    }
    out
}

/// The quantised weight types `qdot` measures: every type the kernels read as stored
/// (each packed as its own blocks, as the engine does for every variant).
const QDOT_TYPES: [DType; 12] = [
    DType::Q8_0,
    DType::Q4_0,
    DType::Q4_1,
    DType::Q5_0,
    DType::IQ4_NL,
    DType::Q5_1,
    DType::Q4_K,
    DType::Q5_K,
    DType::Q6_K,
    DType::IQ4_XS,
    DType::Q2_K,
    DType::Q3_K,
];

/// Byte offsets of a block's f16 scale fields (`d`, and `m`/`dmin` where there is one),
/// from ggml's block layouts.
fn f16_fields(dtype: DType) -> &'static [usize] {
    match dtype {
        DType::Q4_1 | DType::Q5_1 | DType::Q4_K | DType::Q5_K => &[0, 2],
        DType::Q6_K => &[208],
        DType::Q2_K => &[80, 82],
        DType::Q3_K => &[108],
        _ => &[0],
    }
}

fn bench_qdot(c: &mut Criterion) {
    let one = pool(1);
    let mut rng = ChaCha8Rng::seed_from_u64(2);
    // SmolLM2's q_proj shape (576 columns: the 32-wide types only), its MLP's shape rounded
    // to whole super-blocks, and matrices far larger than the last-level cache: a wide one,
    // Qwen2.5-0.5B's LM head (151,936 short rows: the 32-wide types only) and a 4,864-row
    // one of whole super-blocks.
    for (rows, cols) in [
        (1536usize, 576usize),
        (1536, 768),
        (16384, 8192),
        (151936, 896),
        (4864, 8960),
    ] {
        let x = uniform(&mut rng, cols, 1.0);
        let mut out = vec![0.0f32; rows];
        let mut g = c.benchmark_group(format!("qdot/{rows}x{cols}"));
        for dtype in QDOT_TYPES {
            if dtype.bytes_for(cols).is_none() {
                continue;
            }
            let forms = ActsForms::of(dtype);
            let bytes = random_blocks(dtype, rows, cols);
            g.throughput(Throughput::Bytes(bytes.len() as u64));
            let packed = Packed::new(dtype, rows, cols, &bytes);
            for k in Kernel::supported() {
                let (p, kernels) = (&packed, Kernels::new(k, dtype));
                let id = format!("{dtype}-{}-1t-cpu", k.name());
                g.bench_function(BenchmarkId::from_parameter(id), |b| {
                    b.iter_custom(|iters| {
                        one.install(|| {
                            let t0 = Clock::ThreadCpu.now();
                            let mut a = QuantizedActs::default();
                            let mut buf = [0.0f32; GROUP];
                            for _ in 0..iters {
                                a.quantize_forms(black_box(&x), forms);
                                for (gi, o) in out.chunks_mut(GROUP).enumerate() {
                                    kernels.group_dot(p, gi, &a, &mut buf);
                                    o.copy_from_slice(&buf[..o.len()]);
                                }
                            }
                            black_box(&out);
                            Clock::ThreadCpu.now() - t0
                        })
                    })
                });
            }
        }
        g.finish();
    }
}

fn bench_append(c: &mut Criterion) {
    let (heads, hd) = (FLAGSHIP_KV_HEADS, FLAGSHIP_HEAD_DIM);
    let rows = SyntheticRows::new(heads * hd);
    // A fresh layer every RESET appends (outside the timer) keeps memory bounded.
    const RESET: usize = 4096;
    let mut g = c.benchmark_group("kv_append");
    g.throughput(Throughput::Elements(1));
    for (p, clock) in Precision::ALL
        .into_iter()
        .flat_map(|p| clocks(1).iter().map(move |&c| (p, c)))
    {
        let kv = kv_config(p, false);
        let id = format!("{}{}", p.name(), clock.suffix());
        g.bench_function(BenchmarkId::from_parameter(id), |b| {
            let mut layer = LayerKv::new(&kv, heads, hd);
            b.iter_custom(|iters| {
                let mut total = Duration::ZERO;
                let mut i = 0u64;
                while i < iters {
                    if layer.appended() == RESET {
                        layer = LayerKv::new(&kv, heads, hd);
                    }
                    let n = ((RESET - layer.appended()) as u64).min(iters - i);
                    let start = layer.appended();
                    let t = clock.now();
                    for pos in start..start + n as usize {
                        layer.append(rows.k(pos), rows.v(pos), pos);
                    }
                    total += clock.now() - t;
                    i += n;
                }
                total
            });
        });
    }
    g.finish();
}

fn bench_attention(c: &mut Criterion) {
    let cfg = HfConfig::from_json(&flagship_config_json(), Path::new("flagship"))
        .and_then(|h| h.validate(Path::new("flagship")))
        .expect("flagship config");
    let rope = RopeTable::new(&cfg);
    let rows = SyntheticRows::new(cfg.kv_dim());
    let mut rng = ChaCha8Rng::seed_from_u64(3);
    let q = uniform(&mut rng, cfg.q_dim(), 2.0);
    let n = all_cores();
    let pools = [(1usize, pool(1)), (n, pool(n))];
    let mut g = c.benchmark_group("attention_16k");
    let extra = [
        tinygpt_cpu::kv_cache::KvConfig {
            residual: 128,
            ..kv_config(Precision::Int2, false)
        },
        tinygpt_cpu::kv_cache::KvConfig {
            key_rope: tinygpt_cpu::kv_cache::KeyRope::Pre,
            ..kv_config(Precision::Int4, false)
        },
    ];
    for kv in Precision::ALL
        .into_iter()
        .map(|p| kv_config(p, false))
        .chain(extra)
    {
        let one = tinygpt_cpu::config::Config {
            n_layers: 1,
            ..cfg.clone()
        };
        let mut cache = KvCache::new(&one, &kv);
        rows.fill(&mut cache, ATTN_ROWS);
        let base = cache.layer(0).clone();
        g.throughput(Throughput::Bytes(base.bytes() as u64));
        for (t, pl, clock) in pools
            .iter()
            .flat_map(|(t, pl)| clocks(*t).iter().map(move |&c| (*t, pl, c)))
        {
            let mut layer = base.clone();
            let mut scratch = AttnScratch::new(&cfg, &kv);
            let mut out = vec![0.0f32; cfg.q_dim()];
            let id = format!("{}-{t}t{}", kv.quant_name(), clock.suffix());
            let id = BenchmarkId::from_parameter(id);
            g.bench_function(id, |b| {
                b.iter_custom(|iters| {
                    pl.install(|| {
                        let mut total = Duration::ZERO;
                        for _ in 0..iters {
                            // Every call appends a row: restore every 512 (≤ 3% growth).
                            if layer.appended() >= ATTN_ROWS + 512 {
                                layer = base.clone();
                            }
                            let pos = layer.appended();
                            let t = clock.now();
                            attend(
                                &cfg,
                                &rope,
                                &mut layer,
                                &q,
                                rows.k(pos),
                                rows.v(pos),
                                pos,
                                &mut out,
                                &mut scratch,
                                None,
                            );
                            total += clock.now() - t;
                        }
                        total
                    })
                });
            });
        }
    }
    bench_kv_kernels(&mut g);
    g.finish();
}

/// `attention_16k/{int8,int4,int2}-kernels-{variant}-1t-cpu`: the two fused KIVI kernels
/// alone, forced to each variant this CPU supports (`KvKernel::supported`, through the
/// `_with` functions): K scores (`dot_codes_groups_with`, groups of 32 rows) and the
/// V weighted sum (`axpy_codes_rows_with`) of the flagship's 8 KV heads (head dim 32, one
/// query each) over 16K rows, with fixed weights (no softmax, no append). Throughput =
/// bytes of codes and parameters read.
fn bench_kv_kernels(g: &mut criterion::BenchmarkGroup<'_, criterion::measurement::WallTime>) {
    use tinygpt_cpu::kivi::{
        axpy_codes_rows_with, dot_codes_groups_with, Bits, KRun, KvKernel, VRun,
    };
    const GROUP: usize = 32;
    let (heads, hd, rows) = (FLAGSHIP_KV_HEADS, FLAGSHIP_HEAD_DIM, ATTN_ROWS);
    let mut rng = ChaCha8Rng::seed_from_u64(11);
    let q = uniform(&mut rng, heads * hd, 2.0);
    let probs: Vec<f32> = uniform(&mut rng, rows, 1.0)
        .iter()
        .map(|x| x.abs() / rows as f32)
        .collect();
    let params = |rng: &mut ChaCha8Rng, n: usize| -> (Vec<f16>, Vec<f16>) {
        let s = uniform(rng, n, 0.1);
        let z = uniform(rng, n, 1.0);
        (
            s.iter().map(|x| f16::from_f32(x.abs() + 1e-3)).collect(),
            z.iter().map(|x| f16::from_f32(*x)).collect(),
        )
    };
    for bits in [Bits::Int8, Bits::Int4, Bits::Int2] {
        let pk = bits.packed_len(hd);
        let codes: Vec<Vec<u8>> = (0..2 * heads)
            .map(|_| {
                (0..rows * pk)
                    .map(|_| rand::Rng::gen::<u8>(&mut rng))
                    .collect()
            })
            .collect();
        let kp: Vec<_> = (0..heads)
            .map(|_| params(&mut rng, rows / GROUP * hd))
            .collect();
        let vp: Vec<_> = (0..heads).map(|_| params(&mut rng, rows)).collect();
        let bytes = 2 * heads * rows * pk + heads * (rows / GROUP * hd + rows) * 4;
        g.throughput(Throughput::Bytes(bytes as u64));
        let name = match bits {
            Bits::Int8 => "int8",
            Bits::Int4 => "int4",
            Bits::Int2 => "int2",
        };
        for kernel in KvKernel::supported() {
            let clock = Clock::ThreadCpu;
            let id = format!("{name}-kernels-{}-1t{}", kernel.name(), clock.suffix());
            let (mut fold, mut scores) = (vec![0.0f32; hd], vec![0.0f32; rows]);
            let (mut acc, mut vb) = (vec![0.0f32; hd], [0.0f32; 1]);
            g.bench_function(BenchmarkId::from_parameter(id), |b| {
                b.iter_custom(|iters| {
                    let t = clock.now();
                    for _ in 0..iters {
                        for h in 0..heads {
                            dot_codes_groups_with(
                                kernel,
                                &KRun {
                                    codes: &codes[h],
                                    hd,
                                    scale: &kp[h].0,
                                    zero: &kp[h].1,
                                    group: GROUP,
                                    offset: 0,
                                    bits,
                                },
                                &q[h * hd..(h + 1) * hd],
                                &mut fold,
                                &mut scores,
                                rows,
                            );
                            axpy_codes_rows_with(
                                kernel,
                                &VRun {
                                    codes: &codes[heads + h],
                                    scale: &vp[h].0,
                                    zero: &vp[h].1,
                                    bits,
                                },
                                &probs,
                                rows,
                                &mut acc,
                                &mut vb,
                            );
                        }
                        black_box((&scores, &acc, &vb));
                    }
                    clock.now() - t
                })
            });
        }
    }
}

/// SmolLM2-135M's attention shape: 9 query heads on 3 KV heads, head dim 64.
fn gqa_config_json() -> String {
    let mut v: serde_json::Value =
        serde_json::from_str(&flagship_config_json()).expect("flagship json");
    v["head_dim"] = 64.into();
    v["hidden_size"] = 576.into();
    v["num_attention_heads"] = 9.into();
    v["num_key_value_heads"] = 3.into();
    v.to_string()
}

fn bench_attention_gqa(c: &mut Criterion) {
    let cfg = HfConfig::from_json(&gqa_config_json(), Path::new("gqa"))
        .and_then(|h| h.validate(Path::new("gqa")))
        .expect("gqa config");
    let rope = RopeTable::new(&cfg);
    let rows = SyntheticRows::new(cfg.kv_dim());
    let mut rng = ChaCha8Rng::seed_from_u64(5);
    let q = uniform(&mut rng, cfg.q_dim(), 2.0);
    let pl = pool(1);
    let mut g = c.benchmark_group("attention_gqa_16k");
    for p in [Precision::Fp32, Precision::Int4, Precision::Int2] {
        let kv = kv_config(p, false);
        let one = tinygpt_cpu::config::Config {
            n_layers: 1,
            ..cfg.clone()
        };
        let mut cache = KvCache::new(&one, &kv);
        rows.fill(&mut cache, ATTN_ROWS);
        let base = cache.layer(0).clone();
        g.throughput(Throughput::Bytes(base.bytes() as u64));
        for &clock in clocks(1) {
            let mut layer = base.clone();
            let mut scratch = AttnScratch::new(&cfg, &kv);
            let mut out = vec![0.0f32; cfg.q_dim()];
            let id = format!("{}-1t{}", kv.quant_name(), clock.suffix());
            g.bench_function(BenchmarkId::from_parameter(id), |b| {
                b.iter_custom(|iters| {
                    pl.install(|| {
                        let mut total = Duration::ZERO;
                        for _ in 0..iters {
                            if layer.appended() >= ATTN_ROWS + 512 {
                                layer = base.clone();
                            }
                            let pos = layer.appended();
                            let t = clock.now();
                            attend(
                                &cfg,
                                &rope,
                                &mut layer,
                                &q,
                                rows.k(pos),
                                rows.v(pos),
                                pos,
                                &mut out,
                                &mut scratch,
                                None,
                            );
                            total += clock.now() - t;
                        }
                        total
                    })
                });
            });
        }
    }
    g.finish();

    // The two kernels alone, one KV head, single-query (per head) vs multi-query.
    use tinygpt_cpu::kivi::{self, Bits};
    let (hd, nq, n, group) = (64usize, 3usize, ATTN_ROWS, 32usize);
    // This bench's own knob (the engine takes `--kv-kernel`): TINYGPT_KV_KERNEL names a
    // variant this CPU has, else the fastest.
    let kernel = std::env::var("TINYGPT_KV_KERNEL")
        .ok()
        .and_then(|s| kivi::KvKernel::from_name(s.trim()))
        .filter(|k| k.is_supported())
        .unwrap_or_else(|| kivi::KvKernel::best(false));
    eprintln!("kivi_gqa_16k: KV kernel {}", kernel.name());
    let mut g = c.benchmark_group("kivi_gqa_16k");
    for (bits, name) in [(Bits::Int4, "int4"), (Bits::Int2, "int2")] {
        let pk = bits.packed_len(hd);
        let codes: Vec<u8> = (0..n * pk).map(|i| (i * 131 + 7) as u8).collect();
        g.throughput(Throughput::Bytes((n * pk) as u64));
        let groups = n.div_ceil(group);
        let ks: Vec<f16> = (0..groups * hd)
            .map(|i| f16::from_f32(0.01 + (i % 7) as f32 * 1e-3))
            .collect();
        let kz: Vec<f16> = (0..groups * hd)
            .map(|i| f16::from_f32((i % 5) as f32 * 0.1 - 0.2))
            .collect();
        let vs: Vec<f16> = (0..n)
            .map(|i| f16::from_f32(0.01 + (i % 3) as f32 * 1e-3))
            .collect();
        let vz: Vec<f16> = (0..n)
            .map(|i| f16::from_f32((i % 5) as f32 * 0.1 - 0.2))
            .collect();
        let qh = uniform(&mut rng, nq * hd, 2.0);
        let probs: Vec<f32> = (0..nq * n).map(|i| 1e-4 + (i % 13) as f32 * 1e-5).collect();
        let krun = kivi::KRun {
            codes: &codes,
            hd,
            scale: &ks,
            zero: &kz,
            group,
            offset: 0,
            bits,
        };
        let vrun = kivi::VRun {
            codes: &codes,
            scale: &vs,
            zero: &vz,
            bits,
        };
        for (side, multi) in [("k", false), ("k", true), ("v", false), ("v", true)] {
            let form = if multi { "multi" } else { "per-head" };
            let id = format!("{name}-{side}-{form}-1t-cpu");
            let mut fold = vec![0.0f32; nq * hd];
            let mut scores = vec![0.0f32; nq * n];
            let mut acc = vec![0.0f32; nq * hd];
            let mut bias = vec![0.0f32; nq];
            g.bench_function(BenchmarkId::from_parameter(id), |b| {
                b.iter_custom(|iters| {
                    let t = Clock::ThreadCpu.now();
                    for _ in 0..iters {
                        match (side, multi) {
                            ("k", true) => kivi::dot_codes_groups_multi_with(
                                kernel,
                                &krun,
                                &qh,
                                &mut fold,
                                &mut scores,
                                n,
                            ),
                            ("k", _) => kivi::dot_codes_groups_with(
                                kernel,
                                &krun,
                                &qh,
                                &mut fold,
                                &mut scores,
                                n,
                            ),
                            (_, true) => kivi::axpy_codes_rows_multi_with(
                                kernel, &vrun, &probs, n, &mut acc, &mut bias,
                            ),
                            _ => kivi::axpy_codes_rows_with(
                                kernel, &vrun, &probs, n, &mut acc, &mut bias,
                            ),
                        }
                        black_box((&scores, &acc));
                    }
                    Clock::ThreadCpu.now() - t
                });
            });
        }
    }
    g.finish();
}

fn config() -> Criterion {
    Criterion::default()
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(3))
        .sample_size(10)
}

fn bench_read_bandwidth(c: &mut Criterion) {
    use rayon::prelude::*;
    let n = all_cores();
    let pools = [(1usize, pool(1)), (n, pool(n))];
    let mut g = c.benchmark_group("read_bandwidth");
    for (label, bytes) in [
        ("5.5MiB", 5_767_168usize),
        ("64MiB", 64 << 20),
        ("64MiB-thp", 64 << 20),
    ] {
        // f32x8 elements: 32-byte aligned, so no load straddles a cache line. `-thp`: an
        // anonymous mapping advised to use transparent huge pages, as the packed
        // quantised weights are (`wkernels::Packed`); the others are heap buffers (4 KiB pages
        // where THP is `madvise`-only).
        let buf: Vec<wide::f32x8>;
        let mut map;
        let x: &[f32] = if label.ends_with("-thp") {
            map = memmap2::MmapMut::map_anon(bytes).expect("anonymous mapping");
            #[cfg(target_os = "linux")]
            map.advise(memmap2::Advice::HugePage).expect("madvise");
            let x: &mut [f32] = bytemuck::cast_slice_mut(&mut map[..]);
            x.fill(1e-3);
            x
        } else {
            buf = vec![wide::f32x8::splat(1e-3); bytes / 32];
            bytemuck::cast_slice(&buf)
        };
        g.throughput(Throughput::Bytes(bytes as u64));
        for (t, p) in &pools {
            for &clock in clocks(*t) {
                let id = BenchmarkId::from_parameter(format!("{label}-{t}t{}", clock.suffix()));
                g.bench_function(id, |b| {
                    b.iter_custom(|iters| {
                        p.install(|| {
                            let chunk = x.len().div_ceil(*t).next_multiple_of(64);
                            let t0 = clock.now();
                            for _ in 0..iters {
                                let s: f32 = x.par_chunks(chunk).map(sum_read).sum();
                                black_box(s);
                            }
                            clock.now() - t0
                        })
                    })
                });
            }
        }
    }
    g.finish();
}

/// `roofline/{dtype}-{threads}t` (module docs).
fn bench_roofline(c: &mut Criterion) {
    let n = all_cores();
    let pools = [(1usize, pool(1)), (n, pool(n))];
    let (rows, cols) = (32_768usize, 4_864usize);
    let mut rng = ChaCha8Rng::seed_from_u64(3);
    let x = uniform(&mut rng, cols, 1.0);
    let mut out = vec![0.0f32; rows];
    let mut g = c.benchmark_group("roofline");
    for dtype in [
        DType::Q4_0,
        DType::Q4_1,
        DType::Q5_0,
        DType::Q8_0,
        DType::Q4_K,
        DType::Q6_K,
    ] {
        let bytes = random_blocks(dtype, rows, cols);
        let m = common::matrix_of(dtype, rows, cols, &bytes, bench_kernel());
        drop(bytes);
        g.throughput(Throughput::Bytes(m.byte_len() as u64));
        for (t, p) in &pools {
            let id = BenchmarkId::from_parameter(format!("{dtype}-{t}t"));
            g.bench_function(id, |b| {
                b.iter_custom(|iters| {
                    p.install(|| {
                        let t0 = Clock::Wall.now();
                        for _ in 0..iters {
                            matvec(&m, black_box(&x), &mut out);
                        }
                        Clock::Wall.now() - t0
                    })
                })
            });
        }
    }
    g.finish();
}

criterion_group! {
    name = benches;
    config = config();
    targets = bench_read_bandwidth, bench_roofline, bench_qdot, bench_float_variants, bench_matvec, bench_append, bench_attention, bench_attention_gqa
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
