//! Normalisation: `y = act((x − mean)·γ·invstd + β + z)`, with an optional residual `z` and an
//! optional fused ReLU.

use candle_core::backend::BackendStorage;
use candle_core::{bail, CpuStorage, DType, Layout, Result, Shape, Tensor};

#[cfg(feature = "cuda")]
use super::arity::CudaIn;
use super::arity::{self, AnyArity, CpuIn};
use super::{acc_dtype, check_device, check_same_shape, per_channel_f64, OP};
use std::mem::MaybeUninit;

use crate::device::cpu::{self, elementwise, simd_fn, slice, split, written, Elem, Real};
use crate::device::Geometry;

/// Per-channel coefficients of the normalisation, on the host.
#[derive(Debug, Clone)]
pub(crate) struct ApplyCoef {
    /// Mean to subtract (f64: split into hi + lo for f32 arithmetic).
    pub mean: Vec<f64>,
    /// `γ · invstd`.
    pub scale: Vec<f64>,
    /// `β`.
    pub shift: Vec<f64>,
}

impl ApplyCoef {
    /// Coefficients from mean, invstd and optional affine parameters (`None` = 1 and 0).
    pub fn new(
        mean: Vec<f64>,
        invstd: &[f64],
        weight: Option<&[f64]>,
        bias: Option<&[f64]>,
    ) -> Self {
        let scale = match weight {
            Some(w) => w.iter().zip(invstd).map(|(w, s)| w * s).collect(),
            None => invstd.to_vec(),
        };
        let shift = bias.map_or_else(|| vec![0.0; mean.len()], <[f64]>::to_vec);
        Self { mean, scale, shift }
    }

    /// Coefficients from CPU tensors `mean`, `invstd` (`[C]` f64) and `γ`, `β` (`C` values
    /// each, or `None` for 1 and 0).
    pub fn from_tensors(
        mean: &Tensor,
        invstd: &Tensor,
        weight: Option<&[f64]>,
        bias: Option<&[f64]>,
    ) -> Result<Self> {
        Ok(Self::new(
            mean.to_vec1::<f64>()?,
            &invstd.to_vec1::<f64>()?,
            weight,
            bias,
        ))
    }
}

#[inline(always)]
fn act<R: Real, const RELU: bool>(v: R) -> R {
    if RELU && v < R::ZERO {
        R::ZERO
    } else {
        v
    }
}

/// `act(((x − h) − l)·s + b [+ z])` for one value.
#[inline(always)]
fn norm<T: Elem, const RELU: bool>(x: T, z: T::R, [h, l, s, b]: [T::R; 4]) -> T {
    T::store(act::<_, RELU>(((x.load() - h) - l) * s + b + z))
}

#[inline(always)]
fn plane_apply_act<T: Elem, const RELU: bool>(
    x: &[T],
    z: Option<&[T]>,
    o: &mut [MaybeUninit<T>],
    coef: [T::R; 4],
) {
    match z {
        None => o
            .iter_mut()
            .zip(x)
            .for_each(|(o, x)| _ = o.write(norm::<T, RELU>(*x, T::R::ZERO, coef))),
        Some(z) => o
            .iter_mut()
            .zip(x)
            .zip(z)
            .for_each(|((o, x), z)| _ = o.write(norm::<T, RELU>(*x, z.load(), coef))),
    }
}

simd_fn! {
    /// One channels-first segment with its channel's `[mean hi, mean lo, γ·invstd, β]`.
    fn plane_apply<T: Elem>(x: &[T], z: Option<&[T]>, o: &mut [MaybeUninit<T>], coef: [T::R; 4], relu: bool) -> () {
        if relu {
            plane_apply_act::<T, true>(x, z, o, coef)
        } else {
            plane_apply_act::<T, false>(x, z, o, coef)
        }
    }
}

#[inline(always)]
fn rows_apply_act<T: Elem, const RELU: bool>(
    x: &[T],
    z: Option<&[T]>,
    o: &mut [MaybeUninit<T>],
    [h, l, s, b]: [&[T::R]; 4],
) {
    let c = h.len();
    let coef = h
        .iter()
        .zip(l)
        .zip(s)
        .zip(b)
        .map(|(((h, l), s), b)| [*h, *l, *s, *b]);
    for (r, (o, x)) in o.chunks_exact_mut(c).zip(x.chunks_exact(c)).enumerate() {
        match z {
            None => o
                .iter_mut()
                .zip(x)
                .zip(coef.clone())
                .for_each(|((o, x), k)| _ = o.write(norm::<T, RELU>(*x, T::R::ZERO, k))),
            Some(z) => {
                let z = &z[r * c..(r + 1) * c];
                o.iter_mut()
                    .zip(x)
                    .zip(z)
                    .zip(coef.clone())
                    .for_each(|(((o, x), z), k)| _ = o.write(norm::<T, RELU>(*x, z.load(), k)))
            }
        }
    }
}

simd_fn! {
    /// Channels-last rows (`rows × C`) with per-channel `[mean hi, mean lo, γ·invstd, β]`.
    fn rows_apply<T: Elem>(x: &[T], z: Option<&[T]>, o: &mut [MaybeUninit<T>], coef: [&[T::R]; 4], relu: bool) -> () {
        if relu {
            rows_apply_act::<T, true>(x, z, o, coef)
        } else {
            rows_apply_act::<T, false>(x, z, o, coef)
        }
    }
}

/// Applies the normalisation to a contiguous input. `z`: residual of the same shape and dtype.
pub(crate) fn apply_cpu(
    xs: &CpuStorage,
    xl: &Layout,
    z: Option<(&CpuStorage, &Layout)>,
    g: &Geometry,
    coef: &ApplyCoef,
    relu: bool,
) -> Result<CpuStorage> {
    fn run<T: Elem>(x: &[T], z: Option<&[T]>, g: &Geometry, k: &ApplyCoef, relu: bool) -> Vec<T> {
        let c = g.c;
        let (mh, ml): (Vec<T::R>, Vec<T::R>) = k.mean.iter().map(|&m| split::<T::R>(m)).unzip();
        let sc: Vec<T::R> = k.scale.iter().map(|&v| T::R::from_f64(v)).collect();
        type Out<'a, T> = &'a mut [MaybeUninit<T>];
        let be: Vec<T::R> = k.shift.iter().map(|&v| T::R::from_f64(v)).collect();
        let plane = |ch: usize, lo: usize, hi: usize, o: Out<T>, _: Option<Out<T>>| {
            let coef = [mh[ch], ml[ch], sc[ch], be[ch]];
            plane_apply(&x[lo..hi], z.map(|z| &z[lo..hi]), o, coef, relu)
        };
        let rows = |lo: usize, hi: usize, o: Out<T>, _: Option<Out<T>>| {
            let span = lo * c..hi * c;
            let coef = [&mh[..], &ml, &sc, &be];
            rows_apply(&x[span.clone()], z.map(|z| &z[span]), o, coef, relu)
        };
        written(x.len(), |out| elementwise(g, out, None, plane, rows))
    }
    fn go<T: Elem>(
        (xs, xl): (&CpuStorage, &Layout),
        z: Option<(&CpuStorage, &Layout)>,
        g: &Geometry,
        coef: &ApplyCoef,
        relu: bool,
    ) -> Result<CpuStorage> {
        let x = slice::<T>(OP, xs, xl)?;
        let z = z.map(|(zs, zl)| slice::<T>(OP, zs, zl)).transpose()?;
        Ok(T::to_cpu_storage_owned(run(x, z, g, coef, relu)))
    }
    if let Some((zs, _)) = z {
        if zs.dtype() != xs.dtype() {
            bail!(
                "{OP}: residual dtype {:?} differs from input dtype {:?}",
                zs.dtype(),
                xs.dtype()
            )
        }
    }
    cpu::dispatch!(
        format!("{OP} apply"),
        xs.dtype(),
        go((xs, xl), z, g, coef, relu)
    )
}

/// `bn_apply_{nchw,nhwc}_<dtype>` of `kernels/apply.cu` on a contiguous input.
///
/// `mean`, `invstd`: `[C]` f64 views; `weight`, `bias`: `[C]` each in the accumulation dtype
/// (f64 for f64 inputs, else f32), or `None` (1 and 0); two rows of one `[2, C]` storage serve.
#[cfg(feature = "cuda")]
pub(crate) fn apply_cuda(
    x: CudaIn<'_>,
    z: Option<CudaIn<'_>>,
    g: &Geometry,
    mean: &Tensor,
    invstd: &Tensor,
    [weight, bias]: [Option<CudaIn<'_>>; 2],
    relu: bool,
) -> Result<candle_core::CudaStorage> {
    use crate::device::cuda::{dispatch, view, Aux, Buffers};
    use crate::kernels::args::Apply;
    use crate::kernels::{launch, KernelElem, Module};
    use candle_core::CudaStorage;

    fn run<T: KernelElem>(
        x: (&CudaStorage, &Layout),
        z: Option<(&CudaStorage, &Layout)>,
        g: &Geometry,
        mean: &Tensor,
        invstd: &Tensor,
        [weight, bias]: [Option<CudaIn<'_>>; 2],
        relu: bool,
    ) -> Result<CudaStorage> {
        let dev = &x.0.device;
        let (mean, invstd) = (
            Aux::of(OP, mean, dev, DType::F64, "mean")?,
            Aux::of(OP, invstd, dev, DType::F64, "invstd")?,
        );
        let (mean, invstd) = (mean.view::<f64>("mean")?, invstd.view::<f64>("invstd")?);
        let xv = view::<T>(OP, x.0, x.1, "input")?;
        let zv = z
            .map(|(s, l)| view::<T>(OP, s, l, "residual"))
            .transpose()?;
        let wv = weight
            .map(|(s, l)| view::<T::Acc>(OP, s, l, "weight"))
            .transpose()?;
        let bv = bias
            .map(|(s, l)| view::<T::Acc>(OP, s, l, "bias"))
            .transpose()?;
        // SAFETY: the kernel writes every element of y.
        let mut y = unsafe { dev.alloc::<T>(g.len())? };
        let stream = dev.cuda_stream();
        let mut b = Buffers::on(&stream);
        let call = Apply {
            x: b.read(&xv),
            z: zv.as_ref().map(|v| b.read(v)),
            mean: b.read(&mean),
            invstd: b.read(&invstd),
            weight: wv.as_ref().map(|v| b.read(v)),
            bias: bv.as_ref().map(|v| b.read(v)),
            y: b.write(&mut y),
            relu,
        }
        .call(OP, x.0.dtype(), &g.contiguous_channels_as_rows())?;
        launch(dev, Module::Apply, call, b)?;
        Ok(CudaStorage::wrap_cuda_slice(y, dev.clone()))
    }
    dispatch!(
        OP,
        x.0.dtype(),
        run(x, z, g, mean, invstd, [weight, bias], relu)
    )
}

/// Normalisation with statistics and parameters held by the op (no autograd). Inputs `[x]`, or
/// `[x, z]` with a residual.
struct ApplyOp {
    geometry: Geometry,
    /// `[C]` f64 on the input's device.
    mean: Tensor,
    /// `[C]` f64 on the input's device.
    invstd: Tensor,
    /// `γ` and `β`, `[C]` each in the accumulation dtype, or `None` (1 and 0).
    weight: Option<Tensor>,
    bias: Option<Tensor>,
    relu: bool,
}

impl ApplyOp {
    fn coef_cpu(&self) -> Result<ApplyCoef> {
        let host = |t: &Option<Tensor>| -> Result<Option<Vec<f64>>> {
            t.as_ref()
                .map(|t| t.to_dtype(DType::F64)?.to_vec1::<f64>())
                .transpose()
        };
        let (w, b) = (host(&self.weight)?, host(&self.bias)?);
        ApplyCoef::from_tensors(&self.mean, &self.invstd, w.as_deref(), b.as_deref())
    }
}

impl AnyArity for ApplyOp {
    fn name(&self, inputs: usize) -> &'static str {
        match inputs {
            2 => "sync-batch-norm-apply-residual",
            _ => "sync-batch-norm-apply",
        }
    }

    fn cpu(&self, inputs: &[CpuIn<'_>]) -> Result<(CpuStorage, Shape)> {
        let (s, l) = inputs[0];
        let z = inputs.get(1).copied();
        let out = apply_cpu(s, l, z, &self.geometry, &self.coef_cpu()?, self.relu)?;
        Ok((out, l.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda(&self, inputs: &[CudaIn<'_>]) -> Result<(candle_core::CudaStorage, Shape)> {
        let x = inputs[0];
        let dev = &x.0.device;
        let acc = super::acc_dtype(x.0.dtype());
        use crate::device::cuda::Aux;
        let w = (self.weight.as_ref())
            .map(|t| Aux::of(OP, t, dev, acc, "weight"))
            .transpose()?;
        let b = (self.bias.as_ref())
            .map(|t| Aux::of(OP, t, dev, acc, "bias"))
            .transpose()?;
        let out = apply_cuda(
            x,
            inputs.get(1).copied(),
            &self.geometry,
            &self.mean,
            &self.invstd,
            [w.as_ref().map(|w| w.parts()), b.as_ref().map(|b| b.parts())],
            self.relu,
        )?;
        Ok((out, x.1.shape().clone()))
    }
}

/// Normalises `x` with given statistics: `y = act((x − mean)·weight·invstd + bias + residual)`.
///
/// # Arguments
/// * `x` - `(N, C, *)`, or `(N, *, C)` with `ChannelLayout::ChannelsLast`; rank 2 to 5; f32, f64, f16, bf16.
/// * `mean`, `invstd` - `[C]` on `x`'s device (any float dtype; used as f64).
/// * `options` - [`super::ElemtConfig`]: `γ` and `β` (`[C]` or `None`, for 1 and 0), the
///   residual (`x`'s shape and dtype, added before the activation), ReLU, and the layout.
///
/// Returns a tensor of `x`'s shape and dtype. Not differentiable by itself: the
/// [`crate::SyncBatchNorm`] layer wraps this arithmetic in an op with a backward.
///
/// # Errors
///
/// When `x` is not of rank 2 to 5 or its dtype is not f32, f64, f16 or bf16; when `mean`, `invstd`,
/// `weight` or `bias` is not on `x`'s device, not of shape `[C]` or not of a float dtype; when `residual` differs
/// from `x` in shape, dtype or device; on a GPU, when a CUDA allocation or kernel launch fails.
pub fn batch_norm_elemt(
    x: &Tensor,
    mean: &Tensor,
    invstd: &Tensor,
    options: super::ElemtConfig<'_>,
) -> Result<Tensor> {
    let super::ElemtConfig {
        weight,
        bias,
        residual,
        relu,
        layout,
    } = options;
    crate::device::check_supported(OP, x.device())?;
    let geometry = Geometry::of(OP, x.dims(), layout)?;
    let c = geometry.c;
    let dev = x.device();
    for (what, t) in [
        ("mean", Some(mean)),
        ("invstd", Some(invstd)),
        ("weight", weight),
        ("bias", bias),
    ] {
        if let Some(t) = t {
            check_device(what, t, dev)?;
        }
    }
    let acc = acc_dtype(x.dtype());
    let param = |what, t: Option<&Tensor>| {
        t.map(|t| per_channel_f64(what, t, &[c]).and_then(|t| t.to_dtype(acc)))
            .transpose()
    };
    let op = ApplyOp {
        geometry,
        mean: per_channel_f64("mean", mean, &[c])?,
        invstd: per_channel_f64("invstd", invstd, &[c])?,
        weight: param("weight", weight)?,
        bias: param("bias", bias)?,
        relu,
    };
    let x = x.contiguous()?;
    match residual {
        None => arity::apply(op, &[&x], false),
        Some(z) => {
            check_same_shape("residual", x.dims(), z)?;
            arity::apply(op, &[&x, &z.contiguous()?], false)
        }
    }
}
