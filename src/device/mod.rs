//! The floor the kernels and the ops stand on: what touches a device's memory
//! or launches on it, and nothing about batch normalisation.
//!
//! - `geometry`: the `(N, C, S)` shape of an input, channels-first or channels-last.
//! - `call`: what a kernel launch is (grid, parameters, buffers), with a size-checking builder.
//! - `cpu`: element types, contiguous slices of CPU storage, deterministic parallel drivers on
//!   candle's worker pool, and the SIMD helpers of the CPU paths.
//! - `cuda` (feature `cuda`): launching a call, the buffers of a launch with their
//!   stream-ordering guards, the dtype dispatch of the CUDA paths.
//!
//! What the collectives need as well (the run-time SIMD choice, cache hints, device views of
//! storage, the per-thread stream) is defined once, below them, in `crate::collective::device`.
//!
//! Errors raised here name their caller (the `op` argument): an op's errors name the op.

mod call;
pub(crate) mod cpu;
#[cfg(feature = "cuda")]
pub(crate) mod cuda;
mod geometry;
mod support;

pub(crate) use call::List;
pub use call::{Arg, Buffer, Call, Launch};
pub use geometry::Geometry;
pub(crate) use support::{check_supported, composite, missing_copy_feature};
