//! The `portable` variant: every kernel written with `wide`'s vector types only (no
//! `std::arch`, no `unsafe`), so it compiles for every target, and `wide` lowers each
//! operation to the widest vectors the build enables (SSE2 … AVX2 on x86_64, NEON on
//! aarch64, simd128 on wasm, plain arrays elsewhere). It is what a CPU without AVX2 or the
//! Arm dot-product extension runs (for example a Cortex-A72, or an x86_64 build for the
//! baseline target); its speed depends on the vector width the build enables
//! (`.cargo/config.toml` builds for the host CPU).
//!
//! * [`group`]: the interleaved types (`group_dot`, `group_tokens`);
//! * [`kquant`]: the whole-row types (`k4_group`, `q6_k_group`, `iq4_xs_group`,
//!   `q2_k_group`, `q3_k_group`, `q5_1_group`: eight rows × `T` tokens);
//! * [`float`]: the float rows (`float_rows`).

use wide::i16x16;

pub mod float;
pub mod group;
pub mod kquant;

pub use float::float_rows;
pub use group::{group_dot, group_tokens};
pub use kquant::{iq4_xs_group, k4_group, q2_k_group, q3_k_group, q5_1_group, q6_k_group};

/// Lane `i` holds bit `i` (as an `i16`): a 16-bit mask ANDed with it shows each lane its bit.
pub const LANE_BITS: i16x16 = i16x16::new([
    1,
    2,
    4,
    8,
    16,
    32,
    64,
    128,
    256,
    512,
    1024,
    2048,
    4096,
    8192,
    16384,
    i16::MIN,
]);
