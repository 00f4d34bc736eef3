//! The floor the ops and the collectives stand on: what touches a device's memory or launches
//! on it, and nothing about batch normalisation.
//!
//! - `cpu`: element types, the `(N, C, S)` geometry of an input, contiguous slices of CPU
//!   storage, deterministic parallel drivers and the dtype dispatch of the CPU paths.
//! - `cuda` (feature `cuda`): the kernel images built from `kernels/*.cu`, loaded once per
//!   device, kernel lookup, launching, device views of storage, the reductions' arrival
//!   counters and the dtype dispatch of the CUDA paths.
//! - [`launch`]: the launch configuration of every kernel family.
//! - [`args`]: the argument list of every kernel, built once with its buffer sizes checked;
//!   the CUDA path launches what it returns and the kernels' emulation tests run the same
//!   lists on the host.
//! - `fatbin` (tests): reads a fatbin's table of contents.
//!
//! Errors raised here name their caller (the `op` argument): an op's errors name the op, the
//! NCCL backend's name NCCL.

pub mod args;
pub(crate) mod cpu;
#[cfg(feature = "cuda")]
pub(crate) mod cuda;
#[cfg(test)]
mod fatbin;
pub mod launch;
