//! The `avx512vnni` variant's own code (AVX-512 F/BW/VL + VNNI): the interleaved groups
//! ([`group`]: one token, several, and the token tile) and the one-token Q4_K, Q5_K, Q6_K
//! and Q5_1 groups ([`kquant`]). For the rest it runs the AVX2 code (the type table).

pub mod group;
pub mod kquant;

pub use group::{group_dot, group_tile, group_tokens};
pub use kquant::{k4_group, q5_1_group, q6_k_group};
