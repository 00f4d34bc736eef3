//! One op, one optional last input. candle has a custom-op trait per arity (`CustomOp1`, `2`,
//! `3`); an op whose last input may be absent (a residual, a ReLU output) implements
//! [`OptionalLast`] once, and [`apply`] runs it with the arity its inputs have.

use candle_core::{CpuStorage, CustomOp1, CustomOp2, CustomOp3, Layout, Result, Shape, Tensor};

/// An input of a custom op on the CPU: its storage and layout.
pub(crate) type CpuIn<'a> = (&'a CpuStorage, &'a Layout);
/// An input of a custom op on a GPU.
#[cfg(feature = "cuda")]
pub(crate) type CudaIn<'a> = (&'a candle_core::CudaStorage, &'a Layout);

/// Gradients of the required inputs (in order) and of the optional one.
pub(crate) type Grads = (Vec<Option<Tensor>>, Option<Tensor>);

/// A candle op with `REQUIRED` inputs (1 or 2) and an optional last one.
pub(crate) trait OptionalLast: Send + Sync {
    /// Inputs every call has: 1 or 2.
    const REQUIRED: usize;
    /// The op's names for candle, without and with its optional input.
    const NAMES: [&'static str; 2];

    /// The CPU forward: `inputs` holds `REQUIRED` inputs.
    fn cpu(&self, inputs: &[CpuIn<'_>], last: Option<CpuIn<'_>>) -> Result<(CpuStorage, Shape)>;

    /// The CUDA forward: `inputs` holds `REQUIRED` inputs.
    #[cfg(feature = "cuda")]
    fn cuda(
        &self,
        inputs: &[CudaIn<'_>],
        last: Option<CudaIn<'_>>,
    ) -> Result<(candle_core::CudaStorage, Shape)>;

    /// The gradients, given the output `res` and its gradient; by default not differentiable.
    fn bwd(
        &self,
        inputs: &[&Tensor],
        last: Option<&Tensor>,
        res: &Tensor,
        grad: &Tensor,
    ) -> Result<Grads> {
        let _ = (inputs, res, grad);
        Err(candle_core::Error::BackwardNotSupported {
            op: Self::NAMES[usize::from(last.is_some())],
        })
    }
}

/// Runs `op` on `inputs` (its `REQUIRED` ones) and `last`; with `autograd`, the output carries
/// the op's backward into candle's graph.
pub(crate) fn apply<T: OptionalLast + 'static>(
    op: T,
    inputs: &[&Tensor],
    last: Option<&Tensor>,
    autograd: bool,
) -> Result<Tensor> {
    assert_eq!(inputs.len(), T::REQUIRED, "{}: wrong arity", T::NAMES[0]);
    let op = Adapt(op);
    match (inputs, last.as_ref()) {
        ([a], None) if autograd => a.apply_op1(op),
        ([a], None) => a.apply_op1_no_bwd(&op),
        ([a], Some(b)) | ([a, b], None) if autograd => a.apply_op2(b, op),
        ([a], Some(b)) | ([a, b], None) => a.apply_op2_no_bwd(b, &op),
        ([a, b], Some(c)) if autograd => a.apply_op3(b, c, op),
        ([a, b], Some(c)) => a.apply_op3_no_bwd(b, c, &op),
        _ => unreachable!("REQUIRED is 1 or 2"),
    }
}

/// `T` as candle's custom op of each arity.
struct Adapt<T>(T);

impl<T: OptionalLast> CustomOp1 for Adapt<T> {
    fn name(&self) -> &'static str {
        T::NAMES[0]
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        self.0.cpu(&[(s, l)], None)
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s: &candle_core::CudaStorage,
        l: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        self.0.cuda(&[(s, l)], None)
    }

    fn bwd(&self, a: &Tensor, res: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        let (mut g, _) = self.0.bwd(&[a], None, res, grad)?;
        Ok(g.swap_remove(0))
    }
}

impl<T: OptionalLast> CustomOp2 for Adapt<T> {
    fn name(&self) -> &'static str {
        T::NAMES[usize::from(T::REQUIRED == 1)]
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        match T::REQUIRED {
            1 => self.0.cpu(&[(s1, l1)], Some((s2, l2))),
            _ => self.0.cpu(&[(s1, l1), (s2, l2)], None),
        }
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &candle_core::CudaStorage,
        l1: &Layout,
        s2: &candle_core::CudaStorage,
        l2: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        match T::REQUIRED {
            1 => self.0.cuda(&[(s1, l1)], Some((s2, l2))),
            _ => self.0.cuda(&[(s1, l1), (s2, l2)], None),
        }
    }

    fn bwd(
        &self,
        a: &Tensor,
        b: &Tensor,
        res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        Ok(match T::REQUIRED {
            1 => {
                let (mut g, gb) = self.0.bwd(&[a], Some(b), res, grad)?;
                (g.swap_remove(0), gb)
            }
            _ => {
                let (g, _) = self.0.bwd(&[a, b], None, res, grad)?;
                let mut g = g.into_iter();
                (g.next().flatten(), g.next().flatten())
            }
        })
    }
}

impl<T: OptionalLast> CustomOp3 for Adapt<T> {
    fn name(&self) -> &'static str {
        T::NAMES[1]
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
        self.0.cpu(&[(s1, l1), (s2, l2)], Some((s3, l3)))
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
        self.0.cuda(&[(s1, l1), (s2, l2)], Some((s3, l3)))
    }

    fn bwd(
        &self,
        a: &Tensor,
        b: &Tensor,
        c: &Tensor,
        res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let (g, gc) = self.0.bwd(&[a, b], Some(c), res, grad)?;
        let mut g = g.into_iter();
        Ok((g.next().flatten(), g.next().flatten(), gc))
    }
}
