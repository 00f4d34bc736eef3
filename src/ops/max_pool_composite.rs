//! [`super::max_pool2d`] on the composite path (a device without the crate's kernels, or any
//! device with `CANDLE_DISTRIBUTED_COMPOSITE` set): candle tensor ops only, differentiated by
//! candle's autograd, with the kernels' semantics.
//!
//! The `k²` offsets of the window are visited in row-major order; offset `(a, b)` gathers, for
//! every output position, the input element it covers (`index_select` of the rows, then the
//! columns; a position in the padding reads a clamped index and is marked invalid). As in the
//! kernels, an offset takes over the window when it is valid and either no valid offset came
//! before, or its value is greater than the best so far, or it is a NaN. Each output position
//! then takes its winner's value (a chain of `where_cond`), exactly, and the gradient goes to the
//! winner only (through the gathers' backward, `index_add`). On Metal the NaN rule holds only
//! with candle's fast math off (`CANDLE_METAL_ENABLE_FAST_MATH=0`): with it, comparisons with
//! NaN are undefined there.

use candle_core::{bail, DType, Device, Result, Tensor};

use super::max_pool::POOL;

/// The padded pooling of `x` (contiguous, `(N, C, H, W)`) with window `k`, stride `s` and
/// padding `p`, `oh × ow` outputs per plane (already validated).
pub(super) fn max_pool2d(
    x: &Tensor,
    (k, s, p): (usize, usize, usize),
    (oh, ow): (usize, usize),
) -> Result<Tensor> {
    let (n, c, h, w) = x.dims4()?;
    let dev = x.device();
    let full = (n, c, oh, ow);
    if x.dtype() == DType::F64 && dev.is_metal() {
        bail!("{POOL}: an f64 input on {dev:?}: Metal has no f64 arithmetic (use f32, f16 or bf16 there)")
    }
    if !matches!(
        x.dtype(),
        DType::F32 | DType::F64 | DType::F16 | DType::BF16
    ) {
        bail!(
            "{POOL}: unsupported dtype {:?} (expected f32, f64, f16 or bf16)",
            x.dtype()
        )
    }
    if x.elem_count() == 0 {
        // candle's ops hand an empty operand back without a graph node: the empty output is
        // broadcast from x's per-channel sums, so that x still gets its (empty) gradient.
        return x.sum_keepdim([0, 2, 3])?.broadcast_as(full);
    }
    let mut windows = Vec::with_capacity(k * k);
    // Per output position: whether a valid offset was seen, the best value, the winner.
    let mut have = Tensor::zeros((1, 1, oh, ow), DType::F32, dev)?;
    let mut best: Option<Tensor> = None;
    let mut winner = Tensor::zeros(full, DType::F32, dev)?;
    for a in 0..k {
        let (rows, row_ok) = gather_index(a, s, p, h, oh, dev)?;
        for b in 0..k {
            let (cols, col_ok) = gather_index(b, s, p, w, ow, dev)?;
            let v = x.index_select(&rows, 2)?.index_select(&cols, 3)?;
            let vd = v.detach();
            // Valid where both the row and the column are inside the input.
            let valid = row_ok
                .reshape((1, 1, oh, 1))?
                .broadcast_mul(&col_ok.reshape((1, 1, 1, ow))?)?;
            let take = match &best {
                None => valid.broadcast_as(full)?.contiguous()?,
                Some(bst) => {
                    let first = valid.broadcast_mul(&(1.0 - &have)?)?;
                    let better =
                        (vd.gt(bst)?.to_dtype(DType::F32)? + vd.ne(&vd)?.to_dtype(DType::F32)?)?;
                    (first.broadcast_as(full)? + better.broadcast_mul(&valid)?)?
                        .clamp(0f32, 1f32)?
                }
            };
            let pick = take.ne(0f32)?;
            best = Some(match &best {
                None => vd.clone(),
                Some(bst) => pick.where_cond(&vd, bst)?,
            });
            let offset = Tensor::full((a * k + b) as f32, full, dev)?;
            winner = pick.where_cond(&offset, &winner)?;
            have = have.maximum(&valid)?;
            windows.push(v);
        }
    }
    // Each position takes its winner's value, exactly (a −0.0 stays −0.0).
    let mut y = Tensor::zeros(full, x.dtype(), dev)?;
    for (o, v) in windows.iter().enumerate() {
        y = winner.eq(o as f32)?.where_cond(v, &y)?;
    }
    Ok(y)
}

/// The input indices (`u32`, clamped into `0..len`) that offset `a` of the window reads for each
/// of the `out` output positions along one side, and whether each is inside the input (`f32`
/// 1 or 0).
fn gather_index(
    a: usize,
    s: usize,
    p: usize,
    len: usize,
    out: usize,
    dev: &Device,
) -> Result<(Tensor, Tensor)> {
    let (mut at, mut ok) = (Vec::with_capacity(out), Vec::with_capacity(out));
    for i in 0..out {
        let r = (i * s + a) as isize - p as isize;
        let inside = r >= 0 && (r as usize) < len;
        at.push(r.clamp(0, len as isize - 1) as u32);
        ok.push(if inside { 1f32 } else { 0f32 });
    }
    Ok((
        Tensor::from_vec(at, out, &Device::Cpu)?.to_device(dev)?,
        Tensor::from_vec(ok, out, &Device::Cpu)?.to_device(dev)?,
    ))
}
