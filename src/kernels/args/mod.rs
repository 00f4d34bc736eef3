//! The argument list of every kernel in `kernels/*.cu`, written once: the CUDA path launches
//! what these builders return, and the kernels' emulation tests (`tests/kernels_emulated/`) run
//! the same lists on the host, so CPU CI covers the argument order, the entry-point names, the
//! launch configurations and the buffer sizes the Rust side passes.
//!
//! Each kernel family is a struct whose fields are its buffers (and flags); its `call` checks
//! that every buffer holds at least the elements the launch touches and returns the entry point,
//! the launch configuration of [`super::launch`](mod@super::launch) and the parameters in the kernel's order.
//! `None` when there is nothing to launch (no channel, or an empty elementwise pass).

use super::launch;
use crate::device::List;
pub use crate::device::{Arg, Buffer, Call, Geometry, Launch};

mod batch_norm;
mod max_pool;
mod pack;

pub use batch_norm::{
    Apply, BackwardElemt, BackwardReduce, Finalize, RunningBuffers, Scratch, Stats,
};
pub use max_pool::{MaxPoolBwd, MaxPoolFwd, PoolExtent};
pub use pack::{Pack, Segment, PACK_SEGS};

/// How a [`Geometry`] selects and sizes the batch-norm kernels: `<root>_nchw` planes or
/// `<root>_nhwc` rows of channels, by its layout as given (the CUDA path passes
/// [`Geometry::contiguous_channels_as_rows`], the emulation tests every form).
pub trait KernelGeometry {
    /// The reduction launch over this input (`None` when `c` is 0).
    fn reduction(&self) -> Option<launch::Reduction>;
    /// The elementwise launch over this input (`None` when it is empty).
    fn elementwise(&self) -> Option<Launch>;
}

impl KernelGeometry for Geometry {
    fn reduction(&self) -> Option<launch::Reduction> {
        launch::reduction(self.n, self.c, self.s, self.layout.is_channels_last())
    }

    fn elementwise(&self) -> Option<Launch> {
        launch::elementwise(self.n, self.c, self.s, self.layout.is_channels_last())
    }
}

/// `<root>_nchw` or `<root>_nhwc`.
fn root(g: &Geometry, root: &str) -> String {
    let layout = if g.layout.is_channels_last() {
        "nhwc"
    } else {
        "nchw"
    };
    format!("{root}_{layout}")
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::DType;

    fn buf(addr: u64, len: usize) -> Buffer {
        Buffer { addr, len }
    }

    #[test]
    fn a_short_buffer_is_an_error_naming_the_op_the_kernel_and_the_buffer() {
        let e = Geometry {
            n: 2,
            c: 3,
            s: 4,
            layout: crate::layout::ChannelLayout::ChannelsFirst,
        };
        let r = e.reduction().unwrap();
        let scratch = Scratch {
            work: buf(8, r.work_len.max(1)),
            counters: buf(16, r.counters),
        };
        let ok = Stats {
            x: buf(24, 24),
            shift: buf(32, 3),
            out: buf(40, 9),
            scratch,
        };
        let call = ok.call("op", DType::F32, &e).unwrap().unwrap();
        assert_eq!(call.name, "bn_stats_nchw_f32");
        assert_eq!(call.launch, r.launch);
        assert_eq!(
            call.args,
            [24, 32, 40, 8, 16]
                .map(Arg::Ptr)
                .into_iter()
                .chain([2, 3, 4].map(Arg::I64))
                .collect::<Vec<_>>()
        );
        let short = Stats {
            out: buf(40, 8),
            ..ok
        };
        let err = short.call("op", DType::F32, &e).unwrap_err().to_string();
        assert!(
            err.contains("op: bn_stats_nchw_f32 needs 9 elements in `out`, the buffer holds 8"),
            "{err}"
        );
        let null = Stats {
            x: buf(0, 24),
            ..ok
        };
        let err = null.call("op", DType::F32, &e).unwrap_err().to_string();
        assert!(err.contains("null `x`"), "{err}");
        let err = ok.call("op", DType::U8, &e).unwrap_err().to_string();
        assert!(err.contains("op: unsupported dtype U8"), "{err}");
    }

    #[test]
    fn nothing_to_launch_is_none() {
        let e = Geometry {
            n: 0,
            c: 3,
            s: 4,
            layout: crate::layout::ChannelLayout::ChannelsLast,
        };
        let b = buf(8, 64);
        let apply = Apply {
            x: b,
            z: None,
            mean: b,
            invstd: b,
            weight: None,
            bias: None,
            y: b,
            relu: false,
        };
        assert_eq!(apply.call("op", DType::F32, &e).unwrap(), None);
        let f = Finalize {
            sums: b,
            shift: b,
            out: b,
            running: None,
            momentum: 0.1,
            eps: 1e-5,
        };
        assert_eq!(f.call("op", DType::F64, 0).unwrap(), None);
    }
}
