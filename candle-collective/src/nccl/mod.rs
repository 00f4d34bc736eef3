//! `NcclCollective` (feature `nccl`): ranks are GPUs, tensors live on the rank's GPU, and every
//! collective is enqueued on the candle device's stream with no host synchronisation (except
//! `all_gather`, which reads the per-rank row counts, and `barrier`, which waits by definition).
//!
//! Layers: [`ffi`] loads NCCL's functions with C return codes; [`blocking`] asks NCCL whether
//! it runs in blocking mode; [`raw`] owns the NCCL handle and every `unsafe` NCCL call;
//! [`watchdog`] serialises the calls, polls them and aborts on failure; [`enqueue`] turns a
//! collective into a candle op; this file has the constructors and the `Collective` impl.
//!
//! Communicators are non-blocking (`config.blocking = 0`), so no thread ever waits inside
//! NCCL and an abort is legal between any two calls. Blocking mode, which
//! `NCCL_COMM_BLOCKING` (environment, `NCCL_CONF_FILE`, `~/.nccl.conf`, `/etc/nccl.conf`, an
//! environment plugin) would impose over the config, is refused on every rank before any peer
//! is contacted, on NCCL's own answer (a one-rank probe communicator), and again if a start-up
//! completes synchronously. NCCL 2.27 or newer is required (checked
//! at creation): older versions keep a non-blocking call's background job in the calling
//! thread's state, which the watchdog's calls from its own thread would disturb. Failure
//! handling:
//! - start-up (`ncclCommInitRankConfig`, also `split`) is polled under the timeout, before the
//!   watchdog exists: a rank that never arrives makes the others fail with an error naming
//!   the timeout, not hang;
//! - every collective records a CUDA event after it; a watchdog thread per communicator polls
//!   NCCL's asynchronous error (`ncclCommGetAsyncError`: a peer that left, a network error) and
//!   the oldest pending event every 10 ms, and aborts the communicator when NCCL reports an
//!   error, a collective is older than the timeout, or the stream reports a CUDA error;
//! - after an abort every later call, and every `Pending::wait` of a collective started before
//!   it, fails with the reason; [`Collective::deferred_error`] reports it too, which is how
//!   `SyncBatchNorm` learns that a step's all-reduce, enqueued without error, later failed (it
//!   then restores the running statistics of before that step);
//! - dropping a communicator finalizes it (its queued collectives flushed) under the timeout
//!   and destroys it, or aborts it when it is broken or the finalize does not finish (work a
//!   departed peer will never join): a drop never hangs.
//!
//! NCCL does not check that ranks pass the same arguments; wrap the communicator in
//! [`super::Checked`] to have every call's op, dtype and count compared first (a debug mode:
//! one extra small all-gather and a host wait per call).

mod blocking;
mod enqueue;
mod ffi;
mod ops;
mod raw;
mod watchdog;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use candle_core::cuda_backend::cudarc::driver::{sys as cu, CudaStream};
use candle_core::cuda_backend::WrapErr;
use candle_core::{CudaDevice, Device, Result, Tensor};
use candle_rendezvous::progress::ProgressBoard;
use candle_rendezvous::{next_rendezvous, DistEnv, JobStore};

use super::recorder::FlightRecorder;
use super::{AllReduce, Collective, CollectiveError, Op, Pending, ReduceOp};
use enqueue::{unpad, Enqueue};
use raw::{Progress, RawComm};
use watchdog::{finish_close, CallError, Watch};

const BACKEND: &str = "NCCL";

/// The start-up's error as candle's, its message unchanged.
fn startup(e: candle_rendezvous::Error) -> candle_core::Error {
    candle_core::Error::Msg(e.to_string())
}

fn invalid(op: &'static str, detail: String) -> candle_core::Error {
    CollectiveError::invalid(BACKEND, op, detail).into()
}

/// The error of a call of `rank` on an aborted or dropped communicator.
fn rank_left(rank: usize, op: &'static str, call: u64, why: String) -> candle_core::Error {
    CollectiveError::broken(BACKEND, op, call, rank, why).into()
}

/// The error of failed call number `call` of `rank`.
fn call_error(rank: usize, op: &'static str, call: u64, e: CallError) -> candle_core::Error {
    match e {
        CallError::Broken(why) => rank_left(rank, op, call, why),
        CallError::Nccl(f) => f.error(op, rank),
    }
}

/// The communicators of one [`NcclGroup`]: closed together once the last is dropped, since
/// one thread finalizing them one after another would wait for peers it has not reached.
struct Teardown {
    comms: Vec<Arc<Watch>>,
    left: Mutex<usize>,
    timeout: Duration,
}

impl Teardown {
    fn release(&self) {
        let mut left = self.left.lock().unwrap_or_else(|e| e.into_inner());
        *left -= 1;
        if *left == 0 {
            let closing = self.comms.iter().filter_map(|w| w.begin_close()).collect();
            finish_close(closing, self.timeout);
        }
    }
}

/// One rank's NCCL communicator on its GPU. Build it with [`NcclGroup::new`],
/// [`NcclCollective::from_env`] or [`NcclCollective::from_collective`]; use it as an
/// `Arc<dyn Collective>`.
pub struct NcclCollective {
    device: CudaDevice,
    /// The stream of the `*_async` collectives (forked from the device's stream).
    side: Arc<CudaStream>,
    rank: usize,
    world: usize,
    watch: Arc<Watch>,
    /// Set for the communicators of an [`NcclGroup`], closed together.
    teardown: Option<Arc<Teardown>>,
}

impl std::fmt::Debug for NcclCollective {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "NcclCollective(rank {} of {} on {:?})",
            self.rank, self.world, self.device
        )
    }
}

/// Constructor of the communicators of one process driving several GPUs.
#[derive(Debug, Clone, Copy)]
pub struct NcclGroup;

// `new` returns every rank's communicator, as `ThreadGroup::new` does.
#[allow(clippy::new_ret_no_self)]
impl NcclGroup {
    /// One communicator per listed GPU ordinal (`result[i]` has rank `i`, on GPU
    /// `ordinals[i]`), for one thread per GPU. NCCL refuses two ranks on one GPU.
    ///
    /// # Errors
    /// Ordinals repeated or empty, a GPU that cannot be opened, NCCL's error, or a start-up
    /// that does not finish within the default timeout
    /// ([`super::default_timeout`]: `CANDLE_DISTRIBUTED_TIMEOUT`, else
    /// [`DEFAULT_TIMEOUT`](super::DEFAULT_TIMEOUT)).
    pub fn new(ordinals: &[usize]) -> Result<Vec<Arc<NcclCollective>>> {
        Self::with_timeout(ordinals, super::default_timeout()?)
    }

    /// Like [`NcclGroup::new`], with the time the start-up and each collective may take
    /// before the communicator is aborted.
    ///
    /// # Errors
    /// As [`NcclGroup::new`].
    pub fn with_timeout(ordinals: &[usize], timeout: Duration) -> Result<Vec<Arc<NcclCollective>>> {
        let mut seen = ordinals.to_vec();
        seen.sort_unstable();
        seen.dedup();
        if ordinals.is_empty() || seen.len() != ordinals.len() {
            return Err(invalid(
                "new",
                format!("GPU ordinals {ordinals:?} must be distinct and not empty (NCCL allows one rank per GPU)"),
            ));
        }
        crate::share_cores(ordinals.len());
        let devices: Vec<CudaDevice> = ordinals
            .iter()
            .map(|&o| CudaDevice::new_with_stream(o))
            .collect::<Result<_>>()?;
        let world = ordinals.len();
        blocking::refuse_blocking_mode(devices[0].cuda_stream().context(), timeout)
            .map_err(|f| f.error("new", 0))?;
        let id = raw::unique_id().map_err(|f| f.error("new", 0))?;
        let ctxs: Vec<_> = devices
            .iter()
            .map(|d| d.cuda_stream().context().clone())
            .collect();
        let ranks: Vec<usize> = (0..world).collect();
        let refs: Vec<_> = ctxs.iter().map(|c| c.as_ref()).collect();
        let raws = RawComm::init_group(&refs, world, &id, &ranks).map_err(|f| f.error("new", 0))?;
        // Every rank's start-up is polled to completion (under one deadline) before any
        // watchdog exists; on failure the handles are dropped, which aborts them.
        watchdog::wait_ready(&raws, &ranks, "new", timeout)
            .map_err(|(rank, e)| call_error(rank, "new", 0, e))?;
        let mut comms = Vec::with_capacity(world);
        let mut raws = raws.into_iter();
        // One process: each rank's watchdog reads the others' recorders to name the ranks
        // behind a timeout.
        let recorders: Arc<[FlightRecorder]> =
            (0..world).map(|_| FlightRecorder::from_env()).collect();
        for (rank, device) in devices.into_iter().enumerate() {
            let comm = raws.next().expect("one communicator per device");
            // On an error here the communicators not yet wrapped are dropped (aborted), and
            // those already wrapped are closed by their own drop (no teardown set yet).
            let mine = Some((recorders.clone(), rank));
            comms.push(NcclCollective::start(
                comm,
                device,
                (rank, world),
                timeout,
                mine,
                None,
            )?);
        }
        let teardown = Arc::new(Teardown {
            comms: comms.iter().map(|c| c.watch.clone()).collect(),
            left: Mutex::new(world),
            timeout,
        });
        for c in &mut comms {
            c.teardown = Some(teardown.clone());
        }
        Ok(comms.into_iter().map(Arc::new).collect())
    }
}

impl NcclCollective {
    /// Wraps a communicator (initialised: see [`watchdog::wait_ready`]) on `device` and starts
    /// its watchdog.
    fn start(
        comm: RawComm,
        device: CudaDevice,
        (rank, world): (usize, usize),
        timeout: Duration,
        recorders: Option<(Arc<[FlightRecorder]>, usize)>,
        board: Option<Arc<ProgressBoard>>,
    ) -> Result<Self> {
        let ctx = device.cuda_stream().context().clone();
        let recorders = recorders.unwrap_or_else(|| (Arc::from([FlightRecorder::from_env()]), 0));
        let watch = Watch::start(comm, rank, timeout, ctx, recorders, board);
        let side = match device.cuda_stream().fork() {
            Ok(s) => s,
            Err(e) => {
                watch.abort("creating the side stream failed".into());
                return Err(e).w();
            }
        };
        Ok(Self {
            device,
            side,
            rank,
            world,
            watch,
            teardown: None,
        })
    }

    /// The error of a call that is not a numbered collective (a split), numbered as the next
    /// collective would be.
    fn call_error(&self, op: &'static str, e: CallError) -> candle_core::Error {
        call_error(self.rank, op, self.watch.next_call(), e)
    }

    /// One process per GPU from torchrun's environment (`RANK`, `WORLD_SIZE`, `LOCAL_RANK`,
    /// `MASTER_ADDR`, `MASTER_PORT`): this rank runs on GPU `LOCAL_RANK`; rank 0 creates NCCL's
    /// unique id and hands it to the others through the job's store
    /// ([`JobStore`](candle_rendezvous::JobStore): torchrun's own TCPStore under torchrun, else
    /// one that rank 0 hosts on `MASTER_ADDR:MASTER_PORT`, where every rank also needs
    /// `CANDLE_DISTRIBUTED_RUN_ID`; see [`candle_rendezvous`] for the run identity and the
    /// optional shared secret). Default timeout ([`super::default_timeout`]) for the start-up and for
    /// every collective.
    ///
    /// In every multi-process launch each rank also publishes its newest collective in that store
    /// ([`candle_rendezvous::progress`], checked once a second), and a rank whose collective times
    /// out reads the others' to name the ranks behind: "rank 1 never reached all_reduce #1207;
    /// its last collective: all_reduce #1206 ...". Without torchrun, rank 0's store lives as
    /// long as its communicator.
    ///
    /// # Errors
    /// A missing or invalid variable (a launch without torchrun and without a run id), the
    /// bootstrap's error, NCCL's, or a start-up that does not finish within the timeout (a rank
    /// that never arrives).
    pub fn from_env() -> Result<Arc<Self>> {
        Self::from_env_with_timeout(super::default_timeout()?)
    }

    /// Like [`NcclCollective::from_env`], with the timeout.
    ///
    /// # Errors
    /// As [`NcclCollective::from_env`].
    pub fn from_env_with_timeout(timeout: Duration) -> Result<Arc<Self>> {
        let env = DistEnv::from_env().map_err(startup)?;
        crate::share_cores(env.local_world_size.unwrap_or(1));
        let device = CudaDevice::new_with_stream(env.local_rank)?;
        blocking::refuse_blocking_mode(device.cuda_stream().context(), timeout)
            .map_err(|f| f.error("init", env.rank))?;
        let id = if env.rank == 0 {
            Some(raw::unique_id().map_err(|f| f.error("init", 0))?)
        } else {
            None
        };
        let seq = next_rendezvous();
        let job = JobStore::open(&env, timeout).map_err(startup)?;
        let bytes = job
            .share(seq, id.as_ref().map(|b| &b[..]), timeout)
            .map_err(startup)?;
        let board = ProgressBoard::new(&job, seq).map(Arc::new);
        Self::init_rank(device, env.rank, env.world_size, &bytes, timeout, board)
    }

    /// A communicator with the same ranks as `bootstrap` (any backend working on CPU tensors,
    /// e.g. MPI under `mpirun`), on GPU `ordinal`: rank 0 creates NCCL's unique id and broadcasts
    /// it over `bootstrap`. Default timeout ([`super::default_timeout`]) for every collective.
    ///
    /// # Errors
    /// `bootstrap`'s error, NCCL's, or a start-up that does not finish within the timeout.
    pub fn from_collective(bootstrap: &dyn Collective, ordinal: usize) -> Result<Arc<Self>> {
        Self::from_collective_with_timeout(bootstrap, ordinal, super::default_timeout()?)
    }

    /// Like [`NcclCollective::from_collective`], with the timeout.
    ///
    /// # Errors
    /// As [`NcclCollective::from_collective`].
    pub fn from_collective_with_timeout(
        bootstrap: &dyn Collective,
        ordinal: usize,
        timeout: Duration,
    ) -> Result<Arc<Self>> {
        let device = CudaDevice::new_with_stream(ordinal)?;
        blocking::refuse_blocking_mode(device.cuda_stream().context(), timeout)
            .map_err(|f| f.error("init", bootstrap.rank()))?;
        let id = if bootstrap.rank() == 0 {
            raw::unique_id().map_err(|f| f.error("init", 0))?
        } else {
            [0u8; 128]
        };
        let t = Tensor::new(&id[..], &Device::Cpu)?;
        let bytes = bootstrap.broadcast(&t, 0)?.to_vec1::<u8>()?;
        Self::init_rank(
            device,
            bootstrap.rank(),
            bootstrap.world_size(),
            &bytes,
            timeout,
            None,
        )
    }

    fn init_rank(
        device: CudaDevice,
        rank: usize,
        world: usize,
        id: &[u8],
        timeout: Duration,
        board: Option<Arc<ProgressBoard>>,
    ) -> Result<Arc<Self>> {
        let Ok(id) = <[u8; 128]>::try_from(id) else {
            return Err(invalid(
                "init",
                format!("expected a 128-byte NCCL id, got {} bytes", id.len()),
            ));
        };
        let ctx = device.cuda_stream().context().clone();
        let comm = RawComm::init_rank(&ctx, world, &id, rank).map_err(|f| f.error("init", rank))?;
        // Polled to completion before the watchdog exists; dropped (aborted) on failure.
        watchdog::wait_ready(std::slice::from_ref(&comm), &[rank], "init", timeout)
            .map_err(|(rank, e)| call_error(rank, "init", 0, e))?;
        Ok(Arc::new(Self::start(
            comm,
            device,
            (rank, world),
            timeout,
            None,
            board,
        )?))
    }

    /// The GPU this rank's tensors must live on.
    pub fn device(&self) -> Device {
        Device::Cuda(self.device.clone())
    }

    fn check_usable(&self, op: &'static str) -> Result<()> {
        match self.watch.broken() {
            Some(why) => Err(self.left(op, why)),
            None => Ok(()),
        }
    }

    /// The error of a call on an aborted or dropped communicator, numbered as the next
    /// collective would be (the call refused before it was numbered).
    fn left(&self, op: &'static str, why: String) -> candle_core::Error {
        rank_left(self.rank, op, self.watch.next_call(), why)
    }

    /// Enqueues one collective on `t` (on this rank's GPU) on the device's stream and returns
    /// its output tensor.
    fn enqueue(&self, what: Op, t: &Tensor) -> Result<Tensor> {
        self.enqueue_on(what, t, None).map(|(out, _)| out)
    }

    /// Enqueues one collective on the side stream, after the work already on the device's
    /// stream (its input); `wait` makes the device's stream wait for it.
    fn begin(
        &self,
        what: Op,
        t: &Tensor,
        finish: impl FnOnce(Tensor) -> Result<Tensor> + Send + 'static,
    ) -> Result<Pending> {
        let main = self.device.cuda_stream();
        let input = t.contiguous()?;
        let (out, call) = self.enqueue_on(what, &input, Some(self.side.clone()))?;
        let flags = cu::CUevent_flags::CU_EVENT_DISABLE_TIMING;
        let done = self.side.record_event(Some(flags)).w()?;
        // The input stays alive until the device's stream has waited for the side stream, on
        // `wait` or on drop: candle frees a tensor on the stream that last used it, and NCCL
        // may still be reading it on the side stream.
        let keep = KeepInput {
            main,
            done,
            input: Some(input),
        };
        let (watch, rank, op) = (self.watch.clone(), self.rank, what.name());
        Ok(Pending::new(move || {
            keep.release()?;
            // No host wait here (the device's stream waits for the side stream), but a
            // collective lost to an abort never finished writing `out`: say so rather than
            // hand it on.
            // (An abort after this point shows in `deferred_error` and the next call.)
            if let Some(why) = watch.lost() {
                return Err(rank_left(rank, op, call, why));
            }
            finish(out)
        }))
    }

    /// Enqueues one collective on `stream` (`None`: the device's); its output and its number.
    fn enqueue_on(
        &self,
        what: Op,
        t: &Tensor,
        stream: Option<Arc<CudaStream>>,
    ) -> Result<(Tensor, u64)> {
        self.check_call(what, t)?;
        let call = self.watch.begin(what.name(), t.dtype(), t.elem_count());
        let out = t
            .contiguous()
            .and_then(|t| {
                t.apply_op1_no_bwd(&Enqueue {
                    c: self,
                    what,
                    call,
                    stream: stream.clone(),
                })
            })
            .inspect_err(|_| self.watch.failed(call))?;
        self.track(what, stream, call)?;
        Ok((out, call))
    }

    /// Enqueues an all-reduce of `t` into `t` itself on the device's stream (NCCL's in-place
    /// form). `t` must be contiguous.
    fn enqueue_in_place(&self, what: Op, t: &Tensor) -> Result<()> {
        self.check_call(what, t)?;
        let call = self.watch.begin(what.name(), t.dtype(), t.elem_count());
        t.inplace_op1(&Enqueue {
            c: self,
            what,
            call,
            stream: None,
        })
        .inspect_err(|_| self.watch.failed(call))?;
        self.track(what, None, call)
    }

    /// The checks every enqueued collective makes first: a usable communicator, a float dtype
    /// for an average, `t` on this communicator's GPU.
    fn check_call(&self, what: Op, t: &Tensor) -> Result<()> {
        let op = what.name();
        self.check_usable(op)?;
        if let Op::AllReduce(ReduceOp::Avg) | Op::ReduceScatter(ReduceOp::Avg) = what {
            if !t.dtype().is_float() {
                return Err(invalid(
                    op,
                    format!(
                        "ReduceOp::Avg needs a float dtype, got {:?} (NCCL would divide the integer sum, truncating)",
                        t.dtype()
                    ),
                ));
            }
        }
        if !t.device().same_device(&self.device()) {
            return Err(invalid(
                op,
                format!(
                    "tensor on {:?}, the communicator on {:?}",
                    t.device(),
                    self.device()
                ),
            ));
        }
        Ok(())
    }

    /// Hands the watchdog the completion event of the collective just enqueued on `stream`
    /// (the device's stream when `None`).
    fn track(&self, what: Op, stream: Option<Arc<CudaStream>>, call: u64) -> Result<()> {
        let flags = cu::CUevent_flags::CU_EVENT_DISABLE_TIMING;
        let on = stream.unwrap_or_else(|| self.device.cuda_stream());
        let event = on
            .record_event(Some(flags))
            .w()
            .inspect_err(|_| self.watch.failed(call))?;
        self.watch.track(event, what.name(), call);
        Ok(())
    }
}

/// The input of a collective started on the side stream, kept until the device's stream has
/// been made to wait for that collective (`done`).
struct KeepInput {
    main: Arc<CudaStream>,
    done: candle_core::cuda_backend::cudarc::driver::CudaEvent,
    input: Option<Tensor>,
}

impl KeepInput {
    /// Makes the device's stream wait for the collective, then lets the input go.
    fn release(mut self) -> Result<()> {
        self.main.wait(&self.done).w()?;
        self.input = None;
        Ok(())
    }
}

impl Drop for KeepInput {
    /// A `Pending` dropped without `wait`: the same ordering before the input is freed.
    fn drop(&mut self) {
        if self.input.is_some() {
            let _ = self.main.wait(&self.done);
        }
    }
}

impl Drop for NcclCollective {
    /// Closes the communicator (see the module documentation): finalize and destroy under the
    /// timeout, abort when broken or when the finalize does not finish.
    fn drop(&mut self) {
        match self.teardown.take() {
            Some(t) => t.release(),
            None => {
                let closing = self.watch.begin_close().into_iter().collect();
                finish_close(closing, self.watch.timeout);
            }
        }
    }
}
