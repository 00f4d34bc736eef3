//! What a kernel launch is, whatever the kernel: its grid, its parameters as `cuLaunchKernel`
//! receives them, and a builder of parameter lists that checks every buffer's size. The kernels'
//! own argument lists (`crate::kernels::args`) are built with it; the CUDA path launches its
//! [`Call`]s, and the kernels' emulation tests run the same calls on the host.

use candle_core::{bail, DType, Result};

use super::Geometry;

/// Grid, block and dynamic shared memory of one launch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Launch {
    /// Blocks along x, y, z.
    pub grid: [u32; 3],
    /// Threads per block along x, y, z.
    pub block: [u32; 3],
    /// Bytes of dynamic shared memory.
    pub shared_mem_bytes: u32,
}

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
pub(crate) struct List<'a> {
    op: &'a str,
    name: String,
    args: Vec<Arg>,
}

impl<'a> List<'a> {
    pub(crate) fn new(op: &'a str, root: &str, dtype: DType) -> Result<Self> {
        Ok(Self {
            op,
            name: format!("{root}_{}", suffix(op, dtype)?),
            args: Vec::with_capacity(16),
        })
    }

    /// A buffer that must hold at least `need` elements.
    pub(crate) fn buf(self, what: &str, b: Buffer, need: usize) -> Result<Self> {
        self.opt(what, Some(b), need)
    }

    /// An optional buffer: a null pointer when absent.
    /// `what` names it in an error (formatted only then).
    pub(crate) fn opt(
        mut self,
        what: impl std::fmt::Display,
        b: Option<Buffer>,
        need: usize,
    ) -> Result<Self> {
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

    /// The input's `n`, `c` and `s` as three `long long`s.
    pub(crate) fn geometry(mut self, g: &Geometry) -> Self {
        self.args
            .extend([g.n, g.c, g.s].map(|v| Arg::I64(v as i64)));
        self
    }

    pub(crate) fn push(mut self, a: Arg) -> Self {
        self.args.push(a);
        self
    }

    pub(crate) fn call(self, launch: Launch) -> Call {
        Call {
            name: self.name,
            launch,
            args: self.args,
        }
    }
}
