//! The CPU side: whether the AVX2 + FMA builds of the vector loops may run, and cache hints.

/// Set to a non-empty value other than `0` to run the baseline (SSE2) kernels even on a CPU
/// with AVX2 (read once per process; the test suite runs both ways).
pub const NO_SIMD_ENV: &str = "CANDLE_DISTRIBUTED_NO_SIMD";

/// True when the CPU has AVX2 and FMA and [`NO_SIMD_ENV`] does not forbid them.
#[cfg(target_arch = "x86_64")]
#[inline]
pub fn has_avx2_fma() -> bool {
    static ENABLED: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ENABLED.get_or_init(|| {
        let off = std::env::var(NO_SIMD_ENV).is_ok_and(|v| !v.is_empty() && v != "0");
        !off && std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma")
    })
}

/// False: AVX2 and FMA are x86-64's; on other architectures (Apple silicon, ARM servers) the
/// vector loops run their portable build.
#[cfg(not(target_arch = "x86_64"))]
#[inline]
pub fn has_avx2_fma() -> bool {
    false
}

/// Asks the CPU to bring the cache line holding `v` into its caches, if there is one; a hint
/// that reads nothing and changes nothing.
#[inline(always)]
pub fn prefetch<T>(v: Option<&T>) {
    prefetch_into::<false, T>(v)
}

/// Asks the CPU to bring the cache line holding `v` into its level-2 cache, not the level-1
/// ([`prefetch`] asks for both; on cores older than AMD's Zen 4 this hint may act like that
/// one); a hint that reads nothing and changes nothing.
///
/// For the strided reads of wide rows in candle-distributed's channels-last reductions this is
/// the faster hint: the level-1 hint was the slower one wherever those passes' inputs came from
/// memory (measured: candle-distributed's docs/benchmarks.md, section "SyncBatchNorm on the
/// CPU, world size 1, against PyTorch and candle-nn").
#[inline(always)]
pub fn prefetch_l2<T>(v: Option<&T>) {
    prefetch_into::<true, T>(v)
}

/// [`prefetch`] (`L2_ONLY = false`, x86's `T0` hint) or [`prefetch_l2`] (`true`, `T1`); nothing
/// on other architectures.
#[cfg_attr(not(target_arch = "x86_64"), allow(unused_variables))]
#[inline(always)]
fn prefetch_into<const L2_ONLY: bool, T>(v: Option<&T>) {
    #[cfg(target_arch = "x86_64")]
    if let Some(v) = v {
        use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0, _MM_HINT_T1};
        let p = (v as *const T).cast::<i8>();
        // SAFETY: a prefetch reads no memory architecturally and cannot fault; the pointer
        // comes from a reference, so it is valid and aligned anyway.
        unsafe {
            if L2_ONLY {
                _mm_prefetch::<_MM_HINT_T1>(p)
            } else {
                _mm_prefetch::<_MM_HINT_T0>(p)
            }
        }
    }
}
