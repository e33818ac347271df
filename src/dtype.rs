//! Element types of weight tensors as they sit in model files.
//!
//! There is one such enum in the project: the reference crate's
//! [`GgmlType`](tinygpt_reference::ggml::GgmlType) (the reference must name the types its
//! scalar dequantisers read, and cannot see the engine), re-exported here as [`DType`]. Its
//! ggml type ids are mapped in one place, [`crate::gguf::reader::dtype_from_ggml`].
//!
//! Block-quantised types (GGML's `Q8_0`, `Q4_0`, `Q4_1`) store `block_len()` values
//! per block in `block_bytes()` bytes; plain types have a block of one element:
//!
//! | type | values/block | bytes/block | value                                         |
//! |------|--------------|-------------|-----------------------------------------------|
//! | F32  | 1            | 4           | IEEE binary32                                  |
//! | F16  | 1            | 2           | IEEE binary16                                  |
//! | BF16 | 1            | 2           | upper 16 bits of a binary32                    |
//! | Q8_0 | 32           | 34          | f16 scale `d`, 32 × i8; x = d·q               |
//! | Q4_0 | 32           | 18          | f16 scale `d`, 16 bytes of nibbles; x = d·(q − 8) |
//! | Q4_1 | 32           | 20          | f16 `d`, f16 min `m`, 16 bytes of nibbles; x = d·q + m |
//! | Q2_K | 256          | 84          | `reference/src/ggml_more.rs` (kernels: `ops::kquant_low`) |
//! | Q3_K | 256          | 110         | `reference/src/ggml_more.rs` (kernels: `ops::kquant_low`) |
//! | Q4_K | 256          | 144         | `reference/src/ggml_more.rs` (kernels: `ops::kquant`) |
//! | Q5_K | 256          | 176         | `reference/src/ggml_more.rs` (kernels: `ops::kquant`) |
//! | Q6_K | 256          | 210         | `reference/src/ggml_more.rs` (kernels: `ops::kquant`) |
//! | IQ4_XS | 256        | 136         | `reference/src/ggml_more.rs` (kernels: `ops::kquant`) |
//!
//! The engine's own dequantisers are in [`crate::dequant`].

/// A tensor's storage type in a model file.
pub use tinygpt_reference::ggml::GgmlType as DType;
