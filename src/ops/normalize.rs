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
use candle_core::{bail, CpuStorage, DType, Layout, Result, Shape, Tensor};

use super::apply::{apply_cpu, ApplyCoef};
#[cfg(feature = "cuda")]
use super::optional::CudaIn;
use super::optional::{self, CpuIn, Grads, OptionalLast};
use super::{
    acc_dtype, batch_norm_backward_elemt, batch_norm_backward_reduce, check_device,
    check_per_channel, check_same_shape, per_channel_f64, OP,
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
/// * `x` - `(N, C, *)`, or `(N, *, C)` with `Layout::ChannelsLast`; rank 2 to 5; f32, f64, f16, bf16.
/// * `mean`, `invstd` - `[C]` (any float dtype, used as f64) on `x`'s device.
/// * `count` - the global number of values per channel `n` the statistics came from: `[C]`
///   (or any tensor whose first value is `n`) on `x`'s device; read in the backward only.
/// * `affine` - `(γ, β)`, each `[C]`, or `None` for 1 and 0 (then no parameter gradient).
/// * `residual` - `z`, of `x`'s shape, dtype and device, added before the activation.
/// * `relu` - apply ReLU after the sum (its mask is applied to the incoming gradient).
/// * `layout` - where `x`'s channel dimension sits.
/// * `stats` - what `mean` and `invstd` are ([`StatsGrad`]).
///
/// Returns `y` of `x`'s shape and dtype.
///
/// # Errors
///
/// When `x` is not of rank 2 to 5 or its dtype is not f32, f64, f16 or bf16; when `mean`,
/// `invstd`, `count`, `γ` or `β` is not on `x`'s device or `mean`, `invstd`, `γ` or `β`
/// is not of shape `[C]` in a float dtype; when `residual` differs from `x` in shape, dtype or device; on a GPU, when a
/// CUDA allocation or kernel launch fails. The backward fails as the reduction does.
#[allow(clippy::too_many_arguments)]
pub fn batch_norm_elemt_autograd(
    x: &Tensor,
    mean: &Tensor,
    invstd: &Tensor,
    count: &Tensor,
    affine: Option<(&Tensor, &Tensor)>,
    residual: Option<&Tensor>,
    relu: bool,
    layout: crate::Layout,
    stats: StatsGrad,
) -> Result<Tensor> {
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
    let params = match affine {
        Some((w, b)) => {
            check_device("weight", w, dev)?;
            check_device("bias", b, dev)?;
            check_per_channel("weight", w, &[c])?;
            check_per_channel("bias", b, &[c])?;
            Tensor::stack(&[w, b], 0)?
        }
        None => identity_params(c, dev)?,
    }
    .to_dtype(acc)?;
    let (batch_stats, reduce) = match stats {
        StatsGrad::Global(reduce) => (true, Some(reduce)),
        StatsGrad::Local => (true, None),
        StatsGrad::Constant => (false, None),
    };
    let op = NormFn {
        geometry,
        mean: per_channel_f64("mean", mean, &[c])?,
        invstd: per_channel_f64("invstd", invstd, &[c])?,
        count: count.flatten_all()?.to_dtype(DType::F64)?,
        batch_stats,
        reduce,
        relu,
        affine: affine.is_some(),
    };
    let x = x.contiguous()?;
    match residual {
        None => optional::apply(op, &[&x, &params], None, true),
        Some(z) => {
            check_same_shape("residual", x.dims(), z)?;
            check_device("residual", z, dev)?;
            if z.dtype() != x.dtype() {
                bail!(
                    "{OP}: residual dtype {:?} differs from input dtype {:?}",
                    z.dtype(),
                    x.dtype()
                )
            }
            optional::apply(op, &[&x, &params], Some(&z.contiguous()?), true)
        }
    }
}

/// Statistics the forward normalised with, and how the backward must treat them.
#[derive(Clone)]
struct NormFn {
    pub geometry: Geometry,
    /// `[C]` mean, f64 on the input's device.
    pub mean: Tensor,
    /// `[C]` inverse standard deviation, f64 on the input's device.
    pub invstd: Tensor,
    /// `[C]` global values per channel (`n`), f64 on the input's device.
    pub count: Tensor,
    /// The statistics are batch statistics (their gradient flows into dx).
    pub batch_stats: bool,
    /// Combine the backward sums with this reduction (global statistics).
    pub reduce: Option<SumsReduction>,
    pub relu: bool,
    /// `[γ; β]` carries learnable parameters (else a constant `[1; 0]`).
    pub affine: bool,
}

// `[γ; β]` reaches the ops as `[2, C]` in the accumulation dtype of the input (f32, or f64 for
// f64 inputs): the layer converts it before applying the op.

impl NormFn {
    fn forward(
        &self,
        x: (&CpuStorage, &Layout),
        params: (&CpuStorage, &Layout),
        z: Option<(&CpuStorage, &Layout)>,
    ) -> Result<(CpuStorage, Shape)> {
        // The layer passes [γ; β] in the accumulation dtype: f32, or f64 for f64 inputs.
        let p: Vec<f64> = match params.0 {
            CpuStorage::F32(_) => slice::<f32>(OP, params.0, params.1)?
                .iter()
                .map(|&v| v as f64)
                .collect(),
            CpuStorage::F64(_) => slice::<f64>(OP, params.0, params.1)?.to_vec(),
            s => candle_core::bail!(
                "{OP}: weight and bias reach the op as f32 or f64, got {:?}",
                s.dtype()
            ),
        };
        let coef = ApplyCoef::from_tensors(&self.mean, &self.invstd, Some(&p))?;
        let out = apply_cpu(x.0, x.1, z, &self.geometry, &coef, self.relu)?;
        Ok((out, x.1.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn forward_cuda(
        &self,
        x: (&candle_core::CudaStorage, &Layout),
        params: (&candle_core::CudaStorage, &Layout),
        z: Option<(&candle_core::CudaStorage, &Layout)>,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let out = super::apply::apply_cuda(
            x,
            z,
            &self.geometry,
            &self.mean,
            &self.invstd,
            Some(params),
            self.relu,
        )?;
        Ok((out, x.1.shape().clone()))
    }

    /// Gradients of x, [γ; β] and z.
    fn backward(
        &self,
        x: &Tensor,
        params: &Tensor,
        has_z: bool,
        y: &Tensor,
        dy: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let cl = self.geometry.layout;
        let (mean, invstd) = (&self.mean, &self.invstd);
        let relu_y = self.relu.then_some(y);
        let local = batch_norm_backward_reduce(dy, x, mean, relu_y, cl)?;
        let sums = match (&self.reduce, self.batch_stats) {
            // Called on every rank, whatever its local batch: for an all-reduce, the others
            // wait for it.
            (Some(reduce), _) => reduce(&local)?,
            (None, true) => local.clone(),
            (None, false) => local.zeros_like()?,
        };
        let weight = params.get(0)?;
        let want_dz = has_z && self.relu;
        let (dx, dz) = batch_norm_backward_elemt(
            dy,
            x,
            mean,
            invstd,
            Some(&weight),
            &sums,
            &self.count,
            relu_y,
            want_dz,
            cl,
        )?;
        let dz = match (has_z, dz) {
            (false, _) => None,
            (true, Some(dz)) => Some(dz),
            (true, None) => Some(dy.clone()),
        };
        let dparams = if self.affine {
            let dgamma = (local.get(1)? * invstd)?;
            let dbeta = local.get(0)?;
            Some(Tensor::stack(&[dgamma, dbeta], 0)?.to_dtype(params.dtype())?)
        } else {
            None
        };
        Ok((Some(dx), dparams, dz))
    }
}

impl OptionalLast for NormFn {
    const REQUIRED: usize = 2;
    const NAMES: [&'static str; 2] = ["sync-batch-norm", "sync-batch-norm-residual"];

    fn cpu(&self, inputs: &[CpuIn<'_>], z: Option<CpuIn<'_>>) -> Result<(CpuStorage, Shape)> {
        self.forward(inputs[0], inputs[1], z)
    }

    #[cfg(feature = "cuda")]
    fn cuda(
        &self,
        inputs: &[CudaIn<'_>],
        z: Option<CudaIn<'_>>,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        self.forward_cuda(inputs[0], inputs[1], z)
    }

    fn bwd(
        &self,
        inputs: &[&Tensor],
        z: Option<&Tensor>,
        res: &Tensor,
        grad: &Tensor,
    ) -> Result<Grads> {
        let (dx, dp, dz) = self.backward(inputs[0], inputs[1], z.is_some(), res, grad)?;
        Ok((vec![dx, dp], dz))
    }
}

/// Constant `[1; 0]` parameters for a layer without affine parameters, `[2, C]` f32.
fn identity_params(c: usize, dev: &candle_core::Device) -> Result<Tensor> {
    Tensor::stack(
        &[
            Tensor::ones(c, DType::F32, dev)?,
            Tensor::zeros(c, DType::F32, dev)?,
        ],
        0,
    )
}
