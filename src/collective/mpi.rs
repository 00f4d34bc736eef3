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

use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use candle_core::{DType, Device, Result, Tensor};
use mpi::collective::SystemOperation;
use mpi::datatype::PartitionMut;
use mpi::environment::Universe;
use mpi::request::{Request, Scope};
use mpi::topology::{Color, SimpleCommunicator};
use mpi::traits::*;
use mpi::Threading;

use super::{
    scatter_rows, Collective, CollectiveError, Op, Pending, ReduceOp, Worker, DEFAULT_TIMEOUT,
};

const BACKEND: &str = "MPI";

/// One process's MPI environment: initialised by [`Mpi::init`], finalised when the last of
/// [`Mpi`] and the communicators made from it is dropped.
struct Env {
    _universe: Universe,
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

/// The MPI environment of this process.
///
/// ```no_run
/// # fn main() -> candle_core::Result<()> {
/// let mpi = candle_distributed::collective::Mpi::init()?;
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
    ///
    /// # Errors
    ///
    /// [`CollectiveError::InvalidArgument`] when MPI is already initialised in this process, or
    /// when the library provides less than `MPI_THREAD_SERIALIZED`.
    pub fn init() -> Result<Self> {
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
            }),
        })
    }

    /// `MPI_COMM_WORLD` as a communicator, with the default timeout ([`DEFAULT_TIMEOUT`]).
    ///
    /// # Errors
    ///
    /// None at present: an MPI failure while duplicating the communicator (for the `*_async` calls)
    /// aborts the job under MPI's default error handler rather than returning.
    pub fn world(&self) -> Result<Arc<dyn Collective>> {
        self.world_with_timeout(DEFAULT_TIMEOUT)
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

fn invalid(op: &'static str, detail: String) -> candle_core::Error {
    CollectiveError::invalid(BACKEND, op, detail).into()
}

/// A tensor's values on the host in a type MPI knows (f16 and bf16 travel as f32, exactly).
enum HostBuf {
    F32(Vec<f32>),
    F64(Vec<f64>),
    I64(Vec<i64>),
    U32(Vec<u32>),
    U8(Vec<u8>),
}

/// Runs `$body` with `$v` bound to the vector inside a `HostBuf`.
macro_rules! with_buf {
    ($buf:expr, $v:ident => $body:expr) => {
        match $buf {
            HostBuf::F32($v) => $body,
            HostBuf::F64($v) => $body,
            HostBuf::I64($v) => $body,
            HostBuf::U32($v) => $body,
            HostBuf::U8($v) => $body,
        }
    };
}

impl HostBuf {
    fn of(t: &Tensor) -> Result<Self> {
        let t = t.to_device(&Device::Cpu)?.flatten_all()?;
        Ok(match t.dtype() {
            DType::F32 | DType::F16 | DType::BF16 => {
                HostBuf::F32(t.to_dtype(DType::F32)?.to_vec1()?)
            }
            DType::F64 => HostBuf::F64(t.to_vec1()?),
            DType::I64 => HostBuf::I64(t.to_vec1()?),
            DType::U32 => HostBuf::U32(t.to_vec1()?),
            DType::U8 => HostBuf::U8(t.to_vec1()?),
            d => return Err(invalid("collective", format!("unsupported dtype {d:?}"))),
        })
    }

    /// A zeroed buffer of the same type and `len` values.
    fn zeros_like(&self, len: usize) -> Self {
        match self {
            HostBuf::F32(_) => HostBuf::F32(vec![0.0; len]),
            HostBuf::F64(_) => HostBuf::F64(vec![0.0; len]),
            HostBuf::I64(_) => HostBuf::I64(vec![0; len]),
            HostBuf::U32(_) => HostBuf::U32(vec![0; len]),
            HostBuf::U8(_) => HostBuf::U8(vec![0; len]),
        }
    }

    /// Back to a tensor of `dtype`, `dims`, on `device`.
    fn into_tensor(self, dims: &[usize], dtype: DType, device: &Device) -> Result<Tensor> {
        let t = with_buf!(self, v => Tensor::from_vec(v, dims, &Device::Cpu)?);
        t.to_dtype(dtype)?.to_device(device)
    }
}

/// The host type a dtype travels in (f16 and bf16 as f32).
fn recv_dtype(d: DType) -> DType {
    match d {
        DType::F16 | DType::BF16 => DType::F32,
        d => d,
    }
}

/// `ReduceOp::Avg` needs a float dtype: this rank's verdict, shared by `agree`.
fn avg_dtype(t: &Tensor, op: ReduceOp) -> std::result::Result<(), String> {
    if op == ReduceOp::Avg && !t.dtype().is_float() {
        return Err(format!(
            "ReduceOp::Avg needs a float dtype, got {:?}",
            t.dtype()
        ));
    }
    Ok(())
}

fn dtype_code(d: DType) -> i64 {
    d as i64
}

/// A stable 63-bit fingerprint of a shape (all dims, or all but the first for all_gather).
fn shape_code(dims: &[usize]) -> i64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for &d in dims {
        h = (h ^ d as u64).wrapping_mul(0x0000_0100_0000_01b3);
    }
    (h >> 1) as i64
}

impl MpiCollective {
    /// Wraps `comm`; with `with_async`, also duplicates it for the `*_async` calls (collective:
    /// every rank of `comm` constructs at the same point).
    fn new(comm: SimpleCommunicator, env: Arc<Env>, timeout: Duration, with_async: bool) -> Self {
        let (rank, world, dup) = locked(|| {
            let dup = with_async.then(|| comm.duplicate());
            (comm.rank() as usize, comm.size() as usize, dup)
        });
        let async_comm = dup.map(|d| Arc::new(MpiCollective::new(d, env.clone(), timeout, false)));
        Self {
            comm: std::mem::ManuallyDrop::new(comm),
            rank,
            world,
            timeout,
            async_comm,
            worker: Worker::default(),
            broken: Mutex::new(None),
            _env: env,
        }
    }

    /// Runs `f` on the duplicate communicator in the communication thread.
    fn start(
        &self,
        f: impl FnOnce(&MpiCollective) -> Result<Tensor> + Send + 'static,
    ) -> Result<Pending> {
        let Some(dup) = self.async_comm.clone() else {
            return Err(invalid(
                "async",
                "no duplicate communicator for asynchronous calls".into(),
            ));
        };
        self.worker.submit(BACKEND, move || f(&dup))
    }

    /// Polls `req` until it completes; on timeout prints why and aborts the MPI job.
    fn wait<'a, D: ?Sized, S: Scope<'a>>(&self, op: &str, mut req: Request<'a, D, S>) {
        let deadline = Instant::now() + self.timeout;
        let mut spins = 0u32;
        loop {
            match locked(|| req.test()) {
                Ok(_) => return,
                Err(r) => req = r,
            }
            if Instant::now() >= deadline {
                log::error!(
                    "mpi: rank {} timed out after {:?} in {op}; aborting the MPI job (a collective cannot be cancelled)",
                    self.rank, self.timeout
                );
                self.comm.abort(1);
            }
            spins += 1;
            if spins > 1000 {
                std::thread::sleep(Duration::from_micros(50));
            } else {
                std::thread::yield_now();
            }
        }
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
                self.rank,
                format!("the group is broken: {reason}"),
            )
            .into()),
            None => Ok(()),
        }
    }

    /// The ranks agree on a call before anything else happens: every rank's descriptor
    /// `[op, dtype, shape, extra]` and the verdict of its own argument checks (`local`) travel
    /// in one all-gather. Descriptors that differ make the call a mismatch on every rank and
    /// mark the group broken, so that later calls fail too; otherwise a rank whose check failed
    /// makes the call an error on every rank (the group stays usable: every rank skipped the
    /// same call).
    fn agree(
        &self,
        op: &'static str,
        desc: [i64; 4],
        local: std::result::Result<(), String>,
    ) -> Result<()> {
        self.check_broken(op)?;
        let mine = [desc[0], desc[1], desc[2], desc[3], i64::from(local.is_ok())];
        let mut all = vec![0i64; 5 * self.world];
        mpi::request::scope(|scope| {
            let req = locked(|| {
                self.comm
                    .immediate_all_gather_into(scope, &mine[..], &mut all[..])
            });
            self.wait(op, req);
        });
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
                call: 0,
                detail,
            }
            .into());
        }
        let failed: Vec<usize> = (0..self.world).filter(|r| all[5 * r + 4] == 0).collect();
        if !failed.is_empty() {
            let here = match local {
                Err(why) => format!("; here: {why}"),
                Ok(()) => String::new(),
            };
            return Err(invalid(
                op,
                format!("invalid arguments on rank(s) {failed:?}, so the call fails on every rank{here}"),
            ));
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

    /// The element-wise reduction of an agreed call (`agree` has run).
    fn reduce(&self, op: &'static str, t: &Tensor, rop: ReduceOp) -> Result<Tensor> {
        let send = HostBuf::of(t)?;
        let n = t.elem_count();
        let mut recv = send.zeros_like(n);
        let mpi_op = match rop {
            ReduceOp::Sum | ReduceOp::Avg => SystemOperation::sum(),
            ReduceOp::Max => SystemOperation::max(),
            ReduceOp::Min => SystemOperation::min(),
        };
        match (&send, &mut recv) {
            (HostBuf::F32(s), HostBuf::F32(r)) => self.all_reduce_into(op, s, r, mpi_op),
            (HostBuf::F64(s), HostBuf::F64(r)) => self.all_reduce_into(op, s, r, mpi_op),
            (HostBuf::I64(s), HostBuf::I64(r)) => self.all_reduce_into(op, s, r, mpi_op),
            (HostBuf::U32(s), HostBuf::U32(r)) => self.all_reduce_into(op, s, r, mpi_op),
            (HostBuf::U8(s), HostBuf::U8(r)) => self.all_reduce_into(op, s, r, mpi_op),
            _ => unreachable!("zeros_like keeps the variant"),
        }
        if rop == ReduceOp::Avg {
            // Divided in the wire type (f32 for f16/bf16) before the conversion back, so that a
            // sum beyond the input type's range still averages correctly.
            let wire = recv.into_tensor(t.dims(), recv_dtype(t.dtype()), &Device::Cpu)?;
            return (wire / self.world as f64)?
                .to_dtype(t.dtype())?
                .to_device(t.device());
        }
        recv.into_tensor(t.dims(), t.dtype(), t.device())
    }

    fn all_reduce_into<T: Equivalence>(
        &self,
        op: &str,
        s: &[T],
        r: &mut [T],
        mpi_op: SystemOperation,
    ) {
        mpi::request::scope(|scope| {
            let req = locked(|| self.comm.immediate_all_reduce_into(scope, s, r, mpi_op));
            self.wait(op, req);
        });
    }
}

impl Collective for MpiCollective {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.world
    }

    /// All-reduce on the host, after the ranks agree on the call.
    ///
    /// # Errors
    ///
    /// As [`Collective::all_reduce`]; also when the tensor cannot be copied to the host or the
    /// result back to its device. A timeout aborts the MPI job instead of returning.
    fn all_reduce(&self, t: &Tensor, op: ReduceOp) -> Result<Tensor> {
        const OP: &str = "all_reduce";
        let desc = Self::descriptor(Op::AllReduce(op), t, t.dims(), 0);
        self.agree(OP, desc, avg_dtype(t, op))?;
        self.reduce(OP, t, op)
    }

    /// All-reduce on the host, after the ranks agree on the call, then this rank's rows.
    ///
    /// # Errors
    ///
    /// As [`Collective::reduce_scatter`]; also when the tensor cannot be copied to the host or the
    /// result back to its device. A timeout aborts the MPI job instead of returning.
    fn reduce_scatter(&self, t: &Tensor, op: ReduceOp) -> Result<Tensor> {
        const OP: &str = "reduce_scatter";
        let desc = Self::descriptor(Op::ReduceScatter(op), t, t.dims(), 0);
        let local = avg_dtype(t, op).and_then(|()| {
            scatter_rows(t, self.rank, self.world)
                .map(|_| ())
                .map_err(|e| e.to_string())
        });
        self.agree(OP, desc, local)?;
        let full = self.reduce(OP, t, op)?;
        scatter_rows(&full, self.rank, self.world)
    }

    /// Variable-count all-gather on the host, after the ranks agree on the call and exchange their
    /// row counts.
    ///
    /// # Errors
    ///
    /// As [`Collective::all_gather`]; also when the tensor cannot be copied to the host or the
    /// result back to its device. A timeout aborts the MPI job instead of returning.
    fn all_gather(&self, t: &Tensor) -> Result<Tensor> {
        const OP: &str = "all_gather";
        let rest = t.dims().get(1..).unwrap_or(&[]);
        let local = if t.rank() == 0 {
            Err("expected a tensor of rank ≥ 1".to_string())
        } else {
            Ok(())
        };
        let desc = Self::descriptor(Op::AllGather, t, rest, t.rank() as i64);
        self.agree(OP, desc, local)?;
        let row: usize = rest.iter().product();
        let mut rows = vec![0i64; self.world];
        let mine = [t.dims()[0] as i64];
        mpi::request::scope(|scope| {
            let req = locked(|| {
                self.comm
                    .immediate_all_gather_into(scope, &mine[..], &mut rows[..])
            });
            self.wait(OP, req);
        });
        // MPI counts and displacements are i32: the same verdict on every rank (same `rows`).
        let total_elems: i64 = rows.iter().sum::<i64>() * row as i64;
        if total_elems > i32::MAX as i64 {
            return Err(invalid(
                OP,
                format!(
                    "{total_elems} gathered elements exceed MPI's i32 counts (row counts {rows:?})"
                ),
            ));
        }
        let counts: Vec<i32> = rows.iter().map(|&n| (n as usize * row) as i32).collect();
        let displs: Vec<i32> = counts
            .iter()
            .scan(0i32, |acc, &c| {
                let d = *acc;
                *acc += c;
                Some(d)
            })
            .collect();
        let total: usize = counts.iter().map(|&c| c as usize).sum();
        let send = HostBuf::of(t)?;
        let mut recv = send.zeros_like(total);
        macro_rules! gather {
            ($s:expr, $r:expr) => {{
                let mut part = PartitionMut::new(&mut $r[..], &counts[..], &displs[..]);
                mpi::request::scope(|scope| {
                    let req = locked(|| {
                        self.comm
                            .immediate_all_gather_varcount_into(scope, &$s[..], &mut part)
                    });
                    self.wait(OP, req);
                });
            }};
        }
        match (&send, &mut recv) {
            (HostBuf::F32(s), HostBuf::F32(r)) => gather!(s, r),
            (HostBuf::F64(s), HostBuf::F64(r)) => gather!(s, r),
            (HostBuf::I64(s), HostBuf::I64(r)) => gather!(s, r),
            (HostBuf::U32(s), HostBuf::U32(r)) => gather!(s, r),
            (HostBuf::U8(s), HostBuf::U8(r)) => gather!(s, r),
            _ => unreachable!("zeros_like keeps the variant"),
        }
        let mut dims = t.dims().to_vec();
        dims[0] = rows.iter().sum::<i64>() as usize;
        recv.into_tensor(&dims, t.dtype(), t.device())
    }

    /// Broadcast on the host, after the ranks agree on the call.
    ///
    /// # Errors
    ///
    /// As [`Collective::broadcast`]; also when the tensor cannot be copied to the host or the
    /// result back to its device. A timeout aborts the MPI job instead of returning.
    fn broadcast(&self, t: &Tensor, root: usize) -> Result<Tensor> {
        const OP: &str = "broadcast";
        let local = if root >= self.world {
            Err(format!(
                "root {root} out of range for world size {}",
                self.world
            ))
        } else {
            Ok(())
        };
        self.agree(
            OP,
            Self::descriptor(Op::Broadcast(root), t, t.dims(), root as i64),
            local,
        )?;
        let mut buf = HostBuf::of(t)?;
        let root_proc = self.comm.process_at_rank(root as i32);
        with_buf!(&mut buf, v => mpi::request::scope(|scope| {
            let req = locked(|| root_proc.immediate_broadcast_into(scope, &mut v[..]));
            self.wait(OP, req);
        }));
        buf.into_tensor(t.dims(), t.dtype(), t.device())
    }

    /// Barrier, after the ranks agree on the call.
    ///
    /// # Errors
    ///
    /// As [`Collective::barrier`]. A timeout aborts the MPI job instead of returning.
    fn barrier(&self) -> Result<()> {
        let token = Tensor::zeros(1, DType::U8, &Device::Cpu)?;
        self.agree(
            "barrier",
            Self::descriptor(Op::Barrier, &token, token.dims(), 0),
            Ok(()),
        )?;
        let req = locked(|| self.comm.immediate_barrier());
        self.wait("barrier", req);
        Ok(())
    }

    /// `MPI_Comm_split`, after the ranks agree on the call and on the validity of their arguments.
    ///
    /// # Errors
    ///
    /// As [`Collective::split`]. A timeout aborts the MPI job instead of returning.
    fn split(&self, color: Option<u32>, key: u32) -> Result<Option<Arc<dyn Collective>>> {
        const OP: &str = "split";
        let as_i32 =
            |what: &str, v: u32| i32::try_from(v).map_err(|_| format!("{what} {v} exceeds i32"));
        let checked = color
            .map(|c| as_i32("color", c))
            .transpose()
            .and_then(|c| Ok((c, as_i32("key", key)?)));
        let token = Tensor::zeros(1, DType::U8, &Device::Cpu)?;
        // MPI_Comm_split (and the MPI_Comm_dup of the new communicator) block while holding
        // the process's MPI lock: the agreement first (a polled all-gather, the lock released
        // between polls, so this process's communication thread keeps progressing), after which
        // every rank's split returns promptly.
        self.agree(
            OP,
            Self::descriptor(Op::Split, &token, token.dims(), 0),
            checked.as_ref().map(|_| ()).map_err(Clone::clone),
        )?;
        let (color, key) = checked.expect("agreed above: every rank's arguments are valid");
        let color = color.map_or(Color::undefined(), Color::with_value);
        let sub = locked(|| self.comm.split_by_color_with_key(color, key));
        Ok(sub.map(|c| {
            Arc::new(MpiCollective::new(c, self._env.clone(), self.timeout, true))
                as Arc<dyn Collective>
        }))
    }

    /// [`Collective::all_reduce`] on a duplicate of the communicator, run by this rank's
    /// communication thread.
    ///
    /// # Errors
    ///
    /// As [`Collective::all_reduce_async`]: only a communication thread that cannot be started or
    /// has stopped fails here; the failures of [`Collective::all_reduce`] come from
    /// [`Pending::wait`].
    fn all_reduce_async(&self, t: &Tensor, op: ReduceOp) -> Result<Pending> {
        let t = t.clone();
        self.start(move |c| c.all_reduce(&t, op))
    }

    /// [`Collective::all_gather`] on a duplicate of the communicator, run by this rank's
    /// communication thread.
    ///
    /// # Errors
    ///
    /// As [`Collective::all_gather_async`]: only a communication thread that cannot be started or
    /// has stopped fails here; the failures of [`Collective::all_gather`] come from
    /// [`Pending::wait`].
    fn all_gather_async(&self, t: &Tensor) -> Result<Pending> {
        let t = t.clone();
        self.start(move |c| c.all_gather(&t))
    }

    /// [`Collective::reduce_scatter`] on a duplicate of the communicator, run by this rank's
    /// communication thread.
    ///
    /// # Errors
    ///
    /// As [`Collective::reduce_scatter_async`]: only a communication thread that cannot be started
    /// or has stopped fails here; the failures of [`Collective::reduce_scatter`] come from
    /// [`Pending::wait`].
    fn reduce_scatter_async(&self, t: &Tensor, op: ReduceOp) -> Result<Pending> {
        let t = t.clone();
        self.start(move |c| c.reduce_scatter(&t, op))
    }
}
