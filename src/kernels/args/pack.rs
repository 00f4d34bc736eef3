//! The argument list of the gradient-packing kernel.

use candle_core::{bail, DType, Result};

use super::{launch, Arg, Buffer, Call, List};

/// Sources one launch of `pack_<dtype>` takes (`PACK_SEGS` in `kernels/pack.cu`).
pub const PACK_SEGS: usize = 32;

/// One range of a packed buffer: `len` values copied from `src`, or zeros when `src` is `None`
/// (a variable without a gradient here).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Segment {
    /// The source, contiguous, at least `len` values; `None`: fill with zeros.
    pub src: Option<Buffer>,
    /// Values of the range.
    pub len: usize,
    /// Whether the range's flag is 1 (the variable has a gradient on this rank).
    pub present: bool,
}

/// `pack_<dtype>` (`kernels/pack.cu`): up to [`PACK_SEGS`] segments copied (or zero-filled)
/// into consecutive ranges of `out` from index `at`, then, with `flags_at`, one flag per
/// segment (1 or 0 in the dtype) at `out[flags_at + k]`. One thread per value of the longest
/// segment, grid-stride.
#[derive(Debug, Clone)]
pub struct Pack {
    /// The packed buffer.
    pub out: Buffer,
    /// Index in `out` of the first segment's first value.
    pub at: usize,
    /// The segments, in order (at most [`PACK_SEGS`]).
    pub segments: Vec<Segment>,
    /// Index in `out` of the first segment's flag, or `None` to write no flags.
    pub flags_at: Option<usize>,
}

impl Pack {
    /// The launch; `None` when there is neither a value nor a flag to write.
    ///
    /// # Errors
    /// More than [`PACK_SEGS`] segments, a dtype without kernels, or a buffer smaller than
    /// the launch touches (naming `op`).
    pub fn call(&self, op: &str, dtype: DType) -> Result<Option<Call>> {
        let segs = self.segments.len();
        if segs > PACK_SEGS {
            bail!("{op}: {segs} segments in one pack launch (at most {PACK_SEGS})")
        }
        let longest = self.segments.iter().map(|s| s.len).max().unwrap_or(0);
        let threads = longest.max(if self.flags_at.is_some() { segs } else { 0 });
        let Some(l) = launch::grid_stride(threads) else {
            return Ok(None);
        };
        let end = self.at + self.segments.iter().map(|s| s.len).sum::<usize>();
        let need = match self.flags_at {
            Some(f) => end.max(f + segs),
            None => end,
        };
        let mut list = List::new(op, "pack", dtype)?.buf("out", self.out, need)?;
        for k in 0..PACK_SEGS {
            let s = self.segments.get(k);
            let (src, len) = s.map_or((None, 0), |s| (s.src, s.len));
            list = list.opt(format_args!("gradient {k}"), src, len)?;
        }
        let mut off = self.at;
        for k in 0..PACK_SEGS {
            list = list.push(Arg::I64(off as i64));
            off += self.segments.get(k).map_or(0, |s| s.len);
        }
        let present = (self.segments.iter().enumerate())
            .filter(|(_, s)| s.present)
            .fold(0u32, |m, (k, _)| m | 1 << k);
        let flags_at = self.flags_at.map_or(-1, |f| f as i64);
        Ok(Some(
            list.push(Arg::I64(end as i64))
                .push(Arg::I32(segs as i32))
                // The kernel's `unsigned int`, passed as the `int` of the same bits.
                .push(Arg::I32(present as i32))
                .push(Arg::I64(flags_at))
                .call(l),
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn buf(addr: u64, len: usize) -> Buffer {
        Buffer { addr, len }
    }

    #[test]
    fn a_pack_lists_every_slot_and_checks_each_source() {
        let segment = |src, len, present| Segment { src, len, present };
        let p = Pack {
            out: buf(8, 13),
            at: 0,
            segments: vec![
                segment(Some(buf(16, 4)), 4, true),
                segment(None, 5, false),
                segment(Some(buf(24, 1)), 1, true),
            ],
            flags_at: Some(10),
        };
        let call = p.call("op", DType::F32).unwrap().unwrap();
        assert_eq!(call.name, "pack_f32");
        assert_eq!(call.args.len(), 1 + 2 * PACK_SEGS + 4);
        assert_eq!(call.args[..4], [8, 16, 0, 24].map(Arg::Ptr));
        assert_eq!(call.args[4], Arg::Ptr(0));
        let offsets = &call.args[1 + PACK_SEGS..1 + 2 * PACK_SEGS];
        assert_eq!(offsets[..4], [0, 4, 9, 10].map(Arg::I64));
        assert_eq!(offsets[PACK_SEGS - 1], Arg::I64(10));
        let tail = &call.args[1 + 2 * PACK_SEGS..];
        assert_eq!(
            tail,
            [Arg::I64(10), Arg::I32(3), Arg::I32(0b101), Arg::I64(10)]
        );
        assert_eq!(call.launch, launch::grid_stride(5).unwrap());

        let short_out = Pack {
            out: buf(8, 12),
            ..p.clone()
        };
        let err = short_out.call("op", DType::F32).unwrap_err().to_string();
        assert!(
            err.contains("pack_f32 needs 13 elements in `out`, the buffer holds 12"),
            "{err}"
        );
        let mut short_src = p.clone();
        short_src.segments[2].len = 2;
        short_src.flags_at = None;
        let err = short_src.call("op", DType::F32).unwrap_err().to_string();
        assert!(
            err.contains("needs 2 elements in `gradient 2`, the buffer holds 1"),
            "{err}"
        );
        let many = Pack {
            segments: vec![segment(None, 1, false); PACK_SEGS + 1],
            ..p
        };
        let err = many.call("op", DType::F64).unwrap_err().to_string();
        assert!(
            err.contains("33 segments in one pack launch (at most 32)"),
            "{err}"
        );
    }
}
