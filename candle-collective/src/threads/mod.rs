//! `ThreadGroup`: a collective backend whose ranks are threads of one process.
//!
//! Every call deposits its tensor in a numbered slot shared by the group; the last rank to
//! arrive checks that all ranks asked for the same thing, computes the result once (in rank
//! order, so it is bitwise identical everywhere) and wakes the others. A rank that waits past
//! the timeout, or that panics, breaks the group: every rank still waiting, and every later
//! call, fails promptly with the reason. A rank that drops its handle without panicking dooms
//! the calls it never made, at once: a peer waiting in one fails with the reason; the
//! asynchronous calls the rank had started still complete, on its communication thread,
//! which the drop does not wait for (a peer that joins them only after another group's call
//! that needs this rank would otherwise wait for the whole timeout).
//!
//! Allocation on Linux with glibc: results and gradients of many megabytes are allocated on the
//! rank threads, from glibc's per-thread heaps, which hand a heap that becomes empty back to
//! the system whatever `MALLOC_TRIM_THRESHOLD_` says; filling fresh pages again costs page
//! faults on every call. `MALLOC_ARENA_MAX=1` (every thread on the main heap, which keeps what
//! is freed under a high `MALLOC_TRIM_THRESHOLD_`) made `DataParallel::sync_gradients` of a
//! large bucket much faster (measured with that high trim threshold and `MALLOC_MMAP_THRESHOLD_`:
//! docs/benchmarks.md, section "Gradient synchronisation on the CPU backends"). Another
//! allocator may do the same; not tried.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

mod combine;
mod fused;
mod reduce;

use candle_core::{DType, Device, Result, Tensor};

use combine::Plan;
use reduce::Work;

use super::recorder::{self, CallState, FlightRecorder};
use super::{
    check_wire, scatter_rows, split_members, AllReduce, Collective, CollectiveError, Op, Pending,
    ReduceOp, Worker,
};

const BACKEND: &str = "ThreadGroup";

/// Constructor of in-process thread ranks (the backend for tests and multi-core CPU training).
///
/// ```
/// use candle_core::{Device, Tensor};
/// use candle_collective::{ReduceOp, ThreadGroup};
///
/// let sums = ThreadGroup::run(3, |comm| {
///     let t = Tensor::new(&[comm.rank() as f32 + 1.0], &Device::Cpu)?;
///     comm.all_reduce(&t, ReduceOp::Sum)?.to_vec1::<f32>()
/// })?;
/// assert_eq!(sums, vec![vec![6.0]; 3]);
/// # Ok::<(), candle_core::Error>(())
/// ```
#[derive(Debug, Clone, Copy)]
pub struct ThreadGroup;

// `new` returns the communicators of all ranks, not a `ThreadGroup`: the group itself has no
// state of its own once its ranks are handed out.
#[allow(clippy::new_ret_no_self)]
impl ThreadGroup {
    /// One communicator per rank (`result[r]` has rank `r`), with the default timeout
    /// ([`super::default_timeout`]: `CANDLE_DISTRIBUTED_TIMEOUT`, else
    /// [`DEFAULT_TIMEOUT`](super::DEFAULT_TIMEOUT)).
    /// Hand each to its own thread. The machine's cores are shared among the ranks
    /// ([`crate::share_cores`]: `max(1, cores / world_size)` candle threads each, unless
    /// `CANDLE_NUM_THREADS` or `RAYON_NUM_THREADS` is set).
    ///
    /// # Errors
    ///
    /// [`CollectiveError::InvalidArgument`] when `world_size` is 0; an invalid
    /// `CANDLE_DISTRIBUTED_TIMEOUT`.
    pub fn new(world_size: usize) -> Result<Vec<Arc<dyn Collective>>> {
        Self::with_timeout(world_size, super::default_timeout()?)
    }

    /// Like [`ThreadGroup::new`], with the time a rank waits for the others in one collective.
    ///
    /// # Errors
    ///
    /// As [`ThreadGroup::new`].
    pub fn with_timeout(world_size: usize, timeout: Duration) -> Result<Vec<Arc<dyn Collective>>> {
        if world_size == 0 {
            return Err(CollectiveError::invalid(
                BACKEND,
                "new",
                "world_size must be at least 1, got 0".into(),
            )
            .into());
        }
        crate::share_cores(world_size);
        let shared = Shared::new(world_size, timeout);
        Ok((0..world_size)
            .map(|rank| {
                Arc::new(ThreadRank {
                    rank,
                    shared: shared.clone(),
                    next_call: AtomicU64::new(0),
                    worker: Worker::default(),
                }) as Arc<dyn Collective>
            })
            .collect())
    }

    /// Runs `f` on `world_size` scoped threads, one per rank, and returns their results in rank
    /// order, or the error that started the failure: the first error that is not a rank leaving
    /// (the others' usual reaction to the failed rank's departure), with its rank and the other
    /// ranks' errors (their first lines) as context; a [`CollectiveError`] stays matchable
    /// through [`CollectiveError::find`]. A rank that panics is an error naming it, and its
    /// departure makes the others' pending collectives fail promptly. The cores are shared among
    /// the ranks first, as by [`ThreadGroup::new`].
    ///
    /// With the `cuda` feature, each rank's thread waits for the GPU work it enqueued on its
    /// per-thread default stream before its result is handed back: the per-thread streams of
    /// two threads are not ordered with each other, so the caller could otherwise read tensors
    /// a rank's kernels have not written yet. A calling thread without a current CUDA context
    /// then takes the context of the ranks' device, so that it can free the tensors they
    /// returned.
    ///
    /// # Errors
    ///
    /// When `world_size` is 0, and otherwise the failure that started it: the error `f` returned
    /// on the rank that failed first (ranks that failed because another left come after ranks
    /// that failed on their own), or, for a rank that panicked, an error naming it; with
    /// `rank r` and the other failed ranks' first lines as context.
    pub fn run<R, F>(world_size: usize, f: F) -> Result<Vec<R>>
    where
        R: Send,
        F: Fn(Arc<dyn Collective>) -> Result<R> + Sync,
    {
        let comms = Self::new(world_size)?;
        let f = &f;
        std::thread::scope(|s| {
            let handles: Vec<_> = comms
                .into_iter()
                .map(|comm| {
                    let rank = comm.rank();
                    s.spawn(move || {
                        // A panic is caught here, so that it is stamped when it happens (the
                        // communicator, dropped while unwinding, still fails the others).
                        let out =
                            std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| f(comm)))
                                .unwrap_or_else(|p| {
                                    let what = (p.downcast_ref::<&str>().map(|s| s.to_string()))
                                        .or_else(|| p.downcast_ref::<String>().cloned())
                                        .unwrap_or_default();
                                    Err(candle_core::Error::Msg(format!(
                                        "rank {rank} panicked: {what}"
                                    )))
                                });
                        let at = Instant::now();
                        (finish_rank(out), at)
                    })
                })
                .collect();
            let mut values = Vec::with_capacity(world_size);
            let mut failed = Vec::new();
            for (rank, h) in handles.into_iter().enumerate() {
                match h.join() {
                    Ok((Ok((v, ctx)), at)) => match adopt_rank_context(&ctx) {
                        Ok(()) => values.push(v),
                        Err(e) => failed.push((rank, at, e)),
                    },
                    Ok((Err(e), at)) => failed.push((rank, at, e)),
                    Err(_) => failed.push((
                        rank,
                        Instant::now(),
                        candle_core::Error::Msg(format!("rank {rank} panicked")),
                    )),
                }
            }
            match first_cause(failed) {
                None => Ok(values),
                Some(e) => Err(e),
            }
        })
    }
}

/// The failure that started the others, with its rank and the others' first lines as context:
/// the earliest that is not a rank leaving (what the others see once the failed rank is gone),
/// else the earliest.
fn first_cause(
    mut failed: Vec<(usize, Instant, candle_core::Error)>,
) -> Option<candle_core::Error> {
    let consequence =
        |e: &candle_core::Error| CollectiveError::find(e).is_some_and(|c| c.is_consequence());
    let first = (0..failed.len()).min_by_key(|&i| (consequence(&failed[i].2), failed[i].1))?;
    let (rank, _, cause) = failed.remove(first);
    let others: Vec<String> = (failed.iter())
        .map(|(r, _, e)| format!("rank {r}: {}", e.to_string().lines().next().unwrap_or("")))
        .collect();
    Some(match others.is_empty() {
        true => cause.context(format!("rank {rank}")),
        false => cause.context(format!(
            "rank {rank} (where the failure started; then {})",
            others.join("; ")
        )),
    })
}

/// A rank's result, once the work its thread enqueued on a GPU is complete: the caller's thread
/// reads what the rank computed, and the per-thread streams of two threads are not ordered.
/// With it, the CUDA context the rank used (for [`adopt_rank_context`]).
fn finish_rank<R>(result: Result<R>) -> Result<(R, RankContext)> {
    let v = result?;
    #[cfg(feature = "cuda")]
    return crate::device::cuda::finish_thread_work().map(|ctx| (v, ctx));
    #[cfg(not(feature = "cuda"))]
    Ok((v, RankContext))
}

#[cfg(feature = "cuda")]
use crate::device::cuda::RankContext;
/// Nothing to hand over without the `cuda` feature.
#[cfg(not(feature = "cuda"))]
struct RankContext;

/// On the caller's thread: the rank's CUDA context becomes current if the thread has none, so
/// that it can free the tensors the rank returned (see `RankContext::adopt`).
fn adopt_rank_context(ctx: &RankContext) -> Result<()> {
    #[cfg(feature = "cuda")]
    return ctx.adopt();
    #[cfg(not(feature = "cuda"))]
    {
        let _ = ctx;
        Ok(())
    }
}

#[derive(Debug)]
struct Shared {
    world: usize,
    timeout: Duration,
    /// Each rank's flight recorder: in one process, the rank that sees a timeout reads where
    /// the missing ranks stand.
    recorders: Vec<FlightRecorder>,
    state: Mutex<State>,
    cv: Condvar,
    /// Subgroups being handed out by a split: `(split call, color)` → the subgroup and how
    /// many of its members have not taken it yet.
    subgroups: Mutex<HashMap<(u64, u32), Handout>>,
}

/// A subgroup created by a split and the number of its members yet to take it.
type Handout = (Arc<Shared>, usize);

impl Shared {
    fn new(world: usize, timeout: Duration) -> Arc<Self> {
        Arc::new(Self {
            world,
            timeout,
            recorders: (0..world).map(|_| FlightRecorder::from_env()).collect(),
            state: Mutex::new(State::default()),
            cv: Condvar::new(),
            subgroups: Mutex::new(HashMap::new()),
        })
    }
}

#[derive(Debug, Default)]
struct State {
    /// Calls some ranks have entered and others not yet.
    pending: BTreeMap<u64, Vec<Option<Contribution>>>,
    /// Calls whose sum the ranks are computing together.
    working: HashMap<u64, Arc<dyn Work>>,
    /// Finished calls whose result not every rank has read yet.
    done: HashMap<u64, Finished>,
    /// Why the group can no longer complete collectives.
    broken: Option<String>,
    /// Ranks that dropped their handle without panicking: each dooms the calls it never made.
    departed: Vec<Departure>,
}

/// A rank that dropped its handle after making calls `0..issued`.
#[derive(Debug)]
struct Departure {
    rank: usize,
    issued: u64,
    /// Its communication thread has finished (or dropped) every call it was given: a call it
    /// has not contributed to by then never gets its contribution (a call whose submission or
    /// hand-off failed, or that was lost with a panicking thread).
    drained: bool,
    reason: String,
}

impl State {
    /// Why call `call` can never complete: the group is broken, or a rank left without making
    /// it, or with its communication thread done and its contribution missing.
    fn doomed(&self, call: u64) -> Option<&str> {
        self.broken.as_deref().or_else(|| {
            let missing = |rank: usize| {
                self.pending
                    .get(&call)
                    .is_some_and(|slots| slots[rank].is_none())
            };
            self.departed
                .iter()
                .find(|d| d.issued <= call || (d.drained && missing(d.rank)))
                .map(|d| d.reason.as_str())
        })
    }
}

/// Marks a departed rank's communication thread drained when dropped: queued behind its last
/// call, it is dropped after that call ran, or with the queue when the thread died, or at once
/// when there is no thread.
struct DrainedMark {
    shared: Arc<Shared>,
    rank: usize,
}

impl Drop for DrainedMark {
    fn drop(&mut self) {
        let mut st = lock(&self.shared.state);
        if let Some(d) = st.departed.iter_mut().find(|d| d.rank == self.rank) {
            d.drained = true;
        }
        self.shared.cv.notify_all();
    }
}

#[derive(Debug)]
struct Finished {
    result: std::result::Result<Tensor, CollectiveError>,
    readers_left: usize,
}

/// What one rank hands a call: one tensor, or the parts of a `Collective::all_reduce_with` of
/// several.
#[derive(Debug, Clone)]
enum Input {
    One(Tensor),
    Parts(Vec<Tensor>),
}

impl Input {
    /// The tensors, in order.
    fn tensors(&self) -> &[Tensor] {
        match self {
            Input::One(t) => std::slice::from_ref(t),
            Input::Parts(parts) => parts,
        }
    }

    /// The tensors moved to the host, detached (see `complete`).
    fn to_host(&self) -> Result<Input> {
        let host = |t: &Tensor| t.to_device(&Device::Cpu).map(|h| h.detach());
        Ok(match self {
            Input::One(t) => Input::One(host(t)?),
            Input::Parts(parts) => Input::Parts(parts.iter().map(host).collect::<Result<_>>()?),
        })
    }

    /// The dtype (the parts share one: `check_parts`).
    fn dtype(&self) -> DType {
        self.tensors().first().map_or(DType::F32, Tensor::dtype)
    }

    /// The shape of a reduction's result: the tensor's, or the parts' total as one dimension.
    fn result_shape(&self) -> candle_core::Shape {
        match self {
            Input::One(t) => t.shape().clone(),
            Input::Parts(parts) => parts.iter().map(Tensor::elem_count).sum::<usize>().into(),
        }
    }

    /// One tensor: itself, or the parts flattened and laid end to end.
    fn flat(&self) -> Result<Tensor> {
        match self {
            Input::One(t) => Ok(t.clone()),
            // A copy even of one part (which `cat` would hand back as it is): the result must
            // not share the caller's storage.
            Input::Parts(parts) if parts.len() == 1 => parts[0].flatten_all()?.copy(),
            Input::Parts(parts) => {
                let flat = parts
                    .iter()
                    .map(Tensor::flatten_all)
                    .collect::<Result<Vec<_>>>()?;
                Tensor::cat(&flat, 0)
            }
        }
    }
}

/// What one rank brought to a call: its input on the host, or why it could not copy it there
/// (the call then fails on every rank alike, and the group stays in step).
#[derive(Debug)]
struct Contribution {
    kind: Op,
    /// The dtype a reduction rounds each value to (`AllReduce::wire`).
    wire: Option<DType>,
    input: std::result::Result<Input, String>,
}

impl Contribution {
    fn describe(&self) -> String {
        let wire = self
            .wire
            .map_or(String::new(), |w| format!(" on a {w:?} wire"));
        match &self.input {
            Ok(Input::One(t)) => format!("{} {:?} {:?}{wire}", self.kind, t.dtype(), t.dims()),
            Ok(input @ Input::Parts(parts)) => {
                let counts: Vec<usize> = parts.iter().map(Tensor::elem_count).collect();
                format!("{} {:?} parts {counts:?}{wire}", self.kind, input.dtype())
            }
            Err(_) => format!("{} without an input", self.kind),
        }
    }
}

/// One rank's handle on a [`ThreadGroup`].
#[derive(Debug)]
struct ThreadRank {
    rank: usize,
    shared: Arc<Shared>,
    next_call: AtomicU64,
    /// Runs the `*_async` collectives.
    worker: Worker,
}

fn lock(m: &Mutex<State>) -> MutexGuard<'_, State> {
    // A rank that panicked while holding the lock left the state consistent (every mutation
    // is completed before anything that can panic), so the poison flag carries no information.
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl ThreadRank {
    fn call(&self, kind: Op, t: &Tensor) -> Result<Tensor> {
        let call = self.next_call.fetch_add(1, Ordering::SeqCst);
        let t = self.own(t, false)?;
        complete(
            &self.shared,
            self.rank,
            call,
            (kind, None),
            Ok(&Input::One(t)),
        )
    }

    /// `t` as a synchronous call hands it on. One rank's result may be its input itself (a sum
    /// or a gather of one): a variable's tensor is copied first, unless the caller allowed the
    /// result to be it (`may_share`), as a `Var` set after the call would change the result.
    fn own(&self, t: &Tensor, may_share: bool) -> Result<Tensor> {
        match self.shared.world == 1 && !may_share && t.is_variable() {
            true => crate::device::fresh_copy(t),
            false => Ok(t.clone()),
        }
    }

    /// Takes the call's place in the order now and completes it on the communication thread.
    fn call_async(&self, kind: Op, t: &Tensor) -> Result<Pending> {
        self.call_async_on(kind, None, t)
    }

    /// [`Self::call_async`] of a reduction carried in `wire` (`None`: in `t`'s dtype).
    fn call_async_on(&self, kind: Op, wire: Option<DType>, t: &Tensor) -> Result<Pending> {
        let call = self.next_call.fetch_add(1, Ordering::SeqCst);
        // The input is copied here, on the caller's thread: to the host for a GPU input, on the
        // caller's stream (the sum is made on the host anyway), and into a buffer of its own
        // for a CPU input. The communication thread then never reads the caller's tensor,
        // which the caller may write into or free as soon as it waited or dropped the handle
        // (on a GPU, on its own stream, unordered with that thread's), while the others may
        // not have arrived yet. The result goes back to the input's device on the communication
        // thread, whose stream the caller's waits for in `Pending::wait`. Detached, as in
        // `complete`: the worker must not hold the caller's graph either.
        // A failed copy still takes part (the call number is taken): as in `complete`.
        let device = t.device().clone();
        let (shared, rank) = (self.shared.clone(), self.rank);
        let host = if device.is_cpu() {
            t.copy()
        } else {
            t.to_device(&Device::Cpu)
        };
        let host = host.map(|h| Input::One(h.detach()));
        let host = host.map_err(|e| e.to_string());
        let mark = match &host {
            Ok(Input::One(h)) => h.clone(),
            _ => t.detach(),
        };
        let world = self.shared.world;
        self.worker.submit(BACKEND, &mark, move || {
            let out = complete(
                &shared,
                rank,
                call,
                (kind, wire),
                host.as_ref().map_err(Clone::clone),
            )?;
            let out = match kind {
                Op::ReduceScatter(_) => scatter_rows(&out, rank, world)?,
                _ => out,
            };
            out.to_device(&device)
        })
    }
}

/// Deposits rank `rank`'s tensor in slot `call`, computes the result if it is the last to
/// arrive (or plans the sum every rank helps with), and waits for it (or for the timeout, or
/// for the group to break). `what`: the collective and the wire dtype of a reduction.
fn complete(
    sh: &Shared,
    rank: usize,
    call: u64,
    what: (Op, Option<DType>),
    t: std::result::Result<&Input, String>,
) -> Result<Tensor> {
    let kind = what.0;
    let device = match t.as_ref().map(|t| t.tensors().first()) {
        Ok(Some(first)) => first.device().clone(),
        _ => Device::Cpu,
    };
    // Detached: the shared state must not keep the caller's autograd graph alive. That graph
    // can hold the last reference to a rank's communicator (a layer's op keeps its `Arc`), and
    // the communicator's `Drop` takes the lock this function holds when it drops the
    // contributions: a rank that finished first would deadlock the last one.
    // A failed copy (or an input refused on this rank) still takes part: the call number is
    // taken, and the others are waiting for this rank in that slot.
    let (dtype, elems) = match &t {
        Ok(t) => (
            t.tensors().first().map(Tensor::dtype),
            t.tensors().iter().map(Tensor::elem_count).sum(),
        ),
        Err(_) => (None, 0),
    };
    let recorder = &sh.recorders[rank];
    recorder.enqueue(call, kind.name(), dtype, elems);
    let input = t.and_then(|t| t.to_host().map_err(|e| e.to_string()));
    let result = deposit_and_wait(sh, rank, call, what, input, &device);
    let state = match result {
        Ok(_) => CallState::Completed,
        Err(_) => CallState::Failed,
    };
    recorder.mark(call, state);
    result
}

/// [`complete`]'s deposit of this rank's `input` in slot `call`, and its wait for the result.
fn deposit_and_wait(
    sh: &Shared,
    rank: usize,
    call: u64,
    (kind, wire): (Op, Option<DType>),
    input: std::result::Result<Input, String>,
    device: &Device,
) -> Result<Tensor> {
    let mut st = lock(&sh.state);
    if let Some(reason) = st.doomed(call) {
        return Err(left(rank, kind, call, reason.to_string()).into());
    }
    let slots = st
        .pending
        .entry(call)
        .or_insert_with(|| (0..sh.world).map(|_| None).collect());
    slots[rank] = Some(Contribution { kind, wire, input });
    if slots.iter().all(Option::is_some) {
        for r in &sh.recorders {
            r.mark(call, CallState::Started);
        }
        let slots = st.pending.remove(&call).unwrap_or_default();
        let contributions: Vec<Contribution> = slots.into_iter().flatten().collect();
        match combine::plan(call, &contributions) {
            Plan::Ready(result) => {
                st.done.insert(
                    call,
                    Finished {
                        result,
                        readers_left: sh.world,
                    },
                );
            }
            // The waiting ranks wake up to help.
            Plan::Shared(work) => _ = st.working.insert(call, Arc::from(work)),
        }
        sh.cv.notify_all();
    }
    wait_for_result(sh, st, rank, call, kind, device)
}

/// Waits (holding `st` between wake-ups) until call `call`'s result is there, the group breaks
/// or the timeout passes; takes this rank's copy of the result on `device`.
fn wait_for_result<'a>(
    sh: &'a Shared,
    mut st: MutexGuard<'a, State>,
    rank: usize,
    call: u64,
    kind: Op,
    device: &Device,
) -> Result<Tensor> {
    let deadline = Instant::now() + sh.timeout;
    loop {
        if let Some(fin) = st.done.get_mut(&call) {
            // Results are computed (a broadcast's copied) while every rank is still inside
            // the call. Each rank gets a tensor no other rank holds, which it may write into at
            // once: the copy to the rank's GPU, or on the host a copy for every reader but the
            // last, which takes the computed one (with one rank that may be the rank's own
            // input, as an in-place collective leaves it). A reader counts itself out only
            // after its copy, so the last one never writes into what another still copies.
            let own = |t: Tensor, last: bool| {
                if !device.is_cpu() {
                    t.to_device(device)
                } else if last {
                    Ok(t)
                } else {
                    t.copy()
                }
            };
            if fin.readers_left == 1 {
                let result = st.done.remove(&call).map(|f| f.result);
                drop(st);
                let result = result.expect("found above");
                return result
                    .map_err(Into::into)
                    .and_then(|t| own(t, true))
                    .map(|t| t.detach());
            }
            let result = fin.result.clone();
            drop(st);
            let out = result.map_err(Into::into).and_then(|t| own(t, false));
            let mut st = lock(&sh.state);
            if let Some(fin) = st.done.get_mut(&call) {
                fin.readers_left -= 1;
                if fin.readers_left == 0 {
                    st.done.remove(&call);
                }
            }
            return out.map(|t| t.detach());
        }
        if let Some(work) = st.working.get(&call).filter(|w| !w.claimed_all()).cloned() {
            drop(st);
            let finished = work.help();
            st = lock(&sh.state);
            if let Some(result) = finished {
                st.working.remove(&call);
                let result = result
                    .map_err(|e| CollectiveError::invalid(BACKEND, kind.name(), e.to_string()));
                st.done.insert(
                    call,
                    Finished {
                        result,
                        readers_left: sh.world,
                    },
                );
                sh.cv.notify_all();
            }
            continue;
        }
        if let Some(reason) = st.doomed(call) {
            return Err(left(rank, kind, call, reason.to_string()).into());
        }
        let now = Instant::now();
        if now >= deadline {
            let missing: Vec<usize> = st
                .pending
                .get(&call)
                .map(|s| (0..sh.world).filter(|&r| s[r].is_none()).collect())
                .unwrap_or_default();
            let behind: Vec<String> = missing
                .iter()
                .map(|&r| {
                    let rec = &sh.recorders[r];
                    recorder::behind_of(r, kind.name(), call, rec).unwrap_or_else(|| {
                        recorder::behind(r, kind.name(), call, rec.last().as_ref())
                    })
                })
                .collect();
            for (r, rec) in sh.recorders.iter().enumerate() {
                log::error!(
                    "{}",
                    rec.dump(&format!("{BACKEND} rank {r} (timeout seen by rank {rank})"))
                );
            }
            st.broken = Some(format!(
                "rank {rank} timed out after {:?} in {} call #{call} waiting for ranks {missing:?}: {}",
                sh.timeout,
                kind.name(),
                behind.join("; ")
            ));
            sh.cv.notify_all();
            return Err(CollectiveError::Timeout {
                backend: BACKEND,
                op: kind.name(),
                call,
                rank,
                timeout: sh.timeout,
                missing,
                behind,
            }
            .into());
        }
        st = sh
            .cv
            .wait_timeout(st, deadline - now)
            .unwrap_or_else(|e| e.into_inner())
            .0;
    }
}

fn left(rank: usize, kind: Op, call: u64, reason: String) -> CollectiveError {
    CollectiveError::RankLeft {
        backend: BACKEND,
        op: kind.name(),
        call,
        rank,
        reason: format!("the group is broken: {reason}"),
    }
}

impl Drop for ThreadRank {
    fn drop(&mut self) {
        let sh = &*self.shared;
        {
            let mut st = lock(&sh.state);
            if std::thread::panicking() {
                // Its started calls may never get its contribution: every call fails at once.
                if st.broken.is_none() {
                    st.broken = Some(format!("rank {} panicked", self.rank));
                }
            } else {
                st.departed.push(Departure {
                    rank: self.rank,
                    issued: self.next_call.load(Ordering::SeqCst),
                    drained: false,
                    reason: format!("rank {} dropped its communicator", self.rank),
                });
            }
            sh.cv.notify_all();
        }
        // Started asynchronous calls complete on the communication thread (a dropped `Pending`
        // still completes), without this thread waiting for them; the mark follows them.
        let mark = DrainedMark {
            shared: self.shared.clone(),
            rank: self.rank,
        };
        self.worker.detach_then(move || drop(mark));
    }
}

impl Collective for ThreadRank {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.shared.world
    }

    fn recorder(&self) -> Option<&FlightRecorder> {
        Some(&self.shared.recorders[self.rank])
    }

    /// All-reduce in rank order, computed once by the last rank to arrive.
    ///
    /// # Errors
    ///
    /// As [`Collective::all_reduce`]; also when the tensor cannot be copied to the CPU or the
    /// result back to its device.
    /// One tensor is reduced as it lies, its values rounded to a wire dtype as they are summed
    /// (the ranks share memory, so nothing is cast and the bytes moved are those of its own
    /// dtype). Several parts are summed where they lie: the ranks' threads read every rank's
    /// parts in place, block by block, into one shared result, as for one tensor; nothing is
    /// concatenated, and the result is bitwise the concatenation's. Parts on a GPU are copied to
    /// the host one by one (a view copies its whole storage: make such parts contiguous first,
    /// or pack them, as `DataParallel` does). The result is made on the host; `in_place` only
    /// lets one rank return a variable's tensor as its result, without a copy.
    ///
    /// # Errors
    ///
    /// As [`Collective::all_reduce_with`]; also when a part cannot be copied to the CPU or the
    /// result back to the first part's device.
    fn all_reduce_with(&self, parts: &[Tensor], options: AllReduce) -> Result<Tensor> {
        let op = Op::AllReduce(options.op);
        // Checked after the call's number is taken: input refused on one rank fails the call on
        // every rank (with the reason), instead of leaving the others waiting in its slot.
        let call = self.next_call.fetch_add(1, Ordering::SeqCst);
        let checked = super::check_parts(parts).and_then(|()| match options.wire {
            Some(w) => check_wire(&parts[0], w),
            None => Ok(()),
        });
        let wire = options
            .wire
            .filter(|&w| parts.first().is_some_and(|p| w != p.dtype()));
        let input = match parts {
            [t] => Input::One(self.own(t, options.in_place)?),
            _ => Input::Parts(parts.to_vec()),
        };
        complete(
            &self.shared,
            self.rank,
            call,
            (op, wire),
            checked.map(|()| &input).map_err(|e| e.to_string()),
        )
    }

    /// All-gather in rank order, computed once by the last rank to arrive.
    ///
    /// # Errors
    ///
    /// As [`Collective::all_gather`]; also when the tensor cannot be copied to the CPU or the
    /// result back to its device.
    fn all_gather(&self, t: &Tensor) -> Result<Tensor> {
        self.call(Op::AllGather, t)
    }

    /// Broadcast: every rank but `root` gets a copy of `root`'s tensor.
    ///
    /// # Errors
    ///
    /// As [`Collective::broadcast`]; also when the tensor cannot be copied to the CPU or the result
    /// back to its device.
    fn broadcast(&self, t: &Tensor, root: usize) -> Result<Tensor> {
        self.call(Op::Broadcast(root), t)
    }

    /// Barrier: a call with a one-byte token that every rank must join.
    ///
    /// # Errors
    ///
    /// As [`Collective::barrier`].
    fn barrier(&self) -> Result<()> {
        let token = Tensor::zeros(1, DType::U8, &Device::Cpu)?;
        self.call(Op::Barrier, &token).map(|_| ())
    }

    /// Reduce-scatter: the all-reduce of every rank's tensor, then this rank's rows of it.
    ///
    /// # Errors
    ///
    /// As [`Collective::reduce_scatter`]; also when the tensor cannot be copied to the CPU or the
    /// result back to its device.
    fn reduce_scatter(&self, t: &Tensor, op: ReduceOp) -> Result<Tensor> {
        let full = self.call(Op::ReduceScatter(op), t)?;
        scatter_rows(&full, self.rank, self.shared.world)
    }

    /// All-reduce of one tensor completed on this rank's communication thread, its values
    /// rounded to a wire dtype as the blocking call rounds them; several parts are concatenated
    /// first, here.
    ///
    /// # Errors
    ///
    /// As [`Collective::start_all_reduce`]: parts or a wire refused, or a communication thread
    /// that cannot be started or has stopped; the collective's own failures come from
    /// [`Pending::wait`].
    fn start_all_reduce(&self, parts: &[Tensor], options: AllReduce) -> Result<Pending> {
        let [t] = parts else {
            return super::start_as_one(self, parts, options);
        };
        if let Some(w) = options.wire {
            check_wire(t, w)?;
        }
        let wire = options.wire.filter(|&w| w != t.dtype());
        self.call_async_on(Op::AllReduce(options.op), wire, t)
    }

    /// All-gather completed on this rank's communication thread.
    ///
    /// # Errors
    ///
    /// As [`Collective::all_gather_async`]: only a communication thread that cannot be started or
    /// has stopped fails here; the collective's own failures come from [`Pending::wait`].
    fn all_gather_async(&self, t: &Tensor) -> Result<Pending> {
        self.call_async(Op::AllGather, t)
    }

    /// Reduce-scatter completed on this rank's communication thread.
    ///
    /// # Errors
    ///
    /// As [`Collective::reduce_scatter_async`]: only a communication thread that cannot be started
    /// or has stopped fails here; the collective's own failures come from [`Pending::wait`].
    fn reduce_scatter_async(&self, t: &Tensor, op: ReduceOp) -> Result<Pending> {
        self.call_async(Op::ReduceScatter(op), t)
    }

    /// Split through an all-gather of every rank's `(color, key)`; the members of a subgroup share
    /// its state, created by the first of them to arrive.
    ///
    /// # Errors
    ///
    /// As [`Collective::split`]: the exchange of every rank's `(color, key)` is an all-gather that
    /// fails like any other call of the group.
    fn split(&self, color: Option<u32>, key: u32) -> Result<Option<Arc<dyn Collective>>> {
        // Every rank's (color, key), gathered in rank order; u32::MAX + 1 stands for no color.
        let mine = [color.map_or(1 << 32, i64::from), i64::from(key)];
        let call = self.next_call.load(Ordering::SeqCst);
        let all = self.call(Op::Split, &Tensor::new(&[mine], &Device::Cpu)?)?;
        let all: Vec<(Option<u32>, u32)> = all
            .to_vec2::<i64>()?
            .into_iter()
            .map(|v| (u32::try_from(v[0]).ok(), v[1] as u32))
            .collect();
        let Some(color) = color else {
            return Ok(None);
        };
        let members = split_members(&all, color);
        let rank = members
            .iter()
            .position(|&r| r == self.rank)
            .expect("a rank with a color is a member of its subgroup");
        let shared = {
            let mut subs = self
                .shared
                .subgroups
                .lock()
                .unwrap_or_else(|e| e.into_inner());
            let entry = subs.entry((call, color)).or_insert_with(|| {
                (
                    Shared::new(members.len(), self.shared.timeout),
                    members.len(),
                )
            });
            let shared = entry.0.clone();
            entry.1 -= 1;
            if entry.1 == 0 {
                subs.remove(&(call, color));
            }
            shared
        };
        Ok(Some(Arc::new(ThreadRank {
            rank,
            shared,
            next_call: AtomicU64::new(0),
            worker: Worker::default(),
        })))
    }
}
