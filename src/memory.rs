//! Memory estimates checked before allocating: a request that cannot fit is refused with
//! the flag or config key named, instead of aborting in the allocator.

use crate::config::Config;
use crate::kv_cache::Precision;

/// Bytes this process can still allocate: the smaller of the system's `MemAvailable` and
/// what the address-space limit (`ulimit -v`) leaves above the current mappings. `None`
/// when neither is known (not Linux), in which case nothing is refused.
pub fn available_bytes() -> Option<u64> {
    let avail = proc_field("/proc/meminfo", "MemAvailable:").map(|kib| kib * 1024);
    let as_left = address_space_limit().map(|limit| {
        let used = proc_field("/proc/self/status", "VmSize:").unwrap_or(0) * 1024;
        limit.saturating_sub(used)
    });
    match (avail, as_left) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    }
}

/// A `kB` field of a /proc file (`/proc/meminfo`, `/proc/self/status`).
fn proc_field(file: &str, key: &str) -> Option<u64> {
    let text = std::fs::read_to_string(file).ok()?;
    let line = text.lines().find(|l| l.starts_with(key))?;
    line[key.len()..].split_whitespace().next()?.parse().ok()
}

/// RLIMIT_AS from /proc/self/limits (soft limit), if set.
fn address_space_limit() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/self/limits").ok()?;
    let line = text.lines().find(|l| l.starts_with("Max address space"))?;
    line["Max address space".len()..]
        .split_whitespace()
        .next()?
        .parse()
        .ok()
}

/// What a heap block of `size` requested bytes occupies in a general-purpose allocator
/// (0 for no block): glibc's malloc, which every Linux build uses, adds an 8-byte header
/// and rounds the chunk up to 16 bytes, 32 at least. Other allocators' size classes differ
/// by a few bytes a block; this is the model the prompt cache's bound counts with.
pub fn heap_block_bytes(size: usize) -> usize {
    if size == 0 {
        0
    } else {
        (size + 8).next_multiple_of(16).max(32)
    }
}

/// Upper bound of the KV cache bytes one token adds across all layers when both K and V
/// are stored at `precision` (KIVI's scale/zero and the f32 residual group rounded up).
/// For a cache with different K and V precisions pass the wider one
/// ([`widest_precision`]).
pub fn kv_bytes_per_token(cfg: &Config, precision: Precision) -> u128 {
    let values = 2 * cfg.n_layers as u128 * cfg.kv_dim() as u128;
    // Bytes per value, in eighths: the code bits, plus 2 for a KIVI width's f16 scale and
    // zero per group and the f32 residual group, rounded up generously (int8 10, int4 6,
    // int2 4).
    let kivi_overhead = if precision.kivi_bits().is_some() {
        2
    } else {
        0
    };
    let eighths = u128::from(precision.bits()) + kivi_overhead;
    values * eighths / 8
}

/// The wider of a cache's K and V precisions, for [`kv_bytes_per_token`].
pub fn widest_precision(kv: &crate::kv_cache::KvConfig) -> Precision {
    let (k, v) = (kv.key_precision(), kv.value_precision());
    if k.bits() >= v.bits() {
        k
    } else {
        v
    }
}

/// Human-readable size.
pub fn human(n: u128) -> String {
    let gib = n as f64 / (1u64 << 30) as f64;
    if gib >= 1.0 {
        format!("{gib:.1} GiB")
    } else {
        format!("{:.1} MiB", n as f64 / (1u64 << 20) as f64)
    }
}

/// A dense cache's buffers grow by doubling: while one grows, the old and the new buffer
/// coexist. Estimates of a growing cache are multiplied by this.
pub const GROWTH_SLACK: u128 = 2;

/// `Err(msg)` when `bytes` exceed what this process can still allocate.
pub fn check_fits(bytes: u128) -> std::result::Result<(), String> {
    match available_bytes() {
        Some(avail) if bytes > avail as u128 => Err(format!(
            "needs about {} but only {} is available",
            human(bytes),
            human(avail as u128)
        )),
        _ => Ok(()),
    }
}

/// Refuses a weight conversion that cannot fit: `--weights-dtype f32/bf16` copies every
/// tensor not already in that dtype, and the scalar reference engine dequantises all of
/// them to f32 (mmapped weights in their file dtype cost nothing here).
pub fn check_weights_fit(
    files: &crate::weights::ModelFiles,
    wdtype: crate::model::WeightsDType,
    reference: bool,
) -> crate::Result<()> {
    use crate::dtype::DType;
    use crate::model::WeightsDType;
    let target = match (reference, wdtype) {
        (true, _) | (false, WeightsDType::F32) => Some(DType::F32),
        (false, WeightsDType::Bf16) => Some(DType::BF16),
        (false, WeightsDType::Native) => None,
    };
    let Some(target) = target else {
        return Ok(());
    };
    let bytes: u128 = files
        .tensors
        .values()
        .filter(|t| t.dtype != target)
        .map(|t| t.numel() as u128 * target.block_bytes() as u128)
        .sum();
    check_fits(bytes).map_err(|m| {
        crate::Error::flag(
            if reference {
                "--engine"
            } else {
                "--weights-dtype"
            },
            format!("converting the weights to {} {m}", target.name()),
        )
    })
}

/// Gives the heap memory freed so far back to the system, where the allocator would keep
/// it: glibc's malloc holds freed pages in its arenas (one per thread that allocated,
/// raising its mmap threshold to the largest block freed), so a process that once held a
/// large buffer keeps its resident size until `malloc_trim(0)` returns the free pages.
/// Costs a walk over the free lists (milliseconds for a few GiB); a no-op with other
/// allocators and systems. Returns whether memory was released.
pub fn release_free_memory() -> bool {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        // SAFETY: malloc_trim takes each arena's lock itself and only returns free pages
        // (madvise); it is safe to call from any thread at any time.
        unsafe { libc::malloc_trim(0) == 1 }
    }
    #[cfg(not(all(target_os = "linux", target_env = "gnu")))]
    {
        false
    }
}

#[cfg(test)]
mod tests {
    /// The block model is glibc's: its own `malloc_usable_size` is the chunk less the
    /// 8-byte header, for every size below the mmap threshold. A free chunk up to 31 bytes
    /// larger (a remainder below glibc's 32-byte minimum is not split off) can be handed
    /// out instead when other threads' frees left one in a bin (seen under qemu aarch64,
    /// 416 for 400); so up to eight blocks are kept live at once, each within that slack,
    /// and the smallest is the model's.
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    #[test]
    fn heap_block_bytes_is_glibcs_chunk() {
        assert_eq!(super::heap_block_bytes(0), 0);
        for n in (1..=4096).chain([10_000, 30_001, 65_536, 100_003]) {
            let want = super::heap_block_bytes(n);
            // SAFETY: plain malloc/free pairs; the pointers are only measured.
            let chunks: Vec<usize> = unsafe {
                let mut live = Vec::new();
                let mut sizes = Vec::new();
                for _ in 0..8 {
                    let p = libc::malloc(n);
                    assert!(!p.is_null());
                    sizes.push(libc::malloc_usable_size(p) + 8);
                    live.push(p);
                    if sizes.last() == Some(&want) {
                        break;
                    }
                }
                for p in live {
                    libc::free(p);
                }
                sizes
            };
            assert!(
                chunks.iter().all(|&c| c >= want && c < want + 32),
                "{n} bytes: {chunks:?} vs {want}"
            );
            assert_eq!(chunks.iter().min(), Some(&want), "{n} bytes: {chunks:?}");
        }
    }
}
