//! The raw NCCL communicator: the one place that calls NCCL. Every `unsafe` call of the
//! backend is here, behind safe methods whose preconditions the types carry: a [`RawComm`] is
//! not `Copy` or `Clone` (one owner), not `Sync` (the watchdog keeps it behind a mutex, which
//! is NCCL's rule: one thread at a time, `ncclCommAbort` and `ncclCommGetAsyncError`
//! included), and `abort`/`destroy` consume it.
//!
//! Communicators are created non-blocking (`config.blocking = 0`): every call returns at
//! once, possibly with "in progress", after which [`RawComm::state`] is polled before the next
//! call; so no host thread ever sits inside NCCL, and an abort is always possible between
//! calls. (`NCCL_COMM_BLOCKING=1` in the environment would override this; don't set it.)

use std::ffi::{c_void, CStr};

use candle_core::cuda_backend::cudarc::driver::CudaContext;
use candle_core::cuda_backend::cudarc::nccl::{result, sys};
use candle_core::cuda_backend::WrapErr;

use super::super::{CollectiveError, Op, ReduceOp};
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

    fn of(code: sys::ncclResult_t, comm: Option<&RawComm>) -> Self {
        // SAFETY: ncclGetErrorString returns a static string for any code; ncclGetLastError a
        // string owned by NCCL, valid until the next NCCL call on this thread, copied at once.
        let (text, last) = unsafe {
            let text = CStr::from_ptr(sys::ncclGetErrorString(code))
                .to_string_lossy()
                .into_owned();
            let last = match comm {
                Some(c) => {
                    let p = sys::ncclGetLastError(c.0);
                    if p.is_null() {
                        String::new()
                    } else {
                        CStr::from_ptr(p).to_string_lossy().into_owned()
                    }
                }
                None => String::new(),
            };
            (text, last)
        };
        Self {
            code: format!("{code:?}"),
            detail: if last.is_empty() {
                text
            } else {
                format!("{text}; {last}")
            },
        }
    }
}

/// Where a non-blocking call stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Progress {
    Done,
    InProgress,
}

fn check(r: sys::ncclResult_t, comm: Option<&RawComm>) -> Result<Progress, NcclFail> {
    status(r.result(), comm)
}

fn status(
    r: Result<result::NcclStatus, result::NcclError>,
    comm: Option<&RawComm>,
) -> Result<Progress, NcclFail> {
    match r {
        Ok(result::NcclStatus::InProgress) => Ok(Progress::InProgress),
        Ok(_) => Ok(Progress::Done),
        Err(e) => Err(NcclFail::of(e.0, comm)),
    }
}

/// The size of NCCL 2.17's `ncclConfig_t` (size, magic, version, four ints, one pointer): NCCL
/// copies only `size` bytes of a caller's config, so the fields it reads are the ones set below
/// whatever struct version the bindings have.
const CONFIG_2_17_SIZE: usize = 40;
const _: () = assert!(std::mem::offset_of!(sys::ncclConfig_t, netName) + 8 == CONFIG_2_17_SIZE);

/// `NCCL_CONFIG_INITIALIZER` as of NCCL 2.17 (every field undefined, NCCL's defaults) with
/// `blocking = 0`.
fn nonblocking_config() -> sys::ncclConfig_t {
    // SAFETY: a C struct of integers and pointers, for which all-zero bytes are a valid value;
    // NCCL reads only the first CONFIG_2_17_SIZE bytes, all set here.
    let mut c: sys::ncclConfig_t = unsafe { std::mem::zeroed() };
    c.size = CONFIG_2_17_SIZE;
    c.magic = 0xcafe_beef;
    c.version = 21700;
    c.blocking = 0;
    c.cgaClusterSize = i32::MIN;
    c.minCTAs = i32::MIN;
    c.maxCTAs = i32::MIN;
    c.netName = std::ptr::null();
    c
}

fn nccl_type(dtype: candle_core::DType) -> Option<sys::ncclDataType_t> {
    use candle_core::DType as D;
    use sys::ncclDataType_t as T;
    Some(match dtype {
        D::F32 => T::ncclFloat32,
        D::F64 => T::ncclFloat64,
        D::F16 => T::ncclFloat16,
        D::BF16 => T::ncclBfloat16,
        D::I64 => T::ncclInt64,
        D::U32 => T::ncclUint32,
        D::U8 => T::ncclUint8,
        _ => return None,
    })
}

fn nccl_op(op: ReduceOp) -> sys::ncclRedOp_t {
    match op {
        ReduceOp::Sum => sys::ncclRedOp_t::ncclSum,
        ReduceOp::Avg => sys::ncclRedOp_t::ncclAvg,
        ReduceOp::Max => sys::ncclRedOp_t::ncclMax,
        ReduceOp::Min => sys::ncclRedOp_t::ncclMin,
    }
}

/// A new NCCL unique id (rank 0's, handed to the others).
pub(super) fn unique_id() -> Result<[u8; 128], NcclFail> {
    let id = result::get_uniqueid().map_err(|e| NcclFail::of(e.0, None))?;
    Ok(id.internal.map(|c| c as u8))
}

/// One collective's buffers: `count` elements of `dtype` read from `send`, written to `recv`,
/// on `stream` (see [`RawComm::enqueue`] for the sizes each operation needs).
pub(super) struct Buffers {
    pub send: *const c_void,
    pub recv: *mut c_void,
    pub count: usize,
    pub dtype: candle_core::DType,
    pub stream: sys::cudaStream_t,
}

/// The oldest NCCL this backend accepts: 2.27, where a non-blocking communicator's background
/// job belongs to the communicator (before, it lived in the issuing thread's thread-local
/// state, so calls on different communicators from different threads, the watchdog's
/// included, could join or reset each other's jobs).
pub(super) const MIN_NCCL: i32 = 22700;

/// Refuses an NCCL older than [`MIN_NCCL`].
fn check_version() -> Result<(), NcclFail> {
    let v = result::get_nccl_version().map_err(|e| NcclFail::of(e.0, None))?;
    if v < MIN_NCCL {
        return Err(NcclFail {
            code: "version".into(),
            detail: format!(
                "NCCL {}.{}.{} is loaded; this backend needs 2.27 or newer (non-blocking communicators with per-communicator background jobs)",
                v / 10000,
                v / 100 % 100,
                v % 100
            ),
        });
    }
    Ok(())
}

/// An NCCL communicator handle with one owner; dropping it aborts it.
#[derive(Debug)]
pub(super) struct RawComm(sys::ncclComm_t);

// SAFETY: with NCCL ≥ 2.27 (checked before any communicator is made) a communicator may be used
// from any thread, one call at a time; `RawComm` is not `Sync` and its owner keeps it behind a
// mutex.
unsafe impl Send for RawComm {}

impl Drop for RawComm {
    /// `ncclCommAbort`: a handle dropped on an error path (or by `abort`) stops its kernels and
    /// background work and frees it, whatever state it is in.
    fn drop(&mut self) {
        // SAFETY: the only handle, dropped once, so no other call can overlap or follow.
        unsafe {
            let _ = sys::ncclCommAbort(self.0);
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
    pub fn init_group(
        ctxs: &[&CudaContext],
        world: usize,
        id: &[u8; 128],
        ranks: &[usize],
    ) -> Result<Vec<Self>, NcclFail> {
        check_version()?;
        let internal = id.map(|b| b as std::ffi::c_char);
        let mut handles = vec![std::ptr::null_mut(); ctxs.len()];
        status(result::group_start(), None)?;
        let mut first_err = None;
        for (i, ctx) in ctxs.iter().enumerate() {
            if let Err(e) = ctx.bind_to_thread().w() {
                first_err.get_or_insert(NcclFail {
                    code: "CUDA".into(),
                    detail: e.to_string(),
                });
                continue;
            }
            let mut config = nonblocking_config();
            // SAFETY: `handles[i]` receives the handle; the id is 128 bytes from
            // ncclGetUniqueId; the config is a valid 2.17-layout struct that outlives the call.
            let r = unsafe {
                sys::ncclCommInitRankConfig(
                    &mut handles[i],
                    world as i32,
                    sys::ncclUniqueId { internal },
                    ranks[i] as i32,
                    &mut config,
                )
            };
            if let Err(e) = check(r, None) {
                first_err.get_or_insert(e);
            }
        }
        let end = status(result::group_end(), None);
        let comms: Vec<Self> = handles
            .into_iter()
            .filter(|h| !h.is_null())
            .map(Self)
            .collect();
        match first_err.or(end.err()) {
            None if comms.len() == ctxs.len() => Ok(comms),
            err => {
                drop(comms); // aborts each
                Err(err.unwrap_or(NcclFail {
                    code: "init".into(),
                    detail: "NCCL returned no communicator".into(),
                }))
            }
        }
    }

    /// The communicator's state (`ncclCommGetAsyncError`): done, still working on the last
    /// call, or failed (asynchronously too: a peer that left, a network error).
    pub fn state(&self) -> Result<Progress, NcclFail> {
        let mut raw: u32 = 0;
        // SAFETY: a valid handle; the out-parameter is read as a plain u32 (the function's own
        // return value is the bindings' enum, whose every value NCCL ≥ 2.27 returns here).
        let r = unsafe {
            sys::ncclCommGetAsyncError(self.0, (&mut raw as *mut u32).cast::<sys::ncclResult_t>())
        };
        check(r, Some(self))?;
        match raw {
            0 => Ok(Progress::Done),
            7 => Ok(Progress::InProgress),
            code @ 1..=6 => {
                // SAFETY: the codes 1 to 6 are variants in every NCCL version the bindings
                // cover (unhandled CUDA error … remote error).
                let known = unsafe { std::mem::transmute::<u32, sys::ncclResult_t>(code) };
                Err(NcclFail::of(known, Some(self)))
            }
            8 => Err(NcclFail {
                code: "ncclTimeout".into(),
                detail: "NCCL timed out".into(),
            }),
            code => Err(NcclFail {
                code: format!("ncclResult {code}"),
                detail: "an asynchronous NCCL error these bindings do not name".into(),
            }),
        }
    }

    /// This rank in the communicator and its size.
    pub fn rank_and_size(&self) -> Result<(usize, usize), NcclFail> {
        // SAFETY: queries on a valid, initialised handle.
        unsafe {
            let rank = result::comm_user_rank(self.0).map_err(|e| NcclFail::of(e.0, Some(self)))?;
            let size = result::comm_count(self.0).map_err(|e| NcclFail::of(e.0, Some(self)))?;
            Ok((rank as usize, size as usize))
        }
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
        let Some(ty) = nccl_type(b.dtype) else {
            return Err(NcclFail {
                code: "dtype".into(),
                detail: format!("NCCL has no type for {:?}", b.dtype),
            });
        };
        let (s, r, n, c, st) = (b.send, b.recv, b.count, self.0, b.stream);
        let code = match what {
            Op::AllReduce(o) => sys::ncclAllReduce(s, r, n, ty, nccl_op(o), c, st),
            Op::ReduceScatter(o) => sys::ncclReduceScatter(s, r, n, ty, nccl_op(o), c, st),
            Op::AllGather => sys::ncclAllGather(s, r, n, ty, c, st),
            Op::Broadcast(root) => sys::ncclBroadcast(s, r, n, ty, root as i32, c, st),
            Op::Barrier | Op::Split => {
                return Err(NcclFail {
                    code: "op".into(),
                    detail: format!("{what} is not a collective NCCL enqueues"),
                })
            }
        };
        check(code, Some(self))
    }

    /// Starts `ncclCommSplit` (the child inherits non-blocking mode). NCCL fills the returned
    /// slot when the split is done: poll this (the parent's) state, then take the child with
    /// [`Split::child`]. `color` -1 is NCCL_SPLIT_NOCOLOR.
    pub fn split(&self, color: i32, key: i32) -> Result<Split, NcclFail> {
        let mut slot = Box::new(std::ptr::null_mut());
        // SAFETY: a valid, ready parent; the slot is on the heap, so its address stays fixed
        // while NCCL's background job may write it: the `Split` keeps it until the parent's
        // state is done (NCCL stores the child before it publishes the parent's result) or the
        // parent is aborted on this thread (which ends the job); a null config asks for the
        // parent's.
        let r = unsafe { sys::ncclCommSplit(self.0, color, key, &mut *slot, std::ptr::null_mut()) };
        check(r, Some(self))?;
        Ok(Split { slot })
    }

    /// Starts `ncclCommFinalize` (flushes the queued collectives); poll the state, then
    /// [`RawComm::destroy`] when it is done, or [`RawComm::abort`].
    pub fn finalize(&self) -> Result<Progress, NcclFail> {
        // SAFETY: a valid handle, finalized at most once (its owner drops it right after).
        check(unsafe { sys::ncclCommFinalize(self.0) }, Some(self))
    }

    /// `ncclCommDestroy`: frees a finalized communicator whose state is done (local, no wait).
    pub fn destroy(self) {
        let handle = self.0;
        std::mem::forget(self);
        // SAFETY: the only handle, taken out of its owner (which is not dropped, so not also
        // aborted); finalized and done (the caller's contract).
        unsafe {
            let _ = sys::ncclCommDestroy(handle);
        }
    }

    /// `ncclCommAbort`: stops its kernels and frees it, whatever state it is in (initialising,
    /// with queued work, failed). The same as dropping it; named for the call sites.
    pub fn abort(self) {
        drop(self);
    }
}

/// A split in progress: the slot NCCL writes the child's handle into.
pub(super) struct Split {
    slot: Box<sys::ncclComm_t>,
}

impl Split {
    /// The child, once the parent's state is done: `None` for a rank that passed no color.
    pub fn child(self) -> Option<RawComm> {
        let h = *self.slot;
        (!h.is_null()).then_some(RawComm(h))
    }
}
