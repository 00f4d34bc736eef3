//! The layer on a device without the crate's kernels (Metal; CUDA in a build without the
//! `cuda` feature), or on any device when `CANDLE_DISTRIBUTED_COMPOSITE` is set: the same
//! semantics as the kernel path, built from candle's tensor ops so that candle's autograd
//! differentiates it, and one custom op on host tensors (which every build has) for the
//! collectives.
//!
//! Per call, on the input's device in f32 (f64 for f64 inputs, except on Metal, which has no
//! f64): the local mean `m̃` (a constant for autograd, corrected once by the mean of the
//! residuals), `S₁ = Σ(x − m̃)` and `S₂ = Σ(x − m̃)²` per channel. They go to the
//! host as f64, where the shifted sums of the kernel path are assembled with `δ = m̃ − K`:
//!
//! ```text
//! A = S₁ + n·δ = Σ(x − K)        B = S₂ + 2δ·S₁ + n·δ² = Σ(x − K)²
//! ```
//!
//! an identity for any constant `m̃`, so the gradient is exact (`∂B/∂x = 2(x − K)`); and
//! well conditioned for a large mean even on a layer's first step (`K = 0`): the terms in `δ`
//! cancel in f64 in `B − A²/n`, leaving `S₂ − S₁²/n` of small values. The `[3, C]` sums are
//! all-reduced in the graph (backward: the all-reduce of their gradient, `2·C` values), the
//! host finalize of the kernel path turns them into the running statistics and the next
//! shift, and the mean and inverse std are derived from them again with differentiable ops.
//! The normalisation runs on the device as `((x − hi) − lo)·(invstd·γ) + β`, the f64 mean split
//! in two f32 values as on the kernel path, then `+ z` and the ReLU when fused.
//!
//! The price, on this path only: two host round trips per call (the sums up, the statistics
//! down), several passes over the input where the kernels make one, and the input-sized
//! intermediates candle's autograd keeps (about eight in f32, where the kernels keep x and y).

use candle_core::{bail, DType, Device, Result, Tensor, Var};

use super::{SyncBatchNorm, OP};
use crate::device::Geometry;
use crate::ops::attach::attach;
use candle_collective::ReduceOp;

/// The dims the per-channel reductions run over, in the `(rows, C, positions)` view.
const REDUCED: [usize; 2] = [0, 2];

impl SyncBatchNorm {
    /// The layer's forward on the composite path: `x` (contiguous) and `z` already checked
    /// against the layer, `c` channels.
    pub(super) fn forward_composite(
        &self,
        x: &Tensor,
        z: Option<&Tensor>,
        c: usize,
        train: bool,
    ) -> Result<Tensor> {
        let geometry = Geometry::of(OP, x.dims(), self.config.layout)?;
        let acc = crate::ops::acc_dtype(x.dtype());
        if acc == DType::F64 && x.device().is_metal() {
            bail!("{OP}: an f64 input on {:?}: Metal has no f64 arithmetic (use f32, f16 or bf16 there)", x.device())
        }
        // x (and z) in the arithmetic dtype, cast once for the sums and the normalisation.
        let x3 = view3(x, &geometry)?;
        let xa = in_acc(&x3, acc)?;
        let za = match z {
            Some(z) => Some(in_acc(&z.contiguous()?.reshape(x3.dims())?, acc)?),
            None => None,
        };
        let use_batch = train || self.running.is_none();
        if !use_batch {
            let (mean, invstd) = self.running_f64(&Device::Cpu)?;
            return self.normalise_composite(&xa, za.as_ref(), x, &mean, &invstd);
        }
        let (k, done) = self.step_shift(&Device::Cpu, c)?;
        let sums = local_sums(&xa, &geometry, &k)?;
        let sums = if train {
            self.all_reduced(&sums)?
        } else {
            sums
        };
        let (stats, before) = self.finalize(&sums.detach(), &k, train, done, x.device())?;
        self.check_count(&stats, before.as_ref(), x.dims(), train)?;
        let y = statistics(&sums, &k, self.config.eps).and_then(|(mean, invstd)| {
            self.normalise_composite(&xa, za.as_ref(), x, &mean, &invstd)
        });
        self.undo_on_error(y, before.as_ref())
    }

    /// `sums` (`[3, C]` f64 on the host) summed over the ranks, in the graph: the backward
    /// all-reduces the gradient of the two sums' rows (the count row has none). The
    /// collectives run on the communicator's device.
    fn all_reduced(&self, sums: &Tensor) -> Result<Tensor> {
        let comm = self.comm.clone();
        let reduce = move |t: &Tensor| -> Result<Tensor> {
            let t = t.detach().to_device(&comm.device())?;
            comm.all_reduce(&t, ReduceOp::Sum)?.to_device(&Device::Cpu)
        };
        let global = reduce(sums)?;
        attach(
            sums,
            global,
            "sync-batch-norm-sums",
            Box::new(move |grad: &Tensor| {
                // Announced: an overlapped data-parallel backward places its buckets around
                // the collectives of the backward.
                let rows =
                    candle_collective::in_backward::collective(|| reduce(&grad.narrow(0, 1, 2)?))?;
                let none = Tensor::zeros((1, rows.dim(1)?), DType::F64, &Device::Cpu)?;
                Tensor::cat(&[&none, &rows], 0)
            }),
        )
    }

    /// `act(γ·(x − mean)·invstd + β [+ z])` on `x`'s device, from the `[C]` f64 host
    /// statistics (in the graph or constants). `xa` and `za` are `x` and `z` as [`in_acc`]
    /// gives them; the result has `x`'s shape and dtype.
    fn normalise_composite(
        &self,
        xa: &Tensor,
        za: Option<&Tensor>,
        x: &Tensor,
        mean: &Tensor,
        invstd: &Tensor,
    ) -> Result<Tensor> {
        let (dev, acc, c) = (x.device(), xa.dtype(), xa.dim(1)?);
        // The mean as hi + lo: `x − hi` is exact in f32 when |mean| ≫ std.
        let hi = mean.to_dtype(acc)?;
        let lo = (mean - hi.to_dtype(DType::F64)?)?.to_dtype(acc)?;
        let per = Tensor::stack(&[&hi, &lo, &invstd.to_dtype(acc)?], 0)?
            .to_device(dev)?
            .reshape((3, 1, c, 1))?;
        let param = |p: Option<&Tensor>| -> Result<Option<Tensor>> {
            p.map(|p| p.to_dtype(acc)?.reshape((1, c, 1))).transpose()
        };
        let mut scale = per.get(2)?;
        if let Some(w) = param(self.weight.as_ref())? {
            scale = (scale * w)?;
        }
        // candle's element-wise ops hand an empty operand back as it is, without a graph node:
        // for an empty batch the arithmetic runs on its per-channel sums (zeros, but in the
        // graph of x and z) and the result is broadcast to the empty shape, so that the
        // backward reaches x, z, the parameters and the statistics (and with them the
        // all-reduce of their gradient, which every rank must join).
        let empty = x.elem_count() == 0;
        let mut y = xa
            .broadcast_sub(&per.get(0)?)?
            .broadcast_sub(&per.get(1)?)?
            .broadcast_mul(&scale)?;
        if let Some(b) = param(self.bias.as_ref())? {
            y = y.broadcast_add(&b)?;
        }
        if let Some(z) = za {
            y = (y + z)?;
        }
        if self.config.fuse_relu {
            // Not candle's `relu`, whose gradient passes where its input is 0: the kernels'
            // (and PyTorch's) passes only where the output is positive, which matters for a
            // channel whose pre-activation is exactly 0 (a dead channel at β = 0).
            y = y.gt(0.0)?.where_cond(&y, &y.zeros_like()?)?;
        }
        let y = y.to_dtype(x.dtype())?;
        if empty {
            let mut per_channel = vec![1; x.rank()];
            let at = match self.config.layout.is_channels_last() {
                true => x.rank() - 1,
                false => 1,
            };
            per_channel[at] = c;
            y.reshape(per_channel)?.broadcast_as(x.dims())
        } else {
            y.reshape(x.dims())
        }
    }
}

/// `t` (in the `(rows, C, positions)` view) in the arithmetic dtype `acc`; an empty `t` as its
/// per-channel sums `(1, C, 1)`, zeros in the graph of `t`: candle's element-wise ops hand an
/// empty operand back without a graph node, and its CUDA casts refuse an empty tensor.
fn in_acc(t: &Tensor, acc: DType) -> Result<Tensor> {
    if t.elem_count() == 0 {
        t.sum_keepdim(REDUCED)?.to_dtype(acc)
    } else {
        t.to_dtype(acc)
    }
}

/// `x` (contiguous) as `(rows, C, positions)`: `(N, C, S)` channels-first, `(N·S, C, 1)`
/// channels-last, so that one per-channel shape `(1, C, 1)` serves both layouts.
fn view3(x: &Tensor, g: &Geometry) -> Result<Tensor> {
    if g.layout.is_channels_last() {
        x.reshape((g.n * g.s, g.c, 1))
    } else {
        x.reshape((g.n, g.c, g.s))
    }
}

/// This rank's `[3, C]` f64 host sums, rows as [`crate::ops::batch_norm_stats`]'s (count,
/// `Σ(x − K)`, `Σ(x − K)²`), in the graph of `x3` (see the module's text): `x3` as [`in_acc`]
/// gives it (per-channel zeros for an empty batch, `g.count()` then 0).
fn local_sums(x3: &Tensor, g: &Geometry, k: &Tensor) -> Result<Tensor> {
    let n = g.count();
    // The local mean, a constant of the graph (0 for an empty batch), corrected once by the
    // mean of the residuals: the device sums are f32 (candle's CPU sums them one by one), and
    // the closer m̃ is to the mean, the fewer digits `Σ(x − m̃)²` loses.
    let per = 1.0 / n.max(1) as f64;
    let m0 = (x3.sum_keepdim(REDUCED)? * per)?.detach();
    let mt = (&m0 + (x3.broadcast_sub(&m0)?.sum_keepdim(REDUCED)? * per)?)?.detach();
    let d = x3.broadcast_sub(&mt)?;
    let s1 = d.sum_keepdim(REDUCED)?;
    let s2 = d.sqr()?.sum_keepdim(REDUCED)?;
    let host = Tensor::cat(&[&mt, &s1, &s2], 0)?
        .reshape((3, g.c))?
        .to_device(&Device::Cpu)?
        .to_dtype(DType::F64)?;
    let (mt, s1, s2) = (host.get(0)?.detach(), host.get(1)?, host.get(2)?);
    let n = n as f64;
    let delta = (mt - k)?;
    let a = (&s1 + (&delta * n)?)?;
    let b = ((s2 + (s1 * (&delta * 2.0)?)?)? + (delta.sqr()? * n)?)?;
    let count = Tensor::full(n, g.c, &Device::Cpu)?;
    // Plus a zero variable: the sums are always in the graph, so that the backward reaches the
    // all-reduce of their gradient on every rank, also where `x` is not in the graph on this
    // rank only (an empty batch made by candle ops that hand an empty operand back untracked).
    let always = Var::zeros(1, DType::F64, &Device::Cpu)?;
    Tensor::stack(&[&count, &a, &b], 0)?.broadcast_add(always.as_tensor())
}

/// The mean and inverse std (`[C]` f64 on the host) of shifted sums, in the graph of `sums`:
/// the arithmetic of the finalize (`M2 = max(B − A·A/n, 0)`, the biased variance).
fn statistics(sums: &Tensor, k: &Tensor, eps: f64) -> Result<(Tensor, Tensor)> {
    let n = sums.get(0)?.detach().clamp(1.0, f64::INFINITY)?;
    let (a, b) = (sums.get(1)?, sums.get(2)?);
    let d = (a.clone() / &n)?;
    let m2 = (b - (a * &d)?)?.relu()?;
    let invstd = ((m2 / n)? + eps)?.sqrt()?.recip()?;
    Ok(((k + d)?, invstd))
}
