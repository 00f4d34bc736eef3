//! # candle-distributed
//!
//! Synchronized batch normalization for [candle](https://github.com/huggingface/candle): batch
//! statistics computed over the *global* batch of every rank of a data-parallel group, with
//! PyTorch's `nn.SyncBatchNorm` semantics, and the collectives around it.
//!
//! - [`SyncBatchNorm`] / [`sync_batch_norm`]: the drop-in for `candle_nn::BatchNorm`, NCHW or
//!   channels-last, optional fused residual add + ReLU, exact for unequal and empty per-rank
//!   batches, one all-reduce of `3·C` values in the forward and `2·C` in the backward whatever
//!   the number of ranks.
//! - [`collective`]: the [`collective::Collective`] trait and its backends
//!   ([`collective::ThreadGroup`]: ranks as threads of one process; `Mpi` with the `mpi`
//!   feature; `NcclCollective` with the `nccl` feature), process groups, start-up helpers.
//! - [`DataParallel`]: replicas that train as one model (broadcast at start, bucketed gradient
//!   averaging, gradient accumulation, 16-bit gradients on the wire, uneven inputs), with the
//!   gradient all-reduce overlapped with the backward through [`GradHooks`].
//! - [`conv`]: [`Conv2d`], candle-nn's convolution layer (same constructors and variables) on
//!   the crate's faster convolution: a one-line swap.
//! - [`sampler`]: [`DistributedSampler`], each rank's share of a data set per epoch (PyTorch's
//!   `DistributedSampler`), shuffled by (seed, epoch), resumable mid-epoch.
//! - [`checkpoint`]: checkpoints every rank agrees on (atomic, written by rank 0, loaded by
//!   all), and [`optim::AdamW`], whose state can be saved.
//! - [`amp`]: [`amp::GradScaler`], dynamic loss scaling for f16 training, the same decision on
//!   every rank.
//! - [`ops`]: the arithmetic as functional ops, for users building their own layers.
//! - [`parallel`]: differentiable collectives (each documented with the objective its gradient
//!   is exact for) and tensor-parallel linear layers whose backward overlaps communication.
//!
//! Features: `cuda` (the CUDA kernels; nvcc and `CUDA_COMPUTE_CAP` at build time), `nccl`
//! (implies `cuda`), `mpi` (an MPI library at build and run time).
//!
//! ```
//! use candle_core::{DType, Device, Tensor};
//! use candle_distributed::collective::ThreadGroup;
//! use candle_distributed::{sync_batch_norm, SyncBatchNormConfig};
//! use candle_nn::{ModuleT, VarBuilder, VarMap};
//!
//! // Two ranks as two threads; rank 1 has twice as many samples as rank 0.
//! let means = ThreadGroup::run(2, |comm| -> candle_core::Result<Vec<f32>> {
//!     let vm = VarMap::new();
//!     let vb = VarBuilder::from_varmap(&vm, DType::F32, &Device::Cpu);
//!     let bn = sync_batch_norm(3, SyncBatchNormConfig::default(), vb, comm.clone())?;
//!     let n = 2 + 2 * comm.rank();
//!     let x = Tensor::randn(5f32, 2f32, (n, 3, 4, 4), &Device::Cpu)?;
//!     let y = bn.forward_t(&x, true)?; // statistics of all 6 samples
//!     y.backward()?; // the backward all-reduces its gradient sums too
//!     bn.running_mean().unwrap().to_vec1::<f32>()
//! })?;
//! // Every rank holds the same running statistics.
//! assert_eq!(means[0], means[1]);
//! # Ok::<(), candle_core::Error>(())
//! ```
#![cfg_attr(docsrs, feature(doc_cfg))]
#![warn(missing_docs)]
// Every public fallible function says when it fails (a `# Errors` section); `cargo clippy -- -D
// warnings` in CI holds it.
#![warn(clippy::missing_errors_doc)]

pub mod amp;
pub mod batch_norm;
pub mod checkpoint;
pub mod conv;
/// The collectives, the crate `candle-collective`: the [`collective::Collective`] trait, its
/// backends ([`collective::ThreadGroup`]; `Mpi` with the `mpi` feature; `NcclCollective` and
/// `NcclGroup` with the `nccl` feature), process groups, decorators, the flight recorder and the
/// start-up of multi-process jobs ([`collective::rendezvous`]).
pub use candle_collective as collective;
pub mod data_parallel;
mod device;
mod kernels;
mod layout;
/// The launch configurations and argument lists of the CUDA kernels in `kernels/`, shared by
/// the CUDA path and the kernels' emulation tests (`tests/kernels_emulated/`), which is why
/// they are reachable; not part of the API.
#[doc(hidden)]
pub use kernels::{args, launch};
pub mod ops;
pub mod optim;
pub mod parallel;
pub mod sampler;

pub use amp::GradScaler;
pub use batch_norm::{sync_batch_norm, SyncBatchNorm, SyncBatchNormConfig};
pub use conv::{conv2d, conv2d_no_bias, Conv2d};
pub use data_parallel::{DataParallel, GradHooks, OverlapStats};
pub use layout::ChannelLayout;

/// The former name of [`ChannelLayout`] (candle's own `Layout` sits beside it in the same files).
#[deprecated(since = "0.1.0", note = "renamed `ChannelLayout`")]
pub type Layout = ChannelLayout;
pub use sampler::{DistributedSampler, Remainder};

/// The README's Rust code blocks, compiled and run as doctests (`cargo test --doc`), so that
/// the front page's examples cannot rot.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
pub struct ReadmeDoctests;

/// The porting guide's Rust code blocks (`docs/porting.md`), compiled and run as doctests.
#[cfg(doctest)]
#[doc = include_str!("../docs/porting.md")]
pub struct PortingDoctests;
