//! First pass of the backward: per-channel `Σg` and `Σg·(x − mean)`, where `g` is the incoming
//! gradient masked by the fused ReLU (`y > 0`) when there is one.

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, Layout, Result, Shape, Tensor};

#[cfg(feature = "cuda")]
use super::arity::CudaIn;
use super::arity::{self, AnyArity, CpuIn};
use super::{backward_slices, check_device, check_same_shape, per_channel_f64, OP};
use crate::device::cpu::{
    self, prefetch_l2, reduce2, row_sums, segment_sums, simd_fn, split, Elem, Real, Terms, LANES,
};
use crate::device::Geometry;

/// `g = dy`, or `0` where `y ≤ 0` when `MASK` (ReLU's derivative; NaN passes, as in PyTorch).
#[inline(always)]
fn grad<T: Elem, const MASK: bool>(dy: &T, y: &T) -> f64 {
    // Both values loaded first, then a select: the compiler keeps the loop vectorized (a load
    // under the condition made it a branch per value, mispredicted half the time).
    let (g, off) = (dy.load().to_f64(), MASK && y.load() <= T::R::ZERO);
    if off {
        0.0
    } else {
        g
    }
}

/// `(g, g·(x − h − l))` of the values of `dy`, `x` and `y`, with per-channel means split into
/// `h + l`. Without a mask, `dy` stands in for `y` and is never read as such.
struct Centred<'a, T: Elem, const MASK: bool> {
    dy: &'a [T],
    x: &'a [T],
    y: &'a [T],
    h: &'a [T::R],
    l: &'a [T::R],
}

impl<T: Elem, const MASK: bool> Terms for Centred<'_, T, MASK> {
    /// The shortest of the inputs and of the means' halves.
    fn len(&self) -> (usize, usize) {
        let values = self.dy.len().min(self.x.len()).min(self.y.len());
        (values, self.h.len().min(self.l.len()))
    }

    #[inline(always)]
    unsafe fn lanes(&self, i: usize, j: usize) -> [[f64; LANES]; 3] {
        let values = |s: &[T]| {
            // SAFETY: `i + LANES` is within every input (the caller's contract against
            // `len`); an array of `T` has the alignment of `T`.
            unsafe { *s.as_ptr().add(i).cast::<[T; LANES]>() }
        };
        let consts = |s: &[T::R]| {
            // SAFETY: `j + LANES` is within both halves of the means (the caller's contract
            // against `len`); an array of `T::R` has the alignment of `T::R`.
            unsafe { *s.as_ptr().add(j).cast::<[T::R; LANES]>() }
        };
        let (dy, x, y) = (values(self.dy), values(self.x), values(self.y));
        let (h, l) = (consts(self.h), consts(self.l));
        let g: [f64; LANES] = std::array::from_fn(|k| grad::<T, MASK>(&dy[k], &y[k]));
        let xc: [f64; LANES] = std::array::from_fn(|k| ((x[k].load() - h[k]) - l[k]).to_f64());
        [g, g, xc]
    }

    #[inline(always)]
    fn one(&self, i: usize, j: usize) -> [f64; 3] {
        let g = grad::<T, MASK>(&self.dy[i], &self.y[i]);
        [g, g, ((self.x[i].load() - self.h[j]) - self.l[j]).to_f64()]
    }

    #[inline(always)]
    fn prefetch(&self, i: usize) {
        prefetch_l2(self.dy.get(i));
        prefetch_l2(self.x.get(i));
        if MASK {
            prefetch_l2(self.y.get(i));
        }
    }
}

#[inline(always)]
fn plane_reduce_mask<T: Elem, const MASK: bool, const FMA: bool>(
    dy: &[T],
    x: &[T],
    y: &[T],
    h: T::R,
    l: T::R,
) -> (f64, f64) {
    let (h, l) = (&[h; LANES], &[l; LANES]);
    segment_sums::<FMA>(x.len(), &Centred::<T, MASK> { dy, x, y, h, l })
}

simd_fn! {
    /// `(Σg, Σg·(x − h − l))` of one channels-first segment.
    fn plane_reduce<T: Elem, const FMA: bool>(dy: &[T], x: &[T], y: Option<&[T]>, h: T::R, l: T::R) -> (f64, f64) {
        match y {
            None => plane_reduce_mask::<T, false, FMA>(dy, x, dy, h, l),
            Some(y) => plane_reduce_mask::<T, true, FMA>(dy, x, y, h, l),
        }
    }
}

#[inline(always)]
fn rows_reduce_mask<T: Elem, const MASK: bool, const FMA: bool>(
    dy: &[T],
    x: &[T],
    y: &[T],
    [h, l]: [&[T::R]; 2],
    [a, b]: [&mut [f64]; 2],
) {
    row_sums::<FMA>(
        x.len() / h.len(),
        a,
        b,
        &Centred::<T, MASK> { dy, x, y, h, l },
    )
}

simd_fn! {
    /// Adds `Σg` and `Σg·(x − h − l)` of channels-last rows into `[a, b]` (`[C]` each).
    fn rows_reduce<T: Elem, const FMA: bool>(dy: &[T], x: &[T], y: Option<&[T]>, mean: [&[T::R]; 2], acc: [&mut [f64]; 2]) -> () {
        match y {
            None => rows_reduce_mask::<T, false, FMA>(dy, x, dy, mean, acc),
            Some(y) => rows_reduce_mask::<T, true, FMA>(dy, x, y, mean, acc),
        }
    }
}

/// `[Σg (C values), Σg·(x − mean) (C values)]` of contiguous inputs; `y`: the ReLU output whose
/// sign masks `dy`, or `None` without a fused ReLU.
fn backward_reduce_cpu(
    dy: (&CpuStorage, &Layout),
    x: (&CpuStorage, &Layout),
    y: Option<(&CpuStorage, &Layout)>,
    g: &Geometry,
    mean: &[f64],
) -> Result<Vec<f64>> {
    fn run<T: Elem>(dy: &[T], x: &[T], y: Option<&[T]>, g: &Geometry, mean: &[f64]) -> Vec<f64> {
        let c = g.c;
        let (mh, ml): (Vec<T::R>, Vec<T::R>) = mean.iter().map(|&m| split::<T::R>(m)).unzip();
        let plane = |ch: usize, lo: usize, hi: usize| {
            let r = lo..hi;
            plane_reduce(
                &dy[r.clone()],
                &x[r.clone()],
                y.map(|y| &y[r]),
                mh[ch],
                ml[ch],
            )
        };
        let rows = |lo: usize, hi: usize, acc: &mut [f64]| {
            let (a, b) = acc.split_at_mut(c);
            let r = lo * c..hi * c;
            rows_reduce(
                &dy[r.clone()],
                &x[r.clone()],
                y.map(|y| &y[r]),
                [&mh[..], &ml],
                [a, b],
            )
        };
        reduce2(g, plane, rows)
    }
    fn go<T: Elem>(
        dy: (&CpuStorage, &Layout),
        x: (&CpuStorage, &Layout),
        y: Option<(&CpuStorage, &Layout)>,
        g: &Geometry,
        mean: &[f64],
    ) -> Result<Vec<f64>> {
        let (d, xs, y) = backward_slices::<T>(dy, x, y)?;
        Ok(run(d, xs, y, g, mean))
    }
    cpu::dispatch!(format!("{OP} backward"), x.0.dtype(), go(dy, x, y, g, mean))
}

/// `bn_backward_reduce_{nchw,nhwc}_<dtype>` of `kernels/backward_reduce.cu`: `[2, C]` f64.
#[cfg(feature = "cuda")]
fn backward_reduce_cuda(
    dy: (&candle_core::CudaStorage, &Layout),
    x: (&candle_core::CudaStorage, &Layout),
    y: Option<(&candle_core::CudaStorage, &Layout)>,
    g: &Geometry,
    mean: &Tensor,
) -> Result<candle_core::CudaStorage> {
    use crate::device::cuda::{dispatch, view, Aux, Buffers};
    use crate::kernels::args::{BackwardReduce, KernelGeometry, Scratch};
    use crate::kernels::{launch, with_scratch, KernelElem, Module};
    use candle_core::CudaStorage;

    fn run<T: KernelElem>(
        dy: (&CudaStorage, &Layout),
        x: (&CudaStorage, &Layout),
        y: Option<(&CudaStorage, &Layout)>,
        g: &Geometry,
        mean: &Tensor,
    ) -> Result<CudaStorage> {
        let dev = &x.0.device;
        let mean = Aux::of(OP, mean, dev, candle_core::DType::F64, "mean")?;
        let mean = mean.view::<f64>("mean")?;
        let dyv = view::<T>(OP, dy.0, dy.1, "gradient")?;
        let xv = view::<T>(OP, x.0, x.1, "input")?;
        let yv = y
            .map(|(s, l)| view::<T>(OP, s, l, "relu output"))
            .transpose()?;
        // SAFETY: the kernel writes all 2·C values (zeros for an empty batch).
        let mut out = unsafe { dev.alloc::<f64>(2 * g.c)? };
        let e = g.contiguous_channels_as_rows();
        if let Some(r) = e.reduction() {
            let stream = dev.cuda_stream();
            with_scratch(dev, r.counters, r.work_len, |scratch| {
                let mut b = Buffers::on(&stream);
                let call = BackwardReduce {
                    dy: b.read(&dyv),
                    x: b.read(&xv),
                    y: yv.as_ref().map(|v| b.read(v)),
                    mean: b.read(&mean),
                    out: b.write(&mut out),
                    scratch: Scratch {
                        work: b.write(&mut scratch.work),
                        counters: b.write(&mut scratch.counters),
                    },
                }
                .call(OP, x.0.dtype(), &e)?;
                launch(dev, Module::BackwardReduce, call, b)
            })?;
        }
        Ok(CudaStorage::wrap_cuda_slice(out, dev.clone()))
    }
    dispatch!(OP, x.0.dtype(), run(dy, x, y, g, mean))
}

struct BackwardReduceOp {
    geometry: Geometry,
    /// `[C]` f64 on the input's device.
    mean: Tensor,
}

impl BackwardReduceOp {
    fn finish(&self, v: Vec<f64>) -> (CpuStorage, Shape) {
        (CpuStorage::F64(v), Shape::from((2, self.geometry.c)))
    }
}

/// Inputs `[dy, x]`, or `[dy, x, y]` with the fused ReLU's output.
impl AnyArity for BackwardReduceOp {
    fn name(&self, inputs: usize) -> &'static str {
        match inputs {
            3 => "sync-batch-norm-backward-reduce-relu",
            _ => "sync-batch-norm-backward-reduce",
        }
    }

    fn cpu(&self, inputs: &[CpuIn<'_>]) -> Result<(CpuStorage, Shape)> {
        let mean = self.mean.to_vec1::<f64>()?;
        let y = inputs.get(2).copied();
        let v = backward_reduce_cpu(inputs[0], inputs[1], y, &self.geometry, &mean)?;
        Ok(self.finish(v))
    }

    #[cfg(feature = "cuda")]
    fn cuda(&self, inputs: &[CudaIn<'_>]) -> Result<(candle_core::CudaStorage, Shape)> {
        let y = inputs.get(2).copied();
        let out = backward_reduce_cuda(inputs[0], inputs[1], y, &self.geometry, &self.mean)?;
        Ok((out, Shape::from((2, self.geometry.c))))
    }
}

/// Local per-channel reductions of the backward pass.
///
/// # Arguments
/// * `dy` - gradient of the output, shape and dtype of `x`.
/// * `x` - `(N, C, *)`, or `(N, *, C)` with `ChannelLayout::ChannelsLast`.
/// * `mean` - `[C]` on `x`'s device, the mean used in the forward.
/// * `relu_output` - the forward output `y` when ReLU was fused (`dy` counts only where `y > 0`),
///   else `None`.
///
/// Returns `[2, C]` f64 on `x`'s device: row 0 `Σg`, row 1 `Σg·(x − mean)`. Summed over ranks it
/// feeds [`super::batch_norm_backward_elemt`]; locally, row 0 is dβ and row 1 times invstd is dγ.
///
/// # Errors
///
/// When `x` is not of rank 2 to 5 or its dtype is not f32, f64, f16 or bf16; when `dy` or
/// `relu_output` differs from `x` in shape, dtype or device; when `mean` is not on `x`'s device,
/// not of shape `[C]` or not of a float dtype; on a GPU, when a CUDA allocation or kernel launch fails.
pub fn batch_norm_backward_reduce(
    dy: &Tensor,
    x: &Tensor,
    mean: &Tensor,
    relu_output: Option<&Tensor>,
    layout: crate::layout::ChannelLayout,
) -> Result<Tensor> {
    crate::device::check_supported(OP, dy.device())?;
    let geometry = Geometry::of(OP, x.dims(), layout)?;
    check_same_shape("gradient", x.dims(), dy)?;
    check_device("mean", mean, x.device())?;
    let op = BackwardReduceOp {
        geometry,
        mean: per_channel_f64("mean", mean, &[geometry.c])?,
    };
    let (dy, x) = (dy.contiguous()?, x.contiguous()?);
    match relu_output {
        None => arity::apply(op, &[&dy, &x], false),
        Some(y) => {
            check_same_shape("relu output", x.dims(), y)?;
            arity::apply(op, &[&dy, &x, &y.contiguous()?], false)
        }
    }
}
