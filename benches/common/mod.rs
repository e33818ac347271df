//! Shared set-up for the criterion benchmarks: the "flagship-huge" model shape written as a
//! `.tinygpt` with random weights, synthetic K/V rows to fill a cache to a given length,
//! GGML block quantisers for the weight-kernel benchmarks, and local rayon pools.
//!
//! Each bench target includes this module and uses a different subset of it.
#![allow(dead_code)]

use half::f16;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use tinygpt_cpu::kv_cache::{KvCache, KvConfig, PositionsMode, Precision};
use tinygpt_cpu::weights::{ModelFiles, META_CONFIG, META_TOKENIZER};

/// Shape of the generated "flagship-huge" model (random weights). Plain multi-head
/// attention (8 KV heads, no GQA), tied embeddings, f32 weights.
pub const FLAGSHIP_LAYERS: usize = 12;
pub const FLAGSHIP_HEADS: usize = 8;
pub const FLAGSHIP_KV_HEADS: usize = 8;
pub const FLAGSHIP_HEAD_DIM: usize = 32;
pub const FLAGSHIP_HIDDEN: usize = 256;
pub const FLAGSHIP_INTERMEDIATE: usize = 768;
pub const FLAGSHIP_VOCAB: usize = 2048;
pub const FLAGSHIP_CONTEXT: usize = 32768;

/// StreamingLLM settings benchmarked: 4 sinks + 252 recent tokens (256 rows per layer).
pub const SINK: usize = 4;
pub const WINDOW: usize = 252;

/// The config.json text of the flagship shape.
pub fn flagship_config_json() -> String {
    serde_json::json!({
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "attention_bias": false,
        "bos_token_id": 0,
        "eos_token_id": 1,
        "head_dim": FLAGSHIP_HEAD_DIM,
        "hidden_act": "silu",
        "hidden_size": FLAGSHIP_HIDDEN,
        "intermediate_size": FLAGSHIP_INTERMEDIATE,
        "max_position_embeddings": FLAGSHIP_CONTEXT,
        "num_attention_heads": FLAGSHIP_HEADS,
        "num_hidden_layers": FLAGSHIP_LAYERS,
        "num_key_value_heads": FLAGSHIP_KV_HEADS,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "tie_word_embeddings": true,
        "vocab_size": FLAGSHIP_VOCAB,
        "dtype": "float32"
    })
    .to_string()
}

fn tokenizer_json() -> String {
    let p = Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures/tiny/tokenizer.json");
    std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()))
}

/// Uniform random values in `[-a, a]`.
pub fn uniform(rng: &mut ChaCha8Rng, n: usize, a: f32) -> Vec<f32> {
    (0..n).map(|_| rng.gen_range(-a..a)).collect()
}

/// Writes the flagship-shaped model with random f32 weights (fixed seed) as a `.tinygpt`
/// in `dir` and returns its path.
pub fn write_flagship(dir: &Path) -> PathBuf {
    let (h, ff, v) = (FLAGSHIP_HIDDEN, FLAGSHIP_INTERMEDIATE, FLAGSHIP_VOCAB);
    let q = FLAGSHIP_HEADS * FLAGSHIP_HEAD_DIM;
    let kv = FLAGSHIP_KV_HEADS * FLAGSHIP_HEAD_DIM;
    let mut rng = ChaCha8Rng::seed_from_u64(0x5eed);
    // (name, shape, values); matrices are (out_features, in_features), scaled 1/sqrt(in).
    let mut tensors: Vec<(String, Vec<usize>, Vec<f32>)> = Vec::new();
    let mat = |name: String, rows: usize, cols: usize, rng: &mut ChaCha8Rng| {
        let a = 1.0 / (cols as f32).sqrt();
        (name, vec![rows, cols], uniform(rng, rows * cols, a))
    };
    tensors.push(mat("model.embed_tokens.weight".into(), v, h, &mut rng));
    for l in 0..FLAGSHIP_LAYERS {
        let p = format!("model.layers.{l}");
        tensors.push(mat(format!("{p}.self_attn.q_proj.weight"), q, h, &mut rng));
        tensors.push(mat(format!("{p}.self_attn.k_proj.weight"), kv, h, &mut rng));
        tensors.push(mat(format!("{p}.self_attn.v_proj.weight"), kv, h, &mut rng));
        tensors.push(mat(format!("{p}.self_attn.o_proj.weight"), h, q, &mut rng));
        tensors.push(mat(format!("{p}.mlp.gate_proj.weight"), ff, h, &mut rng));
        tensors.push(mat(format!("{p}.mlp.up_proj.weight"), ff, h, &mut rng));
        tensors.push(mat(format!("{p}.mlp.down_proj.weight"), h, ff, &mut rng));
        for n in ["input_layernorm", "post_attention_layernorm"] {
            tensors.push((format!("{p}.{n}.weight"), vec![h], vec![1.0; h]));
        }
    }
    tensors.push(("model.norm.weight".into(), vec![h], vec![1.0; h]));

    let bytes: Vec<(String, Vec<usize>, Vec<u8>)> = tensors
        .into_iter()
        .map(|(n, s, v)| (n, s, bytemuck::cast_slice(&v).to_vec()))
        .collect();
    let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = bytes
        .iter()
        .map(|(n, s, b)| {
            let view = safetensors::tensor::TensorView::new(safetensors::Dtype::F32, s.clone(), b)
                .expect("tensor view");
            (n.clone(), view)
        })
        .collect();
    let meta = HashMap::from([
        (META_CONFIG.to_string(), flagship_config_json()),
        (META_TOKENIZER.to_string(), tokenizer_json()),
    ]);
    let path = dir.join("flagship-huge.tinygpt");
    // Laid out as `tinygpt-cpu convert` writes it: data section on a 64-byte boundary.
    let st = safetensors::serialize(views, Some(meta)).expect("serialise .tinygpt");
    let st = tinygpt_cpu::cli::convert::align_data_section(&st);
    std::fs::write(&path, st).expect("write .tinygpt");
    path
}

/// Opens the flagship model written into a fresh temporary directory (kept alive by the
/// returned guard; the file is memory-mapped).
pub fn flagship_files() -> (tempfile::TempDir, ModelFiles) {
    let dir = tempfile::tempdir().expect("temp dir");
    let path = write_flagship(dir.path());
    let files = ModelFiles::open(Some(&path)).expect("open flagship .tinygpt");
    (dir, files)
}

/// A KV configuration: `precision`, K groups of 32, dense or StreamingLLM (4 + 252).
pub fn kv_config(precision: Precision, streaming: bool) -> KvConfig {
    KvConfig {
        precision,
        group_size: 32,
        sink: if streaming { SINK } else { 0 },
        window: streaming.then_some(WINDOW),
        positions: PositionsMode::Original,
        ..KvConfig::default()
    }
}

/// Synthetic K/V rows, cycled to fill caches. Decode time does not depend on the values
/// (no data-dependent branches except exact-zero softmax weights, which values of this
/// size never produce), so random rows stand in for a prompt that would take minutes to
/// prefill at 16K tokens.
pub struct SyntheticRows {
    k: Vec<Vec<f32>>,
    v: Vec<Vec<f32>>,
}

impl SyntheticRows {
    pub fn new(kv_dim: usize) -> Self {
        let mut rng = ChaCha8Rng::seed_from_u64(7);
        let n = 257; // prime-ish count so layers do not all see the same row at a position
        SyntheticRows {
            k: (0..n).map(|_| uniform(&mut rng, kv_dim, 2.0)).collect(),
            v: (0..n).map(|_| uniform(&mut rng, kv_dim, 1.0)).collect(),
        }
    }
    pub fn k(&self, i: usize) -> &[f32] {
        &self.k[i % self.k.len()]
    }
    pub fn v(&self, i: usize) -> &[f32] {
        &self.v[i % self.v.len()]
    }

    /// Appends positions `0..len` to every layer of `cache` through `LayerKv::append`
    /// (the path the model uses: quantisation of complete K groups, ring eviction).
    pub fn fill(&self, cache: &mut KvCache, len: usize) {
        for l in 0..cache.n_layers() {
            let layer = cache.layer_mut(l);
            for pos in 0..len {
                layer.append(self.k(pos + 31 * l), self.v(pos + 17 * l), pos);
            }
        }
    }

    /// The same for the reference crate's per-layer caches.
    pub fn fill_reference(
        &self,
        caches: &mut [tinygpt_reference::kv_cache::LayerCache],
        len: usize,
    ) {
        for (l, c) in caches.iter_mut().enumerate() {
            for pos in 0..len {
                c.append(self.k(pos + 31 * l), self.v(pos + 17 * l), pos);
            }
        }
    }
}

/// A local rayon pool of `n` threads.
pub fn pool(n: usize) -> rayon::ThreadPool {
    rayon::ThreadPoolBuilder::new()
        .num_threads(n)
        .build()
        .expect("rayon pool")
}

/// All cores of the machine.
pub fn all_cores() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

/// Human label of a cache length: 128, 1K, 4K, 16K.
pub fn len_label(n: usize) -> String {
    if n >= 1024 && n.is_multiple_of(1024) {
        format!("{}K", n / 1024)
    } else {
        n.to_string()
    }
}

/// GGML Q8_0 blocks of `x` (length a multiple of 32): f16 `d = amax / 127`, 32 × i8.
pub fn quantize_q8_0(x: &[f32]) -> Vec<u8> {
    let mut out = Vec::with_capacity(x.len() / 32 * 34);
    for blk in x.chunks_exact(32) {
        let amax = blk.iter().fold(0.0f32, |m, v| m.max(v.abs()));
        let d = amax / 127.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        out.extend_from_slice(&f16::from_f32(d).to_le_bytes());
        out.extend(
            blk.iter()
                .map(|&v| ((v * id).round() as i32).clamp(-127, 127) as i8 as u8),
        );
    }
    out
}

/// GGML Q4_1 blocks of `x`: f16 `d = (max − min) / 15`, f16 `m = min`, then 16 bytes whose
/// low nibble is element `i` and high nibble element `i + 16`.
pub fn quantize_q4_1(x: &[f32]) -> Vec<u8> {
    let mut out = Vec::with_capacity(x.len() / 32 * 20);
    for blk in x.chunks_exact(32) {
        let lo = blk.iter().copied().fold(f32::INFINITY, f32::min);
        let hi = blk.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let d = (hi - lo) / 15.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        out.extend_from_slice(&f16::from_f32(d).to_le_bytes());
        out.extend_from_slice(&f16::from_f32(lo).to_le_bytes());
        let q = |v: f32| (((v - lo) * id).round() as i32).clamp(0, 15) as u8;
        for i in 0..16 {
            out.push(q(blk[i]) | (q(blk[i + 16]) << 4));
        }
    }
    out
}

/// Which clock a benchmark reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Clock {
    /// Elapsed time (what a user waits for).
    Wall,
    /// On-CPU time of the measuring thread: leaves out the time other processes held the
    /// core, so single-threaded numbers stay comparable on a shared, loaded machine. Only
    /// meaningful when all the work runs on that one thread (a 1-thread pool).
    ThreadCpu,
}

impl Clock {
    pub fn suffix(self) -> &'static str {
        match self {
            Clock::Wall => "",
            Clock::ThreadCpu => "-cpu",
        }
    }

    /// A reading of this clock (only differences are meaningful).
    #[inline]
    pub fn now(self) -> std::time::Duration {
        match self {
            Clock::Wall => wall_epoch().elapsed(),
            Clock::ThreadCpu => thread_cpu_time(),
        }
    }
}

fn wall_epoch() -> std::time::Instant {
    static EPOCH: std::sync::OnceLock<std::time::Instant> = std::sync::OnceLock::new();
    *EPOCH.get_or_init(std::time::Instant::now)
}

/// CPU time consumed by the calling thread.
#[cfg(unix)]
pub fn thread_cpu_time() -> std::time::Duration {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime only writes the timespec we pass, which we own.
    let rc = unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    assert_eq!(rc, 0, "clock_gettime(CLOCK_THREAD_CPUTIME_ID) failed");
    std::time::Duration::new(ts.tv_sec as u64, ts.tv_nsec as u32)
}

/// Without a per-thread CPU clock, fall back to wall time.
#[cfg(not(unix))]
pub fn thread_cpu_time() -> std::time::Duration {
    wall_epoch().elapsed()
}

/// The SmolLM2 GGUF, as the tests find it (`tests/common`) (`TINYGPT_SMOLLM2`, else the fetch script's path).
pub fn smollm2_path() -> Option<std::path::PathBuf> {
    let p = std::env::var_os("TINYGPT_SMOLLM2")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| {
            let cache = std::env::var_os("TINYGPT_CACHE")
                .map(std::path::PathBuf::from)
                .unwrap_or_else(|| {
                    std::path::PathBuf::from(std::env::var_os("HOME").unwrap_or_default())
                        .join(".cache/tinygpt-cpu")
                });
            cache.join("smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
        });
    p.is_file().then_some(p)
}

/// Sum of `x` with eight independent f32x8 accumulators: a pure streaming read (the read
/// probe of `kernels.rs`' `read_bandwidth` and of `decode_profile.rs`).
pub fn sum_read(x: &[f32]) -> f32 {
    use wide::f32x8;
    let mut acc = [f32x8::ZERO; 8];
    for c in x.chunks_exact(64) {
        for (j, a) in acc.iter_mut().enumerate() {
            let v: [f32; 8] = c[j * 8..j * 8 + 8].try_into().expect("8 lanes");
            *a += f32x8::from(v);
        }
    }
    acc.iter().fold(f32x8::ZERO, |s, a| s + *a).reduce_add()
}

/// A `rows × cols` matrix of `dtype` holding `bytes` (the file's layout), built as the
/// loader builds one (repacked for `kernel`).
pub fn matrix_of(
    dtype: tinygpt_cpu::dtype::DType,
    rows: usize,
    cols: usize,
    bytes: &[u8],
    kernel: tinygpt_cpu::wkernels::Kernel,
) -> tinygpt_cpu::ops::Matrix {
    use tinygpt_cpu::weights::{Tensor, TensorBytes};
    tinygpt_cpu::ops::Matrix::from_tensor(
        &Tensor {
            name: format!("bench.{dtype}"),
            dtype,
            shape: vec![rows, cols],
            data: TensorBytes::owned(bytes),
        },
        kernel,
    )
}
