//! The reference KV cache: which rows survive (policy) and how they are held (storage).
//!
//! Policy (DESIGN.md §3): after each append, if more than `sink + window` rows are
//! stored, the oldest non-sink row is dropped, so exactly the first `sink` and the
//! last `window` tokens remain. Rows are kept in logical order (oldest first) with
//! their absolute positions stored explicitly.
//!
//! This version is written to be read, not to be fast: rows are `Vec`s and eviction
//! removes from the middle of a `Vec`.

/// Storage precision of cached K/V rows.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Precision {
    Fp32,
    Fp16,
    Bf16,
    Int8,
    Int4,
}

impl Precision {
    pub const ALL: [Precision; 5] = [
        Precision::Fp32,
        Precision::Fp16,
        Precision::Bf16,
        Precision::Int8,
        Precision::Int4,
    ];
    pub fn name(self) -> &'static str {
        match self {
            Precision::Fp32 => "fp32",
            Precision::Fp16 => "fp16",
            Precision::Bf16 => "bf16",
            Precision::Int8 => "int8",
            Precision::Int4 => "int4",
        }
    }
    pub fn parse(s: &str) -> Option<Precision> {
        Precision::ALL.into_iter().find(|p| p.name() == s)
    }
}

/// Where RoPE is applied to keys (DESIGN.md §3).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum PositionsMode {
    /// Keys are stored rotated to their original absolute position; the query uses its
    /// absolute position ("vanilla").
    Original,
    /// Keys are stored before RoPE and rotated by their slot index at attention time;
    /// the query is rotated by its own slot index (the StreamingLLM paper's scheme).
    Cache,
}

impl PositionsMode {
    pub fn name(self) -> &'static str {
        match self {
            PositionsMode::Original => "original",
            PositionsMode::Cache => "cache",
        }
    }
}

/// Cache policy × storage settings, shared by the reference and the engine.
#[derive(Debug, Clone, PartialEq)]
pub struct KvConfig {
    pub precision: Precision,
    /// K quantisation group length in tokens (KIVI modes only).
    pub group_size: usize,
    /// StreamingLLM attention-sink tokens kept forever.
    pub sink: usize,
    /// StreamingLLM recent window; `None` means no eviction.
    pub window: Option<usize>,
    pub positions: PositionsMode,
}

impl Default for KvConfig {
    fn default() -> Self {
        KvConfig {
            precision: Precision::Fp32,
            group_size: 32,
            sink: 0,
            window: None,
            positions: PositionsMode::Original,
        }
    }
}

impl KvConfig {
    /// Maximum rows held, if bounded.
    pub fn capacity(&self) -> Option<usize> {
        self.window.map(|w| self.sink + w)
    }
}

/// One layer's cache: all KV heads of every stored token.
#[derive(Debug, Clone)]
pub struct LayerCache {
    cfg: KvConfig,
    /// Width of one stored row: `n_kv_heads * head_dim`.
    kv_dim: usize,
    /// (stored, kv_dim)
    keys: Vec<Vec<f32>>,
    /// (stored, kv_dim)
    values: Vec<Vec<f32>>,
    /// Absolute position of each stored row, oldest first.
    positions: Vec<usize>,
}

impl LayerCache {
    pub fn new(cfg: &KvConfig, n_kv_heads: usize, head_dim: usize) -> Self {
        LayerCache {
            cfg: cfg.clone(),
            kv_dim: n_kv_heads * head_dim,
            keys: Vec::new(),
            values: Vec::new(),
            positions: Vec::new(),
        }
    }

    /// Appends one token's K and V rows (`kv_dim` each), then evicts per the policy.
    pub fn append(&mut self, k: &[f32], v: &[f32], pos: usize) {
        assert_eq!(k.len(), self.kv_dim);
        assert_eq!(v.len(), self.kv_dim);
        self.keys.push(k.to_vec());
        self.values.push(v.to_vec());
        self.positions.push(pos);
        if let Some(cap) = self.cfg.capacity() {
            while self.positions.len() > cap {
                let victim = self.cfg.sink;
                self.keys.remove(victim);
                self.values.remove(victim);
                self.positions.remove(victim);
            }
        }
    }

    /// Rows stored.
    pub fn len(&self) -> usize {
        self.positions.len()
    }
    pub fn is_empty(&self) -> bool {
        self.positions.is_empty()
    }
    /// Absolute position of stored row `i` (0 = oldest).
    pub fn position(&self, i: usize) -> usize {
        self.positions[i]
    }
    /// Stored row `i`'s key, as f32 (`kv_dim` values).
    pub fn key(&self, i: usize) -> Vec<f32> {
        self.keys[i].clone()
    }
    /// Stored row `i`'s value, as f32 (`kv_dim` values).
    pub fn value(&self, i: usize) -> Vec<f32> {
        self.values[i].clone()
    }
    /// Bytes the stored rows occupy.
    pub fn bytes(&self) -> usize {
        self.len() * self.kv_dim * 2 * std::mem::size_of::<f32>()
    }
    pub fn config(&self) -> &KvConfig {
        &self.cfg
    }
}
