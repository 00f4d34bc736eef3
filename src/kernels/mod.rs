//! The Rust side of the CUDA kernels in `kernels/*.cu`, one place for everything a change of a
//! kernel touches: its argument list ([`args`], built once with every buffer's size checked), its
//! launch grid ([`launch`](mod@launch)), and, with the `cuda` feature, the loaded images (`modules`), the
//! reductions' scratch (`counters`) and the storage types the kernels are compiled for. The
//! CUDA path of each op (`src/ops/<op>.rs`) launches these calls; the kernels' emulation tests
//! (`tests/kernels_emulated/`) run the same calls on the host, which is why [`args`] and
//! [`launch`](mod@launch) are reachable (hidden) from outside the crate.

pub mod args;
#[cfg(feature = "cuda")]
pub(crate) mod counters;
#[cfg(test)]
mod fatbin;
pub mod launch;
#[cfg(feature = "cuda")]
pub(crate) mod modules;

#[cfg(feature = "cuda")]
pub(crate) use counters::with_scratch;
#[cfg(feature = "cuda")]
pub(crate) use modules::{launch, shipped_archs, Module};

#[cfg(feature = "cuda")]
use candle_core::cuda_backend::cudarc::driver::DeviceRepr;
#[cfg(feature = "cuda")]
use candle_core::cuda_backend::CudaDType;

/// A storage type of the kernels with its accumulation type (`AccOf<T>` in
/// `kernels/compat.cuh`): the dtype of the per-channel parameters the kernels read.
#[cfg(feature = "cuda")]
pub(crate) trait KernelElem: CudaDType + DeviceRepr {
    type Acc: CudaDType;
}
#[cfg(feature = "cuda")]
impl KernelElem for f32 {
    type Acc = f32;
}
#[cfg(feature = "cuda")]
impl KernelElem for f64 {
    type Acc = f64;
}
#[cfg(feature = "cuda")]
impl KernelElem for half::f16 {
    type Acc = f32;
}
#[cfg(feature = "cuda")]
impl KernelElem for half::bf16 {
    type Acc = f32;
}
