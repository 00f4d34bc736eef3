//! The raw NCCL communicator: the one place that calls NCCL. Every `unsafe` call of the
//! backend is here, behind safe methods whose preconditions the types carry: a [`RawComm`] is
//! not `Copy` or `Clone` (one owner), not `Sync` (the watchdog keeps it behind a mutex, which
//! is NCCL's rule: one thread at a time, `ncclCommAbort` and `ncclCommGetAsyncError`
//! included), and `abort`/`destroy` consume it.
//!
//! Communicators are created non-blocking (`config.blocking = 0`): every call returns at
//! once, possibly with "in progress", after which [`RawComm::state`] is polled before the next
//! call; so no host thread ever sits inside NCCL, and an abort is always possible between
//! calls. Blocking mode (`NCCL_COMM_BLOCKING`, which NCCL applies over the config) is refused
//! before any peer is contacted, by asking NCCL ([`super::blocking`]), and again if a start-up
//! completes synchronously ([`RawComm::init_group`]).

use std::ffi::{c_int, c_void, CStr};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicPtr, Ordering};

use candle_core::cuda_backend::cudarc::driver::CudaContext;
use candle_core::cuda_backend::WrapErr;

use super::super::{CollectiveError, Op, ReduceOp};
use super::ffi::{self, nccl, Nccl};
use super::BACKEND;

/// An NCCL call's failure: the code by name and NCCL's words for it.
#[derive(Debug, Clone)]
pub(super) struct NcclFail {
    pub code: String,
    pub detail: String,
}

impl NcclFail {
    /// As the crate's error, naming the operation and the rank.
    pub fn error(self, op: &'static str, rank: usize) -> candle_core::Error {
        CollectiveError::Library {
            backend: BACKEND,
            op,
            rank,
            code: self.code,
            detail: self.detail,
        }
        .into()
    }

    /// A failure of the crate's own (not a code NCCL returned).
    pub fn new(code: &str, detail: impl Into<String>) -> Self {
        Self {
            code: code.into(),
            detail: detail.into(),
        }
    }

    fn of(lib: &Nccl, code: c_int, comm: Option<&RawComm>) -> Self {
        // SAFETY: ncclGetErrorString returns a static string for any code (also an unknown
        // one); ncclGetLastError a string owned by NCCL, valid until the next NCCL call on this
        // thread, copied at once. Null is checked for both.
        let (text, last) = unsafe {
            let read = |p: *const std::ffi::c_char| {
                if p.is_null() {
                    String::new()
                } else {
                    CStr::from_ptr(p).to_string_lossy().into_owned()
                }
            };
            let text = read((lib.get_error_string)(code));
            let last = comm.map_or(String::new(), |c| read((lib.get_last_error)(c.0)));
            (text, last)
        };
        Self {
            code: code_name(code),
            detail: if last.is_empty() {
                text
            } else {
                format!("{text}; {last}")
            },
        }
    }
}

/// `ncclResult_t` by name (nccl.h), or by number for a code this crate does not know.
fn code_name(code: c_int) -> String {
    let name = match code {
        0 => "ncclSuccess",
        1 => "ncclUnhandledCudaError",
        2 => "ncclSystemError",
        3 => "ncclInternalError",
        4 => "ncclInvalidArgument",
        5 => "ncclInvalidUsage",
        6 => "ncclRemoteError",
        7 => "ncclInProgress",
        8 => "ncclTimeout",
        _ => return format!("ncclResult {code}"),
    };
    name.into()
}

/// Where a non-blocking call stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Progress {
    Done,
    InProgress,
}

/// A returned code: done, in progress, or (any other value) the failure.
fn check(lib: &Nccl, code: c_int, comm: Option<&RawComm>) -> Result<Progress, NcclFail> {
    match code {
        ffi::SUCCESS => Ok(Progress::Done),
        ffi::IN_PROGRESS => Ok(Progress::InProgress),
        _ => Err(NcclFail::of(lib, code, comm)),
    }
}

fn lib() -> Result<&'static Nccl, NcclFail> {
    nccl().map_err(|e| NcclFail::new("load", e))
}

/// `NCCL_CONFIG_INITIALIZER` as of NCCL 2.17 (every field undefined, NCCL's defaults) with
/// `blocking = 0`.
fn nonblocking_config() -> ffi::Config {
    ffi::Config {
        size: std::mem::size_of::<ffi::Config>(),
        magic: 0xcafe_beef,
        version: 21700,
        blocking: 0,
        cga_cluster_size: i32::MIN,
        min_ctas: i32::MIN,
        max_ctas: i32::MIN,
        net_name: std::ptr::null(),
    }
}

fn nccl_type(dtype: candle_core::DType) -> Option<c_int> {
    use candle_core::DType as D;
    use ffi::dtype as T;
    Some(match dtype {
        D::F32 => T::FLOAT32,
        D::F64 => T::FLOAT64,
        D::F16 => T::FLOAT16,
        D::BF16 => T::BFLOAT16,
        D::I64 => T::INT64,
        D::U32 => T::UINT32,
        D::U8 => T::UINT8,
        _ => return None,
    })
}

fn nccl_op(o: ReduceOp) -> c_int {
    match o {
        ReduceOp::Sum => ffi::op::SUM,
        ReduceOp::Avg => ffi::op::AVG,
        ReduceOp::Max => ffi::op::MAX,
        ReduceOp::Min => ffi::op::MIN,
    }
}

/// A new NCCL unique id (rank 0's, handed to the others).
pub(super) fn unique_id() -> Result<[u8; 128], NcclFail> {
    let lib = lib()?;
    let mut id = ffi::UniqueId { internal: [0; 128] };
    // SAFETY: `id` is a valid ncclUniqueId for NCCL to fill.
    check(lib, unsafe { (lib.get_unique_id)(&mut id) }, None)?;
    Ok(id.internal.map(|c| c as u8))
}

/// One collective's buffers: `count` elements of `dtype` read from `send`, written to `recv`,
/// on `stream` (see [`RawComm::enqueue`] for the sizes each operation needs).
pub(super) struct Buffers {
    pub send: *const c_void,
    pub recv: *mut c_void,
    pub count: usize,
    pub dtype: candle_core::DType,
    pub stream: ffi::Stream,
}

/// The oldest NCCL this backend accepts: 2.27, where a non-blocking communicator's background
/// job belongs to the communicator (before, it lived in the issuing thread's thread-local
/// state, so calls on different communicators from different threads, the watchdog's
/// included, could join or reset each other's jobs).
pub(super) const MIN_NCCL: c_int = 22700;

/// Loads NCCL and refuses a version older than [`MIN_NCCL`].
fn check_version() -> Result<&'static Nccl, NcclFail> {
    let lib = lib()?;
    let mut v: c_int = 0;
    // SAFETY: `v` receives the version.
    check(lib, unsafe { (lib.get_version)(&mut v) }, None)?;
    if v < MIN_NCCL {
        return Err(NcclFail::new(
            "version",
            format!(
                "NCCL {}.{}.{} is loaded; this backend needs 2.27 or newer (non-blocking communicators with per-communicator background jobs)",
                v / 10000,
                v / 100 % 100,
                v % 100
            ),
        ));
    }
    Ok(lib)
}

/// An NCCL communicator handle with one owner; dropping it aborts it.
#[derive(Debug)]
pub(super) struct RawComm(ffi::Comm);

// SAFETY: with NCCL ≥ 2.27 (checked before any communicator is made) a communicator may be used
// from any thread, one call at a time; `RawComm` is not `Sync` and its owner keeps it behind a
// mutex.
unsafe impl Send for RawComm {}

impl Drop for RawComm {
    /// `ncclCommAbort`: a handle dropped on an error path (or by `abort`) stops its kernels and
    /// background work and frees it, whatever state it is in.
    fn drop(&mut self) {
        // Never null (every constructor checks); a null handle here is a defect of this
        // backend, which the tests' debug build reports rather than passing it to NCCL.
        debug_assert!(!self.0.is_null(), "a null NCCL handle was wrapped");
        if self.0.is_null() {
            return;
        }
        // A handle exists only once the library was loaded.
        if let Ok(lib) = nccl() {
            // SAFETY: the only handle, dropped once, so no other call can overlap or follow.
            unsafe {
                let _ = (lib.comm_abort)(self.0);
            }
        }
    }
}

impl RawComm {
    /// Starts `ncclCommInitRankConfig` (non-blocking) for `rank` of `world` on the GPU of
    /// `ctx`; poll [`RawComm::state`] until it is done.
    pub fn init_rank(
        ctx: &CudaContext,
        world: usize,
        id: &[u8; 128],
        rank: usize,
    ) -> Result<Self, NcclFail> {
        Ok(Self::init_group(&[ctx], world, id, &[rank])?.remove(0))
    }

    /// Starts the initialisation of several ranks of one communicator from this thread, one per
    /// GPU (`ctxs[i]` gets rank `ranks[i]`), in one NCCL group, as NCCL requires when one
    /// thread initialises several ranks; poll each one's [`RawComm::state`].
    ///
    /// A non-blocking initialisation inside a group always makes `ncclGroupEnd` return "in
    /// progress"; a synchronous success therefore means that blocking mode is in force (which
    /// [`super::blocking::refuse_blocking_mode`] had not seen): the communicators are aborted
    /// and the start refused.
    pub fn init_group(
        ctxs: &[&CudaContext],
        world: usize,
        id: &[u8; 128],
        ranks: &[usize],
    ) -> Result<Vec<Self>, NcclFail> {
        let (comms, end) = Self::start_group(ctxs, world, id, ranks)?;
        if end == Progress::Done {
            drop(comms); // aborts each
            return Err(NcclFail::new(
                "blocking",
                "NCCL completed the start-up synchronously, so its communicators are in blocking mode, under which no timeout or abort can hold; this backend refuses it",
            ));
        }
        Ok(comms)
    }

    /// The group of [`RawComm::init_group`] without the verdict on its mode: the handles and
    /// what `ncclGroupEnd` returned (done: blocking mode; in progress: non-blocking). Every
    /// handle is aborted on an error.
    pub(super) fn start_group(
        ctxs: &[&CudaContext],
        world: usize,
        id: &[u8; 128],
        ranks: &[usize],
    ) -> Result<(Vec<Self>, Progress), NcclFail> {
        let lib = check_version()?;
        let id = ffi::UniqueId {
            internal: id.map(|b| b as std::ffi::c_char),
        };
        let mut handles: Vec<ffi::Comm> = vec![std::ptr::null_mut(); ctxs.len()];
        // SAFETY: no arguments; paired with the group end below, always reached.
        check(lib, unsafe { (lib.group_start)() }, None)?;
        let mut first_err = None;
        for (i, ctx) in ctxs.iter().enumerate() {
            if let Err(e) = ctx.bind_to_thread().w() {
                first_err.get_or_insert(NcclFail::new("CUDA", e.to_string()));
                continue;
            }
            let mut config = nonblocking_config();
            // SAFETY: `handles[i]` receives the handle; the id is 128 bytes from
            // ncclGetUniqueId; the config is a valid 2.17-layout struct that outlives the call.
            let r = unsafe {
                (lib.comm_init_rank_config)(
                    &mut handles[i],
                    world as c_int,
                    id,
                    ranks[i] as c_int,
                    &mut config,
                )
            };
            if let Err(e) = check(lib, r, None) {
                first_err.get_or_insert(e);
            }
        }
        // SAFETY: closes the group opened above.
        let end = check(lib, unsafe { (lib.group_end)() }, None);
        let comms: Vec<Self> = handles
            .into_iter()
            .filter(|h| !h.is_null())
            .map(Self)
            .collect();
        match (first_err, end) {
            (None, Ok(end)) if comms.len() == ctxs.len() => Ok((comms, end)),
            (err, end) => {
                drop(comms); // aborts each
                Err(err
                    .or(end.err())
                    .unwrap_or(NcclFail::new("init", "NCCL returned no communicator")))
            }
        }
    }

    /// The communicator's state (`ncclCommGetAsyncError`): done, still working on the last
    /// call, or failed (asynchronously too: a peer that left, a network error).
    pub fn state(&self) -> Result<Progress, NcclFail> {
        let lib = lib()?;
        let mut code: c_int = 0;
        // SAFETY: a valid handle; the out-parameter is a C int.
        check(
            lib,
            unsafe { (lib.comm_get_async_error)(self.0, &mut code) },
            Some(self),
        )?;
        check(lib, code, Some(self))
    }

    /// This rank in the communicator and its size.
    pub fn rank_and_size(&self) -> Result<(usize, usize), NcclFail> {
        let lib = lib()?;
        let (mut rank, mut size): (c_int, c_int) = (0, 0);
        // SAFETY: queries on a valid, initialised handle into C ints.
        unsafe {
            check(lib, (lib.comm_user_rank)(self.0, &mut rank), Some(self))?;
            check(lib, (lib.comm_count)(self.0, &mut size), Some(self))?;
        }
        Ok((rank as usize, size as usize))
    }

    /// Enqueues one collective on `b.stream`.
    ///
    /// # Safety
    /// `b.send` and `b.recv` are device buffers on this communicator's GPU that stay valid
    /// until the stream has run the collective: `b.count` elements in `send` (all-reduce,
    /// broadcast, all-gather) or `count × world` (reduce-scatter, whose `count` is per rank),
    /// and in `recv` `count` (all-reduce, broadcast, reduce-scatter) or `count × world`
    /// (all-gather).
    pub unsafe fn enqueue(&self, what: Op, b: &Buffers) -> Result<Progress, NcclFail> {
        let lib = lib()?;
        let Some(ty) = nccl_type(b.dtype) else {
            return Err(NcclFail::new(
                "dtype",
                format!("NCCL has no type for {:?}", b.dtype),
            ));
        };
        let (s, r, n, c, st) = (b.send, b.recv, b.count, self.0, b.stream);
        let code = match what {
            Op::AllReduce(o) => (lib.all_reduce)(s, r, n, ty, nccl_op(o), c, st),
            Op::ReduceScatter(o) => (lib.reduce_scatter)(s, r, n, ty, nccl_op(o), c, st),
            Op::AllGather => (lib.all_gather)(s, r, n, ty, c, st),
            Op::Broadcast(root) => (lib.broadcast)(s, r, n, ty, root as c_int, c, st),
            Op::Barrier | Op::Split => {
                return Err(NcclFail::new(
                    "op",
                    format!("{what} is not a collective NCCL enqueues"),
                ))
            }
        };
        check(lib, code, Some(self))
    }

    /// Starts `ncclCommSplit` (the child inherits non-blocking mode). NCCL fills the returned
    /// slot when the split is done: poll this (the parent's) state, then take the child with
    /// [`Split::child`]. `color` -1 is NCCL_SPLIT_NOCOLOR.
    pub fn split(&self, color: i32, key: i32) -> Result<Split, NcclFail> {
        let lib = lib()?;
        // The slot lives on the heap behind a raw pointer from here until `Split` is dropped:
        // no `Box` is moved (and re-tagged) while NCCL's background job may write it.
        let slot = Split {
            slot: NonNull::from(Box::leak(Box::new(AtomicPtr::new(std::ptr::null_mut())))),
        };
        // SAFETY: a valid, ready parent. The slot's address stays fixed while NCCL may write
        // it: the `Split` frees it only when dropped, which its owner does once the parent's
        // state is done (NCCL stores the child before it publishes the parent's result) or the
        // parent is aborted (which ends the job). A null config asks for the parent's.
        let r = unsafe {
            (lib.comm_split)(
                self.0,
                color,
                key,
                slot.slot.as_ref().as_ptr(),
                std::ptr::null_mut(),
            )
        };
        check(lib, r, Some(self))?;
        Ok(slot)
    }

    /// Starts `ncclCommFinalize` (flushes the queued collectives); poll the state, then
    /// [`RawComm::destroy`] when it is done, or [`RawComm::abort`].
    pub fn finalize(&self) -> Result<Progress, NcclFail> {
        let lib = lib()?;
        // SAFETY: a valid handle, finalized at most once (its owner drops it right after).
        check(lib, unsafe { (lib.comm_finalize)(self.0) }, Some(self))
    }

    /// `ncclCommDestroy`: frees a finalized communicator whose state is done (local, no wait).
    pub fn destroy(self) {
        let handle = self.0;
        std::mem::forget(self);
        if let Ok(lib) = nccl() {
            // SAFETY: the only handle, taken out of its owner (which is not dropped, so not
            // also aborted); finalized and done (the caller's contract).
            unsafe {
                let _ = (lib.comm_destroy)(handle);
            }
        }
    }

    /// `ncclCommAbort`: stops its kernels and frees it, whatever state it is in (initialising,
    /// with queued work, failed). The same as dropping it; named for the call sites.
    pub fn abort(self) {
        drop(self);
    }
}

/// A split in progress: the slot NCCL writes the child's handle into, from its own thread,
/// allocated by `Box::leak` in [`RawComm::split`] and freed by `Box::from_raw` on drop.
pub(super) struct Split {
    slot: NonNull<AtomicPtr<c_void>>,
}

// SAFETY: the slot is an atomic owned by this value alone (NCCL only stores into it); moving
// the owner between threads moves nothing that is shared without synchronisation.
unsafe impl Send for Split {}

impl Split {
    /// The child, once the parent's state is done: `None` for a rank that passed no color.
    pub fn child(self) -> Option<RawComm> {
        // SAFETY: the slot is alive until `self` drops, after this read.
        let h = unsafe { self.slot.as_ref() }.load(Ordering::Acquire);
        // Built only for a handle (`then_some` would build, and drop, one for null too).
        (!h.is_null()).then(|| RawComm(h))
    }
}

impl Drop for Split {
    fn drop(&mut self) {
        // SAFETY: the pointer came from `Box::leak` in `RawComm::split` and is freed once,
        // here; NCCL writes it no more (the owner's contract, see `RawComm::split`).
        drop(unsafe { Box::from_raw(self.slot.as_ptr()) });
    }
}
