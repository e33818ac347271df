//! The aarch64 kernels: `neon` (NEON with the dot-product extension, the `neon-dotprod`
//! variant). Floats run the `portable` code (NEON through `wide`).

pub mod neon;
