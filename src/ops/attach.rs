//! A value computed outside candle's graph, put into the graph with a gradient function of our
//! own: `ops::conv2d`, and `parallel`'s differentiable collectives and overlapped tensor-parallel
//! layers are built this way.
//!
//! The op holds the value itself (not as an input of the graph node), and its forward hands
//! over a copy and releases the value: the graph keeps the copy only, not the value beside it.

use std::sync::Mutex;

use candle_core::backend::{BackendDevice, BackendStorage};
use candle_core::{bail, CpuStorage, CustomOp1, CustomOp2, Layout, Result, Shape, Storage, Tensor};

/// A gradient function of the output gradient, for one input.
pub(crate) type Backward = Box<dyn Fn(&Tensor) -> Result<Tensor> + Send + Sync>;
/// A gradient function of the output gradient, for two inputs (`None`: no gradient for that
/// input).
pub(crate) type Backward2 =
    Box<dyn Fn(&Tensor) -> Result<(Option<Tensor>, Option<Tensor>)> + Send + Sync>;

/// `y` in `x`'s place in the graph: the backward hands the output gradient to `backward` and its
/// result to `x`. `y` must be on `x`'s device.
///
/// # Errors
///
/// When `y` is on another device than `x` or its copy fails, or this build lacks the feature
/// of `x`'s device (`cuda`, `metal`).
pub(crate) fn attach(
    x: &Tensor,
    y: Tensor,
    name: &'static str,
    backward: Backward,
) -> Result<Tensor> {
    check_runs(name, x)?;
    x.apply_op1(Attach {
        name,
        value: Mutex::new(Some(y)),
        backward,
    })
}

/// `y` in the graph as a function of `x` and `w`: the backward hands the output gradient to
/// `backward`, whose two results go to `x` and `w`. `y` must be on `x`'s device.
///
/// # Errors
///
/// As [`attach`].
pub(crate) fn attach2(
    x: &Tensor,
    w: &Tensor,
    y: Tensor,
    name: &'static str,
    backward: Backward2,
) -> Result<Tensor> {
    check_runs(name, x)?;
    x.apply_op2(
        w,
        Attach2 {
            name,
            value: Mutex::new(Some(y)),
            backward,
        },
    )
}

/// Errors, naming `name` and the feature to enable, when this build has no forward for `x`'s
/// device (candle's own error would only say that the op has no implementation there).
fn check_runs(name: &str, x: &Tensor) -> Result<()> {
    match crate::device::missing_copy_feature(x.device()) {
        Some(feature) => bail!(
            "{name}: the input is on {:?}, which needs candle-distributed's `{feature}` feature",
            x.device()
        ),
        None => Ok(()),
    }
}

struct Attach {
    name: &'static str,
    value: Mutex<Option<Tensor>>,
    backward: Backward,
}

struct Attach2 {
    name: &'static str,
    value: Mutex<Option<Tensor>>,
    backward: Backward2,
}

/// Takes the held value out (the op keeps nothing of it after its forward).
fn take(name: &str, value: &Mutex<Option<Tensor>>) -> Result<Tensor> {
    match value.lock().unwrap_or_else(|e| e.into_inner()).take() {
        Some(v) => Ok(v),
        None => bail!("{name}: the attached value was already handed over"),
    }
}

/// A fresh contiguous copy of a storage's elements under `l`, in a buffer of its own on every
/// backend (candle 0.11's Metal `try_clone` shares the buffer instead).
pub(crate) fn copy<S>(s: &S, l: &Layout) -> Result<(S, Shape)>
where
    S: BackendStorage,
    S::Device: BackendDevice<Storage = S>,
{
    let mut dst = s.device().zeros_impl(l.shape(), s.dtype())?;
    s.copy_strided_src(&mut dst, 0, l)?;
    Ok((dst, l.shape().clone()))
}

/// A copy of the held value's CPU storage.
fn copy_cpu(name: &str, value: &Mutex<Option<Tensor>>) -> Result<(CpuStorage, Shape)> {
    let v = take(name, value)?;
    let (storage, layout) = v.storage_and_layout();
    match &*storage {
        Storage::Cpu(s) => copy(s, layout),
        _ => bail!(
            "{name}: the value is on {:?}, the input on the CPU",
            v.device()
        ),
    }
}

/// A copy of the held value's CUDA storage.
#[cfg(feature = "cuda")]
fn copy_cuda(
    name: &str,
    value: &Mutex<Option<Tensor>>,
) -> Result<(candle_core::CudaStorage, Shape)> {
    let v = take(name, value)?;
    let (storage, layout) = v.storage_and_layout();
    match &*storage {
        Storage::Cuda(s) => copy(s, layout),
        _ => bail!(
            "{name}: the value is on {:?}, the input on a GPU",
            v.device()
        ),
    }
}

/// A copy of the held value's Metal storage (into a buffer of its own: candle's Metal
/// `try_clone` would share the value's).
#[cfg(feature = "metal")]
fn copy_metal(
    name: &str,
    value: &Mutex<Option<Tensor>>,
) -> Result<(candle_core::MetalStorage, Shape)> {
    let v = take(name, value)?;
    let (storage, layout) = v.storage_and_layout();
    match &*storage {
        Storage::Metal(s) => copy(s, layout),
        _ => bail!(
            "{name}: the value is on {:?}, the input on a Metal device",
            v.device()
        ),
    }
}

impl CustomOp1 for Attach {
    fn name(&self) -> &'static str {
        self.name
    }

    fn cpu_fwd(&self, _: &CpuStorage, _: &Layout) -> Result<(CpuStorage, Shape)> {
        copy_cpu(self.name, &self.value)
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        _: &candle_core::CudaStorage,
        _: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        copy_cuda(self.name, &self.value)
    }

    #[cfg(feature = "metal")]
    fn metal_fwd(
        &self,
        _: &candle_core::MetalStorage,
        _: &Layout,
    ) -> Result<(candle_core::MetalStorage, Shape)> {
        copy_metal(self.name, &self.value)
    }

    fn bwd(&self, _: &Tensor, _: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        Ok(Some((self.backward)(grad)?))
    }
}

impl CustomOp2 for Attach2 {
    fn name(&self) -> &'static str {
        self.name
    }

    fn cpu_fwd(
        &self,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        copy_cpu(self.name, &self.value)
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        _: &candle_core::CudaStorage,
        _: &Layout,
        _: &candle_core::CudaStorage,
        _: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        copy_cuda(self.name, &self.value)
    }

    #[cfg(feature = "metal")]
    fn metal_fwd(
        &self,
        _: &candle_core::MetalStorage,
        _: &Layout,
        _: &candle_core::MetalStorage,
        _: &Layout,
    ) -> Result<(candle_core::MetalStorage, Shape)> {
        copy_metal(self.name, &self.value)
    }

    fn bwd(
        &self,
        _: &Tensor,
        _: &Tensor,
        _: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        (self.backward)(grad)
    }
}
