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
    let kind = cs[0].kind;
    let mut tensors: Vec<&Tensor> = Vec::with_capacity(cs.len());
    for (r, c) in cs.iter().enumerate() {
        match &c.input {
            Ok(t) => tensors.push(t),
            Err(why) => {
                return Err(CollectiveError::invalid(
                    BACKEND,
                    c.kind.name(),
                    format!("rank {r} could not take part in call #{call}: {why}"),
                ))
            }
        }
    }
    let first = tensors[0];
    let same_rest = |t: &Tensor| match kind {
        Op::AllGather | Op::Split => {
            t.rank() >= 1 && first.rank() >= 1 && t.dims()[1..] == first.dims()[1..]
        }
        _ => t.dims() == first.dims(),
    };
    let agree = cs
        .iter()
        .zip(&tensors)
        .all(|(c, t)| c.kind == kind && t.dtype() == first.dtype() && same_rest(t));
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
    let invalid = |detail: String| CollectiveError::invalid(BACKEND, kind.name(), detail);
    let result = match kind {
        Op::AllReduce(op) => reduce(&tensors, op).map_err(|e| invalid(e.to_string()))?,
        Op::ReduceScatter(op) => {
            // Checked here, once, so that every rank gets the same error.
            scatter_rows(first, 0, cs.len()).map_err(|e| invalid(e.to_string()))?;
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
        Op::Barrier => first.clone(),
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

#[cfg(test)]
mod tests {
    use candle_core::Device;

    use super::*;

    /// A rank whose input never reached the host (a failed device copy) still fills its slot:
    /// the call fails on every rank with the reason, instead of the others waiting for it.
    #[test]
    fn a_rank_without_an_input_fails_the_call_for_everyone() {
        let kind = Op::AllReduce(ReduceOp::Sum);
        let t = Tensor::new(&[1f32, 2.0], &Device::Cpu).unwrap();
        let cs = [
            Contribution { kind, input: Ok(t) },
            Contribution {
                kind,
                input: Err("device lost".into()),
            },
        ];
        let e = combine(7, &cs).unwrap_err().to_string();
        assert!(
            e.contains("rank 1 could not take part in call #7: device lost"),
            "{e}"
        );
    }
}
