//! The watchdog of one NCCL communicator: it owns the [`RawComm`] behind a mutex (NCCL's
//! one-thread-at-a-time rule, abort and state queries included), serialises every call and
//! polls it to completion under the timeout, and a thread that every 10 ms asks NCCL for
//! asynchronous errors and checks the oldest enqueued collective's CUDA event. On any failure
//! it marks the communicator broken (every later call fails with the reason) and aborts it.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::time::{Duration, Instant};

use candle_core::cuda_backend::cudarc::driver::{sys as cu, CudaContext, CudaEvent};
use candle_rendezvous::progress::ProgressBoard;

use super::raw::{NcclFail, Progress, RawComm};
use crate::hang_report::ranks_behind;
use crate::recorder::{self, CallState, FlightRecorder};

/// Time a timed-out rank spends reading the other processes' progress reports.
const REPORT_DEADLINE: Duration = Duration::from_secs(3);

/// Why a call on the communicator failed.
#[derive(Debug)]
pub(super) enum CallError {
    /// The communicator was already (or has just been) aborted or dropped: the reason.
    Broken(String),
    /// NCCL refused the call; the communicator has been aborted.
    Nccl(NcclFail),
}

/// A collective on the stream, not yet known complete, with its call number.
type Enqueued = (CudaEvent, Instant, &'static str, u64);

/// One communicator and what is known about it.
pub(super) struct Watch {
    /// `None` once aborted or destroyed.
    comm: Mutex<Option<RawComm>>,
    pub rank: usize,
    pub timeout: Duration,
    pending: Mutex<VecDeque<Enqueued>>,
    broken: Mutex<Option<String>>,
    /// Set with `broken` when collectives enqueued before were not known complete then: their
    /// outputs may never have been written.
    lost: Mutex<bool>,
    /// The flight recorders this communicator can read: its own at `slot`, and for the ranks
    /// of an [`super::NcclGroup`] (one process) every rank's, which name the ranks behind a
    /// timeout.
    recorders: Arc<[FlightRecorder]>,
    slot: usize,
    /// For a rank of a multi-process job under torchrun: where every rank publishes its newest
    /// collective, read to name the ranks behind a timeout.
    board: Option<Arc<ProgressBoard>>,
    /// The number of the next collective enqueued (every rank numbers its calls alike).
    next_call: AtomicU64,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl Watch {
    /// Watches `comm` (possibly still initialising) and starts the watchdog thread, which
    /// stops when the `Watch` is dropped, and with a `board` the thread that publishes this
    /// rank's progress there.
    pub fn start(
        comm: RawComm,
        rank: usize,
        timeout: Duration,
        ctx: Arc<CudaContext>,
        (recorders, slot): (Arc<[FlightRecorder]>, usize),
        board: Option<Arc<ProgressBoard>>,
    ) -> Arc<Self> {
        let watch = Arc::new(Self {
            comm: Mutex::new(Some(comm)),
            rank,
            timeout,
            pending: Mutex::new(VecDeque::new()),
            broken: Mutex::new(None),
            lost: Mutex::new(false),
            recorders,
            slot,
            board: board.clone(),
            next_call: AtomicU64::new(0),
        });
        let weak: Weak<Watch> = Arc::downgrade(&watch);
        if let Some(board) = board {
            let weak = weak.clone();
            let newest = move || {
                let w = weak.upgrade()?;
                let call = w.next_call.load(Ordering::Relaxed).checked_sub(1);
                let line = w
                    .recorder()
                    .last()
                    .map_or_else(|| "not recorded".to_string(), |r| r.to_string());
                Some((call, line))
            };
            if let Err(e) = board.spawn_publisher(newest) {
                log::warn!("rank {rank}: cannot start the progress publisher thread ({e}): a hang report will not name the ranks behind");
            }
        }
        let spawned = std::thread::Builder::new()
            .name(format!("nccl-watchdog-{rank}"))
            .spawn(move || loop {
                std::thread::sleep(Duration::from_millis(10));
                match weak.upgrade() {
                    Some(w) => w.check(&ctx),
                    None => return,
                }
            });
        if let Err(e) = spawned {
            watch.abort(format!(
                "rank {rank}: cannot start the NCCL watchdog thread: {e}"
            ));
        }
        watch
    }

    /// Why the communicator cannot be used, if it cannot.
    pub fn broken(&self) -> Option<String> {
        lock(&self.broken).clone()
    }

    /// Why the communicator is broken, when collectives that had been enqueued were lost to it.
    pub fn lost(&self) -> Option<String> {
        if *lock(&self.lost) {
            self.broken()
        } else {
            None
        }
    }

    /// Records `why` as the reason the communicator is broken, unless one is recorded, and
    /// whether enqueued collectives were still unconfirmed (the watchdog drops completed ones
    /// every 10 ms, so this errs on the side of "lost").
    fn mark(&self, why: String) {
        let mut broken = lock(&self.broken);
        if broken.is_none() {
            let mut pending = lock(&self.pending);
            *lock(&self.lost) = !pending.is_empty();
            // Their events belong to a communicator that is being aborted: nothing to watch.
            for &(_, _, _, call) in pending.iter() {
                self.failed(call);
            }
            pending.clear();
            log::error!(
                "{}",
                self.recorder()
                    .dump(&format!("nccl rank {} ({why})", self.rank))
            );
            *broken = Some(why);
        }
    }

    /// This communicator's flight recorder.
    pub fn recorder(&self) -> &FlightRecorder {
        &self.recorders[self.slot]
    }

    /// The number the next collective will get.
    pub fn next_call(&self) -> u64 {
        self.next_call.load(Ordering::Relaxed)
    }

    /// Numbers and records a collective about to be enqueued; its number.
    pub fn begin(&self, op: &'static str, dtype: candle_core::DType, elems: usize) -> u64 {
        let call = self.next_call.fetch_add(1, Ordering::Relaxed);
        self.recorder().enqueue(call, op, Some(dtype), elems);
        call
    }

    /// Records call `call` as failed (NCCL refused it, or the communicator was broken).
    pub fn failed(&self, call: u64) {
        self.recorder().mark(call, CallState::Failed);
    }

    /// The ranks that never enqueued call `call` (`op`), and where each stopped: from the
    /// recorders of this process's group, or for a rank of a multi-process job from the
    /// progress reports in the job's store (torchrun's, or the one rank 0 hosts); `None` when
    /// neither is at hand.
    fn behind(&self, op: &str, call: u64) -> Option<Vec<String>> {
        if let Some(board) = &self.board {
            return Some(ranks_behind(
                board,
                op,
                call,
                Instant::now() + REPORT_DEADLINE,
            ));
        }
        if self.recorders.len() == 1 {
            return None;
        }
        Some(
            (0..self.recorders.len())
                .filter(|&q| q != self.slot)
                .filter_map(|q| recorder::behind_of(q, op, call, &self.recorders[q]))
                .collect(),
        )
    }

    /// Marks the communicator broken and aborts it (at once if no call holds it, else as soon
    /// as the call in progress sees the mark, within one poll).
    pub fn abort(&self, why: String) {
        log::error!("nccl: aborting the communicator: {why}");
        self.mark(why);
        let comm = lock(&self.comm).take();
        if let Some(c) = comm {
            c.abort();
        }
    }

    /// Runs `f` on the communicator, then polls it until the call is done, within the timeout.
    /// A failure, the deadline, or a mark set meanwhile by the watchdog aborts the communicator
    /// and fails this call and every later one.
    pub fn call<R>(
        &self,
        op: &'static str,
        f: impl FnOnce(&RawComm) -> Result<(R, Progress), NcclFail>,
    ) -> Result<R, CallError> {
        match self.call_keeping(op, f) {
            (Some(r), None) => Ok(r),
            (_, Some(e)) => Err(e),
            (None, None) => unreachable!("a call without a value has an error"),
        }
    }

    /// [`Watch::call`], also returning what `f` produced when the call then failed: the
    /// communicator has been aborted by then (which ends NCCL's background work), so the value
    /// (e.g. a split's child slot) can be inspected and dropped safely.
    pub fn call_keeping<R>(
        &self,
        op: &'static str,
        f: impl FnOnce(&RawComm) -> Result<(R, Progress), NcclFail>,
    ) -> (Option<R>, Option<CallError>) {
        let mut guard = lock(&self.comm);
        if let Some(why) = self.broken() {
            return (None, Some(CallError::Broken(why)));
        }
        let Some(comm) = guard.as_ref() else {
            return (
                None,
                Some(CallError::Broken("the communicator is closed".into())),
            );
        };
        let started = Instant::now();
        let (value, err) = match f(comm) {
            Ok((r, Progress::Done)) => return (Some(r), None),
            Ok((r, Progress::InProgress)) => match self.settle(comm, op, started) {
                Ok(()) => return (Some(r), None),
                Err(why) => {
                    self.mark(why.clone());
                    (Some(r), CallError::Broken(self.broken().unwrap_or(why)))
                }
            },
            Err(fail) => {
                self.mark(format!(
                    "rank {}: {op} failed in NCCL ({}: {}); the communicator was aborted",
                    self.rank, fail.code, fail.detail
                ));
                (None, CallError::Nccl(fail))
            }
        };
        if let Some(c) = guard.take() {
            c.abort();
        }
        (value, Some(err))
    }

    /// Polls a non-blocking call until NCCL is done with it: `Err(reason)` on an NCCL error,
    /// past the deadline, or when the watchdog marked the communicator broken meanwhile.
    fn settle(&self, comm: &RawComm, op: &'static str, started: Instant) -> Result<(), String> {
        let mut spins = 0u32;
        loop {
            match comm.state() {
                Ok(Progress::Done) => return Ok(()),
                Ok(Progress::InProgress) => {}
                Err(f) => {
                    return Err(format!(
                        "rank {}: {op} failed in NCCL ({}: {}); the communicator was aborted",
                        self.rank, f.code, f.detail
                    ))
                }
            }
            if let Some(why) = self.broken() {
                return Err(why);
            }
            if started.elapsed() > self.timeout {
                return Err(format!(
                    "rank {}: {op} did not complete in NCCL within {:?} (a rank that never arrived?); the communicator was aborted",
                    self.rank, self.timeout
                ));
            }
            spins += 1;
            if spins < 100 {
                std::thread::yield_now();
            } else {
                std::thread::sleep(Duration::from_micros(200));
            }
        }
    }

    /// Records a collective enqueued on a stream, by the event recorded after it.
    ///
    /// When the communicator was aborted between the NCCL call and this record (an
    /// asynchronous error the watchdog saw meanwhile), `mark` could not count the collective
    /// among the unconfirmed ones: it is counted lost here. `broken` is taken first, as in
    /// `mark`, so that one of the two always sees the other.
    pub fn track(&self, event: CudaEvent, op: &'static str, call: u64) {
        let broken = lock(&self.broken);
        if broken.is_some() {
            *lock(&self.lost) = true;
            self.failed(call);
            return;
        }
        self.recorder().mark(call, CallState::Started);
        lock(&self.pending).push_back((event, Instant::now(), op, call));
    }

    /// One pass of the watchdog: NCCL's asynchronous error (when no call holds the
    /// communicator), then the enqueued collectives: completed ones are dropped, the oldest
    /// overdue one or a CUDA error aborts.
    fn check(&self, ctx: &CudaContext) {
        // Aborted (its pending list already judged by `mark`) or closing (judged by
        // `finish_close`).
        if self.broken().is_some() {
            return;
        }
        let failed = match self.comm.try_lock() {
            Ok(g) => g.as_ref().and_then(|c| c.state().err()),
            Err(std::sync::TryLockError::Poisoned(e)) => {
                e.into_inner().as_ref().and_then(|c| c.state().err())
            }
            Err(std::sync::TryLockError::WouldBlock) => None,
        };
        if let Some(f) = failed {
            self.abort(format!(
                "rank {}: NCCL reported an asynchronous error ({}: {}) (a peer that left?); the communicator was aborted",
                self.rank, f.code, f.detail
            ));
            return;
        }
        let mut pending = lock(&self.pending);
        while let Some(&(ref event, started, op, call)) = pending.front() {
            // A context that cannot be bound (a sticky error, such as a kernel's illegal
            // address, recorded by cudarc) is that error, not the query's "no context".
            let status = match ctx.bind_to_thread() {
                Err(e) => e.0,
                // SAFETY: the event is alive (owned by the queue) and its context is bound.
                Ok(()) => unsafe { cu::cuEventQuery(event.cu_event()) },
            };
            let why = match status {
                cu::CUresult::CUDA_SUCCESS => {
                    self.recorder().mark(call, CallState::Completed);
                    pending.pop_front();
                    continue;
                }
                cu::CUresult::CUDA_ERROR_NOT_READY if started.elapsed() <= self.timeout => break,
                cu::CUresult::CUDA_ERROR_NOT_READY => {
                    // The other ranks' reports may take a network read: not under the lock.
                    drop(pending);
                    let behind = match self.behind(op, call) {
                        None => " (the other ranks' progress is not known here: it is reported for the ranks of an NcclGroup and, under torchrun, of NcclCollective::from_env)".to_string(),
                        Some(b) if b.is_empty() => String::new(),
                        Some(b) => format!(" ({})", b.join("; ")),
                    };
                    self.abort(format!(
                        "rank {}: {op} #{call} did not complete within {:?}{behind}; the communicator was aborted",
                        self.rank, self.timeout,
                    ));
                    return;
                }
                e => format!(
                    "rank {}: CUDA error {e:?} while waiting for {op}; the communicator was aborted",
                    self.rank
                ),
            };
            drop(pending);
            self.abort(why);
            return;
        }
    }

    /// Starts closing: marks the communicator closed (later calls fail) and starts
    /// `ncclCommFinalize`, which flushes its queued collectives: whether they were lost is
    /// decided by [`finish_close`], by how the finalize ends. `None` when it was aborted or
    /// already closed.
    pub fn begin_close(self: &Arc<Self>) -> Option<Closing> {
        let mut guard = lock(&self.comm);
        lock(&self.broken).get_or_insert_with(|| "the communicator was dropped".into());
        let comm = guard.take()?;
        let started = comm.finalize();
        Some(Closing {
            watch: self.clone(),
            comm,
            started,
        })
    }

    /// The close ends in an abort: collectives still unconfirmed may never have run.
    fn lose_pending(&self) {
        let mut pending = lock(&self.pending);
        if !pending.is_empty() {
            *lock(&self.lost) = true;
        }
        pending.clear();
    }
}

/// A communicator whose finalize was started by [`Watch::begin_close`].
pub(super) struct Closing {
    watch: Arc<Watch>,
    comm: RawComm,
    started: Result<Progress, NcclFail>,
}

/// Polls communicators that are starting (`ncclCommInitRankConfig`, several of one NCCL group
/// from one thread) until each is done, under one deadline, before any watchdog sees them:
/// `Err` on an NCCL error or at the deadline (the caller drops them, which aborts them), with
/// the rank whose communicator failed: `ranks[i]` names `comms[i]`.
pub(super) fn wait_ready(
    comms: &[RawComm],
    ranks: &[usize],
    op: &'static str,
    timeout: Duration,
) -> Result<(), (usize, CallError)> {
    let deadline = Instant::now() + timeout;
    let mut busy: Vec<usize> = (0..comms.len()).collect();
    while !busy.is_empty() {
        let mut still = Vec::new();
        for i in busy {
            match comms[i].state() {
                Ok(Progress::Done) => {}
                Ok(Progress::InProgress) if Instant::now() < deadline => still.push(i),
                Ok(Progress::InProgress) => {
                    return Err((
                        ranks[i],
                        CallError::Broken(format!(
                            "{op} did not complete in NCCL within {timeout:?} (a rank that never arrived?); the communicator was aborted"
                        )),
                    ))
                }
                Err(f) => return Err((ranks[i], CallError::Nccl(f))),
            }
        }
        busy = still;
        if !busy.is_empty() {
            std::thread::sleep(Duration::from_millis(1));
        }
    }
    Ok(())
}

/// Finishes closing communicators started by [`Watch::begin_close`] (all of one node's, for
/// a group driven by one thread): polls each until its finalize is done, within `timeout`,
/// then destroys it (its collectives all ran: a `Pending` that outlives it completes); one
/// that fails or is still busy at the deadline (queued work a departed peer will never join) is
/// aborted instead, its unconfirmed collectives counted lost, so a drop never hangs.
pub(super) fn finish_close(closing: Vec<Closing>, timeout: Duration) {
    let deadline = Instant::now() + timeout;
    let abort = |c: Closing| {
        c.watch.lose_pending();
        c.comm.abort();
    };
    let mut busy: Vec<Closing> = Vec::new();
    for c in closing {
        match c.started {
            Ok(_) => busy.push(c),
            Err(_) => abort(c),
        }
    }
    while !busy.is_empty() {
        let mut still = Vec::new();
        for c in busy {
            match c.comm.state() {
                Ok(Progress::Done) => {
                    lock(&c.watch.pending).clear();
                    c.comm.destroy();
                }
                Ok(Progress::InProgress) if Instant::now() < deadline => still.push(c),
                _ => abort(c),
            }
        }
        busy = still;
        if !busy.is_empty() {
            std::thread::sleep(Duration::from_millis(1));
        }
    }
}
