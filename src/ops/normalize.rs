//! The differentiable normalisation: `y = act(γ·(x − mean)·invstd + β + z)` on (x, [γ; β], z)
//! as one candle op whose backward combines the gradient sums through the caller's reduction
//! ([`batch_norm_elemt_autograd`]; the layer's forward is this op after the statistics, with an
//! all-reduce over its communicator as that reduction).
//!
//! The output comes from this op even for an empty local batch, so `loss.backward()` always
//! reaches its `bwd` and every rank issues the backward collective (candle returns the input
//! of an ordinary op on an empty tensor unchanged, which would cut that path).

use std::sync::Arc;

use candle_core::backend::BackendStorage;
use candle_core::{bail, CpuStorage, DType, Result, Shape, Tensor};

use super::apply::{apply_cpu, ApplyCoef};
#[cfg(feature = "cuda")]
use super::arity::CudaIn;
use super::arity::{self, AnyArity, CpuIn};
use super::{
    acc_dtype, batch_norm_backward_elemt, batch_norm_backward_reduce, check_device,
    check_per_channel, check_same_shape, per_channel_f64, BackwardElemtConfig, OP,
};
use crate::device::cpu::slice;
use crate::device::Geometry;

/// Combines this rank's `[2, C]` f64 backward sums into those of the whole batch the
/// statistics came from: for synchronized batch norm, an all-reduce (sum) over the ranks
/// (`crate::batch_norm::synced`). Called once per backward, on every rank, whatever its batch.
pub type SumsReduction = Arc<dyn Fn(&Tensor) -> Result<Tensor> + Send + Sync>;

/// What the statistics given to [`batch_norm_elemt_autograd`] are, which decides the gradient
/// flowing through them.
#[derive(Clone)]
pub enum StatsGrad {
    /// Statistics of a batch spread over several parts (ranks): the backward hands its local
    /// `[2, C]` gradient sums to the reduction and uses what it returns.
    Global(SumsReduction),
    /// Batch statistics of this rank's input alone: their gradient flows into `dx` with no
    /// reduction.
    Local,
    /// Constants (running statistics in evaluation): no gradient through them.
    Constant,
}

impl std::fmt::Debug for StatsGrad {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            StatsGrad::Global(_) => "Global(..)",
            StatsGrad::Local => "Local",
            StatsGrad::Constant => "Constant",
        })
    }
}

/// The differentiable form of [`super::batch_norm_elemt`]: `y = act(γ·(x − mean)·invstd + β + z)`
/// whose gradients with respect to `x`, `γ`, `β` and `z` reach candle's autograd. The backward
/// is [`super::batch_norm_backward_reduce`], with [`StatsGrad::Global`] the reduction of its
/// `[2, C]` f64 sums (an all-reduce for [`crate::SyncBatchNorm`], which runs this op after its
/// statistics), then [`super::batch_norm_backward_elemt`].
///
/// # Arguments
/// * `x` - `(N, C, *)`, or `(N, *, C)` with `ChannelLayout::ChannelsLast`; rank 2 to 5; f32, f64, f16, bf16.
/// * `mean`, `invstd` - `[C]` (any float dtype, used as f64) on `x`'s device.
/// * `count` - the global number of values per channel `n` the statistics came from: `[C]`
///   (or any tensor whose first value is `n`) on `x`'s device; read in the backward only.
/// * `options` - [`super::ElemtConfig`]: `γ` and `β`, each `[C]`, both or neither (1 and 0,
///   then no parameter gradient); the residual `z`, of `x`'s shape, dtype and device, added
///   before the activation; ReLU after the sum (its mask applied to the incoming gradient);
///   where `x`'s channel dimension sits.
/// * `stats` - what `mean` and `invstd` are ([`StatsGrad`]).
///
/// Returns `y` of `x`'s shape and dtype.
///
/// # Errors
///
/// When only one of `γ` and `β` is given; when `x` is not of rank 2 to 5 or its dtype is not
/// f32, f64, f16 or bf16; when `mean`,
/// `invstd`, `count`, `γ` or `β` is not on `x`'s device or `mean`, `invstd`, `γ` or `β`
/// is not of shape `[C]` in a float dtype; when `residual` differs from `x` in shape, dtype or device; on a GPU, when a
/// CUDA allocation or kernel launch fails. The backward fails as the reduction does.
pub fn batch_norm_elemt_autograd(
    x: &Tensor,
    mean: &Tensor,
    invstd: &Tensor,
    count: &Tensor,
    options: super::ElemtConfig<'_>,
    stats: StatsGrad,
) -> Result<Tensor> {
    let super::ElemtConfig {
        weight,
        bias,
        residual,
        relu,
        layout,
    } = options;
    let affine = match (weight, bias) {
        (Some(w), Some(b)) => Some((w, b)),
        (None, None) => None,
        (w, _) => bail!(
            "{OP}: batch_norm_elemt_autograd: the weight and the bias come together here (the gradient is taken for both), got only the {}",
            if w.is_some() { "weight" } else { "bias" }
        ),
    };
    crate::device::check_supported(OP, x.device())?;
    let geometry = Geometry::of(OP, x.dims(), layout)?;
    let (c, dev) = (geometry.c, x.device());
    for (what, t) in [("mean", mean), ("invstd", invstd), ("count", count)] {
        check_device(what, t, dev)?;
    }
    if count.elem_count() != 1 && count.elem_count() != c {
        bail!(
            "{OP}: count must hold one value or {c} (the global count n per channel), got shape {:?}",
            count.dims()
        )
    }
    let acc = acc_dtype(x.dtype());
    if let Some((w, b)) = affine {
        check_device("weight", w, dev)?;
        check_device("bias", b, dev)?;
        check_per_channel("weight", w, &[c])?;
        check_per_channel("bias", b, &[c])?;
    }
    if let Some(z) = residual {
        check_same_shape("residual", x.dims(), z)?;
        check_device("residual", z, dev)?;
        if z.dtype() != x.dtype() {
            bail!(
                "{OP}: residual dtype {:?} differs from input dtype {:?}",
                z.dtype(),
                x.dtype()
            )
        }
    }
    let (batch_stats, reduce) = match stats {
        StatsGrad::Global(reduce) => (true, Some(reduce)),
        StatsGrad::Local => (true, None),
        StatsGrad::Constant => (false, None),
    };
    // γ and β reach the kernel as two inputs, so that nothing is copied; candle's ops take at
    // most three inputs, so with a residual too they travel stacked as one `[2, C]` input.
    let x = x.contiguous()?;
    let as_acc = |t: &Tensor| t.to_dtype(acc).and_then(|t| t.contiguous());
    let (params, inputs) = match (affine, residual) {
        (None, None) => (Params::None, vec![x]),
        (None, Some(z)) => (Params::None, vec![x, z.contiguous()?]),
        (Some((w, b)), None) => (Params::Separate, vec![x, as_acc(w)?, as_acc(b)?]),
        (Some((w, b)), Some(z)) => (
            Params::Stacked,
            vec![
                x,
                Tensor::stack(&[as_acc(w)?, as_acc(b)?], 0)?,
                z.contiguous()?,
            ],
        ),
    };
    let op = NormFn {
        geometry,
        mean: per_channel_f64("mean", mean, &[c])?,
        invstd: per_channel_f64("invstd", invstd, &[c])?,
        count: count.flatten_all()?.to_dtype(DType::F64)?,
        batch_stats,
        reduce,
        relu,
        params,
        residual: residual.is_some(),
    };
    let refs: Vec<&Tensor> = inputs.iter().collect();
    arity::apply(op, &refs, true)
}

/// How `γ` and `β` reach [`NormFn`]: its inputs are `[x]`, `[x, z]`, `[x, γ, β]` or
/// `[x, [γ; β], z]`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Params {
    /// No affine parameters (1 and 0).
    None,
    /// Inputs 1 and 2, `[C]` each.
    Separate,
    /// Input 1, `[2, C]` = `[γ; β]`.
    Stacked,
}

/// Statistics the forward normalised with, and how the backward must treat them.
#[derive(Clone)]
struct NormFn {
    geometry: Geometry,
    /// `[C]` mean, f64 on the input's device.
    mean: Tensor,
    /// `[C]` inverse standard deviation, f64 on the input's device.
    invstd: Tensor,
    /// `[C]` global values per channel (`n`), f64 on the input's device.
    count: Tensor,
    /// The statistics are batch statistics (their gradient flows into dx).
    batch_stats: bool,
    /// Combine the backward sums with this reduction (global statistics).
    reduce: Option<SumsReduction>,
    relu: bool,
    params: Params,
    /// The last input is a residual `z`.
    residual: bool,
}

// `γ` and `β` reach the op in the accumulation dtype of the input (f32, or f64 for f64 inputs).

/// An input's values as f64 on the host (the CPU path's `γ`, `β`, in f32 or f64).
fn host_f64(what: &str, (s, l): CpuIn<'_>) -> Result<Vec<f64>> {
    Ok(match s {
        CpuStorage::F32(_) => slice::<f32>(OP, s, l)?.iter().map(|&v| v as f64).collect(),
        CpuStorage::F64(_) => slice::<f64>(OP, s, l)?.to_vec(),
        s => bail!(
            "{OP}: {what} reaches the op as f32 or f64, got {:?}",
            s.dtype()
        ),
    })
}

impl NormFn {
    /// The residual among `inputs`, if any.
    fn z<S: Copy>(&self, inputs: &[S]) -> Option<S> {
        self.residual.then(|| inputs[inputs.len() - 1])
    }

    /// Gradients of the inputs, in input order.
    fn backward(&self, inputs: &[&Tensor], y: &Tensor, dy: &Tensor) -> Result<Vec<Option<Tensor>>> {
        let x = inputs[0];
        let weight = match self.params {
            Params::None => None,
            Params::Separate => Some(inputs[1].clone()),
            Params::Stacked => Some(inputs[1].get(0)?),
        };
        let layout = self.geometry.layout;
        let (mean, invstd) = (&self.mean, &self.invstd);
        let relu_y = self.relu.then_some(y);
        let local = batch_norm_backward_reduce(dy, x, mean, relu_y, layout)?;
        let sums = match (&self.reduce, self.batch_stats) {
            // Called on every rank, whatever its local batch: for an all-reduce, the others
            // wait for it. Announced first: an overlapped data-parallel backward places its
            // buckets around the collectives of the backward (`collective::in_backward`).
            (Some(reduce), _) => candle_collective::in_backward::collective(|| reduce(&local))?,
            (None, true) => local.clone(),
            (None, false) => local.zeros_like()?,
        };
        let want_dz = self.residual && self.relu;
        let (dx, dz) = batch_norm_backward_elemt(
            dy,
            x,
            mean,
            invstd,
            &sums,
            &self.count,
            BackwardElemtConfig {
                weight: weight.as_ref(),
                relu_output: relu_y,
                want_dz,
                layout,
            },
        )?;
        let dz = match (self.residual, dz) {
            (false, _) => None,
            (true, Some(dz)) => Some(dz),
            (true, None) => Some(dy.clone()),
        };
        let dgamma = || local.get(1)? * invstd;
        let mut grads = vec![Some(dx)];
        match self.params {
            Params::None => {}
            Params::Separate => {
                grads.push(Some(dgamma()?.to_dtype(inputs[1].dtype())?));
                grads.push(Some(local.get(0)?.to_dtype(inputs[2].dtype())?));
            }
            Params::Stacked => {
                let d = Tensor::stack(&[dgamma()?, local.get(0)?], 0)?;
                grads.push(Some(d.to_dtype(inputs[1].dtype())?));
            }
        }
        if self.residual {
            grads.push(dz);
        }
        Ok(grads)
    }
}

impl AnyArity for NormFn {
    fn name(&self, inputs: usize) -> &'static str {
        match (self.residual, inputs) {
            (true, _) => "sync-batch-norm-residual",
            _ => "sync-batch-norm",
        }
    }

    fn cpu(&self, inputs: &[CpuIn<'_>]) -> Result<(CpuStorage, Shape)> {
        let c = self.geometry.c;
        let (w, b) = match self.params {
            Params::None => (None, None),
            Params::Separate => (
                Some(host_f64("weight", inputs[1])?),
                Some(host_f64("bias", inputs[2])?),
            ),
            Params::Stacked => {
                let mut p = host_f64("weight and bias", inputs[1])?;
                let b = p.split_off(c);
                (Some(p), Some(b))
            }
        };
        let coef = ApplyCoef::from_tensors(&self.mean, &self.invstd, w.as_deref(), b.as_deref())?;
        let (xs, xl) = inputs[0];
        let out = apply_cpu(xs, xl, self.z(inputs), &self.geometry, &coef, self.relu)?;
        Ok((out, xl.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda(&self, inputs: &[CudaIn<'_>]) -> Result<(candle_core::CudaStorage, Shape)> {
        let x = inputs[0];
        // The stacked `[γ; β]` as its two rows.
        let rows = match self.params {
            Params::Stacked => {
                let (s, l) = inputs[1];
                Some((s, l.narrow(0, 0, 1)?, l.narrow(0, 1, 1)?))
            }
            _ => None,
        };
        let params = match (self.params, &rows) {
            (Params::Separate, _) => [Some(inputs[1]), Some(inputs[2])],
            (Params::Stacked, Some((s, w, b))) => [Some((*s, w)), Some((*s, b))],
            _ => [None, None],
        };
        let out = super::apply::apply_cuda(
            x,
            self.z(inputs),
            &self.geometry,
            &self.mean,
            &self.invstd,
            params,
            self.relu,
        )?;
        Ok((out, x.1.shape().clone()))
    }

    fn bwd(&self, inputs: &[&Tensor], res: &Tensor, grad: &Tensor) -> Result<Vec<Option<Tensor>>> {
        self.backward(inputs, res, grad)
    }
}
