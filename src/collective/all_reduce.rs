//! The all-reduce's options ([`AllReduce`]), and the forms every backend can reduce to: one
//! tensor, in its own dtype.

use candle_core::{DType, Result, Tensor};

use super::{Collective, Pending, ReduceOp};

/// How an all-reduce runs: the reduction, the dtype the values travel in, and whether the result
/// may take the input's storage (PyTorch c10d's `AllreduceOptions`, with a wire dtype).
///
/// `AllReduce::from(ReduceOp::Sum)` (or `ReduceOp::Sum.into()`) is a plain sum; the builders
/// add the rest: `AllReduce::new(ReduceOp::Avg).wire(DType::BF16)`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AllReduce {
    /// The element-wise reduction over ranks.
    pub op: ReduceOp,
    /// The float dtype the values travel in (`None`: the input's): each rank's values rounded
    /// to it, reduced (f16 and bf16 accumulate in f32), the result rounded to it and returned in
    /// the input's dtype. `DataParallel::with_wire_dtype` sends its buckets this way.
    pub wire: Option<DType>,
    /// The result may be written into the input's own storage and returned in it (one input
    /// tensor), which saves the result's allocation on a backend that reduces in place (NCCL,
    /// for a contiguous input: its send and receive buffers are then one). Any other handle to
    /// that storage (a clone, a view) then sees the result: set it only for an input nothing
    /// else reads. After an error the input's values are unspecified. `SyncBatchNorm`'s forward
    /// hands its local sums over this way.
    pub in_place: bool,
}

impl AllReduce {
    /// `op`, in the input's dtype, into a new tensor.
    pub fn new(op: ReduceOp) -> Self {
        Self {
            op,
            wire: None,
            in_place: false,
        }
    }

    /// The same, carried in the float dtype `wire` (see [`AllReduce::wire`](field@AllReduce::wire)).
    pub fn wire(self, wire: DType) -> Self {
        Self {
            wire: Some(wire),
            ..self
        }
    }

    /// The same, allowed to write the result into the input's storage (see
    /// [`AllReduce::in_place`](field@AllReduce::in_place)).
    pub fn in_place(self) -> Self {
        Self {
            in_place: true,
            ..self
        }
    }
}

impl From<ReduceOp> for AllReduce {
    fn from(op: ReduceOp) -> Self {
        Self::new(op)
    }
}

/// Errors unless `parts` holds at least one tensor, all of one dtype and one device.
pub(crate) fn check_parts(parts: &[Tensor]) -> Result<()> {
    let Some(first) = parts.first() else {
        candle_core::bail!("all_reduce: expected at least one part, got none")
    };
    for (i, p) in parts.iter().enumerate() {
        if p.dtype() != first.dtype() {
            candle_core::bail!(
                "all_reduce: part {i} is {:?}, part 0 {:?}: the parts must share one dtype",
                p.dtype(),
                first.dtype()
            )
        }
        if !p.device().same_device(first.device()) {
            candle_core::bail!(
                "all_reduce: part {i} is on {:?}, part 0 on {:?}: the parts must share one device",
                p.device(),
                first.device()
            )
        }
    }
    Ok(())
}

/// Errors unless `t` and `wire` are float dtypes.
pub(crate) fn check_wire(t: &Tensor, wire: DType) -> Result<()> {
    if !t.dtype().is_float() || !wire.is_float() {
        candle_core::bail!(
            "all_reduce: a {:?} tensor cannot be carried on a {wire:?} wire: both must be float dtypes",
            t.dtype()
        )
    }
    Ok(())
}

/// The parts flattened and laid end to end in a new tensor.
fn concatenated(parts: &[Tensor]) -> Result<Tensor> {
    let flat = parts
        .iter()
        .map(Tensor::flatten_all)
        .collect::<Result<Vec<_>>>()?;
    Tensor::cat(&flat, 0)
}

/// Refuses a call that [`all_reduce_as_one`] cannot make simpler (one tensor, no wire): the
/// backend must reduce it itself.
fn nothing_to_simplify() -> candle_core::Error {
    candle_core::Error::Msg(
        "all_reduce: one tensor without a wire is each backend's own to reduce".into(),
    )
}

/// `c`'s all-reduce of `parts` with `options` made simpler, for the forms a backend carries no
/// other way: several parts concatenated into a new tensor (reduced in place, the wire kept,
/// so that the backend carries it its own way), or one tensor cast to the wire dtype and the
/// result cast back.
///
/// # Errors
/// Parts refused by [`check_parts`], a wire refused by [`check_wire`], one tensor without a
/// wire (the caller's to reduce), and `c`'s.
pub(crate) fn all_reduce_as_one<C: Collective + ?Sized>(
    c: &C,
    parts: &[Tensor],
    options: AllReduce,
) -> Result<Tensor> {
    check_parts(parts)?;
    let ([t], Some(w)) = (parts, options.wire) else {
        return match parts.len() {
            1 => Err(nothing_to_simplify()),
            _ => c.all_reduce_with(&[concatenated(parts)?], options.in_place()),
        };
    };
    check_wire(t, w)?;
    let plain = AllReduce {
        wire: None,
        ..options
    };
    if w == t.dtype() {
        return c.all_reduce_with(parts, plain);
    }
    c.all_reduce_with(&[t.to_dtype(w)?], plain.in_place())?
        .to_dtype(t.dtype())
}

/// [`all_reduce_as_one`] started: [`Pending::wait`] gives what it returns.
///
/// # Errors
/// As [`all_reduce_as_one`], for what is found when starting.
pub(crate) fn start_as_one<C: Collective + ?Sized>(
    c: &C,
    parts: &[Tensor],
    options: AllReduce,
) -> Result<Pending> {
    check_parts(parts)?;
    let ([t], Some(w)) = (parts, options.wire) else {
        return match parts.len() {
            1 => Err(nothing_to_simplify()),
            _ => c.start_all_reduce(&[concatenated(parts)?], options.in_place()),
        };
    };
    check_wire(t, w)?;
    let plain = AllReduce {
        wire: None,
        ..options
    };
    if w == t.dtype() {
        return c.start_all_reduce(parts, plain);
    }
    let dtype = t.dtype();
    let pending = c.start_all_reduce(&[t.to_dtype(w)?], plain.in_place())?;
    Ok(Pending::new(move || pending.wait()?.to_dtype(dtype)))
}
