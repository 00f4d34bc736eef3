//! 2-D max pooling with a backward for overlapping windows (torchvision's 3×3, stride-2 stem
//! pool), which candle 0.11's `max_pool2d` lacks: PyTorch's semantics (the gradient of each
//! window goes to its first maximum in row-major order; a NaN wins), CPU and CUDA
//! (`kernels/max_pool.cu`), channels-first, f32, f64, f16 and bf16.
//!
//! The backward recomputes each window's maximum from the input instead of storing indices,
//! and sums, per input element, the gradients of the windows whose maximum it is, in increasing
//! window order: deterministic, no atomics, and the same bits on the CPU and the GPU.

use candle_core::backend::BackendStorage;
use candle_core::{bail, CpuStorage, CustomOp1, CustomOp2, Layout, Result, Shape, Tensor};

use crate::device::cpu::{self, chunks_on_pool, slice, Elem, Real};

/// Name used in error messages.
pub(super) const POOL: &str = "max_pool2d";

/// Window, stride and padding of a square 2-D pooling over `(N, C, H, W)` inputs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Pool {
    k: usize,
    s: usize,
    p: usize,
    /// Planes (`N·C`), input height and width, output height and width.
    planes: usize,
    h: usize,
    w: usize,
    oh: usize,
    ow: usize,
}

impl Pool {
    /// Validates the arguments against an input shape (PyTorch's rules) and derives the output.
    fn new(dims: &[usize], k: usize, s: usize, p: usize) -> Result<Self> {
        let &[n, c, h, w] = dims else {
            bail!("{POOL}: expected an input of shape (N, C, H, W), got {dims:?}")
        };
        if k == 0 || s == 0 {
            bail!("{POOL}: kernel size ({k}) and stride ({s}) must be at least 1")
        }
        let limit = i32::MAX as usize;
        if k > limit || s > limit {
            bail!("{POOL}: kernel size ({k}) and stride ({s}) must fit in 32 bits")
        }
        if h == 0 || w == 0 {
            bail!("{POOL}: the input's height and width must be at least 1 (input shape {dims:?})")
        }
        if p > k / 2 {
            bail!("{POOL}: padding ({p}) must be at most half the kernel size ({k})")
        }
        if h + 2 * p < k || w + 2 * p < k {
            bail!(
                "{POOL}: the padded input ({}×{}) is smaller than the {k}×{k} window (input shape {dims:?}, padding {p})",
                h + 2 * p,
                w + 2 * p
            )
        }
        Ok(Self {
            k,
            s,
            p,
            planes: n * c,
            h,
            w,
            oh: (h + 2 * p - k) / s + 1,
            ow: (w + 2 * p - k) / s + 1,
        })
    }

    fn out_shape(&self, dims: &[usize]) -> Shape {
        Shape::from((dims[0], dims[1], self.oh, self.ow))
    }

    /// Index within its `h×w` plane of the first maximum of window `(i, j)` (a NaN wins).
    fn argmax<T: Elem>(&self, plane: &[T], i: usize, j: usize) -> usize {
        let (h0, w0) = (
            (i * self.s) as isize - self.p as isize,
            (j * self.s) as isize - self.p as isize,
        );
        let (h1, w1) = (
            ((h0 + self.k as isize) as usize).min(self.h),
            ((w0 + self.k as isize) as usize).min(self.w),
        );
        let (h0, w0) = (h0.max(0) as usize, w0.max(0) as usize);
        let mut at = h0 * self.w + w0;
        let mut best = plane[at].load();
        for a in h0..h1 {
            for b in w0..w1 {
                let v = plane[a * self.w + b].load();
                if v > best || v.to_f64().is_nan() {
                    best = v;
                    at = a * self.w + b;
                }
            }
        }
        at
    }

    fn forward_cpu<T: Elem>(&self, x: &[T]) -> Vec<T> {
        let (hw, ohw) = (self.h * self.w, self.oh * self.ow);
        let mut y = vec![T::from_f64(0.0); self.planes * ohw];
        if ohw > 0 && hw > 0 {
            chunks_on_pool(&mut y, ohw, |p, yp| {
                let xp = &x[p * hw..(p + 1) * hw];
                for (o, v) in yp.iter_mut().enumerate() {
                    *v = xp[self.argmax(xp, o / self.ow, o % self.ow)];
                }
            });
        }
        y
    }

    /// Per plane, each window's gradient added to its maximum in window order (the order in
    /// which the CUDA kernel sums them), accumulated in the arithmetic type.
    fn backward_cpu<T: Elem>(&self, x: &[T], dy: &[T]) -> Vec<T> {
        let (hw, ohw) = (self.h * self.w, self.oh * self.ow);
        let mut dx = vec![T::from_f64(0.0); self.planes * hw];
        if hw > 0 {
            chunks_on_pool(&mut dx, hw, |p, dxp| {
                let xp = &x[p * hw..(p + 1) * hw];
                let dyp = &dy[p * ohw..(p + 1) * ohw];
                let mut acc = vec![<T::R as Real>::ZERO; hw];
                for (o, g) in dyp.iter().enumerate() {
                    let at = self.argmax(xp, o / self.ow, o % self.ow);
                    acc[at] = acc[at] + g.load();
                }
                for (d, a) in dxp.iter_mut().zip(acc) {
                    *d = T::store(a);
                }
            });
        }
        dx
    }

    /// The pooling as the kernels see it.
    #[cfg(feature = "cuda")]
    fn extent(&self) -> crate::kernels::args::PoolExtent {
        crate::kernels::args::PoolExtent {
            planes: self.planes,
            h: self.h,
            w: self.w,
            oh: self.oh,
            ow: self.ow,
            k: self.k,
            s: self.s,
            p: self.p,
        }
    }
}

/// The forward op: `(N, C, H, W)` → `(N, C, OH, OW)`.
struct MaxPoolOp(Pool);

impl CustomOp1 for MaxPoolOp {
    fn name(&self) -> &'static str {
        "max-pool2d"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        fn run<T: Elem>(p: &Pool, s: &CpuStorage, l: &Layout) -> Result<CpuStorage> {
            Ok(T::to_cpu_storage_owned(
                p.forward_cpu(slice::<T>(POOL, s, l)?),
            ))
        }
        let out = cpu::dispatch!(POOL, s.dtype(), run(&self.0, s, l))?;
        Ok((out, self.0.out_shape(l.dims())))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s: &candle_core::CudaStorage,
        l: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        use crate::device::cuda::{dispatch, view, Buffers};
        use crate::kernels::args::MaxPoolFwd;
        use crate::kernels::{launch, KernelElem, Module};
        use candle_core::CudaStorage;

        fn run<T: KernelElem>(p: &Pool, s: &CudaStorage, l: &Layout) -> Result<CudaStorage> {
            let dev = &s.device;
            let x = view::<T>(POOL, s, l, "input")?;
            // SAFETY: the kernel writes every output element.
            let mut y = unsafe { dev.alloc::<T>(p.planes * p.oh * p.ow)? };
            let stream = dev.cuda_stream();
            let mut b = Buffers::on(&stream);
            let call = MaxPoolFwd {
                x: b.read(&x),
                y: b.write(&mut y),
            }
            .call(POOL, s.dtype(), &p.extent())?;
            launch(dev, Module::MaxPool, call, b)?;
            Ok(CudaStorage::wrap_cuda_slice(y, dev.clone()))
        }
        let out = dispatch!(POOL, s.dtype(), run(&self.0, s, l))?;
        Ok((out, self.0.out_shape(l.dims())))
    }

    fn bwd(&self, x: &Tensor, _y: &Tensor, dy: &Tensor) -> Result<Option<Tensor>> {
        let dy = dy.contiguous()?;
        Ok(Some(x.apply_op2_no_bwd(&dy, &MaxPoolBackwardOp(self.0))?))
    }
}

/// The backward op: `(x, dy)` → `dx`, the shape of `x`.
struct MaxPoolBackwardOp(Pool);

impl CustomOp2 for MaxPoolBackwardOp {
    fn name(&self) -> &'static str {
        "max-pool2d-backward"
    }

    fn cpu_fwd(
        &self,
        xs: &CpuStorage,
        xl: &Layout,
        dys: &CpuStorage,
        dyl: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        fn run<T: Elem>(
            p: &Pool,
            xs: &CpuStorage,
            xl: &Layout,
            dys: &CpuStorage,
            dyl: &Layout,
        ) -> Result<CpuStorage> {
            let (x, dy) = (slice::<T>(POOL, xs, xl)?, slice::<T>(POOL, dys, dyl)?);
            Ok(T::to_cpu_storage_owned(p.backward_cpu(x, dy)))
        }
        let out = cpu::dispatch!(POOL, xs.dtype(), run(&self.0, xs, xl, dys, dyl))?;
        Ok((out, xl.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        xs: &candle_core::CudaStorage,
        xl: &Layout,
        dys: &candle_core::CudaStorage,
        dyl: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        use crate::device::cuda::{dispatch, view, Buffers};
        use crate::kernels::args::MaxPoolBwd;
        use crate::kernels::{launch, KernelElem, Module};
        use candle_core::CudaStorage;

        fn run<T: KernelElem>(
            p: &Pool,
            xs: &CudaStorage,
            xl: &Layout,
            dys: &CudaStorage,
            dyl: &Layout,
        ) -> Result<CudaStorage> {
            let dev = &xs.device;
            let (x, dy) = (
                view::<T>(POOL, xs, xl, "input")?,
                view::<T>(POOL, dys, dyl, "gradient")?,
            );
            // SAFETY: the kernel writes every element of dx.
            let mut dx = unsafe { dev.alloc::<T>(p.planes * p.h * p.w)? };
            let stream = dev.cuda_stream();
            let mut b = Buffers::on(&stream);
            let call = MaxPoolBwd {
                x: b.read(&x),
                dy: b.read(&dy),
                dx: b.write(&mut dx),
            }
            .call(POOL, xs.dtype(), &p.extent())?;
            launch(dev, Module::MaxPool, call, b)?;
            Ok(CudaStorage::wrap_cuda_slice(dx, dev.clone()))
        }
        let out = dispatch!(POOL, xs.dtype(), run(&self.0, xs, xl, dys, dyl))?;
        Ok((out, xl.shape().clone()))
    }
}

/// 2-D max pooling of `x` with a square `kernel`, `stride` and zero-free `padding` (padded
/// positions never win), differentiable, PyTorch's `max_pool2d(x, kernel, stride, padding)`
/// without dilation or ceil mode.
///
/// # Arguments
/// - `x`: `(N, C, H, W)`, f32, f64, f16 or bf16, on any candle device (the crate's kernels on
///   the CPU and CUDA, candle tensor ops elsewhere); any strides.
/// - `kernel`, `stride`: at least 1; `padding`: at most `kernel / 2`.
///
/// Returns `(N, C, OH, OW)` with `OH = (H + 2·padding − kernel) / stride + 1` (likewise `OW`).
/// Its gradient goes, for each window, to the window's first maximum in row-major order, as in
/// PyTorch: with ties only the first element receives it.
///
/// # Errors
/// When `x` is not 4-D, its dtype is not a float, `kernel` or `stride` is 0, `padding`
/// exceeds `kernel / 2`, or the padded input is smaller than the window.
pub fn max_pool2d(x: &Tensor, kernel: usize, stride: usize, padding: usize) -> Result<Tensor> {
    let pool = Pool::new(x.dims(), kernel, stride, padding)?;
    if crate::device::composite(x.device()) {
        let window = (pool.k, pool.s, pool.p);
        return super::max_pool_composite::max_pool2d(&x.contiguous()?, window, (pool.oh, pool.ow));
    }
    x.contiguous()?.apply_op1(MaxPoolOp(pool))
}
