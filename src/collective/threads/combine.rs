//! What the last rank to arrive at a [`super::ThreadGroup`] call does: check that every rank
//! asked for the same thing, and compute the common result once, in rank order.

use candle_core::{DType, Result, Tensor};

use super::{Contribution, BACKEND};
use crate::collective::{scatter_rows, CollectiveError, Op, ReduceOp};

/// Checks that every rank asked for the same thing and computes the common result.
pub(super) fn combine(
    call: u64,
    cs: &[Contribution],
) -> std::result::Result<Tensor, CollectiveError> {
    let first = &cs[0];
    let same_rest = |c: &Contribution| match first.kind {
        Op::AllGather | Op::Split => {
            c.tensor.rank() >= 1
                && first.tensor.rank() >= 1
                && c.tensor.dims()[1..] == first.tensor.dims()[1..]
        }
        _ => c.tensor.dims() == first.tensor.dims(),
    };
    let agree = cs
        .iter()
        .all(|c| c.kind == first.kind && c.tensor.dtype() == first.tensor.dtype() && same_rest(c));
    let mismatch = |why: &str| CollectiveError::Mismatch {
        backend: BACKEND,
        call,
        detail: format!(
            "{why}: {}",
            cs.iter()
                .enumerate()
                .map(|(r, c)| format!("rank {r}: {}", c.describe()))
                .collect::<Vec<_>>()
                .join("; ")
        ),
    };
    if !agree {
        return Err(mismatch(
            "every rank must call the same collective with the same dtype and shape",
        ));
    }
    let invalid = |detail: String| CollectiveError::invalid(BACKEND, first.kind.name(), detail);
    let tensors: Vec<&Tensor> = cs.iter().map(|c| &c.tensor).collect();
    let result = match first.kind {
        Op::AllReduce(op) => reduce(&tensors, op).map_err(|e| invalid(e.to_string()))?,
        Op::ReduceScatter(op) => {
            // Checked here, once, so that every rank gets the same error.
            scatter_rows(&first.tensor, 0, cs.len()).map_err(|e| invalid(e.to_string()))?;
            reduce(&tensors, op).map_err(|e| invalid(e.to_string()))?
        }
        Op::AllGather | Op::Split => {
            Tensor::cat(&tensors, 0).map_err(|e| invalid(e.to_string()))?
        }
        Op::Broadcast(root) => {
            if root >= cs.len() {
                return Err(invalid(format!(
                    "root {root} out of range for world size {}",
                    cs.len()
                )));
            }
            tensors[root].clone()
        }
        Op::Barrier => first.tensor.clone(),
    };
    Ok(result)
}

/// Element-wise reduction in rank order; f16/bf16 accumulate in f32.
fn reduce(ts: &[&Tensor], op: ReduceOp) -> Result<Tensor> {
    let dtype = ts[0].dtype();
    let acc_dtype = match dtype {
        DType::F16 | DType::BF16 => DType::F32,
        d => d,
    };
    if op == ReduceOp::Avg && !dtype.is_float() {
        candle_core::bail!("ReduceOp::Avg needs a float dtype, got {dtype:?}")
    }
    let mut acc = ts[0].to_dtype(acc_dtype)?;
    for t in &ts[1..] {
        let t = t.to_dtype(acc_dtype)?;
        acc = match op {
            ReduceOp::Sum | ReduceOp::Avg => (acc + t)?,
            ReduceOp::Max => acc.maximum(&t)?,
            ReduceOp::Min => acc.minimum(&t)?,
        };
    }
    if op == ReduceOp::Avg {
        acc = (acc / ts.len() as f64)?;
    }
    acc.to_dtype(dtype)
}
