//! Element types of weight tensors as they sit in model files.
//!
//! There is one such enum in the project: [`GgmlType`](tinygpt_types::ggml::GgmlType) in
//! the crate the engine and the scalar reference share (`types/`), re-exported here as
//! [`DType`]. It carries each type's format facts (values and bytes per block, ggml's name
//! and type id); how the engine holds, dequantises and multiplies each type is one table,
//! [`crate::wkernels::entry`].
//!
//! | type   | values/block | bytes/block | value                                            |
//! |--------|--------------|-------------|--------------------------------------------------|
//! | F32    | 1            | 4           | IEEE binary32                                     |
//! | F16    | 1            | 2           | IEEE binary16                                     |
//! | BF16   | 1            | 2           | upper 16 bits of a binary32                       |
//! | Q8_0   | 32           | 34          | f16 scale `d`, 32 × i8; x = d·q                  |
//! | Q4_0   | 32           | 18          | f16 scale `d`, 16 bytes of nibbles; x = d·(q − 8) |
//! | Q4_1   | 32           | 20          | f16 `d`, f16 min `m`, 16 bytes of nibbles; x = d·q + m |
//! | Q5_0, Q5_1, IQ4_NL | 32 | 22, 24, 18 | `reference/src/ggml_more.rs`                     |
//! | Q2_K … Q6_K, IQ4_XS | 256 | 84 … 210, 136 | `reference/src/ggml_more.rs`              |

/// A tensor's storage type in a model file.
pub use tinygpt_types::ggml::GgmlType as DType;
