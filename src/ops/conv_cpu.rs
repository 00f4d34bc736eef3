//! The CPU path of [`super::conv2d`] in f32 and f64: per sample, the input's patches laid out
//! as a `(C_in·k·k, H_out·W_out)` matrix (im2col) and one matrix product with the `gemm` crate
//! (the one candle's CPU matrix product uses), straight into the channels-first output; the
//! backward as two more products, the input's gradient scattered back from patches (col2im),
//! the weight's gradient summed over the samples.
//!
//! The samples are split into one group per thread of candle's CPU worker pool
//! ([`on_pool`]), each group with one patch buffer, each product on one thread: one job per
//! convolution instead of candle's per-tile products. A batch smaller than the pool runs its
//! samples one after another and lets each product use the pool's thread count through `gemm`'s
//! own parallelism. The weight's gradient adds the groups' partial sums in group order: the
//! same bits from run to run on one machine (not across thread counts).

use std::ops::Range;

use candle_core::backend::BackendStorage;
use candle_core::{bail, CpuStorage, CustomOp2, DType, Layout, Result, Shape, Tensor, WithDType};
use gemm::Parallelism;

use crate::device::cpu::{chunks_on_pool_for, pool_threads, simd_fn, slice, written, Elem};

/// The shapes of one convolution: `x` `(n, c, h, w)`, `w` `(co, c, k, k)`, `y` `(n, co, oh, ow)`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Geometry {
    pub n: usize,
    pub c: usize,
    pub h: usize,
    pub w: usize,
    pub co: usize,
    pub k: usize,
    pub stride: usize,
    pub pad: usize,
    pub oh: usize,
    pub ow: usize,
}

impl Geometry {
    /// From validated dimensions (`super::conv2d` checks them).
    pub fn new(
        x: (usize, usize, usize, usize),
        co: usize,
        k: usize,
        pad: usize,
        stride: usize,
    ) -> Self {
        let (n, c, h, w) = x;
        Self {
            n,
            c,
            h,
            w,
            co,
            k,
            stride,
            pad,
            oh: (h + 2 * pad - k) / stride + 1,
            ow: (w + 2 * pad - k) / stride + 1,
        }
    }

    /// Rows of the patch matrix: `c·k·k`.
    fn rows(&self) -> usize {
        self.c * self.k * self.k
    }

    /// Output positions per sample, the patch matrix's columns: `oh·ow`.
    fn cols(&self) -> usize {
        self.oh * self.ow
    }

    fn x_len(&self) -> usize {
        self.c * self.h * self.w
    }

    /// Samples per group: one group per pool thread, at least one sample each.
    fn per_group(&self) -> usize {
        self.n.div_ceil(pool_threads().min(self.n).max(1)).max(1)
    }

    /// The samples of group `g`.
    fn group(&self, g: usize) -> Range<usize> {
        let per = self.per_group();
        (g * per).min(self.n)..((g + 1) * per).min(self.n)
    }

    /// Multiply-adds of one product over the whole batch: the pool's work estimate.
    fn work(&self) -> usize {
        self.n * self.co * self.rows() * self.cols()
    }

    /// The products' own parallelism: the pool's threads when the batch is too small to give
    /// each of them a sample, else one thread per product.
    fn parallelism(&self) -> Parallelism {
        let threads = pool_threads();
        if self.n < threads && self.co * self.rows() * self.cols() >= 1 << 20 {
            Parallelism::Rayon(threads)
        } else {
            Parallelism::None
        }
    }

    /// Length of one sample's input padded on every side: `(c, h + 2·pad, w + 2·pad)`.
    fn padded_len(&self) -> usize {
        self.c * (self.h + 2 * self.pad) * (self.w + 2 * self.pad)
    }

    /// A zeroed buffer for [`Geometry::padded`] and [`Self::col2im`].
    fn pad_buffer<T: WithDType>(&self) -> Vec<T> {
        vec![T::zero(); if self.pad > 0 { self.padded_len() } else { 0 }]
    }

    /// One sample `x` `(c, h, w)` padded with zeros: `x` itself without padding, else `buf`
    /// (from [`Geometry::pad_buffer`], whose border no call writes) with `x` copied inside.
    fn padded<'a, T: WithDType>(&self, x: &'a [T], buf: &'a mut [T]) -> &'a [T] {
        if self.pad == 0 {
            return x;
        }
        let (p, wp) = (self.pad, self.w + 2 * self.pad);
        let plane = (self.h + 2 * p) * wp;
        for (r, src) in x.chunks_exact(self.w).enumerate() {
            let (ci, row) = (r / self.h, r % self.h);
            copy(&mut buf[ci * plane + (row + p) * wp + p..][..self.w], src);
        }
        buf
    }
}

simd_fn! {
    /// Writes the patch matrix of one padded sample `(c, h + 2·pad, w + 2·pad)` into `cols`
    /// `(c·k·k, oh·ow)`: row `(ci, i, j)`, column `(a, b)` holds the padded input at
    /// `[ci, a·stride + i, b·stride + j]`.
    fn im2col<T: Elem>(g: &Geometry, padded: &[T], cols: &mut [T]) -> () {
        let (k, s, ow) = (g.k, g.stride, g.ow);
        let wp = g.w + 2 * g.pad;
        let plane = (g.h + 2 * g.pad) * wp;
        for (r, row) in cols.chunks_exact_mut(g.cols()).enumerate() {
            let (ci, i, j) = (r / (k * k), r / k % k, r % k);
            let src = &padded[ci * plane..(ci + 1) * plane];
            // Rows of a length known at compile time are straight vector moves.
            match (s, ow) {
                (1, 4) => rows_of::<T, 4>(row, &src[i * wp + j..], wp),
                (1, 8) => rows_of::<T, 8>(row, &src[i * wp + j..], wp),
                (1, 16) => rows_of::<T, 16>(row, &src[i * wp + j..], wp),
                _ => {}
            }
            if s == 1 && matches!(ow, 4 | 8 | 16) {
                continue;
            }
            for (a, out) in row.chunks_exact_mut(ow).enumerate() {
                let from = &src[(a * s + i) * wp + j..];
                if s == 1 {
                    copy(out, &from[..ow]);
                } else {
                    for (b, o) in out.iter_mut().enumerate() {
                        *o = from[b * s];
                    }
                }
            }
        }
    }
}

simd_fn! {
    /// Adds the patch matrix `cols` `(c·k·k, oh·ow)` of one sample back onto its input
    /// positions, the transpose of [`im2col`], and writes the sum into `dx` `(c, h, w)`;
    /// `buf` (from [`Geometry::pad_buffer`]) holds the padded sum on the way.
    fn col2im<T: Elem>(g: &Geometry, cols: &[T], buf: &mut [T], dx: &mut [T]) -> () {
        let (k, s, ow, p) = (g.k, g.stride, g.ow, g.pad);
        let wp = g.w + 2 * p;
        let plane = (g.h + 2 * p) * wp;
        let sum = if p == 0 { &mut *dx } else { &mut *buf };
        sum.fill(T::zero());
        for (r, row) in cols.chunks_exact(g.cols()).enumerate() {
            let (ci, i, j) = (r / (k * k), r / k % k, r % k);
            let dst = &mut sum[ci * plane..(ci + 1) * plane];
            for (a, src) in row.chunks_exact(ow).enumerate() {
                let to = &mut dst[(a * s + i) * wp + j..];
                if s == 1 {
                    for (d, v) in to[..ow].iter_mut().zip(src) {
                        *d += *v;
                    }
                } else {
                    for (b, v) in src.iter().enumerate() {
                        to[b * s] += *v;
                    }
                }
            }
        }
        if p > 0 {
            for (r, out) in dx.chunks_exact_mut(g.w).enumerate() {
                let (ci, row) = (r / g.h, r % g.h);
                copy(out, &buf[ci * plane + (row + p) * wp + p..][..g.w]);
            }
        }
    }
}

/// `dst = src` (equal lengths) in blocks of 8 and 4, which the compiler keeps as vector moves
/// where `copy_from_slice` would call `memcpy` for rows of a few values.
#[inline(always)]
fn copy<T: Copy>(dst: &mut [T], src: &[T]) {
    let (mut d, mut s) = (dst.chunks_exact_mut(8), src.chunks_exact(8));
    for (a, b) in (&mut d).zip(&mut s) {
        block::<T, 8>(a, b);
    }
    let (mut d, mut s) = (
        d.into_remainder().chunks_exact_mut(4),
        s.remainder().chunks_exact(4),
    );
    for (a, b) in (&mut d).zip(&mut s) {
        block::<T, 4>(a, b);
    }
    for (a, b) in d.into_remainder().iter_mut().zip(s.remainder()) {
        *a = *b;
    }
}

/// `dst = src`, both `N` long.
#[inline(always)]
fn block<T: Copy, const N: usize>(dst: &mut [T], src: &[T]) {
    let dst: &mut [T; N] = dst.try_into().expect("a block of N");
    *dst = *<&[T; N]>::try_from(src).expect("a block of N");
}

/// Fills `out` (`rows × N`) with the rows of `N` values that start every `stride` values of
/// `src`.
#[inline(always)]
fn rows_of<T: Copy, const N: usize>(out: &mut [T], src: &[T], stride: usize) {
    for (a, o) in out.chunks_exact_mut(N).enumerate() {
        block::<T, N>(o, &src[a * stride..a * stride + N]);
    }
}

/// `dst (m×n) = lhs (m×k) · rhs (k×n)`, or `dst += …` with `accumulate`; every matrix given
/// by its pointer and (row, column) strides in elements.
///
/// # Safety
/// The pointers must address every element their shapes and strides reach, `dst` exclusively.
#[allow(clippy::too_many_arguments)]
unsafe fn product<T: WithDType>(
    (m, n, k): (usize, usize, usize),
    dst: (*mut T, isize, isize),
    lhs: (*const T, isize, isize),
    rhs: (*const T, isize, isize),
    accumulate: bool,
    parallelism: Parallelism,
) {
    // SAFETY: the caller's contract; `T` is f32 or f64 (`run` dispatches only those), which
    // `gemm` supports. gemm computes dst = alpha·dst + beta·lhs·rhs, reading dst only when asked.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            dst.0,
            dst.2,
            dst.1,
            accumulate,
            lhs.0,
            lhs.2,
            lhs.1,
            rhs.0,
            rhs.2,
            rhs.1,
            T::one(),
            T::one(),
            false,
            false,
            false,
            parallelism,
        )
    }
}

/// The forward: `y_n (co, oh·ow) = w (co, c·k·k) · im2col(x_n)` for every sample.
fn forward<T: Elem>(g: &Geometry, x: &[T], w: &[T]) -> Vec<T> {
    let (rows, cols, out) = (g.rows(), g.cols(), g.co * g.cols());
    let par = g.parallelism();
    // Written by the products alone (no zero-fill first): every sample's `(co, cols)` block,
    // and the blocks cover the output.
    written(g.n * out, |y| {
        chunks_on_pool_for(y, g.per_group() * out, g.work(), |gi, ys| {
            let (mut patches, mut buf) = (vec![T::zero(); rows * cols], g.pad_buffer());
            for (n, yn) in g.group(gi).zip(ys.chunks_exact_mut(out)) {
                let xn = g.padded(&x[n * g.x_len()..(n + 1) * g.x_len()], &mut buf);
                im2col(g, xn, &mut patches);
                let (r, c) = (rows as isize, cols as isize);
                // SAFETY: yn is (co, cols) contiguous, w (co, rows), patches (rows, cols); a
                // product that does not accumulate writes every element of its destination
                // without reading it, so uninitialised memory is fine there.
                unsafe {
                    product(
                        (g.co, cols, rows),
                        (yn.as_mut_ptr().cast::<T>(), c, 1),
                        (w.as_ptr(), r, 1),
                        (patches.as_ptr(), c, 1),
                        false,
                        par,
                    )
                }
            }
        })
    })
}

/// The input's gradient: `dx_n = col2im(wᵀ (c·k·k, co) · dy_n (co, oh·ow))`.
fn input_grad<T: Elem>(g: &Geometry, w: &[T], dy: &[T]) -> Vec<T> {
    let (rows, cols) = (g.rows(), g.cols());
    let mut dx = vec![T::zero(); g.n * g.x_len()];
    let par = g.parallelism();
    chunks_on_pool_for(&mut dx, g.per_group() * g.x_len(), g.work(), |gi, dxs| {
        let (mut patches, mut buf) = (vec![T::zero(); rows * cols], g.pad_buffer());
        for (n, dxn) in g.group(gi).zip(dxs.chunks_exact_mut(g.x_len())) {
            let dyn_ = &dy[n * g.co * cols..(n + 1) * g.co * cols];
            let (r, c) = (rows as isize, cols as isize);
            // SAFETY: patches is (rows, cols) contiguous, w (co, rows) read transposed,
            // dy_n (co, cols).
            unsafe {
                product(
                    (rows, cols, g.co),
                    (patches.as_mut_ptr(), c, 1),
                    (w.as_ptr(), 1, r),
                    (dyn_.as_ptr(), c, 1),
                    false,
                    par,
                )
            }
            col2im(g, &patches, &mut buf, dxn);
        }
    });
    dx
}

/// The weight's gradient: `Σ_n dy_n (co, oh·ow) · im2col(x_n)ᵀ`, one partial sum per group,
/// added in group order.
fn weight_grad<T: Elem>(g: &Geometry, x: &[T], dy: &[T]) -> Vec<T> {
    let (rows, cols, len) = (g.rows(), g.cols(), g.co * g.rows());
    let groups = g.n.div_ceil(g.per_group());
    let mut partial = vec![T::zero(); groups.max(1) * len];
    let par = g.parallelism();
    chunks_on_pool_for(&mut partial, len, g.work(), |gi, dw| {
        let (mut patches, mut buf) = (vec![T::zero(); rows * cols], g.pad_buffer());
        for (i, n) in g.group(gi).enumerate() {
            let xn = g.padded(&x[n * g.x_len()..(n + 1) * g.x_len()], &mut buf);
            im2col(g, xn, &mut patches);
            let dyn_ = &dy[n * g.co * cols..(n + 1) * g.co * cols];
            let (r, c) = (rows as isize, cols as isize);
            // SAFETY: dw is (co, rows) contiguous, dy_n (co, cols), patches (rows, cols) read
            // transposed.
            unsafe {
                product(
                    (g.co, rows, cols),
                    (dw.as_mut_ptr(), r, 1),
                    (dyn_.as_ptr(), c, 1),
                    (patches.as_ptr(), 1, c),
                    i > 0,
                    par,
                )
            }
        }
    });
    let mut parts = partial.chunks_exact(len);
    let mut dw = parts.next().map(<[T]>::to_vec).unwrap_or_default();
    for part in parts {
        for (a, b) in dw.iter_mut().zip(part) {
            *a += *b;
        }
    }
    dw
}

/// Which of the three products an op runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Pass {
    /// `(x, w)` → `y`.
    Forward,
    /// `(w, dy)` → `dx`.
    InputGrad,
    /// `(x, dy)` → `dw`.
    WeightGrad,
}

/// One pass of the convolution as a candle op on two contiguous CPU tensors of one dtype,
/// f32 or f64.
#[derive(Debug, Clone, Copy)]
struct ConvOp(Geometry, Pass);

impl ConvOp {
    fn out_shape(&self) -> Shape {
        let g = &self.0;
        match self.1 {
            Pass::Forward => Shape::from((g.n, g.co, g.oh, g.ow)),
            Pass::InputGrad => Shape::from((g.n, g.c, g.h, g.w)),
            Pass::WeightGrad => Shape::from((g.co, g.c, g.k, g.k)),
        }
    }
}

impl CustomOp2 for ConvOp {
    fn name(&self) -> &'static str {
        match self.1 {
            Pass::Forward => "conv2d",
            Pass::InputGrad => "conv2d-input-grad",
            Pass::WeightGrad => "conv2d-weight-grad",
        }
    }

    fn cpu_fwd(
        &self,
        a: &CpuStorage,
        al: &Layout,
        b: &CpuStorage,
        bl: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        fn run<T: Elem>(
            op: &ConvOp,
            a: &CpuStorage,
            al: &Layout,
            b: &CpuStorage,
            bl: &Layout,
        ) -> Result<CpuStorage> {
            let name = op.name();
            let (a, b) = (slice::<T>(name, a, al)?, slice::<T>(name, b, bl)?);
            let g = &op.0;
            Ok(T::to_cpu_storage_owned(match op.1 {
                Pass::Forward => forward(g, a, b),
                Pass::InputGrad => input_grad(g, a, b),
                Pass::WeightGrad => weight_grad(g, a, b),
            }))
        }
        let out = match (a.dtype(), b.dtype()) {
            (DType::F32, DType::F32) => run::<f32>(self, a, al, b, bl)?,
            (DType::F64, DType::F64) => run::<f64>(self, a, al, b, bl)?,
            (p, q) => bail!(
                "{}: expected two f32 or two f64 tensors, got {p:?} and {q:?}",
                self.name()
            ),
        };
        Ok((out, self.out_shape()))
    }

    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        _y: &Tensor,
        dy: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let dy = dy.contiguous()?;
        let g = self.0;
        let dx = match x.track_op() {
            true => Some(w.apply_op2_no_bwd(&dy, &ConvOp(g, Pass::InputGrad))?),
            false => None,
        };
        let dw = match w.track_op() {
            true => Some(x.apply_op2_no_bwd(&dy, &ConvOp(g, Pass::WeightGrad))?),
            false => None,
        };
        Ok((dx, dw))
    }
}

/// Whether the CPU path takes this convolution: both tensors on the CPU, both f32 or both f64.
/// Empty channels or planes are left to candle.
pub(super) fn takes(x: &Tensor, w: &Tensor) -> bool {
    x.device().is_cpu()
        && x.dtype() == w.dtype()
        && matches!(x.dtype(), DType::F32 | DType::F64)
        && x.dims()[1..].iter().chain(w.dims()).all(|&d| d > 0)
}

/// The convolution of `x` `(n, c, h, w)` with `w` `(co, c, k, k)` on the CPU, with its backward
/// for candle's autograd; shapes validated by the caller.
pub(super) fn conv2d(x: &Tensor, w: &Tensor, g: Geometry) -> Result<Tensor> {
    let (x, w) = (x.contiguous()?, w.contiguous()?);
    x.apply_op2(&w, ConvOp(g, Pass::Forward))
}
