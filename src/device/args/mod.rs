//! The argument list of every kernel in `kernels/*.cu`, written once: the CUDA path launches
//! what these builders return, and the kernels' emulation tests (`tests/kernels_emulated/`) run
//! the same lists on the host, so CPU CI covers the argument order, the entry-point names, the
//! launch configurations and the buffer sizes the Rust side passes.
//!
//! Each kernel family is a struct whose fields are its buffers (and flags); its `call` checks
//! that every buffer holds at least the elements the launch touches and returns the entry point,
//! the launch configuration of [`super::launch`] and the parameters in the kernel's order.
//! `None` when there is nothing to launch (no channel, or an empty elementwise pass).

use candle_core::{bail, DType, Result};

use super::launch::{self, Launch};

mod batch_norm;
mod max_pool;

pub use batch_norm::{
    Apply, BackwardElemt, BackwardReduce, Finalize, RunningBuffers, Scratch, Stats,
};
pub use max_pool::{MaxPoolBwd, MaxPoolFwd, PoolExtent};

/// A buffer as a kernel receives it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Buffer {
    /// The address passed to the kernel: a device pointer on CUDA, a host address under the
    /// emulator.
    pub addr: u64,
    /// Elements of the parameter's type it holds.
    pub len: usize,
}

/// One kernel parameter, as `cuLaunchKernel` receives it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Arg {
    /// A pointer; `0` for an absent optional buffer.
    Ptr(u64),
    /// A `long long`.
    I64(i64),
    /// An `int`.
    I32(i32),
    /// A `double`.
    F64(f64),
}

/// One launch of one entry point.
#[derive(Debug, Clone, PartialEq)]
pub struct Call {
    /// The entry point, `<root>_<dtype suffix>`.
    pub name: String,
    /// Grid, block and shared memory.
    pub launch: Launch,
    /// The parameters in the kernel's order.
    pub args: Vec<Arg>,
}

/// The input every batch-norm kernel sees: `n` batch entries × `c` channels × `hw` positions,
/// channels-first (`(N, C, HW)`) or as rows of `c` contiguous channels (`channels_last`, which
/// the CUDA path also picks for `hw = 1`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Extent {
    /// Batch entries.
    pub n: usize,
    /// Channels.
    pub c: usize,
    /// Positions per channel and entry.
    pub hw: usize,
    /// Rows of contiguous channels (`nhwc` kernels) rather than planes (`nchw`).
    pub channels_last: bool,
}

impl Extent {
    /// Elements of the input.
    pub fn len(&self) -> usize {
        self.n * self.c * self.hw
    }

    /// True for an input without elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// `<root>_nchw` or `<root>_nhwc`.
    fn root(&self, root: &str) -> String {
        let layout = if self.channels_last { "nhwc" } else { "nchw" };
        format!("{root}_{layout}")
    }

    /// The reduction launch over this input (`None` when `c` is 0).
    pub fn reduction(&self) -> Option<launch::Reduction> {
        launch::reduction(self.n, self.c, self.hw, self.channels_last)
    }

    /// The elementwise launch over this input (`None` when it is empty).
    pub fn elementwise(&self) -> Option<Launch> {
        launch::elementwise(self.n, self.c, self.hw, self.channels_last)
    }
}

/// The suffix of the entry point of `dtype`; another dtype is an error naming `op`.
fn suffix(op: &str, dtype: DType) -> Result<&'static str> {
    Ok(match dtype {
        DType::F32 => "f32",
        DType::F64 => "f64",
        DType::F16 => "f16",
        DType::BF16 => "bf16",
        d => bail!("{op}: unsupported dtype {d:?} on CUDA (expected f32, f64, f16 or bf16)"),
    })
}

/// Parameters being listed, with the size checks; errors name the caller and the entry point.
struct List<'a> {
    op: &'a str,
    name: String,
    args: Vec<Arg>,
}

impl<'a> List<'a> {
    fn new(op: &'a str, root: &str, dtype: DType) -> Result<Self> {
        Ok(Self {
            op,
            name: format!("{root}_{}", suffix(op, dtype)?),
            args: Vec::with_capacity(16),
        })
    }

    /// A buffer that must hold at least `need` elements.
    fn buf(self, what: &str, b: Buffer, need: usize) -> Result<Self> {
        self.opt(what, Some(b), need)
    }

    /// An optional buffer: a null pointer when absent.
    fn opt(mut self, what: &str, b: Option<Buffer>, need: usize) -> Result<Self> {
        let addr = match b {
            Some(b) if b.len < need => bail!(
                "{}: {} needs {need} elements in `{what}`, the buffer holds {}",
                self.op,
                self.name,
                b.len
            ),
            // (An empty input may sit at address 0; a buffer of no elements is never touched.)
            Some(b) if b.addr == 0 && need > 0 => {
                bail!("{}: {} got a null `{what}`", self.op, self.name)
            }
            Some(b) => b.addr,
            None => 0,
        };
        self.args.push(Arg::Ptr(addr));
        Ok(self)
    }

    fn extent(mut self, e: &Extent) -> Self {
        self.args
            .extend([e.n, e.c, e.hw].map(|v| Arg::I64(v as i64)));
        self
    }

    fn push(mut self, a: Arg) -> Self {
        self.args.push(a);
        self
    }

    fn call(self, launch: Launch) -> Call {
        Call {
            name: self.name,
            launch,
            args: self.args,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn buf(addr: u64, len: usize) -> Buffer {
        Buffer { addr, len }
    }

    #[test]
    fn a_short_buffer_is_an_error_naming_the_op_the_kernel_and_the_buffer() {
        let e = Extent {
            n: 2,
            c: 3,
            hw: 4,
            channels_last: false,
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
        let e = Extent {
            n: 0,
            c: 3,
            hw: 4,
            channels_last: true,
        };
        let b = buf(8, 64);
        let apply = Apply {
            x: b,
            z: None,
            mean: b,
            invstd: b,
            params: None,
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
