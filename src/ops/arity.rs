//! One op, any arity. candle has a custom-op trait per number of inputs (`CustomOp1`, `2`, `3`);
//! an op whose inputs vary with its options (an optional residual, separate or no affine
//! parameters) implements [`AnyArity`] once, over a slice of its inputs, and [`apply`] runs it
//! with the arity its inputs have.

use candle_core::{CpuStorage, CustomOp1, CustomOp2, CustomOp3, Layout, Result, Shape, Tensor};

/// An input of a custom op on the CPU: its storage and layout.
pub(crate) type CpuIn<'a> = (&'a CpuStorage, &'a Layout);
/// An input of a custom op on a GPU.
#[cfg(feature = "cuda")]
pub(crate) type CudaIn<'a> = (&'a candle_core::CudaStorage, &'a Layout);

/// A candle op over 1 to 3 inputs, which it tells apart by its own options.
pub(crate) trait AnyArity: Send + Sync {
    /// The op's name for candle, when it has `inputs` inputs.
    fn name(&self, inputs: usize) -> &'static str;

    /// The CPU forward.
    fn cpu(&self, inputs: &[CpuIn<'_>]) -> Result<(CpuStorage, Shape)>;

    /// The CUDA forward.
    #[cfg(feature = "cuda")]
    fn cuda(&self, inputs: &[CudaIn<'_>]) -> Result<(candle_core::CudaStorage, Shape)>;

    /// The gradient of each input, given the output `res` and its gradient; by default not
    /// differentiable.
    fn bwd(&self, inputs: &[&Tensor], res: &Tensor, grad: &Tensor) -> Result<Vec<Option<Tensor>>> {
        let _ = (res, grad);
        Err(candle_core::Error::BackwardNotSupported {
            op: self.name(inputs.len()),
        })
    }
}

/// Runs `op` on `inputs` (1 to 3); with `autograd`, the output carries the op's backward into
/// candle's graph.
pub(crate) fn apply<T: AnyArity + 'static>(
    op: T,
    inputs: &[&Tensor],
    autograd: bool,
) -> Result<Tensor> {
    let op = Adapt(op);
    match inputs {
        [a] if autograd => a.apply_op1(op),
        [a] => a.apply_op1_no_bwd(&op),
        [a, b] if autograd => a.apply_op2(b, op),
        [a, b] => a.apply_op2_no_bwd(b, &op),
        [a, b, c] if autograd => a.apply_op3(b, c, op),
        [a, b, c] => a.apply_op3_no_bwd(b, c, &op),
        _ => candle_core::bail!(
            "{}: {} inputs (an op takes 1 to 3)",
            op.0.name(inputs.len()),
            inputs.len()
        ),
    }
}

/// `T` as candle's custom op of each arity.
struct Adapt<T>(T);

/// The `i`-th gradient, `None` past the end.
fn nth(g: &mut [Option<Tensor>], i: usize) -> Option<Tensor> {
    g.get_mut(i).and_then(Option::take)
}

impl<T: AnyArity> CustomOp1 for Adapt<T> {
    fn name(&self) -> &'static str {
        self.0.name(1)
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        self.0.cpu(&[(s, l)])
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s: &candle_core::CudaStorage,
        l: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        self.0.cuda(&[(s, l)])
    }

    fn bwd(&self, a: &Tensor, res: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        let mut g = self.0.bwd(&[a], res, grad)?;
        Ok(nth(&mut g, 0))
    }
}

impl<T: AnyArity> CustomOp2 for Adapt<T> {
    fn name(&self) -> &'static str {
        self.0.name(2)
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        self.0.cpu(&[(s1, l1), (s2, l2)])
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &candle_core::CudaStorage,
        l1: &Layout,
        s2: &candle_core::CudaStorage,
        l2: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        self.0.cuda(&[(s1, l1), (s2, l2)])
    }

    fn bwd(
        &self,
        a: &Tensor,
        b: &Tensor,
        res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let mut g = self.0.bwd(&[a, b], res, grad)?;
        Ok((nth(&mut g, 0), nth(&mut g, 1)))
    }
}

impl<T: AnyArity> CustomOp3 for Adapt<T> {
    fn name(&self) -> &'static str {
        self.0.name(3)
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        self.0.cpu(&[(s1, l1), (s2, l2), (s3, l3)])
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &candle_core::CudaStorage,
        l1: &Layout,
        s2: &candle_core::CudaStorage,
        l2: &Layout,
        s3: &candle_core::CudaStorage,
        l3: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        self.0.cuda(&[(s1, l1), (s2, l2), (s3, l3)])
    }

    fn bwd(
        &self,
        a: &Tensor,
        b: &Tensor,
        c: &Tensor,
        res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let mut g = self.0.bwd(&[a, b, c], res, grad)?;
        Ok((nth(&mut g, 0), nth(&mut g, 1), nth(&mut g, 2)))
    }
}
