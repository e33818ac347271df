//! # tinygpt-cpu
//!
//! A pure-CPU decode engine for Llama-family models whose KV cache can stop growing:
//! StreamingLLM (sink + window eviction) and KIVI (int8/int4 affine quantisation),
//! composable, checked against a scalar reference crate (`tinygpt-reference`).
//!
//! The pipeline, in data-flow order:
//! [`config`] (config.json / GGUF metadata → validated `Config`) →
//! [`weights`] (safetensors / `.tinygpt` / [`gguf`] → named tensors, memory-mapped) →
//! [`tokenizer`] (+ [`chat`] templates) →
//! [`model`] (forward pass) → [`attention`] (+ [`rope`] frequencies) → [`kv_cache`] (policy:
//! which rows survive; storage: how they are held) → [`quant`] (the KV cache's KIVI
//! quantisers only; GGML weight blocks are dequantised by [`dequant`] and multiplied by
//! `ops::qdot`) → [`ops`] (SIMD kernels + rayon) → [`sampler`] → [`generate`]
//! (prefill/decode loop, stats) → [`cli`];
//! [`server`] runs many sequences at once behind an OpenAI-shaped HTTP API.

pub mod attention;
pub mod chat;
pub mod cli;
pub mod config;
pub mod dequant;
pub mod dtype;
pub mod error;
pub mod eval;
pub mod generate;
pub mod gguf;
pub mod interrupt;
pub mod kv_cache;
pub mod memory;
pub mod model;
pub mod ops;
pub mod quant;
pub mod relay;
pub mod rope;
pub mod sampler;
pub mod server;
pub mod threads;
pub mod tokenizer;
pub mod weights;

pub use error::{Error, Result};
