//! # tinygpt-types
//!
//! The types tinygpt-cpu's optimised engine and its scalar reference crate both name, in
//! one place, so neither has to depend on the other for them:
//!
//! * [`ggml`]: the weight types a model file may hold ([`GgmlType`]) with their format
//!   facts (block length and bytes, ggml's name and type id) and the format constants
//!   (block widths, the IQ4 levels);
//! * [`config`]: the validated model configuration ([`Config`]);
//! * [`kv`]: the KV cache configuration ([`KvConfig`]) and the KIVI code widths.
//!
//! Data, parsing and validation only. Numerics (dequantisers, dot products, quantisers,
//! RoPE frequencies) are not here: the engine and the reference each have their own, and
//! the engine's are tested bit for bit against the reference's.
#![forbid(unsafe_code)]

pub mod config;
pub mod ggml;
pub mod kv;

pub use config::{AttentionType, Config, GemmaOptions, RopeScaling};
pub use ggml::{DequantError, GgmlType};
pub use kv::{Bits, KeyRope, KvConfig, KvRotation, PositionsMode, Precision};
