//! # tinygpt-reference
//!
//! The scalar reference implementation of tinygpt-cpu's numerics, written to be read:
//! plain loops over `f32`, no SIMD, no threads, no `unsafe`. The optimised engine is
//! tested against it (as ggml's `*_ref` functions are the oracle for its kernels).
//!
//! Pipeline: [`config`] → [`model`] (forward) → [`attention`] → [`kv_cache`] (policy and
//! storage) → [`rope`].
#![forbid(unsafe_code)]

pub mod attention;
pub mod config;
pub mod ggml;
pub mod ggml_dot;
pub mod kv_cache;
pub mod model;
pub mod quant;
pub mod rope;

pub use config::{AttentionType, Config, RopeScaling};
pub use kv_cache::{KvConfig, LayerCache, PositionsMode, Precision};
pub use model::{Model, State, Weights};
