//! # tinygpt-cpu
//!
//! A pure-CPU decode engine for Llama-family models whose KV cache can stop growing:
//! StreamingLLM (sink + window eviction) and KIVI (int8/int4 affine quantisation),
//! composable, checked against a scalar reference crate (`tinygpt-reference`, a
//! dev-dependency; the types both name are in `tinygpt-types`).
//!
//! The pipeline, in data-flow order:
//! [`config`] (config.json / GGUF metadata → validated `Config`) →
//! [`weights`] (safetensors / `.tinygpt` / [`gguf`] → named tensors, memory-mapped) →
//! [`tokenizer`] (+ [`chat`] templates) →
//! [`model`] (forward pass) → [`attention`] (+ [`rope`] frequencies) → [`kv_cache`] (policy:
//! which rows survive; storage: how they are held) → [`kivi`] (the KV cache's codes: KIVI
//! quantisers, the fused attention kernels over codes per ISA, the Hadamard rotation) →
//! [`ops`] (float operations and the matrix products, SIMD and rayon; their weight kernels,
//! one table of weight types laid out by instruction set, are [`wkernels`]) → [`sampler`] →
//! [`generate`] (prefill/decode loop, stats) → [`cli`];
//! [`server`] runs many sequences at once behind an OpenAI-shaped HTTP API; [`state`] saves
//! one sequence's cache to a file and loads it back (`sample --save-state/--load-state`).

pub mod attention;
pub mod chat;
pub mod cli;
pub mod config;
pub mod dtype;
pub mod error;
pub mod eval;
pub mod exec;
pub mod generate;
pub mod gguf;
pub mod interrupt;
pub mod kivi;
pub mod kv_cache;
pub mod memory;
pub mod model;
pub mod ops;
pub mod relay;
pub mod rope;
pub mod sampler;
pub mod server;
pub mod speculate;
pub mod state;
pub mod threads;
pub mod tokenizer;
pub mod weights;
pub mod wkernels;

pub use error::{Error, Result};
