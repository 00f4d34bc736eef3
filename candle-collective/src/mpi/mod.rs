//! `MpiCollective` (feature `mpi`): ranks are MPI processes, on one or many machines, started by
//! `mpirun`; CPU tensors (tensors on another device are copied to the CPU and back).
//!
//! Every collective is preceded by an all-gather of a 5-value descriptor (operation, dtype,
//! shape, root or rank, and the verdict of the rank's own argument checks), so that ranks
//! calling different collectives or passing different shapes get an error naming every rank's
//! call, instead of MPI combining buffers of different sizes, and an argument invalid on one
//! rank is an error on every rank (the price: one more, 40-byte collective per call; all_gather
//! also gathers the row counts). Waiting uses MPI's nonblocking collectives polled against the
//! timeout; an MPI collective cannot be cancelled, so on timeout the rank prints the reason and
//! calls `MPI_Abort`, which ends every process of the job: nothing hangs forever, and the error
//! is on stderr rather than returned.

use std::sync::{Arc, Mutex, MutexGuard, TryLockError};
use std::time::{Duration, Instant};

use candle_core::{DType, Result, Tensor};
use mpi::collective::SystemOperation;
use mpi::environment::Universe;
use mpi::raw::{AsRaw, FromRaw};
use mpi::request::{Request, Scope};
use mpi::topology::{Color, SimpleCommunicator};
use mpi::traits::*;
use mpi::Threading;

use super::recorder::{CallState, FlightRecorder};
use super::round::Wire;
use super::{
    all_reduce_as_one, check_parts, check_wire, scatter_rows, AllReduce, Collective,
    CollectiveError, Op, Pending, ReduceOp, Worker,
};

mod host;
mod ops;
mod parts;

use host::{
    avg_dtype, dtype_code, input_of, invalid, shape_code, with_buf, HostBuf, HostSlice, Source,
};

const BACKEND: &str = "MPI";

/// One process's MPI environment: initialised by [`Mpi::init`], finalised when the last of
/// [`Mpi`] and the communicators made from it is dropped.
struct Env {
    _universe: Universe,
    /// The thread that initialised MPI, where the MPI standard wants `MPI_Finalize` called.
    init_thread: std::thread::ThreadId,
}

impl Drop for Env {
    fn drop(&mut self) {
        // `_universe` finalises MPI after this, on this thread.
        if std::thread::current().id() != self.init_thread {
            log::warn!(
                "mpi: MPI is finalised on another thread than the one that initialised it (the last communicator was dropped there); keep `Mpi` alive on the initialising thread until every communicator is gone"
            );
        }
    }
}

/// Serialises this process's MPI calls: MPI is initialised with `MPI_THREAD_SERIALIZED`.
static MPI_CALLS: Mutex<()> = Mutex::new(());

fn serialised() -> MutexGuard<'static, ()> {
    MPI_CALLS.lock().unwrap_or_else(|e| e.into_inner())
}

/// Runs one MPI call with `MPI_CALLS` held. Waits poll with the lock released in between, so
/// that another thread of this process (the communication thread of the `*_async` calls) can
/// make progress on its own communicator meanwhile.
fn locked<R>(f: impl FnOnce() -> R) -> R {
    let _g = serialised();
    f()
}

/// `MPI_Abort` on `comm`, under `MPI_CALLS` as `MPI_THREAD_SERIALIZED` requires, waiting at
/// most one second for it: a thread that holds it inside a blocking MPI call (`MPI_Comm_dup`,
/// `MPI_Comm_split`) waiting for a dead rank would otherwise keep the job alive forever, and the
/// abort then goes ahead without the lock.
fn abort_job(comm: &SimpleCommunicator) -> ! {
    // One abort per process: a second thread timing out meanwhile waits for the first's to end
    // the process, instead of calling MPI beside it.
    static ABORTING: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
    if ABORTING.swap(true, std::sync::atomic::Ordering::SeqCst) {
        loop {
            std::thread::park();
        }
    }
    let until = Instant::now() + Duration::from_secs(1);
    let _guard = loop {
        match MPI_CALLS.try_lock() {
            Ok(g) => break Some(g),
            Err(TryLockError::Poisoned(p)) => break Some(p.into_inner()),
            Err(TryLockError::WouldBlock) if Instant::now() < until => {
                std::thread::sleep(Duration::from_millis(1));
            }
            Err(TryLockError::WouldBlock) => break None,
        }
    };
    comm.abort(1)
}

/// Calls `done` (which takes `MPI_CALLS` for its own MPI call, so that other threads progress
/// between polls) until it returns true; past `timeout`, prints why and aborts the MPI job on
/// `comm`.
fn poll(
    comm: &SimpleCommunicator,
    (rank, recorder): (usize, Option<&FlightRecorder>),
    timeout: Duration,
    op: &str,
    mut done: impl FnMut() -> bool,
) {
    let deadline = Instant::now() + timeout;
    let mut spins = 0u32;
    while !done() {
        if Instant::now() >= deadline {
            let mut why = format!(
                "mpi: rank {rank} timed out after {timeout:?} in {op}; aborting the MPI job (a collective cannot be cancelled)"
            );
            if let Some(r) = recorder {
                why = format!("{why}\n{}", r.dump(&format!("mpi rank {rank}")));
            }
            // On stderr as well as through `log`: the process ends next, whatever logger the
            // application installed.
            log::error!("{why}");
            eprintln!("{why}");
            abort_job(comm);
        }
        spins += 1;
        if spins > 1000 {
            std::thread::sleep(Duration::from_micros(50));
        } else {
            std::thread::yield_now();
        }
    }
}

/// `MPI_Comm_idup` of `comm`, polled against `timeout` like every collective (a rank that never
/// arrives aborts the job instead of hanging it; `MPI_Comm_dup` would block, untimed, with
/// `MPI_CALLS` held).
fn duplicate(comm: &SimpleCommunicator, rank: usize, timeout: Duration) -> SimpleCommunicator {
    let mut newcomm = std::mem::MaybeUninit::<mpi::ffi::MPI_Comm>::uninit();
    let mut req = std::mem::MaybeUninit::<mpi::ffi::MPI_Request>::uninit();
    // SAFETY: `comm` is a live communicator; `newcomm` and `req` outlive the request (this
    // function polls it to completion before returning), as MPI requires of the outputs of a
    // nonblocking call. The call is made under `MPI_CALLS` (MPI_THREAD_SERIALIZED).
    let rc = locked(|| unsafe {
        mpi::ffi::MPI_Comm_idup(comm.as_raw(), newcomm.as_mut_ptr(), req.as_mut_ptr())
    });
    if rc != mpi::ffi::MPI_SUCCESS as std::os::raw::c_int {
        // Reached only under an error handler that returns (MPI's default aborts).
        let why =
            format!("mpi: rank {rank}: MPI_Comm_idup failed with code {rc}; aborting the MPI job");
        log::error!("{why}");
        eprintln!("{why}");
        abort_job(comm);
    }
    // SAFETY: MPI_Comm_idup succeeded, so it wrote the request handle.
    let mut req = unsafe { req.assume_init() };
    poll(comm, (rank, None), timeout, "dup", || {
        let mut flag: std::os::raw::c_int = 0;
        // SAFETY: `req` is the live request of the idup (MPI sets it to MPI_REQUEST_NULL once
        // complete, after which the loop stops); the call is made under `MPI_CALLS`.
        locked(|| unsafe {
            mpi::ffi::MPI_Test(&mut req, &mut flag, mpi::ffi::RSMPI_STATUS_IGNORE)
        });
        flag != 0
    });
    // SAFETY: the request completed, so MPI wrote the new communicator's handle, which this
    // process now owns (freed by `SimpleCommunicator`'s drop).
    unsafe { SimpleCommunicator::from_raw(newcomm.assume_init()) }
}

/// The MPI environment of this process. MPI is finalised when the last of it and the
/// communicators made from it is dropped, on that thread: keep it alive on the thread that
/// called [`Mpi::init`] (the MPI standard wants `MPI_Finalize` there) until every communicator
/// is gone; a finalize on another thread is logged as a warning.
///
/// ```no_run
/// # fn main() -> candle_core::Result<()> {
/// let mpi = candle_collective::Mpi::init()?;
/// let comm = mpi.world()?; // Arc<dyn Collective>, rank = MPI rank
/// # Ok(()) }
/// ```
pub struct Mpi {
    env: Arc<Env>,
}

impl std::fmt::Debug for Mpi {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Mpi")
    }
}

impl Mpi {
    /// Initialises MPI (`MPI_Init_thread` asking for `MPI_THREAD_SERIALIZED`). Errors when MPI
    /// was already initialised in this process, or provides less than serialised threading.
    /// First the machine's cores are shared among the processes `mpirun` placed on it
    /// ([`crate::share_cores`], unless `CANDLE_NUM_THREADS` or `RAYON_NUM_THREADS` is set).
    ///
    /// # Errors
    ///
    /// [`CollectiveError::InvalidArgument`] when MPI is already initialised in this process, or
    /// when the library provides less than `MPI_THREAD_SERIALIZED`.
    pub fn init() -> Result<Self> {
        crate::share_cores(candle_rendezvous::local_world_size().unwrap_or(1));
        let (universe, provided) = mpi::initialize_with_threading(Threading::Serialized)
            .ok_or_else(|| invalid("init", "MPI is already initialised in this process".into()))?;
        if provided < Threading::Serialized {
            return Err(invalid(
                "init",
                format!("the MPI library provides only {provided:?} threading; SyncBatchNorm needs Serialized"),
            ));
        }
        Ok(Self {
            env: Arc::new(Env {
                _universe: universe,
                init_thread: std::thread::current().id(),
            }),
        })
    }

    /// `MPI_COMM_WORLD` as a communicator, with the default timeout ([`super::default_timeout`]:
    /// `CANDLE_DISTRIBUTED_TIMEOUT`, else [`DEFAULT_TIMEOUT`](super::DEFAULT_TIMEOUT)).
    ///
    /// # Errors
    ///
    /// None at present. The duplicate of the communicator (for the `*_async` calls) is a
    /// collective polled against the timeout: a rank that does not arrive aborts the job, and an
    /// MPI failure aborts it under MPI's default error handler, rather than returning.
    pub fn world(&self) -> Result<Arc<dyn Collective>> {
        self.world_with_timeout(super::default_timeout()?)
    }

    /// `MPI_COMM_WORLD` with the time a rank waits for the others in one collective.
    ///
    /// # Errors
    ///
    /// As [`Mpi::world`].
    pub fn world_with_timeout(&self, timeout: Duration) -> Result<Arc<dyn Collective>> {
        let comm = {
            let _g = serialised();
            self.env._universe.world()
        };
        Ok(Arc::new(MpiCollective::new(
            comm,
            self.env.clone(),
            timeout,
            true,
        )))
    }
}

/// One rank's handle on an MPI communicator.
struct MpiCollective {
    /// Freed (under `MPI_CALLS`) before `env` is dropped, so before MPI is finalised.
    comm: std::mem::ManuallyDrop<SimpleCommunicator>,
    rank: usize,
    world: usize,
    timeout: Duration,
    /// A duplicate of `comm` for the `*_async` calls, which run on `worker` in their own order
    /// (MPI matches collectives per communicator); `None` on that duplicate itself.
    async_comm: Option<Arc<MpiCollective>>,
    worker: Worker,
    /// Set on every rank alike when the ranks disagreed on a call: later calls fail with it.
    broken: Mutex<Option<String>>,
    /// The last collectives, printed with a timeout before the job is aborted. A call is
    /// recorded when its ranks agree on it, and completed when the next one begins.
    recorder: FlightRecorder,
    /// The number of the next agreement (every rank numbers its calls alike).
    next_call: std::sync::atomic::AtomicU64,
    _env: Arc<Env>,
}

impl Drop for MpiCollective {
    fn drop(&mut self) {
        // The worker (and with it the duplicate's last user) stops first.
        self.async_comm.take();
        let _g = serialised();
        // SAFETY: `comm` is not used after this point.
        unsafe { std::mem::ManuallyDrop::drop(&mut self.comm) };
    }
}

// SAFETY: MPI handles may be used from any thread of a process initialised with
// MPI_THREAD_SERIALIZED as long as no two threads call MPI at once; every MPI call of this
// module happens while `MPI_CALLS` is held.
unsafe impl Send for MpiCollective {}
// SAFETY: as for `Send`: `&self` methods reach MPI only through `MPI_CALLS`.
unsafe impl Sync for MpiCollective {}
// SAFETY: the universe is only dropped (MPI_Finalize), once, by whichever thread drops the last
// reference; no other MPI call can run then, since every communicator holds a reference.
unsafe impl Send for Env {}
// SAFETY: `Env` has no `&self` methods that call MPI.
unsafe impl Sync for Env {}

impl std::fmt::Debug for MpiCollective {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "MpiCollective(rank {} of {})", self.rank, self.world)
    }
}

impl MpiCollective {
    /// Wraps `comm`; with `with_async`, also duplicates it for the `*_async` calls (collective:
    /// every rank of `comm` constructs at the same point).
    fn new(comm: SimpleCommunicator, env: Arc<Env>, timeout: Duration, with_async: bool) -> Self {
        let (rank, world) = locked(|| (comm.rank() as usize, comm.size() as usize));
        let dup = with_async.then(|| duplicate(&comm, rank, timeout));
        let async_comm = dup.map(|d| Arc::new(MpiCollective::new(d, env.clone(), timeout, false)));
        Self {
            comm: std::mem::ManuallyDrop::new(comm),
            rank,
            world,
            timeout,
            async_comm,
            worker: Worker::default(),
            broken: Mutex::new(None),
            recorder: FlightRecorder::from_env(),
            next_call: std::sync::atomic::AtomicU64::new(0),
            _env: env,
        }
    }

    /// Runs `f`, which reads `input` (the call's own copy, [`own_copy`]), on the duplicate
    /// communicator in the communication thread.
    fn start(
        &self,
        input: &Tensor,
        f: impl FnOnce(&MpiCollective) -> Result<Tensor> + Send + 'static,
    ) -> Result<Pending> {
        let Some(dup) = self.async_comm.clone() else {
            return Err(invalid(
                "async",
                "no duplicate communicator for asynchronous calls".into(),
            ));
        };
        self.worker.submit(BACKEND, input, move || f(&dup))
    }

    /// Polls `req` until it completes; on timeout prints why and aborts the MPI job.
    fn wait<'a, D: ?Sized, S: Scope<'a>>(&self, op: &str, req: Request<'a, D, S>) {
        let mut req = Some(req);
        poll(
            &self.comm,
            (self.rank, Some(&self.recorder)),
            self.timeout,
            op,
            || match locked(|| req.take().expect("polled until done").test()) {
                Ok(_) => true,
                Err(r) => {
                    req = Some(r);
                    false
                }
            },
        );
    }

    /// The error of a call on a group a mismatch has broken.
    fn check_broken(&self, op: &'static str) -> Result<()> {
        match self
            .broken
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
        {
            Some(reason) => Err(CollectiveError::broken(
                BACKEND,
                op,
                self.next_call.load(std::sync::atomic::Ordering::Relaxed),
                self.rank,
                format!("the group is broken: {reason}"),
            )
            .into()),
            None => Ok(()),
        }
    }

    /// The ranks agree on a call before anything else happens: every rank's descriptor
    /// `[op, dtype, shape, extra]` and the verdict of its own argument checks (`local`) travel
    /// in one all-gather. A rank whose check failed makes the call an error on every rank (the
    /// group stays usable: every rank skips the same call); otherwise descriptors that differ
    /// make the call a mismatch on every rank and mark the group broken, so that later calls
    /// fail too.
    ///
    /// `input` (its dtype and element count, when the call has one) goes into the recorder.
    fn agree(
        &self,
        op: &'static str,
        desc: [i64; 4],
        input: Option<(DType, usize)>,
        local: std::result::Result<(), String>,
    ) -> Result<()> {
        self.check_broken(op)?;
        // Calls on one communicator run one after another: this one's start ends the last.
        let call = self
            .next_call
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        if let Some(last) = call.checked_sub(1) {
            self.recorder.settle(last);
        }
        self.recorder
            .enqueue(call, op, input.map(|i| i.0), input.map_or(0, |i| i.1));
        let mine = [desc[0], desc[1], desc[2], desc[3], i64::from(local.is_ok())];
        let agreed = self.agree_on(op, call, mine, local.err());
        let state = match agreed {
            Ok(()) => CallState::Started,
            Err(_) => CallState::Failed,
        };
        self.recorder.mark(call, state);
        agreed
    }

    /// [`Self::agree`]'s all-gather of every rank's descriptor and verdict (`mine`; `refused`:
    /// why this rank's own check failed) for agreement number `call`, and their judgement.
    fn agree_on(
        &self,
        op: &'static str,
        call: u64,
        mine: [i64; 5],
        refused: Option<String>,
    ) -> Result<()> {
        let mut all = vec![0i64; 5 * self.world];
        mpi::request::scope(|scope| {
            let req = locked(|| {
                self.comm
                    .immediate_all_gather_into(scope, &mine[..], &mut all[..])
            });
            self.wait(op, req);
        });
        // A rank that refused its own arguments first: its descriptor may not describe a call
        // at all (an empty list of parts), and every rank has made this one agreement, so the
        // call fails everywhere and the group stays usable.
        let failed: Vec<usize> = (0..self.world).filter(|r| all[5 * r + 4] == 0).collect();
        if !failed.is_empty() {
            let here = match refused {
                Some(why) => format!("; here: {why}"),
                None => String::new(),
            };
            return Err(invalid(
                op,
                format!("invalid arguments on rank(s) {failed:?}, so the call fails on every rank{here}"),
            ));
        }
        let first = &all[..4];
        if all.chunks(5).any(|d| &d[..4] != first) {
            let detail = all
                .chunks(5)
                .enumerate()
                .map(|(r, d)| format!("rank {r}: {}", Self::describe(d)))
                .collect::<Vec<_>>()
                .join("; ");
            let detail = format!(
                "every rank must call the same collective with the same dtype and shape: {detail}"
            );
            *self.broken.lock().unwrap_or_else(|e| e.into_inner()) =
                Some(format!("{op}: {detail}"));
            return Err(CollectiveError::Mismatch {
                backend: BACKEND,
                call,
                detail,
            }
            .into());
        }
        Ok(())
    }

    fn descriptor(op: Op, t: &Tensor, dims: &[usize], extra: i64) -> [i64; 4] {
        [op.code(), dtype_code(t.dtype()), shape_code(dims), extra]
    }

    fn describe(d: &[i64]) -> String {
        format!(
            "op code {}, dtype code {}, shape code {}, argument {}",
            d[0], d[1], d[2], d[3]
        )
    }

    /// The element-wise reduction of an agreed call (`agree` has run) of `t`, read from `send`
    /// (in place for a contiguous host tensor of an MPI type, else a copy); with a `wire`, the
    /// f32 result rounded to it (`AllReduce::wire`).
    fn reduce(
        &self,
        op: &'static str,
        send: Source,
        t: &Tensor,
        rop: ReduceOp,
        wire: Option<DType>,
    ) -> Result<Tensor> {
        let n = t.elem_count();
        let mpi_op = mpi_op(rop);
        let recv = send.with_slice(|s| match s {
            HostSlice::F32(s) => {
                HostBuf::F32(received(n, |r| self.all_reduce_into(op, s, r, mpi_op)))
            }
            HostSlice::F64(s) => {
                HostBuf::F64(received(n, |r| self.all_reduce_into(op, s, r, mpi_op)))
            }
            HostSlice::I64(s) => {
                HostBuf::I64(received(n, |r| self.all_reduce_into(op, s, r, mpi_op)))
            }
            HostSlice::U32(s) => {
                HostBuf::U32(received(n, |r| self.all_reduce_into(op, s, r, mpi_op)))
            }
            HostSlice::U8(s) => {
                HostBuf::U8(received(n, |r| self.all_reduce_into(op, s, r, mpi_op)))
            }
        })?;
        self.finish(recv, t.dims(), t.dtype(), t.device(), rop, wire)
    }

    /// A reduction's result `recv` as a tensor of `dims`, `dtype` on `device`: averaged for
    /// `Avg`, and rounded to `wire` (if any).
    fn finish(
        &self,
        mut recv: HostBuf,
        dims: &[usize],
        dtype: DType,
        device: &candle_core::Device,
        rop: ReduceOp,
        wire: Option<DType>,
    ) -> Result<Tensor> {
        // An average is scaled in place in the wire type (f32 for f16/bf16) before the
        // conversion back, so that a sum beyond the input type's range still averages
        // correctly; by `1/world` rounded to the wire type, as candle divides a tensor by a
        // scalar. An f32 result is scaled and rounded to the wire dtype (if any) in one pass.
        let avg = rop == ReduceOp::Avg;
        match &mut recv {
            HostBuf::F32(r) => {
                let k = avg.then_some((1.0 / self.world as f64) as f32);
                Wire::to(wire).scale_round(r, k);
            }
            HostBuf::F64(r) if avg => {
                let k = 1.0 / self.world as f64;
                r.iter_mut().for_each(|x| *x *= k);
            }
            // No scaling: a sum, a maximum or a minimum, or an integer type, whose average is
            // refused before any communication (`avg_dtype`).
            HostBuf::F64(_) | HostBuf::I64(_) | HostBuf::U32(_) | HostBuf::U8(_) => {}
        }
        recv.into_tensor(dims, dtype, device)
    }

    fn all_reduce_into<T: Equivalence, R: Equivalence>(
        &self,
        op: &str,
        s: &[T],
        r: &mut [R],
        mpi_op: SystemOperation,
    ) {
        mpi::request::scope(|scope| {
            let req = locked(|| self.comm.immediate_all_reduce_into(scope, s, r, mpi_op));
            self.wait(op, req);
        });
    }
}

/// MPI's operation for `rop` (an average is a sum, scaled afterwards).
fn mpi_op(rop: ReduceOp) -> SystemOperation {
    match rop {
        ReduceOp::Sum | ReduceOp::Avg => SystemOperation::sum(),
        ReduceOp::Max => SystemOperation::max(),
        ReduceOp::Min => SystemOperation::min(),
    }
}

/// A value MPI writes into: uninitialised until the call that fills it returns.
#[repr(transparent)]
struct Unfilled<T>(std::mem::MaybeUninit<T>);

// SAFETY: `Unfilled<T>` has `T`'s size, alignment and layout (`repr(transparent)` over
// `MaybeUninit<T>`, which has `T`'s), so `T`'s datatype describes it.
unsafe impl<T: Equivalence> Equivalence for Unfilled<T> {
    type Out = T::Out;
    fn equivalent_datatype() -> T::Out {
        T::equivalent_datatype()
    }
}

/// `len` values written by `fill`, a collective that receives into every one of them (the
/// all-reduce, and the all-gather, whose parts tile its buffer). The buffer is not zero-filled
/// first: that was a whole extra pass over the result (the all-reduce against raw
/// `MPI_Allreduce`: docs/benchmarks.md).
fn received<T: Equivalence>(len: usize, fill: impl FnOnce(&mut [Unfilled<T>])) -> Vec<T> {
    let mut v: Vec<Unfilled<T>> = Vec::with_capacity(len);
    // SAFETY: the capacity is `len`, and `MaybeUninit` values need no initialisation.
    unsafe { v.set_len(len) };
    fill(&mut v);
    let mut v = std::mem::ManuallyDrop::new(v);
    // SAFETY: `fill` returned, so the collective wrote all `len` values (a receive that cannot
    // complete ends the process in `wait`, it does not return); `Unfilled<T>` has `T`'s layout,
    // so the allocation is that of a `Vec<T>` of the same length and capacity.
    unsafe { Vec::from_raw_parts(v.as_mut_ptr().cast::<T>(), v.len(), v.capacity()) }
}

/// The input of an asynchronous call, copied on the caller's thread (and, on a GPU, its stream)
/// into a buffer of its own, detached: the communication thread reads the copy, so the caller
/// may write into its tensor as soon as it waited or dropped the handle, while the other ranks
/// may not have arrived yet.
fn own_copy(t: &Tensor) -> Result<Tensor> {
    Ok(t.copy()?.detach())
}
