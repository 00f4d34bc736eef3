//! Second pass of the backward: `dx = γ·invstd·(g − S1/n − (x − mean)·invstd²·S2/n)` and,
//! with a residual, `dz = g`, written in one pass.

use candle_core::backend::BackendStorage;
use candle_core::{bail, CpuStorage, DType, Layout, Result, Shape, Tensor};

#[cfg(feature = "cuda")]
use super::arity::CudaIn;
use super::arity::{self, AnyArity, CpuIn};
use super::{acc_dtype, backward_slices, check_device, check_same_shape, per_channel_f64, OP};
use std::mem::MaybeUninit;

use crate::device::cpu::{self, elementwise, simd_fn, split, written, Elem, Real};
use crate::device::Geometry;

/// Per-channel coefficients: `dx = a·(g − b − (x − mean)·k)`.
#[derive(Debug, Clone)]
struct ElemtCoef {
    pub mean: Vec<f64>,
    /// `γ · invstd`.
    pub a: Vec<f64>,
    /// `S1 / n`.
    pub b: Vec<f64>,
    /// `invstd² · S2 / n`.
    pub k: Vec<f64>,
}

impl ElemtCoef {
    /// From the statistics, the optional weight and the summed reductions `sums` (`[S1.., S2..]`,
    /// `2·C`; all zeros when the statistics are constants, as in eval mode).
    pub fn new(
        mean: Vec<f64>,
        invstd: &[f64],
        weight: Option<&[f64]>,
        sums: &[f64],
        count: &[f64],
    ) -> Self {
        let c = mean.len();
        let a = (0..c)
            .map(|j| weight.map_or(1.0, |w| w[j]) * invstd[j])
            .collect();
        // A channel without values anywhere (n = 0) gets no correction terms, as on CUDA.
        let per_n = |j: usize, v: f64| if count[j] > 0.0 { v / count[j] } else { 0.0 };
        let b = (0..c).map(|j| per_n(j, sums[j])).collect();
        let k = (0..c)
            .map(|j| per_n(j, invstd[j] * invstd[j] * sums[c + j]))
            .collect();
        Self { mean, a, b, k }
    }

    /// From the CPU tensors an op holds.
    fn from_op(op: &BackwardElemtOp) -> Result<Self> {
        let weight = match &op.weight {
            Some(w) => Some(w.to_dtype(DType::F64)?.to_vec1::<f64>()?),
            None => None,
        };
        Ok(Self::new(
            op.mean.to_vec1::<f64>()?,
            &op.invstd.to_vec1::<f64>()?,
            weight.as_deref(),
            &op.sums.flatten_all()?.to_vec1::<f64>()?,
            &op.count.to_vec1::<f64>()?,
        ))
    }
}

/// `g = dy`, or `0` where `y ≤ 0` when `MASK` (ReLU's derivative; NaN passes, as in PyTorch).
#[inline(always)]
fn grad<T: Elem, const MASK: bool>(dy: &T, y: &T) -> T::R {
    // Both values loaded first, then a select: the compiler keeps the loop vectorized (a load
    // under the condition made it a branch per value, mispredicted half the time).
    let (g, off) = (dy.load(), MASK && y.load() <= T::R::ZERO);
    if off {
        T::R::ZERO
    } else {
        g
    }
}

/// `(dx, g)` of one value with `[mean hi, mean lo, a, b, k]`: `dx = a·((g − b) − (x − h − l)·k)`.
#[inline(always)]
fn dx_of<T: Elem, const MASK: bool>(dy: &T, x: &T, y: &T, [h, l, a, b, k]: [T::R; 5]) -> (T, T::R) {
    let gv = grad::<T, MASK>(dy, y);
    (T::store(a * ((gv - b) - ((x.load() - h) - l) * k)), gv)
}

/// One span with per-value coefficients from `coef`; without a mask `dy` stands in for `y`.
#[inline(always)]
fn span<T: Elem, const MASK: bool>(
    (dy, x, y): (&[T], &[T], &[T]),
    o: &mut [MaybeUninit<T>],
    oz: Option<&mut [MaybeUninit<T>]>,
    coef: impl Iterator<Item = [T::R; 5]>,
) {
    let it = dy.iter().zip(x).zip(y).zip(coef);
    match oz {
        None => o
            .iter_mut()
            .zip(it)
            .for_each(|(o, (((d, x), y), k))| _ = o.write(dx_of::<T, MASK>(d, x, y, k).0)),
        Some(oz) => {
            o.iter_mut()
                .zip(oz.iter_mut())
                .zip(it)
                .for_each(|((o, oz), (((d, x), y), k))| {
                    let (v, gv) = dx_of::<T, MASK>(d, x, y, k);
                    o.write(v);
                    oz.write(T::store(gv));
                })
        }
    }
}

simd_fn! {
    /// dx (and dz = g into `oz`) of one channels-first segment with its channel's coefficients.
    fn plane_elemt<T: Elem>(dy: &[T], x: &[T], y: Option<&[T]>, o: &mut [MaybeUninit<T>], oz: Option<&mut [MaybeUninit<T>]>, coef: [T::R; 5]) -> () {
        let k = std::iter::repeat(coef);
        match y {
            None => span::<T, false>((dy, x, dy), o, oz, k),
            Some(y) => span::<T, true>((dy, x, y), o, oz, k),
        }
    }
}

simd_fn! {
    /// dx (and dz) of channels-last rows (`rows × C`) with per-channel coefficients.
    fn rows_elemt<T: Elem>(dy: &[T], x: &[T], y: Option<&[T]>, o: &mut [MaybeUninit<T>], oz: Option<&mut [MaybeUninit<T>]>, coef: [&[T::R]; 5]) -> () {
        let mut oz = oz;
        let [h, l, a, b, k] = coef;
        let c = h.len();
        let per_channel = h.iter().zip(l).zip(a).zip(b).zip(k).map(|((((h, l), a), b), k)| [*h, *l, *a, *b, *k]);
        for (r, o) in o.chunks_exact_mut(c).enumerate() {
            let s = r * c..(r + 1) * c;
            let oz = oz.as_deref_mut().map(|oz| &mut oz[s.clone()]);
            match y {
                None => span::<T, false>((&dy[s.clone()], &x[s.clone()], &dy[s]), o, oz, per_channel.clone()),
                Some(y) => span::<T, true>((&dy[s.clone()], &x[s.clone()], &y[s]), o, oz, per_channel.clone()),
            }
        }
    }
}

/// Writes dx (and dz = g when `want_dz`) of contiguous inputs. Returns one storage: `dx`, or
/// `[dx; dz]` concatenated (`2 × len`).
fn backward_elemt_cpu(
    dy: (&CpuStorage, &Layout),
    x: (&CpuStorage, &Layout),
    y: Option<(&CpuStorage, &Layout)>,
    g: &Geometry,
    coef: &ElemtCoef,
    want_dz: bool,
) -> Result<CpuStorage> {
    fn run<T: Elem>(
        dy: &[T],
        x: &[T],
        y: Option<&[T]>,
        g: &Geometry,
        k: &ElemtCoef,
        want_dz: bool,
    ) -> Vec<T> {
        let c = g.c;
        let len = x.len();
        let (mh, ml): (Vec<T::R>, Vec<T::R>) = k.mean.iter().map(|&m| split::<T::R>(m)).unzip();
        let cv = |v: &[f64]| -> Vec<T::R> { v.iter().map(|&v| T::R::from_f64(v)).collect() };
        let (ca, cb, ck) = (cv(&k.a), cv(&k.b), cv(&k.k));
        type Out<'a, T> = &'a mut [MaybeUninit<T>];
        let plane = |ch: usize, lo: usize, hi: usize, o: Out<T>, oz: Option<Out<T>>| {
            let r = lo..hi;
            let coef = [mh[ch], ml[ch], ca[ch], cb[ch], ck[ch]];
            plane_elemt(&dy[r.clone()], &x[r.clone()], y.map(|y| &y[r]), o, oz, coef)
        };
        let rows = |lo: usize, hi: usize, o: Out<T>, oz: Option<Out<T>>| {
            let r = lo * c..hi * c;
            let coef = [&mh[..], &ml, &ca, &cb, &ck];
            rows_elemt(&dy[r.clone()], &x[r.clone()], y.map(|y| &y[r]), o, oz, coef)
        };
        written(if want_dz { 2 * len } else { len }, |out| {
            let (dx, dz) = out.split_at_mut(len);
            elementwise(g, dx, want_dz.then_some(dz), plane, rows)
        })
    }
    fn go<T: Elem>(
        dy: (&CpuStorage, &Layout),
        x: (&CpuStorage, &Layout),
        y: Option<(&CpuStorage, &Layout)>,
        g: &Geometry,
        coef: &ElemtCoef,
        want_dz: bool,
    ) -> Result<CpuStorage> {
        let (d, xs, y) = backward_slices::<T>(dy, x, y)?;
        Ok(T::to_cpu_storage_owned(run(d, xs, y, g, coef, want_dz)))
    }
    cpu::dispatch!(
        format!("{OP} backward"),
        x.0.dtype(),
        go(dy, x, y, g, coef, want_dz)
    )
}

/// `bn_backward_elemt_{nchw,nhwc}_<dtype>` of `kernels/backward_elemt.cu`: dx, then dz when
/// `want_dz`, in one buffer.
#[cfg(feature = "cuda")]
fn backward_elemt_cuda(
    dy: (&candle_core::CudaStorage, &Layout),
    x: (&candle_core::CudaStorage, &Layout),
    y: Option<(&candle_core::CudaStorage, &Layout)>,
    op: &BackwardElemtOp,
) -> Result<candle_core::CudaStorage> {
    use crate::device::cuda::{dispatch, view, Aux, Buffers};
    use crate::kernels::args::BackwardElemt;
    use crate::kernels::{launch, KernelElem, Module};
    use candle_core::CudaStorage;

    fn run<T: KernelElem>(
        dy: (&CudaStorage, &Layout),
        x: (&CudaStorage, &Layout),
        y: Option<(&CudaStorage, &Layout)>,
        op: &BackwardElemtOp,
    ) -> Result<CudaStorage> {
        let dev = &x.0.device;
        let f64_aux = |t, what| Aux::of(OP, t, dev, DType::F64, what);
        let (mean, invstd) = (f64_aux(&op.mean, "mean")?, f64_aux(&op.invstd, "invstd")?);
        let (sums, count) = (f64_aux(&op.sums, "sums")?, f64_aux(&op.count, "count")?);
        let acc = super::acc_dtype(x.0.dtype());
        let weight = op
            .weight
            .as_ref()
            .map(|w| Aux::of(OP, w, dev, acc, "weight"))
            .transpose()?;
        let (mean, invstd) = (mean.view::<f64>("mean")?, invstd.view::<f64>("invstd")?);
        let (sums, count) = (sums.view::<f64>("sums")?, count.view::<f64>("count")?);
        let wv = weight
            .as_ref()
            .map(|w| w.view::<T::Acc>("weight"))
            .transpose()?;
        let dyv = view::<T>(OP, dy.0, dy.1, "gradient")?;
        let xv = view::<T>(OP, x.0, x.1, "input")?;
        let yv = y
            .map(|(s, l)| view::<T>(OP, s, l, "relu output"))
            .transpose()?;
        let g = &op.geometry;
        let len = g.len();
        // SAFETY: the kernel writes every element of dx, and of dz when asked.
        let mut out = unsafe { dev.alloc::<T>(if op.want_dz { 2 * len } else { len })? };
        {
            let (mut dx, mut dz) = out.split_at_mut(len);
            let stream = dev.cuda_stream();
            let mut b = Buffers::on(&stream);
            let call = BackwardElemt {
                dy: b.read(&dyv),
                x: b.read(&xv),
                y: yv.as_ref().map(|v| b.read(v)),
                mean: b.read(&mean),
                invstd: b.read(&invstd),
                weight: wv.as_ref().map(|v| b.read(v)),
                sums: b.read(&sums),
                count: b.read(&count),
                dx: b.write(&mut dx),
                dz: op.want_dz.then(|| b.write(&mut dz)),
            }
            .call(OP, x.0.dtype(), &g.contiguous_channels_as_rows())?;
            launch(dev, Module::BackwardElemt, call, b)?;
        }
        Ok(CudaStorage::wrap_cuda_slice(out, dev.clone()))
    }
    dispatch!(OP, x.0.dtype(), run(dy, x, y, op))
}

/// The backward element-wise op; per-channel tensors on the input's device.
struct BackwardElemtOp {
    geometry: Geometry,
    /// `[C]` f64.
    mean: Tensor,
    /// `[C]` f64.
    invstd: Tensor,
    /// `[C]` in the accumulation dtype, or `None` (1).
    weight: Option<Tensor>,
    /// `[2, C]` f64, all-reduced `[Σg, Σg·(x − mean)]`.
    sums: Tensor,
    /// `[C]` f64, the global count.
    count: Tensor,
    want_dz: bool,
}

impl BackwardElemtOp {
    fn shape(&self, l: &Layout) -> Shape {
        let mut dims = l.dims().to_vec();
        if self.want_dz {
            dims.insert(0, 2);
        }
        Shape::from(dims)
    }
}

/// Inputs `[dy, x]`, or `[dy, x, y]` with the fused ReLU's output.
impl AnyArity for BackwardElemtOp {
    fn name(&self, inputs: usize) -> &'static str {
        match inputs {
            3 => "sync-batch-norm-backward-elemt-relu",
            _ => "sync-batch-norm-backward-elemt",
        }
    }

    fn cpu(&self, inputs: &[CpuIn<'_>]) -> Result<(CpuStorage, Shape)> {
        let coef = ElemtCoef::from_op(self)?;
        let y = inputs.get(2).copied();
        let out = backward_elemt_cpu(inputs[0], inputs[1], y, &self.geometry, &coef, self.want_dz)?;
        Ok((out, self.shape(inputs[1].1)))
    }

    #[cfg(feature = "cuda")]
    fn cuda(&self, inputs: &[CudaIn<'_>]) -> Result<(candle_core::CudaStorage, Shape)> {
        let out = backward_elemt_cuda(inputs[0], inputs[1], inputs.get(2).copied(), self)?;
        Ok((out, self.shape(inputs[1].1)))
    }
}

/// Input gradient of batch normalisation (and of the residual, when asked).
///
/// # Arguments
/// * `dy` - gradient of the output, shape and dtype of `x`.
/// * `x` - `(N, C, *)`, or `(N, *, C)` with `ChannelLayout::ChannelsLast`.
/// * `mean`, `invstd` - `[C]`, the statistics used in the forward.
/// * `sums` - `[2, C]`: `[Σg, Σg·(x − mean)]` summed over **all ranks** (from
///   [`super::batch_norm_backward_reduce`] and an all-reduce). Pass zeros when the statistics
///   were constants (eval with running statistics): then `dx = g·γ·invstd`.
/// * `count` - values per channel in the global batch (`n`): one value, or `[C]` (as
///   [`super::BatchStats::count`]).
/// * `options` - [`super::BackwardElemtConfig`]: `γ` (`[C]` or `None`, for 1), the forward
///   output when ReLU was fused, whether to return `dz = g` (the residual's gradient), and the
///   layout.
///
/// Every per-channel tensor lives on `x`'s device; nothing is read back to the host.
/// Returns `(dx, dz)`: `dx` of `x`'s shape and dtype; `dz` the same when `want_dz`.
///
/// # Errors
///
/// When `x` is not of rank 2 to 5 or its dtype is not f32, f64, f16 or bf16; when `dy` or
/// `relu_output` differs from `x` in shape, dtype or device; when `mean`, `invstd`, `weight`,
/// `sums` or `count` is not on `x`'s device or of the wrong shape (`[C]` each, `[2, C]` for
/// `sums`, one value or `[C]` for `count`) or not of a float dtype; on a GPU, when a CUDA allocation or kernel launch fails.
pub fn batch_norm_backward_elemt(
    dy: &Tensor,
    x: &Tensor,
    mean: &Tensor,
    invstd: &Tensor,
    sums: &Tensor,
    count: &Tensor,
    options: super::BackwardElemtConfig<'_>,
) -> Result<(Tensor, Option<Tensor>)> {
    let super::BackwardElemtConfig {
        weight,
        relu_output,
        want_dz,
        layout,
    } = options;
    crate::device::check_supported(OP, dy.device())?;
    let geometry = Geometry::of(OP, x.dims(), layout)?;
    let c = geometry.c;
    check_same_shape("gradient", x.dims(), dy)?;
    let dev = x.device();
    for (what, t) in [
        ("mean", Some(mean)),
        ("invstd", Some(invstd)),
        ("weight", weight),
        ("sums", Some(sums)),
        ("count", Some(count)),
    ] {
        if let Some(t) = t {
            check_device(what, t, dev)?;
        }
    }
    let count = match count.elem_count() {
        1 if !count.dtype().is_float() => {
            bail!(
                "{OP}: expected count in a float dtype, got {:?}",
                count.dtype()
            )
        }
        1 => count
            .flatten_all()?
            .to_dtype(DType::F64)?
            .broadcast_as(c)?
            .contiguous()?,
        _ => per_channel_f64("count", count, &[c])?,
    };
    let weight = weight
        .map(|w| per_channel_f64("weight", w, &[c]).and_then(|w| w.to_dtype(acc_dtype(x.dtype()))))
        .transpose()?;
    let op = BackwardElemtOp {
        geometry,
        mean: per_channel_f64("mean", mean, &[c])?,
        invstd: per_channel_f64("invstd", invstd, &[c])?,
        weight,
        sums: per_channel_f64("sums", sums, &[2, c])?,
        count,
        want_dz,
    };
    let (dy, x) = (dy.contiguous()?, x.contiguous()?);
    let out = match relu_output {
        None => arity::apply(op, &[&dy, &x], false)?,
        Some(y) => {
            check_same_shape("relu output", x.dims(), y)?;
            arity::apply(op, &[&dy, &x, &y.contiguous()?], false)?
        }
    };
    if want_dz {
        Ok((out.get(0)?, Some(out.get(1)?)))
    } else {
        Ok((out, None))
    }
}
