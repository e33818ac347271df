//! The `avx2` variant (AVX2 + FMA + F16C): the interleaved groups ([`group`]), the whole-row
//! K-quant, IQ4_XS and Q5_1 kernels ([`kquant`]), the Q2_K / Q3_K rows ([`low`]) and the
//! float rows ([`float`]). The `avx512vnni` variant runs much of it as well (the type
//! table says where).

pub mod float;
pub mod group;
pub mod kquant;
pub mod low;

pub use float::float_rows;
pub use group::{group_dot, group_tokens};
pub use kquant::{
    iq4_xs_group, iq4_xs_row, k4_group, k4_row, q5_1_group, q5_1_row, q6_k_group, q6_k_row,
};
pub use low::{q2_k_row, q3_k_row};
