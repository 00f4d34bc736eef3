//! Collective communication between the ranks of a data-parallel group.
//!
//! [`Collective`] is the object-safe interface every backend implements; the synchronized
//! layers of this crate hold an `Arc<dyn Collective>` and never know which backend is behind it.
//!
//! Rules every backend follows (and every caller must follow):
//! - every rank issues the same collectives, in the same order, whatever its local data;
//! - results are identical on every rank (`ThreadGroup`: bitwise, one reduction in rank order;
//!   MPI and NCCL: the libraries' own reduction order, identical across the ranks of a
//!   communicator in practice);
//! - a collective that cannot complete (timeout, a rank that left, mismatched arguments)
//!   returns an error on every rank that can still run; nothing hangs forever.
//!
//! Backends: [`ThreadGroup`] (ranks are threads of one process); `Mpi` (feature `mpi`: ranks are
//! MPI processes); `NcclCollective` (feature `nccl`: ranks are GPUs).

pub mod bootstrap;
mod checked;
mod error;
#[cfg(feature = "mpi")]
mod mpi;
#[cfg(feature = "nccl")]
mod nccl;
mod op;
mod pending;
pub mod store;
mod threads;

pub use checked::Checked;
pub use error::CollectiveError;
#[cfg(feature = "mpi")]
pub use mpi::Mpi;
#[cfg(feature = "nccl")]
pub use nccl::{NcclCollective, NcclGroup};
pub use op::Op;
pub use pending::Pending;
pub(crate) use pending::Worker;
pub use threads::ThreadGroup;

use std::sync::Arc;
use std::time::Duration;

use candle_core::{Result, Tensor};

/// Default time a collective may take before it fails (every backend; 5 minutes).
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(300);

/// Reduction applied element-wise by [`Collective::all_reduce`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ReduceOp {
    /// Element-wise sum over ranks.
    Sum,
    /// Element-wise sum over ranks divided by the world size (float dtypes only).
    Avg,
    /// Element-wise maximum over ranks.
    Max,
    /// Element-wise minimum over ranks.
    Min,
}

/// A communicator: one rank's handle on a group of `world_size` ranks.
///
/// All methods are collective: every rank of the group must call them in the same order with
/// tensors of the same dtype and element count (except where a method says otherwise).
pub trait Collective: Send + Sync + std::fmt::Debug {
    /// This rank's index in `0..world_size()`.
    fn rank(&self) -> usize;

    /// Number of ranks in the group.
    fn world_size(&self) -> usize;

    /// Element-wise reduction of `t` over all ranks.
    ///
    /// `t`: any shape, identical on every rank. Returns a tensor of the same shape, dtype and
    /// device, identical on every rank (see the module documentation).
    fn all_reduce(&self, t: &Tensor, op: ReduceOp) -> Result<Tensor>;

    /// Concatenation of every rank's `t` along dimension 0, in rank order.
    ///
    /// `t`: `(n_r, *rest)`, where `rest` and the dtype are identical on every rank but `n_r` may
    /// differ (unequal per-rank batches). Returns `(Σ n_r, *rest)`.
    fn all_gather(&self, t: &Tensor) -> Result<Tensor>;

    /// Rank `root`'s `t`, delivered to every rank.
    ///
    /// `t`: any shape, identical shape and dtype on every rank (the non-root values are ignored).
    fn broadcast(&self, t: &Tensor, root: usize) -> Result<Tensor>;

    /// Returns once every rank has called `barrier`.
    fn barrier(&self) -> Result<()>;

    /// Element-wise reduction over ranks, scattered along dimension 0: rank `r` receives rows
    /// `r·k .. (r+1)·k` of the reduced tensor.
    ///
    /// `t`: `(W·k, *rest)` with `W = world_size()`, identical shape and dtype on every rank.
    /// Returns `(k, *rest)`: the same rows as [`Collective::all_reduce`] gives.
    fn reduce_scatter(&self, t: &Tensor, op: ReduceOp) -> Result<Tensor>;

    /// Starts [`Collective::all_reduce`] and returns at once; [`Pending::wait`] gives the result.
    ///
    /// The call takes its place in the group's call order when it is started: every rank must
    /// start it at the same position relative to its other collectives. Progress happens while
    /// the caller computes (a communication thread on `ThreadGroup` and MPI, a side stream on
    /// NCCL).
    fn all_reduce_async(&self, t: &Tensor, op: ReduceOp) -> Result<Pending>;

    /// Starts [`Collective::all_gather`]; see [`Collective::all_reduce_async`].
    fn all_gather_async(&self, t: &Tensor) -> Result<Pending>;

    /// Starts [`Collective::reduce_scatter`]; see [`Collective::all_reduce_async`].
    fn reduce_scatter_async(&self, t: &Tensor, op: ReduceOp) -> Result<Pending>;

    /// `Err` when a collective whose call had already returned `Ok` failed afterwards, so that
    /// its output was never written; `Ok` otherwise. Not collective, and cheap (no
    /// communication, no device wait).
    ///
    /// Only NCCL has such failures: a collective is enqueued when its call returns, and the
    /// watchdog may abort it later (a peer that died, a timeout). [`crate::SyncBatchNorm`] asks
    /// before each training step and rolls its running statistics back when the answer is an
    /// error. Backends whose calls return their final result (`ThreadGroup`, MPI) fail the call
    /// itself, and keep the default.
    fn deferred_error(&self) -> Result<()> {
        Ok(())
    }

    /// Whether a call can return `Ok` before its collective has completed, so that
    /// [`Collective::deferred_error`] can later report it lost (`true` for NCCL): callers whose
    /// rollback state costs something can keep it only then. Wrappers forward it.
    fn defers_errors(&self) -> bool {
        false
    }

    /// Splits the group into disjoint subgroups (MPI's `MPI_Comm_split`, NCCL's
    /// `ncclCommSplit`): ranks passing the same `color` form one group, ordered by `key`, then
    /// by their rank here. A rank passing `None` joins no group and gets `None`.
    ///
    /// Collective over this group: every rank calls it, in the same order as the other
    /// collectives. The new communicators are independent of this one (their own call order,
    /// their own failures).
    fn split(&self, color: Option<u32>, key: u32) -> Result<Option<Arc<dyn Collective>>>;

    /// The subgroup of the listed ranks (PyTorch's `new_group(ranks)`), ranked in list order;
    /// `None` on the ranks not listed. Every rank must call it with the same list.
    fn new_group(&self, ranks: &[usize]) -> Result<Option<Arc<dyn Collective>>> {
        let world = self.world_size();
        let mut seen = vec![false; world];
        for &r in ranks {
            if r >= world || std::mem::replace(&mut seen[r], true) {
                candle_core::bail!(
                    "new_group: ranks {ranks:?} must be distinct and below the world size {world}"
                )
            }
        }
        let me = ranks.iter().position(|&r| r == self.rank());
        self.split(me.map(|_| 0), me.unwrap_or(0) as u32)
    }
}

/// The rows `[rank·k, (rank+1)·k)` of a `(W·k, *rest)` tensor, `W = world`: the part of a
/// reduce-scatter that `rank` receives. Errors when the rows do not divide evenly.
pub(crate) fn scatter_rows(t: &Tensor, rank: usize, world: usize) -> Result<Tensor> {
    let rows = t.dims().first().copied().unwrap_or(0);
    if t.rank() == 0 || rows % world != 0 {
        candle_core::bail!(
            "reduce_scatter: dimension 0 of shape {:?} must be a multiple of the world size {world}",
            t.dims()
        )
    }
    let k = rows / world;
    t.narrow(0, rank * k, k)
}

/// Members of `color`'s subgroup in a split, from every rank's `(color, key)` in rank order:
/// ranks ordered by `(key, rank)`.
pub(crate) fn split_members(all: &[(Option<u32>, u32)], color: u32) -> Vec<usize> {
    let mut m: Vec<usize> = (0..all.len())
        .filter(|&r| all[r].0 == Some(color))
        .collect();
    m.sort_by_key(|&r| (all[r].1, r));
    m
}
