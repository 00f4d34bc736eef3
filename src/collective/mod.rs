//! Collective communication between the ranks of a data-parallel group.
//!
//! [`Collective`] is the object-safe interface every backend implements; the synchronized
//! layers of this crate hold an `Arc<dyn Collective>` and never know which backend is behind it.
//!
//! Rules every backend follows (and every caller must follow):
//! - every rank issues the same collectives, in the same order, whatever its local data;
//! - results are bitwise identical on every rank (deterministic reduction order);
//! - a collective that cannot complete (timeout, a rank that left, mismatched arguments)
//!   returns an error on every rank that can still run; nothing hangs forever.
//!
//! Backends: [`ThreadGroup`] (ranks are threads of one process).

mod error;
mod threads;

pub use error::CollectiveError;
pub use threads::ThreadGroup;

use candle_core::{Result, Tensor};

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
    /// device, bitwise identical on every rank.
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
}
