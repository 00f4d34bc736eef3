//! The argument lists of the max-pooling kernels.

use candle_core::{DType, Result};

use super::{launch, Arg, Buffer, Call, List};

/// A 2-D max pooling: `planes` (`N·C`) planes of `h × w` → `oh × ow`, square window `k`,
/// stride `s`, padding `p`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PoolExtent {
    /// `N · C`.
    pub planes: usize,
    /// Input height.
    pub h: usize,
    /// Input width.
    pub w: usize,
    /// Output height.
    pub oh: usize,
    /// Output width.
    pub ow: usize,
    /// Window side.
    pub k: usize,
    /// Stride.
    pub s: usize,
    /// Padding.
    pub p: usize,
}

impl PoolExtent {
    fn push<'a>(&self, mut list: List<'a>) -> List<'a> {
        let [planes, h, w, oh, ow] = [self.planes, self.h, self.w, self.oh, self.ow];
        for v in [planes, h, w, oh, ow] {
            list = list.push(Arg::I64(v as i64));
        }
        for v in [self.k, self.s, self.p] {
            list = list.push(Arg::I32(v as i32));
        }
        list
    }

    fn input_len(&self) -> usize {
        self.planes * self.h * self.w
    }

    fn output_len(&self) -> usize {
        self.planes * self.oh * self.ow
    }
}

/// `max_pool2d_fwd_<dtype>` (`kernels/max_pool.cu`): one thread per output element.
#[derive(Debug, Clone, Copy)]
pub struct MaxPoolFwd {
    /// `(planes, h, w)`.
    pub x: Buffer,
    /// `(planes, oh, ow)`.
    pub y: Buffer,
}

impl MaxPoolFwd {
    /// The launch; `None` for an empty output.
    ///
    /// # Errors
    /// A dtype without kernels, or a buffer smaller than the launch touches (naming `op`).
    pub fn call(&self, op: &str, dtype: DType, e: &PoolExtent) -> Result<Option<Call>> {
        let Some(l) = launch::grid_stride(e.output_len()) else {
            return Ok(None);
        };
        let list = List::new(op, "max_pool2d_fwd", dtype)?
            .buf("x", self.x, e.input_len())?
            .buf("y", self.y, e.output_len())?;
        Ok(Some(e.push(list).call(l)))
    }
}

/// `max_pool2d_bwd_<dtype>` (`kernels/max_pool.cu`): one thread per input element.
#[derive(Debug, Clone, Copy)]
pub struct MaxPoolBwd {
    /// `(planes, h, w)`.
    pub x: Buffer,
    /// `(planes, oh, ow)`.
    pub dy: Buffer,
    /// `(planes, h, w)`.
    pub dx: Buffer,
}

impl MaxPoolBwd {
    /// The launch; `None` for an empty input.
    ///
    /// # Errors
    /// A dtype without kernels, or a buffer smaller than the launch touches (naming `op`).
    pub fn call(&self, op: &str, dtype: DType, e: &PoolExtent) -> Result<Option<Call>> {
        let Some(l) = launch::grid_stride(e.input_len()) else {
            return Ok(None);
        };
        let list = List::new(op, "max_pool2d_bwd", dtype)?
            .buf("x", self.x, e.input_len())?
            .buf("dy", self.dy, e.output_len())?
            .buf("dx", self.dx, e.input_len())?;
        Ok(Some(e.push(list).call(l)))
    }
}
