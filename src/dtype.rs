//! Element types of weight tensors as they sit in model files.
//!
//! Block-quantised types (GGML's `Q8_0`, `Q4_0`, `Q4_1`) store `block_len()` values
//! per block in `block_bytes()` bytes; plain types have a block of one element.

/// A tensor's storage type in a model file.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DType {
    F32,
    F16,
    BF16,
    /// GGML Q8_0: blocks of 32 values: f16 scale `d`, then 32 × i8; x = d·q.
    Q8_0,
    /// GGML Q4_0: blocks of 32 values: f16 scale `d`, then 16 bytes of nibbles; x = d·(q − 8).
    Q4_0,
    /// GGML Q4_1: blocks of 32 values: f16 scale `d`, f16 min `m`, 16 bytes of nibbles; x = d·q + m.
    Q4_1,
}

impl DType {
    /// Values per block.
    pub fn block_len(self) -> usize {
        match self {
            DType::F32 | DType::F16 | DType::BF16 => 1,
            DType::Q8_0 | DType::Q4_0 | DType::Q4_1 => 32,
        }
    }
    /// Bytes per block.
    pub fn block_bytes(self) -> usize {
        match self {
            DType::F32 => 4,
            DType::F16 | DType::BF16 => 2,
            DType::Q8_0 => 34,
            DType::Q4_0 => 18,
            DType::Q4_1 => 20,
        }
    }
    /// Bytes needed for `n` values (`n` must be a multiple of the block length).
    pub fn bytes_for(self, n: usize) -> Option<usize> {
        if !n.is_multiple_of(self.block_len()) {
            return None;
        }
        (n / self.block_len()).checked_mul(self.block_bytes())
    }
    pub fn is_quantized(self) -> bool {
        self.block_len() > 1
    }
    pub fn name(self) -> &'static str {
        match self {
            DType::F32 => "F32",
            DType::F16 => "F16",
            DType::BF16 => "BF16",
            DType::Q8_0 => "Q8_0",
            DType::Q4_0 => "Q4_0",
            DType::Q4_1 => "Q4_1",
        }
    }
}

impl std::fmt::Display for DType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}
