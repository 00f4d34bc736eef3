//! What the last rank to arrive at a [`super::ThreadGroup`] call does: check that every rank
//! asked for the same thing, and compute the common result once, in rank order, or hand the
//! sum of an all-reduce to every rank ([`super::reduce`]).

use candle_core::{DType, Result, Tensor};

use super::reduce::{self, Work};
use super::{Contribution, Input, BACKEND};
use crate::{scatter_rows, CollectiveError, Op, ReduceOp};

/// How a call's result comes about.
pub(super) enum Plan {
    /// Computed (or refused) by the last rank to arrive.
    Ready(std::result::Result<Tensor, CollectiveError>),
    /// A sum every rank helps compute.
    Shared(Box<dyn Work>),
}

/// Checks that every rank asked for the same thing, then computes the common result or plans
/// its parallel sum.
pub(super) fn plan(call: u64, cs: &[Contribution]) -> Plan {
    let wire = cs[0].wire;
    let reduction = match cs[0].kind {
        Op::AllReduce(op) | Op::ReduceScatter(op) => Some(op),
        _ => None,
    };
    let inputs = match agree(call, cs) {
        Ok(inputs) => inputs,
        Err(e) => return Plan::Ready(Err(e)),
    };
    let invalid =
        |e: candle_core::Error| CollectiveError::invalid(BACKEND, cs[0].kind.name(), e.to_string());
    if let Some(op) = reduction {
        if let (Op::ReduceScatter(_), Input::One(t)) = (cs[0].kind, inputs[0]) {
            // Checked here, once, so that every rank gets the same error.
            if let Err(e) = scatter_rows(t, 0, cs.len()) {
                return Plan::Ready(Err(invalid(e)));
            }
        }
        let parts: Vec<&[Tensor]> = inputs.iter().map(|i| i.tensors()).collect();
        match reduce::plan(&parts, &inputs[0].result_shape(), op, wire) {
            Ok(Some(work)) => return Plan::Shared(work),
            Ok(None) => {}
            Err(e) => return Plan::Ready(Err(invalid(e))),
        }
    }
    let flat = match inputs.iter().map(|i| i.flat()).collect::<Result<Vec<_>>>() {
        Ok(flat) => flat,
        Err(e) => return Plan::Ready(Err(invalid(e))),
    };
    let flat: Vec<&Tensor> = flat.iter().collect();
    Plan::Ready(combine(cs[0].kind, wire, &flat, cs.len()))
}

/// Checks that every rank asked for the same thing; returns their inputs in rank order.
fn agree(call: u64, cs: &[Contribution]) -> std::result::Result<Vec<&Input>, CollectiveError> {
    let kind = cs[0].kind;
    let mut inputs: Vec<&Input> = Vec::with_capacity(cs.len());
    for (r, c) in cs.iter().enumerate() {
        match &c.input {
            Ok(input) => inputs.push(input),
            Err(why) => {
                return Err(CollectiveError::invalid(
                    BACKEND,
                    c.kind.name(),
                    format!("rank {r} could not take part in call #{call}: {why}"),
                ))
            }
        }
    }
    let first = inputs[0];
    let same_rest = |input: &Input| match (kind, input, first) {
        (Op::AllGather | Op::Split, Input::One(t), Input::One(f)) => {
            t.rank() >= 1 && f.rank() >= 1 && t.dims()[1..] == f.dims()[1..]
        }
        (_, Input::One(t), Input::One(f)) => t.dims() == f.dims(),
        (Op::AllReduce(_), Input::Parts(ps), Input::Parts(fs)) => {
            ps.len() == fs.len()
                && ps
                    .iter()
                    .zip(fs)
                    .all(|(p, f)| p.elem_count() == f.elem_count())
                && ps.iter().all(|p| p.dtype() == first.dtype())
        }
        _ => false,
    };
    let agree = cs.iter().zip(&inputs).all(|(c, input)| {
        c.kind == kind && c.wire == cs[0].wire && input.dtype() == first.dtype() && same_rest(input)
    });
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
            "every rank must call the same collective with the same dtype, shape and wire dtype",
        ));
    }
    Ok(inputs)
}

/// The common result of a call the ranks agree on, computed on this thread.
fn combine(
    kind: Op,
    wire: Option<DType>,
    tensors: &[&Tensor],
    world: usize,
) -> std::result::Result<Tensor, CollectiveError> {
    let invalid = |detail: String| CollectiveError::invalid(BACKEND, kind.name(), detail);
    let result = match kind {
        Op::AllReduce(op) | Op::ReduceScatter(op) => {
            reduce_through(tensors, op, wire).map_err(|e| invalid(e.to_string()))?
        }
        Op::AllGather | Op::Split => Tensor::cat(tensors, 0).map_err(|e| invalid(e.to_string()))?,
        Op::Broadcast(root) => {
            if root >= world {
                return Err(invalid(format!(
                    "root {root} out of range for world size {world}"
                )));
            }
            // A copy, made while every rank is still inside the call: the root may change its
            // tensor in place (`Var::set`) the moment it returns, before the others read.
            tensors[root].copy().map_err(|e| invalid(e.to_string()))?
        }
        Op::Barrier => tensors[0].clone(),
    };
    Ok(result)
}

/// [`reduce`] of the inputs rounded to the wire dtype, returned in their own dtype.
fn reduce_through(ts: &[&Tensor], op: ReduceOp, wire: Option<DType>) -> Result<Tensor> {
    let Some(wire) = wire else {
        return reduce(ts, op);
    };
    let narrowed = ts
        .iter()
        .map(|t| t.to_dtype(wire))
        .collect::<Result<Vec<_>>>()?;
    reduce(&narrowed.iter().collect::<Vec<_>>(), op)?.to_dtype(ts[0].dtype())
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
            Contribution {
                kind,
                wire: None,
                input: Ok(Input::One(t)),
            },
            Contribution {
                kind,
                wire: None,
                input: Err("device lost".into()),
            },
        ];
        let Plan::Ready(Err(e)) = plan(7, &cs) else {
            panic!("the call should fail")
        };
        let e = e.to_string();
        assert!(
            e.contains("rank 1 could not take part in call #7: device lost"),
            "{e}"
        );
    }
}
