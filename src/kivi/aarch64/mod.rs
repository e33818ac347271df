//! The aarch64 variants of the fused KIVI attention kernels: `neon` (the one Apple Silicon
//! runs), with the functions every variant has (`takes`, `dot_codes_groups`,
//! `axpy_codes_rows`, `dot_codes_groups_multi`, `axpy_codes_rows_multi`).

pub(super) mod neon;
