//! `conv2d` (PyTorch's, without bias, dilation or groups) with a faster CPU path and backward.
//!
//! - On the CPU in f32 and f64: the crate's own im2col + `gemm` forward and backward
//!   (`conv_cpu.rs`), faster than candle's `conv2d` and its backward at the main job's ResNet
//!   shapes (measured: docs/benchmarks.md, section "The convolution on the CPU: im2col + gemm,
//!   and the cores shared among the ranks").
//! - Elsewhere (a GPU, Metal, f16, bf16, or with the composite path forced): candle's forward; for stride 1 the input's gradient as a
//!   `conv2d` of the output gradient with the flipped, transposed kernel (candle's backward runs
//!   `conv_transpose2d`, whose CPU loops are slower; measured: docs/benchmarks.md, section "A
//!   first step: the convolution's input gradient"); the weight's gradient candle's.

use candle_core::{bail, Result, Tensor};

use super::attach::attach2;
use super::conv_cpu;

/// PyTorch's `conv2d` without bias, dilation or groups: `x` `(N, C_in, H, W)`, `w`
/// `(C_out, C_in, k, k)` (a square kernel), `padding` on every side, `stride`; the output is
/// `(N, C_out, H_out, W_out)` with `H_out = (H + 2·padding − k) / stride + 1` (and `W_out`
/// alike), what candle's `x.conv2d(w, padding, stride, 1, 1)` computes.
///
/// On the CPU in f32 and f64 the op is the crate's own: per sample, im2col of the input and
/// one matrix product with the `gemm` crate, the samples split among candle's CPU threads; the
/// backward as two more products (the input's gradient scattered back with col2im, the weight's
/// summed over the samples in one partial sum per thread, added in a fixed order). Its sums run
/// in another order than candle's: within 1e-6 of candle's output and 1e-5 of its gradients
/// in f32, 1e-12 in f64, and within 1e-7 of central finite differences in f64
/// (`tests/conv.rs`). Memory: one patch buffer of `C_in·k²·H_out·W_out` values per thread
/// during each pass; nothing beyond `x` and `w` is kept for the backward. An input that does not
/// need a gradient (the images) costs no input gradient.
///
/// Elsewhere (a GPU, f16, bf16, empty channels): candle's forward (the op returns a copy of it);
/// for stride 1 the input's gradient is `conv2d(dy, flip(w)ᵀ, k − 1 − padding)`, for stride > 1
/// candle's `conv_transpose2d` with each side's own output padding (candle's backward uses the
/// height's for both and fails on rectangular inputs whose padded sides differ in parity); the
/// weight's gradient is candle's.
///
/// # Errors
///
/// When the shapes are not as above, the kernel is not square, `padding` is not below the
/// kernel size, `stride` is 0, the padded input is smaller than the kernel, or candle's
/// convolution fails (dtype, device).
pub fn conv2d(x: &Tensor, w: &Tensor, padding: usize, stride: usize) -> Result<Tensor> {
    let (Ok((_, c_in, _, _)), Ok((_, w_in, k_h, k_w))) = (x.dims4(), w.dims4()) else {
        bail!(
            "{CONV}: expected x (N, C_in, H, W) and w (C_out, C_in, k, k), got {:?} and {:?}",
            x.dims(),
            w.dims()
        )
    };
    let (h, wd) = (x.dim(2)?, x.dim(3)?);
    if c_in != w_in || k_h != k_w || padding >= k_h || stride == 0 {
        bail!(
            "{CONV}: x {:?}, w {:?}, padding {padding}, stride {stride}: needs the same C_in, a square kernel, padding below the kernel size and a stride of at least 1",
            x.dims(),
            w.dims()
        )
    }
    if h + 2 * padding < k_h || wd + 2 * padding < k_h {
        bail!(
            "{CONV}: the padded input ({}×{}) is smaller than the {k_h}×{k_h} kernel (x {:?}, padding {padding})",
            h + 2 * padding,
            wd + 2 * padding,
            x.dims()
        )
    }
    // The crate's CPU kernels, unless the composite path is forced (then candle's ops, as on
    // a device without the crate's kernels).
    if conv_cpu::takes(x, w) && !crate::device::composite(x.device()) {
        let g = conv_cpu::Geometry::new(x.dims4()?, w.dim(0)?, k_h, padding, stride);
        return conv_cpu::conv2d(x, w, g);
    }
    if let Some(feature) = crate::device::missing_copy_feature(x.device()) {
        if feature == "metal" {
            bail!(
                "{CONV}: the input is on {:?}, where candle 0.11's own convolution backward gives \
                 wrong weight gradients and this build's corrected one cannot run: enable \
                 candle-distributed's `metal` feature",
                x.device()
            )
        }
        // CUDA in a build without the `cuda` feature: candle's convolution and its backward,
        // which are right there.
        return x
            .contiguous()?
            .conv2d(&w.contiguous()?, padding, stride, 1, 1);
    }
    // Every convolution below gets contiguous operands: candle 0.11's Metal convolution reads
    // a non-contiguous kernel wrongly (it copies it, then uses the original buffer).
    let (xd, wd) = (x.detach().contiguous()?, w.detach().contiguous()?);
    let y = xd.conv2d(&wd, padding, stride, 1, 1)?;
    if !x.track_op() && !w.track_op() {
        return Ok(y);
    }
    // Only the inputs in the graph get a gradient: a constant input (the images) costs no input
    // gradient, a frozen weight none for the weight.
    let (need_x, need_w) = (x.track_op(), w.track_op());
    let backward = move |g: &Tensor| -> Result<(Option<Tensor>, Option<Tensor>)> {
        let g = g.contiguous()?;
        let dx = if !need_x {
            None
        } else if stride == 1 {
            let flipped = wd.flip(&[2, 3])?.transpose(0, 1)?.contiguous()?;
            Some(g.conv2d(&flipped, k_h - 1 - padding, 1, 1, 1)?)
        } else {
            // conv_transpose2d with the output padding that restores H and W: candle's takes
            // one for both (its own backward uses H's for W too, and fails when they differ),
            // so the larger, and the extra row or column (no input behind it) is cut off.
            let (h, w) = (xd.dim(2)?, xd.dim(3)?);
            let out = |d: usize| (d - 1) * stride + k_h - 2 * padding;
            let extra = (h - out(g.dim(2)?)).max(w - out(g.dim(3)?));
            let dx = g.conv_transpose2d(&wd, padding, extra, stride, 1)?;
            Some(dx.narrow(2, 0, h)?.narrow(3, 0, w)?)
        };
        if !need_w {
            return Ok((dx, None));
        }
        // candle's: the stride becomes the dilation of a convolution over the batch.
        let dw = xd
            .transpose(0, 1)?
            .contiguous()?
            .conv2d(&g.transpose(0, 1)?.contiguous()?, padding, 1, stride, 1)?
            .transpose(0, 1)?;
        Ok((dx, Some(dw.narrow(2, 0, k_h)?.narrow(3, 0, k_w)?)))
    };
    attach2(x, w, y, CONV, Box::new(backward))
}

/// The name the op's errors begin with.
const CONV: &str = "conv2d";
