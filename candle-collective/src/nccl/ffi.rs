//! NCCL's entry points as `nccl.h` declares them, loaded from `libnccl.so.2` at first use, with
//! every `ncclResult_t` read as a C `int`: a code that the Rust bindings do not name (one that
//! a newer NCCL adds, such as `ncclTimeout` in 2.30) is then an error with its number, never a
//! value outside a Rust enum (undefined behaviour) or a code misread as success.

use std::ffi::{c_char, c_int, c_void};
use std::sync::OnceLock;

/// `ncclComm_t`: an opaque handle.
pub type Comm = *mut c_void;
/// `cudaStream_t` (the driver's `CUstream`).
pub type Stream = *mut c_void;

/// `ncclUniqueId`: 128 opaque bytes.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct UniqueId {
    pub internal: [c_char; 128],
}

/// `ncclConfig_t` as of NCCL 2.17 (size, magic, version, four ints, one pointer): NCCL copies
/// only `size` bytes of a caller's config, so later versions read exactly these fields.
#[repr(C)]
pub struct Config {
    pub size: usize,
    pub magic: u32,
    pub version: u32,
    pub blocking: c_int,
    pub cga_cluster_size: c_int,
    pub min_ctas: c_int,
    pub max_ctas: c_int,
    pub net_name: *const c_char,
}
const _: () = assert!(std::mem::size_of::<Config>() == 40);

/// `ncclSuccess` and `ncclInProgress`; every other code is an error.
pub const SUCCESS: c_int = 0;
pub const IN_PROGRESS: c_int = 7;
/// `NCCL_SPLIT_NOCOLOR`.
pub const SPLIT_NOCOLOR: c_int = -1;

/// `ncclDataType_t` values used here.
pub mod dtype {
    use std::ffi::c_int;
    pub const UINT8: c_int = 1;
    pub const UINT32: c_int = 3;
    pub const INT64: c_int = 4;
    pub const FLOAT16: c_int = 6;
    pub const FLOAT32: c_int = 7;
    pub const FLOAT64: c_int = 8;
    pub const BFLOAT16: c_int = 9;
}

/// `ncclRedOp_t` values used here.
pub mod op {
    use std::ffi::c_int;
    pub const SUM: c_int = 0;
    pub const MAX: c_int = 2;
    pub const MIN: c_int = 3;
    pub const AVG: c_int = 4;
}

type Coll =
    unsafe extern "C" fn(*const c_void, *mut c_void, usize, c_int, c_int, Comm, Stream) -> c_int;

/// The functions this backend calls, resolved once.
pub struct Nccl {
    _lib: libloading::Library,
    pub get_version: unsafe extern "C" fn(*mut c_int) -> c_int,
    pub get_unique_id: unsafe extern "C" fn(*mut UniqueId) -> c_int,
    pub get_error_string: unsafe extern "C" fn(c_int) -> *const c_char,
    pub get_last_error: unsafe extern "C" fn(Comm) -> *const c_char,
    pub group_start: unsafe extern "C" fn() -> c_int,
    pub group_end: unsafe extern "C" fn() -> c_int,
    pub comm_init_rank_config:
        unsafe extern "C" fn(*mut Comm, c_int, UniqueId, c_int, *mut Config) -> c_int,
    pub comm_get_async_error: unsafe extern "C" fn(Comm, *mut c_int) -> c_int,
    pub comm_user_rank: unsafe extern "C" fn(Comm, *mut c_int) -> c_int,
    pub comm_count: unsafe extern "C" fn(Comm, *mut c_int) -> c_int,
    pub comm_split: unsafe extern "C" fn(Comm, c_int, c_int, *mut Comm, *mut Config) -> c_int,
    pub comm_finalize: unsafe extern "C" fn(Comm) -> c_int,
    pub comm_destroy: unsafe extern "C" fn(Comm) -> c_int,
    pub comm_abort: unsafe extern "C" fn(Comm) -> c_int,
    pub all_reduce: Coll,
    pub reduce_scatter: Coll,
    /// `ncclAllGather(send, recv, sendcount, type, comm, stream)`.
    pub all_gather:
        unsafe extern "C" fn(*const c_void, *mut c_void, usize, c_int, Comm, Stream) -> c_int,
    /// `ncclBroadcast(send, recv, count, type, root, comm, stream)`.
    pub broadcast: Coll,
}

fn load() -> Result<Nccl, String> {
    // SAFETY: loading NCCL runs its library initialisers, which have no preconditions.
    let lib = unsafe { libloading::Library::new("libnccl.so.2") }
        .map_err(|e| format!("cannot load libnccl.so.2: {e}"))?;
    macro_rules! sym {
        ($name:literal) => {
            // SAFETY: the symbol is NCCL's function of that name, whose C signature (nccl.h)
            // the field's type spells with `ncclResult_t` as `int`; the library stays loaded
            // as long as the table (it owns it).
            *unsafe { lib.get(concat!($name, "\0").as_bytes()) }
                .map_err(|e| format!("libnccl.so.2 has no {}: {e}", $name))?
        };
    }
    Ok(Nccl {
        get_version: sym!("ncclGetVersion"),
        get_unique_id: sym!("ncclGetUniqueId"),
        get_error_string: sym!("ncclGetErrorString"),
        get_last_error: sym!("ncclGetLastError"),
        group_start: sym!("ncclGroupStart"),
        group_end: sym!("ncclGroupEnd"),
        comm_init_rank_config: sym!("ncclCommInitRankConfig"),
        comm_get_async_error: sym!("ncclCommGetAsyncError"),
        comm_user_rank: sym!("ncclCommUserRank"),
        comm_count: sym!("ncclCommCount"),
        comm_split: sym!("ncclCommSplit"),
        comm_finalize: sym!("ncclCommFinalize"),
        comm_destroy: sym!("ncclCommDestroy"),
        comm_abort: sym!("ncclCommAbort"),
        all_reduce: sym!("ncclAllReduce"),
        reduce_scatter: sym!("ncclReduceScatter"),
        all_gather: sym!("ncclAllGather"),
        broadcast: sym!("ncclBroadcast"),
        _lib: lib,
    })
}

/// The loaded library, or why it could not be loaded.
pub fn nccl() -> Result<&'static Nccl, String> {
    static LIB: OnceLock<Result<Nccl, String>> = OnceLock::new();
    LIB.get_or_init(load).as_ref().map_err(Clone::clone)
}
