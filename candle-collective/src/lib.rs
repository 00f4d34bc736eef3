//! # candle-collective
//!
//! Collective communication between the ranks of a data-parallel (or tensor-parallel) group of
//! [candle](https://github.com/huggingface/candle) programs: all-reduce, broadcast, all-gather,
//! reduce-scatter, barrier and split, on threads of one process, MPI processes or NCCL GPUs,
//! with timeouts that end in errors instead of hangs, hang reports and a flight recorder.
//!
//! [`Collective`] is the object-safe interface every backend implements; whatever is built on
//! it holds an `Arc<dyn Collective>` and never knows which backend is behind it.
//! `candle-distributed` builds its synchronized batch norm, data-parallel training and
//! tensor-parallel layers on this crate alone and re-exports it as
//! `candle_distributed::collective`; a program that needs the collectives without batch norm
//! (a transformer fine-tune with its own data-parallel loop) can depend on this crate alone.
//!
//! Features: `cuda` (tensors on CUDA devices), `nccl` (the NCCL backend; implies `cuda`),
//! `mpi` (the MPI backend; an MPI library at build and run time).
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
//!
//! # Backends
//!
//! | backend | feature | device | how to create one |
//! |---|---|---|---|
//! | `ThreadGroup` | — | any | `ThreadGroup::run(n, \|comm\| …)` or `ThreadGroup::new(n)` |
//! | `Mpi` | `mpi` | CPU (others are copied) | `Mpi::init()?.world()?` under `mpirun` |
//! | `NcclCollective` | `nccl` | the rank's GPU | `NcclGroup::new`, `from_env`, `from_collective` |
//!
//! `ThreadGroup`'s tensors, timeouts and faults:
//! - tensors on any device, reduced on the CPU;
//! - a rank waiting past the timeout, or one that panics, makes every pending and later call
//!   fail on every rank;
//! - a rank that drops its communicator makes every call it never made fail at once, while the
//!   asynchronous calls it had started still complete, without its drop waiting for them
//!   (`tests/thread_group.rs::a_rank_that_leaves_with_an_async_call_outstanding_fails_its_peers_at_once`).
//!
//! `Mpi`'s timeouts and faults:
//! - every call first agrees on op, dtype, shape and root, together with each rank's verdict on
//!   its own arguments (a 40-byte all-gather): ranks that disagree get a mismatch error on every
//!   rank and the group is broken for every later call; an argument invalid on some ranks (e.g.
//!   a split color beyond `i32` on one rank) is an error on every rank and leaves the group
//!   usable (`scripts/test-mpi.sh`, "mismatched calls fail on every rank");
//! - waits are polled against the timeout, and since an MPI collective cannot be cancelled a
//!   timeout prints the reason and calls `MPI_Abort`, ending the job;
//! - `split` is blocking, without timeout.
//!
//! `NcclCollective`'s start-up, timeouts and faults:
//! - created with `NcclGroup::new(&[0, …, 7])` (one process, thread per GPU),
//!   `NcclCollective::from_env()` (torchrun variables; the id through the job's store: torchrun's,
//!   or without torchrun one that rank 0 hosts) or
//!   `NcclCollective::from_collective(&*mpi_world, local_rank)` (id over MPI);
//! - non-blocking communicators (`config.blocking = 0`): no thread ever waits inside NCCL, so an
//!   abort is legal between any two calls; NCCL ≥ 2.27 required, checked at creation;
//! - the start-up and `split` are polled under the timeout (a rank that never arrives is an
//!   error, not a hang);
//! - a watchdog thread per communicator polls `ncclCommGetAsyncError` and an event recorded
//!   after each collective every 10 ms, and on an NCCL error, a collective past the timeout or
//!   a CUDA error marks the communicator broken and calls `ncclCommAbort`: every later call,
//!   and the `wait` of a collective started before, fails with the reason; NCCL errors carry
//!   NCCL's code and text;
//! - dropping finalizes (queued work flushed) under the timeout, then destroys, or aborts a
//!   broken communicator or one whose finalize does not finish (an `NcclGroup`'s communicators
//!   close together when the last one is dropped);
//! - NCCL does not compare the ranks' arguments: wrap it in [`Checked`] to agree on
//!   op, dtype and count before each call (one small all-gather and a host wait per call; off
//!   by default, which costs nothing; `tests/checked.rs` on thread ranks);
//! - blocking mode (`NCCL_COMM_BLOCKING`, wherever NCCL finds it) is refused on every rank
//!   before any peer is contacted, on NCCL's own answer (a one-rank probe communicator): it
//!   would void every timeout;
//! - no host synchronisation except `barrier` and `all_gather` (which reads the per-rank row
//!   counts);
//! - layout: `src/nccl/{ffi,raw,blocking,watchdog,enqueue,ops,mod}.rs`.
//!
//! What each fault does to every rank, and the test that shows it: `docs/faults.md` in
//! `candle-distributed`'s repository.
//!
//! # Timeouts and launching
//!
//! All timeouts default to [`DEFAULT_TIMEOUT`] (5 minutes), or to
//! `CANDLE_DISTRIBUTED_TIMEOUT` seconds where that variable is set (one setting for every
//! backend; PyTorch's is `init_process_group`'s `timeout` argument), and have a
//! `*_with_timeout` constructor.
//!
//! **Hang reports.** Every rank of every backend keeps a flight recorder of its last
//! collectives ([`recorder`]: call number, op, dtype, element count, state, times;
//! `CANDLE_DISTRIBUTED_RECORDER` records, 64 by default; `Collective::recorder`). On a timeout
//! a thread rank logs every rank's recorder (`log::error!`), an NCCL rank its own when its
//! communicator is aborted, an MPI rank prints its own before it aborts the job; where the
//! ranks share a process (`ThreadGroup`, `NcclGroup`) the error names the ranks behind and
//! where they stopped:
//!
//! ```text
//! threads all_reduce (call #2) on rank 0: timed out after 2s waiting for ranks [2]: rank 2 never
//! reached all_reduce #2; its last collective: all_reduce #1 F32×4, completed, enqueued at
//! 0.001 s, started at 0.001 s, ended at 0.001 s
//! ```
//!
//! (`tests/errors.rs::a_timeout_names_where_the_laggard_stopped`; on the simulated NCCL,
//! `tests/nccl_faults.rs::a_hang_report_names_the_rank_behind`: "all_reduce #1 did not complete
//! within 2s (rank 1 never reached all_reduce #1; its last collective: all_reduce #0 …)").
//! Ranks in separate processes: NCCL started by `NcclCollective::from_env` names the ranks
//! behind from the progress each rank publishes in the job's store (torchrun's, or the one
//! that rank 0 hosts in any other launch:
//! `tests/nccl_faults.rs::a_hang_report_across_processes_names_the_rank_behind`,
//! `a_hang_report_names_the_rank_behind_in_a_launch_without_torchrun`); NCCL started from
//! another collective, and MPI, report only their own calls.
//!
//! Rules for every backend: every rank issues the same collectives in the same order.
//! ThreadGroup reduces once, in rank order, so every rank gets bitwise the same result; MPI and
//! NCCL choose their own reduction order (both return the same result on every rank of one
//! communicator in practice, which the standards recommend but do not promise).
//!
//! Launching (the ResNet example's `--backend` does this; any program built on the crate starts
//! the same way):
//!
//! ```sh
//! # 8 GPUs in one process: let comms = NcclGroup::new(&[0, 1, 2, 3, 4, 5, 6, 7])?; one thread each
//! # one process per GPU, on one or many machines (torchrun sets RANK, WORLD_SIZE, LOCAL_RANK, MASTER_*):
//! torchrun --nproc_per_node 8 --no-python ./target/release/examples/your_training_binary
//! # the start-up exchange alone, on CPU processes (run in CI with the torchrun of PyTorch 2.5.1 and 2.15.0):
//! cargo build --example rendezvous && torchrun --nproc_per_node 2 --no-python target/debug/examples/rendezvous
//! # MPI processes (CPU tensors, or NCCL bootstrapped over MPI with NcclCollective::from_collective):
//! mpirun -np 4 ./target/release/examples/your_training_binary
//! ```

#![cfg_attr(docsrs, feature(doc_cfg))]
#![warn(missing_docs)]
// Every public fallible function says when it fails (a `# Errors` section); `cargo clippy -- -D
// warnings` in CI holds it.
#![warn(clippy::missing_errors_doc)]

mod all_reduce;
mod checked;
mod cores;
mod decorator;
#[doc(hidden)]
pub mod device;
mod error;
mod groups;
pub mod hang_report;
pub mod in_backward;
#[cfg(feature = "mpi")]
mod mpi;
#[cfg(feature = "nccl")]
mod nccl;
mod op;
mod pending;
pub mod recorder;
mod round;
mod threads;

pub use all_reduce::AllReduce;
pub(crate) use all_reduce::{all_reduce_as_one, check_parts, check_wire, start_as_one};
pub use checked::Checked;
pub use cores::{share_cores, THREAD_VARS};
pub use decorator::Decorator;
pub use error::CollectiveError;
pub use groups::groups_of;
#[cfg(feature = "mpi")]
#[cfg_attr(docsrs, doc(cfg(feature = "mpi")))]
pub use mpi::Mpi;
#[cfg(feature = "nccl")]
#[cfg_attr(docsrs, doc(cfg(feature = "nccl")))]
pub use nccl::{NcclCollective, NcclGroup};
pub use op::Op;
pub use pending::Pending;
pub(crate) use pending::Worker;
pub use threads::ThreadGroup;

/// The start-up of multi-process jobs (the crate `candle-rendezvous`): the launcher's variables
/// ([`rendezvous::DistEnv`]), the job's store (torchrun's, or one rank 0 hosts), and NCCL's id
/// handed from rank 0 to every rank.
pub use candle_rendezvous as rendezvous;

use std::sync::Arc;
use std::time::Duration;

use candle_core::{Result, Tensor};

/// Default time a collective may take before it fails (every backend; 5 minutes), unless
/// [`TIMEOUT_VAR`] says otherwise.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(300);

/// Environment variable with the timeout, in seconds, of every communicator made without an
/// explicit one (`ThreadGroup::new`, `Mpi::world`, `NcclGroup::new`,
/// `NcclCollective::from_env`, `NcclCollective::from_collective`): one setting for every
/// backend, the start-up included. PyTorch's counterpart is `init_process_group`'s `timeout`
/// argument (10 minutes for NCCL, 30 for the others), which no variable sets.
pub const TIMEOUT_VAR: &str = "CANDLE_DISTRIBUTED_TIMEOUT";

/// The timeout of communicators made without an explicit one: [`TIMEOUT_VAR`] in seconds (a
/// positive number, fractions allowed), else [`DEFAULT_TIMEOUT`].
///
/// # Errors
/// When the variable is set to anything else, naming it and its value.
pub fn default_timeout() -> Result<Duration> {
    match std::env::var(TIMEOUT_VAR) {
        Err(_) => Ok(DEFAULT_TIMEOUT),
        Ok(v) => match v.trim().parse::<f64>() {
            Ok(s) if s.is_finite() && s > 0.0 && s < 1e9 => Ok(Duration::from_secs_f64(s)),
            _ => candle_core::bail!(
                "{TIMEOUT_VAR}={v:?}: expected the timeout of every collective in seconds, a positive number"
            ),
        },
    }
}

/// Reduction applied element-wise by [`Collective::all_reduce`] (new reductions may be added in
/// a minor release).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
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

    /// This rank's flight recorder: its last collectives on this communicator, which a timeout
    /// logs and names the ranks behind from ([`recorder`]); `None` for a backend without one
    /// (the default; every backend of this crate has one).
    fn recorder(&self) -> Option<&recorder::FlightRecorder> {
        None
    }

    /// Element-wise reduction of `t` over all ranks: the all-reduce of one tensor, with
    /// `op` and no other option ([`Collective::all_reduce_with`]).
    ///
    /// `t`: any shape, identical on every rank. Returns a tensor of the same shape, dtype and
    /// device, identical on every rank (see the module documentation).
    ///
    /// # Errors
    ///
    /// - [`CollectiveError::Mismatch`] when the ranks disagree on the call (another collective,
    ///   dtype or shape on some rank). `ThreadGroup` and MPI detect it; NCCL does not (wrap it in
    ///   [`Checked`]), and then hangs until the timeout or combines mismatched buffers.
    /// - [`CollectiveError::InvalidArgument`] for [`ReduceOp::Avg`] on an integer dtype
    ///   (`ThreadGroup` and MPI), for a dtype the backend cannot carry (MPI and NCCL take f32, f64,
    ///   f16, bf16, i64, u32 and u8 only), or, on NCCL, for a tensor that is not on the
    ///   communicator's GPU.
    /// - [`CollectiveError::RankLeft`] when a rank dropped its communicator or panicked, or when an
    ///   earlier failure broke the group.
    /// - [`CollectiveError::Timeout`] when some rank does not arrive within the timeout
    ///   (`ThreadGroup`; the ranks still waiting get `RankLeft`). MPI aborts the whole job instead
    ///   of returning. On NCCL the watchdog aborts the communicator, and a later call (or
    ///   [`Collective::deferred_error`]) reports it.
    /// - [`CollectiveError::Library`] when NCCL rejects the call.
    fn all_reduce(&self, t: &Tensor, op: ReduceOp) -> Result<Tensor> {
        self.all_reduce_with(std::slice::from_ref(t), op.into())
    }

    /// The all-reduce, with its [`AllReduce`] options: of one tensor (`parts` of one, whose
    /// shape the result keeps), or of several laid end to end as one collective (a `[Σ nᵢ]`
    /// result, where `nᵢ` is part `i`'s element count, each part read flattened in its
    /// row-major order). `DataParallel::sync_gradients` sends a bucket of host gradients this
    /// way, `SyncBatchNorm`'s forward its sums in place.
    ///
    /// `parts`: at least one tensor, one dtype and device; every rank passes as many parts,
    /// with the same element counts and dtype, and the same options. Returns the result in
    /// the parts' dtype and device, identical on every rank.
    ///
    /// The default starts the call ([`Collective::start_all_reduce`]) and waits for it; every
    /// backend of this crate reduces on the calling thread instead. How each carries the
    /// options: a wire dtype is cast to and from on NCCL (which then moves the wire's bytes),
    /// while thread ranks and MPI round the values on the host as they reduce them, without
    /// the casts, bitwise the casts' result
    /// (`tests/thread_group.rs::a_wire_dtype_rounds_like_the_casts_it_saves`, and the MPI
    /// suite's check of that name, `scripts/test-mpi.sh`); several parts are concatenated,
    /// except on thread ranks, which sum each rank's parts where they lie, bitwise the
    /// concatenation's result (`tests/thread_group.rs::parts_are_summed_where_they_lie`), and
    /// MPI, which reduces each host part of f32 or f64 of at least 64 Ki elements in place
    /// (without a wire); `in_place` saves the result's allocation on NCCL.
    ///
    /// # Errors
    ///
    /// When `parts` is empty or its tensors differ in dtype or device (on thread ranks and MPI
    /// the call then fails on every rank, with this rank's reason), when the input or `wire` is
    /// not a float dtype while a wire is set, when the ranks' parts differ in number, element
    /// counts or dtype ([`CollectiveError::Mismatch`] on thread ranks and MPI), and otherwise as
    /// [`Collective::all_reduce`].
    fn all_reduce_with(&self, parts: &[Tensor], options: AllReduce) -> Result<Tensor> {
        self.start_all_reduce(parts, options)?.wait()
    }

    /// Concatenation of every rank's `t` along dimension 0, in rank order.
    ///
    /// `t`: `(n_r, *rest)`, where `rest` and the dtype are identical on every rank but `n_r` may
    /// differ (unequal per-rank batches). Returns `(Σ n_r, *rest)`.
    ///
    /// # Errors
    ///
    /// When `t` is a scalar (rank 0), when the ranks' dtypes or trailing dimensions `rest` differ
    /// ([`CollectiveError::Mismatch`] on `ThreadGroup` and MPI; NCCL checks only when wrapped in
    /// [`Checked`]), on MPI when the result would have more than `i32::MAX` elements, and in the
    /// cases every collective shares, listed under [`Collective::all_reduce`]: an unsupported dtype
    /// or device, a rank that left or a broken group, a timeout, an NCCL error.
    fn all_gather(&self, t: &Tensor) -> Result<Tensor>;

    /// Rank `root`'s `t`, delivered to every rank.
    ///
    /// `t`: any shape, identical shape and dtype on every rank (the non-root values are ignored).
    ///
    /// # Errors
    ///
    /// [`CollectiveError::InvalidArgument`] when `root` is not below `world_size()`; when the ranks
    /// pass different roots, shapes or dtypes ([`CollectiveError::Mismatch`] on `ThreadGroup` and
    /// MPI; NCCL checks only when wrapped in [`Checked`]); and in the cases every collective
    /// shares, listed under [`Collective::all_reduce`]: an unsupported dtype or device, a rank that
    /// left or a broken group, a timeout, an NCCL error.
    fn broadcast(&self, t: &Tensor, root: usize) -> Result<Tensor>;

    /// Returns once every rank has called `barrier`.
    ///
    /// # Errors
    ///
    /// [`CollectiveError::RankLeft`] when a rank left or an earlier failure broke the group;
    /// [`CollectiveError::Timeout`] when some rank does not arrive within the timeout
    /// (`ThreadGroup`; MPI aborts the job instead; on NCCL the watchdog aborts the communicator and
    /// the barrier fails with its reason); [`CollectiveError::Mismatch`] when the ranks are at
    /// different collectives (`ThreadGroup` and MPI); on NCCL, a rejected call or a CUDA error
    /// while waiting for the stream.
    fn barrier(&self) -> Result<()>;

    /// Element-wise reduction over ranks, scattered along dimension 0: rank `r` receives rows
    /// `r·k .. (r+1)·k` of the reduced tensor.
    ///
    /// `t`: `(W·k, *rest)` with `W = world_size()`, identical shape and dtype on every rank.
    /// Returns `(k, *rest)`: the same rows as [`Collective::all_reduce`] gives.
    ///
    /// # Errors
    ///
    /// When `t` is a scalar or its dimension 0 is not a multiple of `world_size()`
    /// ([`CollectiveError::InvalidArgument`] on every rank for `ThreadGroup` and MPI; a plain error
    /// on the calling rank for NCCL); for [`ReduceOp::Avg`] on an integer dtype (`ThreadGroup`,
    /// MPI); and in the cases every collective shares, listed under [`Collective::all_reduce`]:
    /// ranks that disagree on the call, an unsupported dtype or device, a rank that left or a
    /// broken group, a timeout, an NCCL error.
    fn reduce_scatter(&self, t: &Tensor, op: ReduceOp) -> Result<Tensor>;

    /// Starts [`Collective::all_reduce_with`] and returns at once; [`Pending::wait`] gives what
    /// the blocking call returns, bit for bit (`DataParallel::backward` sends its buckets this
    /// way). The one all-reduce every backend must implement.
    ///
    /// The call takes its place in the group's call order when it is started: every rank must
    /// start it at the same position relative to its other collectives. Progress happens while
    /// the caller computes (a communication thread on `ThreadGroup` and MPI, a side stream on
    /// NCCL).
    ///
    /// The collective sends what the parts hold when the call is made. Once [`Pending::wait`] has
    /// returned, or the handle was dropped, the caller may write into the parts (and into the result)
    /// at once: `ThreadGroup` and MPI copy the input when the call starts, and on NCCL the device's
    /// stream waits for the collective before anything enqueued after the wait or the drop.
    /// Between the start and the wait, a write into a part is a race on NCCL (the side stream may
    /// still be reading it).
    ///
    /// # Errors
    ///
    /// Here only for what is found when starting: on NCCL, the failures of
    /// [`Collective::all_reduce_with`] that need no communication (parts or a wire refused, a
    /// broken communicator, a tensor on another device, an unsupported dtype, NCCL rejecting the
    /// call); on `ThreadGroup` and MPI, a
    /// communication thread that cannot be started or has stopped; with [`Checked`], a mismatch
    /// between the ranks. Everything else, which on `ThreadGroup` and MPI is every other failure of
    /// [`Collective::all_reduce_with`], comes from [`Pending::wait`].
    fn start_all_reduce(&self, parts: &[Tensor], options: AllReduce) -> Result<Pending>;

    /// Starts [`Collective::all_gather`]; see [`Collective::start_all_reduce`].
    ///
    /// # Errors
    ///
    /// As [`Collective::start_all_reduce`], with the conditions of [`Collective::all_gather`]. NCCL
    /// exchanges the row counts before starting the gather, so on NCCL a scalar `t` and the
    /// failures of that exchange are returned here.
    fn all_gather_async(&self, t: &Tensor) -> Result<Pending>;

    /// Starts [`Collective::reduce_scatter`]; see [`Collective::start_all_reduce`].
    ///
    /// # Errors
    ///
    /// As [`Collective::start_all_reduce`], with the conditions of [`Collective::reduce_scatter`].
    /// On NCCL a scalar `t`, or a dimension 0 that is not a multiple of `world_size()`, is returned
    /// here.
    fn reduce_scatter_async(&self, t: &Tensor, op: ReduceOp) -> Result<Pending>;

    /// `Err` when a collective whose call had already returned `Ok` failed afterwards, so that
    /// its output was never written; `Ok` otherwise. Not collective, and cheap (no
    /// communication, no device wait).
    ///
    /// Only NCCL has such failures: a collective is enqueued when its call returns, and the
    /// watchdog may abort it later (a peer that died, a timeout). `candle-distributed`'s `SyncBatchNorm` asks
    /// before each training step and rolls its running statistics back when the answer is an
    /// error. Backends whose calls return their final result (`ThreadGroup`, MPI) fail the call
    /// itself, and keep the default.
    ///
    /// # Errors
    ///
    /// When a collective whose call returned `Ok` was lost: on NCCL, once the watchdog has aborted
    /// the communicator (a timeout, a peer that left, a CUDA or NCCL error) while collectives
    /// enqueued earlier were not yet known complete. The error is a [`CollectiveError::RankLeft`]
    /// carrying the reason. The default implementation never fails.
    fn deferred_error(&self) -> Result<()> {
        Ok(())
    }

    /// Where this communicator takes small tensors of its own callers (agreements, flags,
    /// counts): the rank's GPU for NCCL, which takes tensors on it only; the CPU for the other
    /// backends (the default). Wrappers forward it.
    fn device(&self) -> candle_core::Device {
        candle_core::Device::Cpu
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
    ///
    /// # Errors
    ///
    /// When `color` or `key` exceeds `i32::MAX` on MPI or NCCL (on MPI an error on every rank; on
    /// NCCL only on the ranks that passed it, while the others wait in the split until the
    /// timeout); when the ranks are at different collectives ([`CollectiveError::Mismatch`] on
    /// `ThreadGroup` and MPI); and in the cases every collective shares, listed under
    /// [`Collective::all_reduce`]: a rank that left or a broken group, a timeout, an NCCL error
    /// while creating the subgroup (which also aborts this communicator).
    fn split(&self, color: Option<u32>, key: u32) -> Result<Option<Arc<dyn Collective>>>;

    /// The subgroup of the listed ranks (PyTorch's `new_group(ranks)`), ranked in list order;
    /// `None` on the ranks not listed. Every rank must call it with the same list.
    ///
    /// # Errors
    ///
    /// When `ranks` names a rank not below `world_size()` or names one twice (checked before any
    /// communication), and as [`Collective::split`].
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
