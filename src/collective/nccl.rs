//! `NcclCollective` (feature `nccl`): ranks are GPUs, tensors live on the rank's GPU, and every
//! collective is enqueued on the candle device's stream with no host synchronisation (except
//! `all_gather`, which reads the per-rank row counts, and `barrier`, which waits by definition).
//!
//! NCCL through candle's re-export of cudarc, at the level of its `result` API: the raw
//! communicator is wrapped once, in [`RawComm`]. Bootstrap: [`NcclGroup::new`] (one process, one
//! thread per GPU), [`NcclCollective::from_env`] (one process per GPU, torchrun's environment,
//! rank 0 hands out NCCL's unique id over TCP), [`NcclCollective::from_collective`] (the id
//! broadcast over another communicator, e.g. MPI under `mpirun`).
//!
//! Timeouts: every collective records a CUDA event after its NCCL call; a watchdog thread per
//! communicator polls the oldest pending event every 10 ms, and the NCCL call in progress when
//! it blocks on the host; when either is older than the timeout (or the stream reports a CUDA
//! error) it marks the communicator broken, then aborts it (`ncclCommAbort`, which also unblocks
//! the stream and a stuck call). Every later call on it fails with the reason. The cost: one
//! event record per collective and one mostly sleeping thread per communicator.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::time::{Duration, Instant};

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{
    sys as cu, CudaContext, CudaEvent, CudaStream, DevicePtr, DevicePtrMut, DeviceRepr,
};
use candle_core::cuda_backend::cudarc::nccl::{result, sys, NcclType};
use candle_core::cuda_backend::{CudaDType, WrapErr};
use candle_core::{
    CpuStorage, CudaDevice, CudaStorage, CustomOp1, DType, Device, Layout, Result, Shape, Tensor,
};

use super::bootstrap::{share_bytes, DistEnv};
use super::{Collective, CollectiveError, Op, Pending, ReduceOp, DEFAULT_TIMEOUT};
use crate::ops::cuda::view;

const BACKEND: &str = "NCCL";

/// A raw NCCL communicator.
///
/// NCCL's rule: a communicator may be used from any thread, but by one thread at a time
/// (`ncclCommAbort` excepted, which exists to be called while another thread is stuck).
/// [`NcclCollective`] keeps it behind a mutex for every call but the watchdog's abort.
#[derive(Debug, Clone, Copy)]
struct RawComm(sys::ncclComm_t);

// SAFETY: the handle is an opaque pointer NCCL allows to be used from any thread; the calls are
// serialised by `NcclCollective::comm` (see the rule above).
unsafe impl Send for RawComm {}
// SAFETY: as for `Send`; shared references only hand the handle to serialised calls or to
// ncclCommAbort, which NCCL permits concurrently.
unsafe impl Sync for RawComm {}

/// An NCCL error with its code, NCCL's text and the communicator's last error message.
fn nccl_error(
    op: &'static str,
    rank: usize,
    e: result::NcclError,
    comm: Option<RawComm>,
) -> candle_core::Error {
    // SAFETY: ncclGetErrorString returns a static string for any code; ncclGetLastError returns a
    // string owned by NCCL, valid until the next NCCL call on this thread, copied at once.
    let (text, last) = unsafe {
        let text = std::ffi::CStr::from_ptr(sys::ncclGetErrorString(e.0))
            .to_string_lossy()
            .into_owned();
        let last = match comm {
            Some(c) => {
                let p = sys::ncclGetLastError(c.0);
                if p.is_null() {
                    String::new()
                } else {
                    std::ffi::CStr::from_ptr(p).to_string_lossy().into_owned()
                }
            }
            None => String::new(),
        };
        (text, last)
    };
    CollectiveError::Library {
        backend: BACKEND,
        op,
        rank,
        code: format!("{:?}", e.0),
        detail: if last.is_empty() {
            text
        } else {
            format!("{text}; {last}")
        },
    }
    .into()
}

fn invalid(op: &'static str, detail: String) -> candle_core::Error {
    CollectiveError::InvalidArgument {
        backend: BACKEND,
        op,
        detail,
    }
    .into()
}

/// The communicator and what its watchdog watches: collectives enqueued but not complete, and a
/// call blocked inside NCCL on the host (a peer that never arrives can block the call itself).
struct Watch {
    /// The communicator, locked for every NCCL call (NCCL's one-thread rule) and, when the
    /// holder is not stuck inside NCCL, for the abort.
    comm: Mutex<RawComm>,
    rank: usize,
    timeout: Duration,
    pending: Mutex<VecDeque<(CudaEvent, Instant, &'static str)>>,
    /// The NCCL call in progress on the host, since when.
    in_call: Mutex<Option<(Instant, &'static str)>>,
    broken: Mutex<Option<String>>,
    /// A copy of the handle, for an abort while a stuck call holds `comm`.
    handle: std::sync::OnceLock<RawComm>,
}

impl Watch {
    fn lock_pending(&self) -> MutexGuard<'_, VecDeque<(CudaEvent, Instant, &'static str)>> {
        self.pending.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn lock_comm(&self) -> MutexGuard<'_, RawComm> {
        self.comm.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn broken(&self) -> Option<String> {
        self.broken
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// Runs one NCCL call with the communicator locked, visible to the watchdog while it runs;
    /// fails without calling when the communicator was aborted or dropped.
    fn call<R>(
        &self,
        op: &'static str,
        f: impl FnOnce(RawComm) -> R,
    ) -> std::result::Result<R, String> {
        let guard = self.lock_comm();
        if let Some(why) = self.broken() {
            return Err(why);
        }
        *self.in_call.lock().unwrap_or_else(|e| e.into_inner()) = Some((Instant::now(), op));
        let r = f(*guard);
        *self.in_call.lock().unwrap_or_else(|e| e.into_inner()) = None;
        Ok(r)
    }

    /// Marks the communicator broken first (no new call starts), then aborts it: under its
    /// lock when the lock comes within a grace period, else without (its holder is stuck inside
    /// NCCL, which ncclCommAbort exists to unblock).
    fn abort(&self, why: String) {
        {
            let mut broken = self.broken.lock().unwrap_or_else(|e| e.into_inner());
            if broken.is_some() {
                return;
            }
            *broken = Some(why);
        }
        let deadline = Instant::now() + Duration::from_millis(100);
        let guard = loop {
            match self.comm.try_lock() {
                Ok(g) => break Some(g),
                Err(std::sync::TryLockError::Poisoned(e)) => break Some(e.into_inner()),
                Err(std::sync::TryLockError::WouldBlock) if Instant::now() < deadline => {
                    std::thread::sleep(Duration::from_millis(1))
                }
                Err(std::sync::TryLockError::WouldBlock) => break None,
            }
        };
        let comm = match &guard {
            Some(g) => **g,
            None => self.handle_copy(),
        };
        // SAFETY: `broken` is set, so no new call starts on the handle; a call stuck inside NCCL
        // is what ncclCommAbort is for; the handle is never destroyed after an abort (Drop and
        // the group teardown skip broken communicators).
        unsafe {
            let _ = result::comm_abort(comm.0);
        }
        drop(guard);
    }

    /// The handle without the lock, for an abort while a call stuck in NCCL holds it.
    fn handle_copy(&self) -> RawComm {
        *self.handle.get().expect("set at construction")
    }

    /// One pass of the watchdog: drops completed events; aborts when the oldest collective or a
    /// host-blocked call is overdue, or when the stream reports an error.
    fn check(&self, ctx: &CudaContext) {
        let mut pending = self.lock_pending();
        if self.broken().is_some() {
            pending.clear();
            return;
        }
        let stuck = *self.in_call.lock().unwrap_or_else(|e| e.into_inner());
        if let Some((since, op)) = stuck {
            if since.elapsed() > self.timeout {
                pending.clear();
                drop(pending);
                self.abort(format!(
                    "rank {}: {op} blocked in NCCL for more than {:?} (a rank that never arrived?); the communicator was aborted",
                    self.rank, self.timeout
                ));
                return;
            }
        }
        while let Some((event, started, op)) = pending.front() {
            // SAFETY: the event is alive (owned by the queue) and its context is bound first.
            let status = unsafe {
                let _ = ctx.bind_to_thread();
                cu::cuEventQuery(event.cu_event())
            };
            let why = match status {
                cu::CUresult::CUDA_SUCCESS => {
                    pending.pop_front();
                    continue;
                }
                cu::CUresult::CUDA_ERROR_NOT_READY if started.elapsed() <= self.timeout => break,
                cu::CUresult::CUDA_ERROR_NOT_READY => format!(
                    "rank {}: {op} did not complete within {:?}; the communicator was aborted",
                    self.rank, self.timeout
                ),
                e => format!(
                    "rank {}: CUDA error {e:?} while waiting for {op}; the communicator was aborted",
                    self.rank
                ),
            };
            pending.clear();
            drop(pending);
            self.abort(why);
            return;
        }
    }
}

/// The communicators of one [`NcclGroup`]: destroyed together, once the last is dropped, since
/// destroying one communicator of a node waits for its peers (one thread dropping them one by
/// one would hang).
struct Teardown {
    comms: Vec<Arc<Watch>>,
    left: Mutex<usize>,
}

impl Teardown {
    fn release(&self) {
        let mut left = self.left.lock().unwrap_or_else(|e| e.into_inner());
        *left -= 1;
        if *left > 0 {
            return;
        }
        let live: Vec<RawComm> = self
            .comms
            .iter()
            .filter_map(|w| {
                let mut broken = w.broken.lock().unwrap_or_else(|e| e.into_inner());
                if broken.is_some() {
                    return None;
                }
                *broken = Some("the communicator was dropped".into());
                Some(*w.lock_comm())
            })
            .collect();
        // SAFETY: last use of handles that were not aborted; finalize in one group, then destroy.
        unsafe {
            let _ = result::group_start();
            for c in &live {
                let _ = result::comm_finalize(c.0);
            }
            let _ = result::group_end();
            for c in &live {
                let _ = result::comm_destroy(c.0);
            }
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
    /// Set for the communicators of an [`NcclGroup`], destroyed together.
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
    pub fn new(ordinals: &[usize]) -> Result<Vec<Arc<NcclCollective>>> {
        Self::with_timeout(ordinals, DEFAULT_TIMEOUT)
    }

    /// Like [`NcclGroup::new`], with the time a collective may take before its communicator is
    /// aborted.
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
        let devices: Vec<CudaDevice> = ordinals
            .iter()
            .map(|&o| CudaDevice::new_with_stream(o))
            .collect::<Result<_>>()?;
        let list: Vec<i32> = ordinals.iter().map(|&o| o as i32).collect();
        let mut raw = vec![std::ptr::null_mut(); ordinals.len()];
        // SAFETY: `raw` has room for one handle per device in `list`.
        unsafe { result::comm_init_all(raw.as_mut_ptr(), list.len() as i32, list.as_ptr()) }
            .map_err(|e| nccl_error("new", 0, e, None))?;
        let world = ordinals.len();
        let mut comms: Vec<NcclCollective> = raw
            .into_iter()
            .zip(devices)
            .enumerate()
            .map(|(rank, (comm, device))| {
                NcclCollective::wrap(RawComm(comm), device, rank, world, timeout)
            })
            .collect();
        let teardown = Arc::new(Teardown {
            comms: comms.iter().map(|c| c.watch.clone()).collect(),
            left: Mutex::new(comms.len()),
        });
        for c in &mut comms {
            c.teardown = Some(teardown.clone());
        }
        Ok(comms.into_iter().map(Arc::new).collect())
    }
}

impl NcclCollective {
    fn wrap(
        comm: RawComm,
        device: CudaDevice,
        rank: usize,
        world: usize,
        timeout: Duration,
    ) -> Self {
        let watch = Arc::new(Watch {
            comm: Mutex::new(comm),
            rank,
            timeout,
            pending: Mutex::new(VecDeque::new()),
            in_call: Mutex::new(None),
            broken: Mutex::new(None),
            handle: std::sync::OnceLock::from(comm),
        });
        let side = device
            .cuda_stream()
            .fork()
            .expect("creating the NCCL side stream");
        let weak: Weak<Watch> = Arc::downgrade(&watch);
        let ctx = device.cuda_stream().context().clone();
        std::thread::Builder::new()
            .name(format!("nccl-watchdog-{rank}"))
            .spawn(move || loop {
                std::thread::sleep(Duration::from_millis(10));
                match weak.upgrade() {
                    Some(w) => w.check(&ctx),
                    None => return,
                }
            })
            .expect("spawning the NCCL watchdog thread");
        Self {
            device,
            side,
            rank,
            world,
            watch,
            teardown: None,
        }
    }

    /// One process per GPU from torchrun's environment (`RANK`, `WORLD_SIZE`, `LOCAL_RANK`,
    /// `MASTER_ADDR`, `MASTER_PORT`): this rank runs on GPU `LOCAL_RANK`; rank 0 creates NCCL's
    /// unique id and hands it to the others with [`super::bootstrap::share_bytes`] (through
    /// torchrun's own TCPStore under torchrun, else over TCP from rank 0). Default timeout
    /// ([`DEFAULT_TIMEOUT`]) for the start-up and for every collective.
    pub fn from_env() -> Result<Arc<Self>> {
        Self::from_env_with_timeout(DEFAULT_TIMEOUT)
    }

    /// Like [`NcclCollective::from_env`], with the timeout.
    pub fn from_env_with_timeout(timeout: Duration) -> Result<Arc<Self>> {
        let env = DistEnv::from_env()?;
        let device = CudaDevice::new_with_stream(env.local_rank)?;
        let id = if env.rank == 0 {
            Some(unique_id()?)
        } else {
            None
        };
        let bytes = share_bytes(&env, id.as_ref().map(|b| &b[..]), timeout)?;
        Self::init_rank(device, env.rank, env.world_size, &bytes, timeout)
    }

    /// A communicator with the same ranks as `bootstrap` (any backend working on CPU tensors,
    /// e.g. MPI under `mpirun`), on GPU `ordinal`: rank 0 creates NCCL's unique id and broadcasts
    /// it over `bootstrap`. Default timeout ([`DEFAULT_TIMEOUT`]) for every collective.
    pub fn from_collective(bootstrap: &dyn Collective, ordinal: usize) -> Result<Arc<Self>> {
        Self::from_collective_with_timeout(bootstrap, ordinal, DEFAULT_TIMEOUT)
    }

    /// Like [`NcclCollective::from_collective`], with the timeout.
    pub fn from_collective_with_timeout(
        bootstrap: &dyn Collective,
        ordinal: usize,
        timeout: Duration,
    ) -> Result<Arc<Self>> {
        let device = CudaDevice::new_with_stream(ordinal)?;
        let id = if bootstrap.rank() == 0 {
            unique_id()?
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
        )
    }

    fn init_rank(
        device: CudaDevice,
        rank: usize,
        world: usize,
        id: &[u8],
        timeout: Duration,
    ) -> Result<Arc<Self>> {
        let internal: [std::ffi::c_char; 128] = match <[u8; 128]>::try_from(id) {
            Ok(b) => b.map(|v| v as std::ffi::c_char),
            Err(_) => {
                return Err(invalid(
                    "init",
                    format!("expected a 128-byte NCCL id, got {} bytes", id.len()),
                ))
            }
        };
        device.cuda_stream().context().bind_to_thread().w()?;
        let mut comm = std::ptr::null_mut();
        // SAFETY: `comm` receives the new handle; the id comes from ncclGetUniqueId on rank 0.
        unsafe {
            result::comm_init_rank(
                &mut comm,
                world as i32,
                sys::ncclUniqueId { internal },
                rank as i32,
            )
        }
        .map_err(|e| nccl_error("init", rank, e, None))?;
        Ok(Arc::new(Self::wrap(
            RawComm(comm),
            device,
            rank,
            world,
            timeout,
        )))
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

    /// The error of a call on an aborted or dropped communicator.
    fn left(&self, op: &'static str, why: String) -> candle_core::Error {
        rank_left(self.rank, op, why)
    }

    /// Enqueues one collective on `t` (on this rank's GPU) on the device's stream and returns
    /// its output tensor.
    fn enqueue(&self, what: Op, t: &Tensor) -> Result<Tensor> {
        self.enqueue_on(what, t, None)
    }

    /// Enqueues one collective on the side stream, after the work already on the device's
    /// stream (its input); `wait` makes the device's stream wait for it.
    fn start(
        &self,
        what: Op,
        t: &Tensor,
        finish: impl FnOnce(Tensor) -> Result<Tensor> + Send + 'static,
    ) -> Result<Pending> {
        let main = self.device.cuda_stream();
        let out = self.enqueue_on(what, t, Some(self.side.clone()))?;
        let flags = cu::CUevent_flags::CU_EVENT_DISABLE_TIMING;
        let done = self.side.record_event(Some(flags)).w()?;
        let (watch, rank, op) = (self.watch.clone(), self.rank, what.name());
        Ok(Pending::new(move || {
            main.wait(&done).w()?;
            // No host wait here (the device's stream waits for the side stream), but a
            // communicator the watchdog has aborted meanwhile never wrote `out`: say so rather
            // than hand it on. (An abort after this point shows in the next call.)
            if let Some(why) = watch.broken() {
                return Err(rank_left(rank, op, why));
            }
            finish(out)
        }))
    }

    fn enqueue_on(&self, what: Op, t: &Tensor, stream: Option<Arc<CudaStream>>) -> Result<Tensor> {
        let op = what.name();
        self.check_usable(op)?;
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
        let out = t.contiguous()?.apply_op1_no_bwd(&Enqueue {
            c: self,
            what,
            stream: stream.clone(),
        })?;
        let flags = cu::CUevent_flags::CU_EVENT_DISABLE_TIMING;
        let on = stream.unwrap_or_else(|| self.device.cuda_stream());
        let event = on.record_event(Some(flags)).w()?;
        self.watch
            .lock_pending()
            .push_back((event, Instant::now(), op));
        Ok(out)
    }
}

impl NcclCollective {
    /// Every rank's row count (read back: one synchronisation) and `t` padded with zero rows to
    /// the largest count, as NCCL's all-gather needs equal sizes.
    fn pad_for_gather(&self, t: &Tensor) -> Result<(Tensor, Vec<usize>, usize)> {
        if t.rank() == 0 {
            return Err(invalid(
                "all_gather",
                "expected a tensor of rank ≥ 1".into(),
            ));
        }
        let n = t.dims()[0];
        let counts = Tensor::new(&[n as i64], &self.device())?;
        let counts = self.enqueue(Op::AllGather, &counts)?.to_vec1::<i64>()?;
        // The read waited for the stream: if the watchdog aborted the gather meanwhile, the
        // buffer was never written, and its bytes are not row counts.
        self.check_usable("all_gather")?;
        let row: usize = t.dims()[1..].iter().product::<usize>().max(1);
        let limit = (isize::MAX as usize / row / t.dtype().size_in_bytes()) as i64;
        if let Some(bad) = counts.iter().find(|&&c| !(0..=limit).contains(&c)) {
            return Err(invalid(
                "all_gather",
                format!(
                    "a rank reported {bad} rows (row counts {counts:?}): not a valid row count"
                ),
            ));
        }
        let counts: Vec<usize> = counts.into_iter().map(|c| c as usize).collect();
        let max = counts.iter().copied().max().unwrap_or(0);
        if n == max {
            return Ok((t.clone(), counts, max));
        }
        let mut pad = t.dims().to_vec();
        pad[0] = max - n;
        let padded = Tensor::cat(&[t, &Tensor::zeros(pad, t.dtype(), t.device())?], 0)?;
        Ok((padded, counts, max))
    }
}

/// Rank r's `counts[r]` rows out of each block of `max` rows of a padded all-gather.
fn unpad(all: &Tensor, counts: &[usize], max: usize) -> Result<Tensor> {
    if counts.iter().all(|&c| c == max) {
        return Ok(all.clone());
    }
    let pieces: Vec<Tensor> = counts
        .iter()
        .enumerate()
        .map(|(r, &c)| all.narrow(0, r * max, c))
        .collect::<Result<_>>()?;
    Tensor::cat(&pieces, 0)
}

impl Drop for NcclCollective {
    fn drop(&mut self) {
        if let Some(t) = self.teardown.take() {
            t.release();
            return;
        }
        // The watchdog checks under the pending-queue lock and skips a broken communicator:
        // holding that lock while marking it closed and destroying it keeps the two apart.
        let _pending = self.watch.lock_pending();
        let comm = *self.watch.lock_comm();
        let mut broken = self.watch.broken.lock().unwrap_or_else(|e| e.into_inner());
        if broken.is_none() {
            *broken = Some("the communicator was dropped".into());
            // SAFETY: last use of the handle, which was not aborted (ncclCommAbort frees it).
            unsafe {
                let _ = result::comm_destroy(comm.0);
            }
        }
    }
}

fn unique_id() -> Result<[u8; 128]> {
    let id = result::get_uniqueid().map_err(|e| nccl_error("init", 0, e, None))?;
    Ok(id.internal.map(|c| c as u8))
}

/// The error of a call of `rank` on an aborted or dropped communicator.
fn rank_left(rank: usize, op: &'static str, why: String) -> candle_core::Error {
    CollectiveError::RankLeft {
        backend: BACKEND,
        op,
        call: 0,
        rank,
        reason: why,
    }
    .into()
}

fn nccl_op(op: ReduceOp) -> sys::ncclRedOp_t {
    match op {
        ReduceOp::Sum => sys::ncclRedOp_t::ncclSum,
        ReduceOp::Avg => sys::ncclRedOp_t::ncclAvg,
        ReduceOp::Max => sys::ncclRedOp_t::ncclMax,
        ReduceOp::Min => sys::ncclRedOp_t::ncclMin,
    }
}

/// The collective as a candle op, so that its output is an ordinary device tensor.
struct Enqueue<'a> {
    c: &'a NcclCollective,
    what: Op,
    /// The stream to enqueue on; `None` for the device's stream.
    stream: Option<Arc<CudaStream>>,
}

impl CustomOp1 for Enqueue<'_> {
    fn name(&self) -> &'static str {
        "nccl-collective"
    }

    fn cpu_fwd(&self, _: &CpuStorage, _: &Layout) -> Result<(CpuStorage, Shape)> {
        Err(invalid(
            self.what.name(),
            "NCCL needs tensors on the communicator's GPU, got a CPU tensor".into(),
        ))
    }

    fn cuda_fwd(&self, s: &CudaStorage, l: &Layout) -> Result<(CudaStorage, Shape)> {
        fn run<T: NcclType + DeviceRepr + CudaDType>(
            e: &Enqueue,
            s: &CudaStorage,
            l: &Layout,
        ) -> Result<(CudaStorage, Shape)> {
            let (c, op) = (e.c, e.what.name());
            let dev = &c.device;
            let src = view::<T>(s, l, "input")?;
            let n = l.shape().elem_count();
            let dims = l.dims();
            let (out_len, out_dims) = match e.what {
                Op::AllReduce(_) | Op::Broadcast(_) => (n, dims.to_vec()),
                Op::ReduceScatter(_) => {
                    let mut d = dims.to_vec();
                    d[0] /= c.world;
                    (n / c.world, d)
                }
                Op::AllGather => {
                    let mut d = dims.to_vec();
                    d[0] *= c.world;
                    (n * c.world, d)
                }
                Op::Barrier | Op::Split => {
                    return Err(invalid(op, "not a collective NCCL enqueues".into()))
                }
            };
            // SAFETY: NCCL writes every element of the output.
            let mut out = unsafe { dev.alloc::<T>(out_len)? };
            let stream = e.stream.clone().unwrap_or_else(|| dev.cuda_stream());
            if let Some(side) = &e.stream {
                // The side stream starts after everything on the device's stream so far: the
                // input and the output's allocation.
                side.join(&dev.cuda_stream()).w()?;
            }
            let (sp, _read) = src.device_ptr(&stream);
            let (dp, _write) = out.device_ptr_mut(&stream);
            let (sp, dp) = (sp as *const std::ffi::c_void, dp as *mut std::ffi::c_void);
            let (ty, cs) = (T::as_nccl_type(), stream.cu_stream() as sys::cudaStream_t);
            let res = c
                .watch
                .call(op, |comm| {
                    // SAFETY: both buffers live on this communicator's GPU and hold the counts
                    // passed (the input `n` values, the output `out_len`); the call holds the
                    // communicator's lock (NCCL's one-thread rule) and runs only if the
                    // communicator was neither aborted nor dropped.
                    let r = unsafe {
                        match e.what {
                            Op::AllReduce(o) => {
                                result::all_reduce(sp, dp, n, ty, nccl_op(o), comm.0, cs)
                            }
                            Op::ReduceScatter(o) => {
                                result::reduce_scatter(sp, dp, out_len, ty, nccl_op(o), comm.0, cs)
                            }
                            Op::AllGather => result::all_gather(sp, dp, n, ty, comm.0, cs),
                            Op::Broadcast(root) => {
                                result::broadcast(sp, dp, n, ty, root as i32, comm.0, cs)
                            }
                            Op::Barrier | Op::Split => {
                                unreachable!("rejected when the output shape was computed")
                            }
                        }
                    };
                    r.map_err(|err| nccl_error(op, c.rank, err, Some(comm)))
                })
                .map_err(|why| c.left(op, why))?;
            res?;
            drop((_read, _write));
            Ok((
                CudaStorage::wrap_cuda_slice(out, dev.clone()),
                Shape::from(out_dims),
            ))
        }
        if s.device().id() != self.c.device.id() {
            return Err(invalid(
                self.what.name(),
                "the tensor is on another CUDA device than the communicator".into(),
            ));
        }
        match s.dtype() {
            DType::F32 => run::<f32>(self, s, l),
            DType::F64 => run::<f64>(self, s, l),
            DType::F16 => run::<half::f16>(self, s, l),
            DType::BF16 => run::<half::bf16>(self, s, l),
            DType::I64 => run::<i64>(self, s, l),
            DType::U32 => run::<u32>(self, s, l),
            DType::U8 => run::<u8>(self, s, l),
            d => Err(invalid(
                self.what.name(),
                format!("unsupported dtype {d:?}"),
            )),
        }
    }
}

impl Collective for NcclCollective {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.world
    }

    fn all_reduce(&self, t: &Tensor, op: ReduceOp) -> Result<Tensor> {
        self.enqueue(Op::AllReduce(op), t)
    }

    fn reduce_scatter(&self, t: &Tensor, op: ReduceOp) -> Result<Tensor> {
        super::scatter_rows(t, self.rank, self.world)?;
        self.enqueue(Op::ReduceScatter(op), t)
    }

    /// Unequal row counts are supported: the counts are all-gathered and read back to the host
    /// (one synchronisation), every rank's rows padded to the largest, gathered, then unpadded.
    fn all_gather(&self, t: &Tensor) -> Result<Tensor> {
        let (padded, counts, max) = self.pad_for_gather(t)?;
        unpad(&self.enqueue(Op::AllGather, &padded)?, &counts, max)
    }

    fn broadcast(&self, t: &Tensor, root: usize) -> Result<Tensor> {
        if root >= self.world {
            return Err(invalid(
                "broadcast",
                format!("root {root} out of range for world size {}", self.world),
            ));
        }
        self.enqueue(Op::Broadcast(root), t)
    }

    /// An all-reduce of one value, then a wait for the stream: returns once every rank arrived.
    fn barrier(&self) -> Result<()> {
        let token = Tensor::zeros(1, DType::F32, &self.device())?;
        self.enqueue(Op::AllReduce(ReduceOp::Sum), &token)?;
        self.device.cuda_stream().synchronize().w()?;
        self.check_usable("barrier")
    }

    fn all_reduce_async(&self, t: &Tensor, op: ReduceOp) -> Result<Pending> {
        self.start(Op::AllReduce(op), t, Ok)
    }

    fn reduce_scatter_async(&self, t: &Tensor, op: ReduceOp) -> Result<Pending> {
        super::scatter_rows(t, self.rank, self.world)?;
        self.start(Op::ReduceScatter(op), t, Ok)
    }

    /// The row counts are exchanged (and read back) before the gather is started.
    fn all_gather_async(&self, t: &Tensor) -> Result<Pending> {
        let (padded, counts, max) = self.pad_for_gather(t)?;
        self.start(Op::AllGather, &padded, move |all| unpad(&all, &counts, max))
    }

    fn split(&self, color: Option<u32>, key: u32) -> Result<Option<Arc<dyn Collective>>> {
        self.check_usable("split")?;
        // NCCL_SPLIT_NOCOLOR is -1.
        let color = match color {
            Some(c) => {
                i32::try_from(c).map_err(|_| invalid("split", format!("color {c} exceeds i32")))?
            }
            None => -1,
        };
        let key =
            i32::try_from(key).map_err(|_| invalid("split", format!("key {key} exceeds i32")))?;
        let mut new = std::ptr::null_mut();
        self.watch
            .call("split", |comm| {
                // SAFETY: `new` receives the handle (null for NCCL_SPLIT_NOCOLOR); a null config
                // asks for the parent's configuration; the call holds the communicator's lock.
                unsafe {
                    sys::ncclCommSplit(comm.0, color, key, &mut new, std::ptr::null_mut()).result()
                }
                .map_err(|e| nccl_error("split", self.rank, e, Some(comm)))
            })
            .map_err(|why| self.left("split", why))??;
        if new.is_null() {
            return Ok(None);
        }
        let raw = RawComm(new);
        // SAFETY: queries on the new, valid handle.
        let (rank, world) = unsafe {
            (
                result::comm_user_rank(raw.0)
                    .map_err(|e| nccl_error("split", self.rank, e, Some(raw)))?,
                result::comm_count(raw.0)
                    .map_err(|e| nccl_error("split", self.rank, e, Some(raw)))?,
            )
        };
        let sub = Arc::new(Self::wrap(
            raw,
            self.device.clone(),
            rank as usize,
            world as usize,
            self.watch.timeout,
        ));
        Ok(Some(sub as Arc<dyn Collective>))
    }
}
