//! # tinygpt-reference
//!
//! The scalar reference implementation of tinygpt-cpu's numerics, written to be read:
//! plain loops over `f32`, no SIMD, no threads, no `unsafe`. The optimised engine is
//! tested against it (as ggml's `*_ref` functions are the oracle for its kernels).
//!
//! Pipeline: [`config`] → [`model`] (forward) → [`attention`] → [`kv_cache`] (policy and
//! storage) → [`rope`].
//!
//! Tensors are [`ndarray`] arrays with their shapes in the types: weight matrices
//! `Array2<f32>` `(out_features, in_features)`, per-head query/key/value `(heads, head_dim)`,
//! a sequence's keys `(tokens, kv_heads, head_dim)`, indexed as `w[[o, i]]` rather than
//! `w[o * cols + i]`. Every sum is an explicit loop in the engine's canonical order
//! ([`order`]: eight lane sums and a fixed reduction tree, never `.dot()`), so the engine's
//! differential tests compare against it bit for bit. Byte formats
//! ([`ggml`], [`ggml_dot`]) and the cache's storage ([`kv_cache`], [`quant`]) stay on byte
//! and code slices, which is what they describe.
#![forbid(unsafe_code)]

/// The array crate the reference's tensors are held in, re-exported so that code building
/// [`model::Weights`] names the same version.
pub use ndarray;

pub mod attention;
pub mod config;
pub mod ggml;
pub mod ggml_dot;
pub mod ggml_kdot;
pub mod ggml_more;
pub mod hadamard;
pub mod kv_cache;
pub mod model;
pub mod order;
pub mod quant;
pub mod rope;
#[cfg(test)]
mod test_rng;

pub use config::{AttentionType, Config, RopeScaling};
pub use kv_cache::{KvConfig, KvRotation, LayerCache, PositionsMode, Precision};
pub use model::{Model, State, Weights};
