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

/// One step simpler: the tensor to reduce, its options, and the dtype to cast the result back
/// to (`None`: the result as it comes).
type Simpler = (Tensor, AllReduce, Option<DType>);

/// The call made one step simpler, for the forms a backend carries no other way: several parts
/// concatenated into a new tensor (reduced in place, the wire kept, so that the backend carries
/// it its own way), or one tensor cast to the wire dtype (the result to be cast back).
///
/// # Errors
/// Parts refused by [`check_parts`], a wire refused by [`check_wire`], or one tensor without a
/// wire: each backend reduces that itself (simplifying it would recurse).
fn simpler(parts: &[Tensor], options: AllReduce) -> Result<Simpler> {
    check_parts(parts)?;
    let ([t], Some(w)) = (parts, options.wire) else {
        if parts.len() == 1 {
            candle_core::bail!(
                "all_reduce: one tensor without a wire is each backend's own to reduce"
            )
        }
        return Ok((concatenated(parts)?, options.in_place(), None));
    };
    check_wire(t, w)?;
    let plain = AllReduce {
        wire: None,
        ..options
    };
    Ok(match w == t.dtype() {
        true => (t.clone(), plain, None),
        false => (t.to_dtype(w)?, plain.in_place(), Some(t.dtype())),
    })
}

/// `c`'s all-reduce of `parts` with `options`, made one step simpler ([`simpler`]).
///
/// # Errors
/// As [`simpler`], and `c`'s.
pub(crate) fn all_reduce_as_one<C: Collective + ?Sized>(
    c: &C,
    parts: &[Tensor],
    options: AllReduce,
) -> Result<Tensor> {
    let (t, options, back) = simpler(parts, options)?;
    let out = c.all_reduce_with(&[t], options)?;
    match back {
        None => Ok(out),
        Some(d) => out.to_dtype(d),
    }
}

/// [`all_reduce_as_one`] started: [`Pending::wait`] gives what it returns.
///
/// # Errors
/// As [`simpler`], and what `c` finds when starting.
pub(crate) fn start_as_one<C: Collective + ?Sized>(
    c: &C,
    parts: &[Tensor],
    options: AllReduce,
) -> Result<Pending> {
    let (t, options, back) = simpler(parts, options)?;
    let pending = c.start_all_reduce(&[t], options)?;
    Ok(match back {
        None => pending,
        Some(d) => Pending::new(move || pending.wait()?.to_dtype(d)),
    })
}
