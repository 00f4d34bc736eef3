//! [`Checked`]: a debug wrapper that makes every rank agree on each call's arguments before
//! the call runs, for backends that do not check them (NCCL reduces whatever bytes it is given
//! and hangs when the element counts differ).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use candle_core::{DType, Device, Result, Tensor};

use super::{Collective, CollectiveError, Decorator, Op, ReduceOp};

const BACKEND: &str = "Checked";

/// `inner`, with every call preceded by an all-gather of its descriptor (operation, root,
/// dtype, element count) over `inner` and a comparison on every rank: ranks that disagree all
/// get [`CollectiveError::Mismatch`] naming what each passed, instead of a silently wrong
/// reduction or a hang, and the wrapper is broken from then on (later calls fail with the
/// reason, as after any failed collective).
///
/// Cost: one extra all-gather of 5 `i64` per rank and a host wait for its result on every call
/// (on NCCL, a stream synchronisation, so the calls are no longer asynchronous). A debugging
/// and testing aid; the default is not to wrap, which costs nothing. `ThreadGroup` and MPI
/// check agreement themselves and need no wrapper.
///
/// For an all-gather, where row counts may differ by design, the row length (elements per
/// row) and the tensor's rank are compared instead of the element count.
///
/// # Errors of its calls
///
/// Those of the inner communicator's; also [`CollectiveError::Mismatch`] on every rank when the
/// ranks' call descriptors differ, [`CollectiveError::RankLeft`] on every call after such a
/// mismatch, and the failures of the descriptor's all-gather over the inner communicator. A
/// mismatch is not reported by `deferred_error`: it fails the calls themselves.
#[derive(Debug)]
pub struct Checked {
    inner: Arc<dyn Collective>,
    /// Where descriptors of calls without a tensor (barrier, split) are exchanged: the device
    /// `inner` takes tensors on.
    device: Device,
    broken: Mutex<Option<String>>,
    /// The number of the next call checked (every rank numbers its calls alike).
    next_call: AtomicU64,
}

impl Checked {
    /// Wraps `inner`; `device` is the device `inner`'s collectives take tensors on (the GPU for
    /// NCCL, the CPU for host backends). Not collective.
    pub fn new(inner: Arc<dyn Collective>, device: &Device) -> Arc<Self> {
        Arc::new(Self {
            inner,
            device: device.clone(),
            broken: Mutex::new(None),
            next_call: AtomicU64::new(0),
        })
    }

    /// Exchanges `[op code, root, dtype, rank of the tensor, count]` and fails on every rank
    /// when they differ.
    fn agree(&self, op: Op, t: Option<&Tensor>) -> Result<()> {
        let call = self.next_call.load(Ordering::Relaxed);
        if let Some(reason) = self
            .broken
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
        {
            return Err(CollectiveError::broken(
                BACKEND,
                op.name(),
                call,
                self.inner.rank(),
                format!("an earlier call broke the group: {reason}"),
            )
            .into());
        }
        self.next_call.fetch_add(1, Ordering::Relaxed);
        let mine = descriptor(op, t);
        let device = t.map(|t| t.device()).unwrap_or(&self.device);
        let all = self
            .inner
            .all_gather(&Tensor::new(&[mine], device)?)?
            .to_vec2::<i64>()?;
        if all.iter().all(|d| *d == mine) {
            return Ok(());
        }
        let detail = all
            .iter()
            .enumerate()
            .map(|(r, d)| format!("rank {r}: {}", describe(d)))
            .collect::<Vec<_>>()
            .join("; ");
        let detail = format!("every rank must pass the same call: {detail}");
        *self.broken.lock().unwrap_or_else(|e| e.into_inner()) = Some(detail.clone());
        Err(CollectiveError::Mismatch {
            backend: BACKEND,
            call,
            detail,
        }
        .into())
    }
}

const DTYPES: [DType; 7] = [
    DType::U8,
    DType::U32,
    DType::I64,
    DType::BF16,
    DType::F16,
    DType::F32,
    DType::F64,
];

const OPS: [Op; 11] = [
    Op::AllReduce(ReduceOp::Sum),
    Op::AllReduce(ReduceOp::Avg),
    Op::AllReduce(ReduceOp::Max),
    Op::AllReduce(ReduceOp::Min),
    Op::ReduceScatter(ReduceOp::Sum),
    Op::ReduceScatter(ReduceOp::Avg),
    Op::ReduceScatter(ReduceOp::Max),
    Op::ReduceScatter(ReduceOp::Min),
    Op::AllGather,
    Op::Barrier,
    Op::Split,
];

/// `[op code, root (broadcast) or -1, dtype or -1, tensor rank or -1, count or -1]`.
fn descriptor(op: Op, t: Option<&Tensor>) -> [i64; 5] {
    let root = match op {
        Op::Broadcast(r) => r as i64,
        _ => -1,
    };
    let Some(t) = t else {
        return [op.code(), root, -1, -1, -1];
    };
    let count = match op {
        Op::AllGather => t.dims().iter().skip(1).product::<usize>(),
        _ => t.elem_count(),
    };
    [
        op.code(),
        root,
        t.dtype() as i64,
        t.rank() as i64,
        count as i64,
    ]
}

/// One rank's descriptor in words.
fn describe(d: &[i64]) -> String {
    let op = match d[0] {
        c if c == Op::Broadcast(0).code() => format!("broadcast(root={})", d[1]),
        c => OPS
            .iter()
            .find(|o| o.code() == c)
            .map(|o| o.to_string())
            .unwrap_or_else(|| format!("operation #{c}")),
    };
    if d[2] < 0 {
        return op;
    }
    let dtype = DTYPES
        .iter()
        .find(|t| **t as i64 == d[2])
        .map(|t| format!("{t:?}"))
        .unwrap_or_else(|| format!("dtype #{}", d[2]));
    let what = if d[0] == Op::AllGather.code() {
        "elements per row"
    } else {
        "elements"
    };
    format!("{op} of {dtype}, rank {}, {} {what}", d[3], d[4])
}

impl Decorator for Checked {
    fn inner(&self) -> &Arc<dyn Collective> {
        &self.inner
    }

    /// Every rank's descriptor of this call, compared before the call runs (for an
    /// asynchronous call too: a mismatch fails the call, not its [`super::Pending::wait`]).
    fn before(&self, op: Op, t: Option<&Tensor>) -> Result<()> {
        self.agree(op, t)
    }

    /// The subgroups are wrapped too.
    fn subgroup(&self, sub: Arc<dyn Collective>) -> Arc<dyn Collective> {
        Checked::new(sub, &self.device)
    }
}
