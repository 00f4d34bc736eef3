//! Helpers shared by the integration tests: seeded data, layers with given parameters, thread
//! ranks, a counting communicator and an obviously-correct reference batch norm.
#![allow(dead_code)]

pub mod conformance;
pub mod many_vars;
pub mod mlp;
pub mod overlap;
pub mod training;
pub mod writes;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use anyhow::Result;
use candle_core::{DType, Device, Tensor, Var, D};
use candle_distributed::collective::{Collective, Decorator, Op, ThreadGroup};
use candle_distributed::{sync_batch_norm, SyncBatchNorm, SyncBatchNormConfig};
use candle_nn::{VarBuilder, VarMap};
use rand::{Rng, SeedableRng};

/// Uniform values with the given mean and standard deviation, f64, seeded.
pub fn randn(seed: u64, dims: &[usize], mean: f64, std: f64) -> Tensor {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let n: usize = dims.iter().product();
    let half_width = std * 3f64.sqrt();
    let v: Vec<f64> = (0..n)
        .map(|_| mean + half_width * (2.0 * rng.gen::<f64>() - 1.0))
        .collect();
    Tensor::from_vec(v, dims, &Device::Cpu).unwrap()
}

/// Per-channel parameters of a test layer.
#[derive(Debug, Clone)]
pub struct Params {
    pub weight: Vec<f64>,
    pub bias: Vec<f64>,
}

impl Params {
    /// Non-trivial γ in [0.5, 1.5] and β in [-0.5, 0.5].
    pub fn random(seed: u64, c: usize) -> Self {
        let w = randn(seed, &[c], 1.0, 0.25).to_vec1().unwrap();
        let b = randn(seed + 1, &[c], 0.0, 0.25).to_vec1().unwrap();
        Self { weight: w, bias: b }
    }
}

/// A layer on `dev` whose variables live in a fresh `VarMap` (returned, to read gradients by
/// name).
pub fn layer(
    c: usize,
    config: SyncBatchNormConfig,
    comm: Arc<dyn Collective>,
    params: Option<&Params>,
    dtype: DType,
    dev: &Device,
) -> (SyncBatchNorm, VarMap) {
    let vm = VarMap::new();
    if let Some(p) = params {
        let mut data = vm.data().lock().unwrap();
        for (name, v) in [("weight", &p.weight), ("bias", &p.bias)] {
            let t = Tensor::new(v.as_slice(), &Device::Cpu)
                .unwrap()
                .to_dtype(dtype)
                .unwrap()
                .to_device(dev)
                .unwrap();
            data.insert(name.to_string(), Var::from_tensor(&t).unwrap());
        }
    }
    let vb = VarBuilder::from_varmap(&vm, dtype, dev);
    let bn = sync_batch_norm(c, config, vb, comm).unwrap();
    (bn, vm)
}

/// The variable `name` of a `VarMap`.
pub fn var(vm: &VarMap, name: &str) -> Var {
    vm.data().lock().unwrap().get(name).unwrap().clone()
}

/// Runs `f` on `world` thread ranks and returns the results in rank order (panics on error).
pub fn run_ranks<R: Send>(
    world: usize,
    f: impl Fn(Arc<dyn Collective>) -> Result<R> + Sync,
) -> Vec<R> {
    ThreadGroup::run(world, |comm| {
        f(comm).map_err(|e| candle_core::Error::Msg(format!("{e:?}")))
    })
    .unwrap_or_else(|e| panic!("{e}"))
}

/// `(N, *, C)` → `(N, C, *)`.
pub fn to_channels_first(x: &Tensor) -> Tensor {
    let r = x.rank();
    let mut perm: Vec<usize> = vec![0, r - 1];
    perm.extend(1..r - 1);
    x.permute(perm).unwrap().contiguous().unwrap()
}

pub use candle_distributed::ChannelLayout;

/// The [`ChannelLayout`] of a test case that iterates over `[false, true]`.
pub fn layout_of(channels_last: bool) -> ChannelLayout {
    if channels_last {
        ChannelLayout::ChannelsLast
    } else {
        ChannelLayout::ChannelsFirst
    }
}

/// `(N, C, *)` → `(N, *, C)`.
pub fn to_channels_last(x: &Tensor) -> Tensor {
    let r = x.rank();
    let mut perm: Vec<usize> = vec![0];
    perm.extend(2..r);
    perm.push(1);
    x.permute(perm).unwrap().contiguous().unwrap()
}

/// Reference batch norm over the whole (single-process) batch, in f64 candle tensor ops:
/// `act(γ·(x − mean)/sqrt(var_b + eps) + β + z)` for `x` of shape `(N, C, *)`.
/// Returns `(y, mean [C], biased var [C])`.
pub fn reference_bn(
    x: &Tensor,
    weight: Option<&Tensor>,
    bias: Option<&Tensor>,
    z: Option<&Tensor>,
    relu: bool,
    eps: f64,
) -> (Tensor, Tensor, Tensor) {
    let c = x.dim(1).unwrap();
    let mut bshape = vec![1usize; x.rank()];
    bshape[1] = c;
    let xt = x.transpose(0, 1).unwrap().flatten_from(1).unwrap(); // (C, M)
    let mean = xt.mean_keepdim(D::Minus1).unwrap();
    let centered = xt.broadcast_sub(&mean).unwrap();
    let var = centered.sqr().unwrap().mean_keepdim(D::Minus1).unwrap();
    let mean_b = mean.reshape(bshape.as_slice()).unwrap();
    let var_b = var.reshape(bshape.as_slice()).unwrap();
    let mut y = x
        .broadcast_sub(&mean_b)
        .unwrap()
        .broadcast_div(&(var_b + eps).unwrap().sqrt().unwrap())
        .unwrap();
    if let Some(w) = weight {
        y = y
            .broadcast_mul(&w.reshape(bshape.as_slice()).unwrap())
            .unwrap();
    }
    if let Some(b) = bias {
        y = y
            .broadcast_add(&b.reshape(bshape.as_slice()).unwrap())
            .unwrap();
    }
    if let Some(z) = z {
        y = (y + z).unwrap();
    }
    if relu {
        y = y.relu().unwrap();
    }
    (y, mean.flatten_all().unwrap(), var.flatten_all().unwrap())
}

/// Largest absolute difference of two tensors of the same shape, on any devices.
pub fn max_abs_diff(a: &Tensor, b: &Tensor) -> f64 {
    assert_eq!(a.dims(), b.dims(), "shapes differ");
    if a.elem_count() == 0 {
        return 0.0;
    }
    let a = cpu(a).to_dtype(DType::F64).unwrap();
    let b = cpu(b).to_dtype(DType::F64).unwrap();
    (a - b)
        .unwrap()
        .abs()
        .unwrap()
        .flatten_all()
        .unwrap()
        .max(0)
        .unwrap()
        .to_scalar()
        .unwrap()
}

/// Asserts `max |a − b| ≤ tol`, naming what was compared.
#[track_caller]
pub fn assert_close(what: &str, a: &Tensor, b: &Tensor, tol: f64) {
    let d = max_abs_diff(a, b);
    assert!(
        d <= tol,
        "{what}: max abs difference {d:e} > tolerance {tol:e}"
    );
}

/// `t` on the CPU (a no-op for a CPU tensor).
pub fn cpu(t: &Tensor) -> Tensor {
    t.to_device(&Device::Cpu).unwrap()
}

/// `t` on `dev` (a copy; candle's CUDA transfers handle empty tensors, unlike its fills and
/// casts, so build and cast on the CPU, then move).
pub fn on(dev: &Device, t: &Tensor) -> Tensor {
    t.to_device(dev).unwrap()
}

/// `Σ y·w`, differentiable, also for empty tensors on a GPU (candle's CUDA reductions reject
/// them; the sum is taken on the CPU then, and the gradient flows back to the GPU).
pub fn weighted_sum(y: &Tensor, w: &Tensor) -> candle_core::Result<Tensor> {
    let p = (y * w)?;
    if p.elem_count() == 0 && !p.device().is_cpu() {
        return p.to_device(&Device::Cpu)?.sum_all();
    }
    p.sum_all()
}

/// Asserts, element by element, `|got − want| ≤ tol · max(1, max |want|)` with `got` finite
/// exactly where `want` is, naming what was compared and the first offending element. For
/// results whose scale is set by the data (sums, outputs of either sign).
#[track_caller]
pub fn assert_close_rel(what: &str, got: &Tensor, want: &Tensor, tol: f64) {
    assert_eq!(got.dims(), want.dims(), "{what}: shapes");
    let flat = |t: &Tensor| -> Vec<f64> {
        cpu(t)
            .to_dtype(DType::F64)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1()
            .unwrap()
    };
    let (g, w) = (flat(got), flat(want));
    let scale = w.iter().fold(1f64, |m, v| m.max(v.abs()));
    for (i, (a, b)) in g.iter().zip(&w).enumerate() {
        assert!(
            a.is_finite() == b.is_finite() && (!b.is_finite() || (a - b).abs() <= tol * scale),
            "{what}: element {i}: got {a} vs {b} (tolerance {tol:e} × {scale:e})"
        );
    }
}

/// Splits `x` along dim 0 into consecutive pieces of the given sizes.
pub fn split_batch(x: &Tensor, sizes: &[usize]) -> Vec<Tensor> {
    let mut out = Vec::new();
    let mut start = 0;
    for &s in sizes {
        out.push(x.narrow(0, start, s).unwrap().contiguous().unwrap());
        start += s;
    }
    out
}

/// A communicator that counts the collectives it forwards and the elements of each call's
/// tensor, and, when given a device, refuses tensors on any other device, as NCCL does: thread
/// ranks on a GPU then catch a tensor made on the wrong device, which `ThreadGroup` alone
/// would accept.
#[derive(Debug)]
pub struct Probe {
    pub inner: Arc<dyn Collective>,
    pub calls: AtomicUsize,
    /// Elements of each call's tensor, in call order (calls without a tensor not listed).
    pub elements: std::sync::Mutex<Vec<usize>>,
    /// Dtype of each call's tensor, in the same order.
    pub dtypes: std::sync::Mutex<Vec<DType>>,
    pub device: Option<Device>,
}

/// The counting-only probe (older name).
pub type Counting = Probe;

impl Probe {
    pub fn new(inner: Arc<dyn Collective>) -> Arc<Self> {
        Self::build(inner, None)
    }

    pub fn on_device(inner: Arc<dyn Collective>, dev: &Device) -> Arc<Self> {
        Self::build(inner, Some(dev.clone()))
    }

    fn build(inner: Arc<dyn Collective>, device: Option<Device>) -> Arc<Self> {
        Arc::new(Self {
            inner,
            calls: AtomicUsize::new(0),
            elements: Default::default(),
            dtypes: Default::default(),
            device,
        })
    }

    pub fn count(&self) -> usize {
        self.calls.load(Ordering::SeqCst)
    }

    /// Elements of every call's tensor so far.
    pub fn elements(&self) -> Vec<usize> {
        self.elements.lock().unwrap().clone()
    }

    /// Dtypes of every call's tensor so far.
    pub fn dtypes(&self) -> Vec<DType> {
        self.dtypes.lock().unwrap().clone()
    }

    /// Counts a call and checks its tensor's device.
    fn enter(&self, op: &str, t: Option<&Tensor>) -> candle_core::Result<()> {
        self.calls.fetch_add(1, Ordering::SeqCst);
        if let Some(t) = t {
            self.elements.lock().unwrap().push(t.elem_count());
            self.dtypes.lock().unwrap().push(t.dtype());
        }
        if let (Some(dev), Some(t)) = (&self.device, t) {
            if !t.device().same_device(dev) {
                candle_core::bail!(
                    "{op}: tensor on {:?}, the communicator on {dev:?}",
                    t.device()
                )
            }
        }
        Ok(())
    }
}

impl Decorator for Probe {
    fn inner(&self) -> &Arc<dyn Collective> {
        &self.inner
    }
    fn before(&self, op: Op, t: Option<&Tensor>) -> candle_core::Result<()> {
        self.enter(op.name(), t)
    }
    fn subgroup(&self, sub: Arc<dyn Collective>) -> Arc<dyn Collective> {
        Self::build(sub, self.device.clone())
    }
    fn tensor_device(&self) -> Device {
        self.device.clone().unwrap_or_else(|| self.inner.device())
    }
}

/// [`run_ranks`] with every communicator a [`Probe`] pinned to `dev`: a collective handed a
/// tensor on another device fails, as it would under NCCL.
pub fn run_ranks_on<R: Send>(
    world: usize,
    dev: &Device,
    f: impl Fn(Arc<dyn Collective>) -> Result<R> + Sync,
) -> Vec<R> {
    run_ranks(world, |comm| f(Probe::on_device(comm, dev)))
}

/// True when the batch-norm layer knows its global batch count on the host on `dev`, and so
/// refuses a training batch of one value per channel with an error: on the CPU, and on every
/// device when the composite path is forced (`CANDLE_DISTRIBUTED_COMPOSITE`, as CI's second
/// run of the suites sets it). The CUDA kernels never read it back: NaN outputs instead.
pub fn counts_on_host(dev: &Device) -> bool {
    let forced = std::env::var_os("CANDLE_DISTRIBUTED_COMPOSITE");
    dev.is_cpu() || forced.is_some_and(|v| !v.is_empty() && v != "0")
}

/// The CUDA device the `cuda::` variants of the tests run on: GPU 0, one `Device` shared by
/// every test and every thread rank of a process (candle treats two `Device::new_cuda(0)` as
/// different devices).
#[cfg(feature = "cuda")]
pub fn cuda_device() -> Device {
    static DEV: std::sync::OnceLock<Device> = std::sync::OnceLock::new();
    DEV.get_or_init(|| Device::new_cuda(0).expect("the cuda:: tests need a CUDA GPU"))
        .clone()
}

/// One test body per behaviour, run on every device: for each `name`, a `cpu::name` test that
/// calls `name(&Device::Cpu)` and, with the `cuda` feature, a `cuda::name` test that calls it
/// with [`cuda_device`]. Bodies have the signature `fn(&Device) -> anyhow::Result<()>`.
#[macro_export]
macro_rules! device_tests {
    ($($name:ident),* $(,)?) => {
        mod cpu {
            $(
                #[test]
                fn $name() -> anyhow::Result<()> {
                    super::$name(&candle_core::Device::Cpu)
                }
            )*
        }
        #[cfg(feature = "cuda")]
        mod cuda {
            $(
                #[test]
                fn $name() -> anyhow::Result<()> {
                    super::$name(&$crate::common::cuda_device())
                }
            )*
        }
    };
}

/// Tolerances of the suites, by what is compared; every test takes its bound from here.
pub mod tol {
    /// f64 end to end against an f64 reference: rounding only (the sums of a few hundred
    /// values in a different order).
    pub const F64: f64 = 1e-10;
    /// f64 through a training loop (optimizer steps amplify rounding a little).
    pub const F64_STEPS: f64 = 1e-9;
    /// f16 outputs and gradients against the f32 computation: 4 × f16's relative precision
    /// (9.8e-4), as the gradient goes through two rounded tensors.
    pub const F16: f64 = 4.0 * 9.8e-4;
    /// bf16 likewise: 4 × bf16's relative precision (7.9e-3).
    pub const BF16: f64 = 4.0 * 7.9e-3;
    /// f32 outputs of well-conditioned data of magnitude ~3 against f64.
    pub const F32_OUT: f64 = 1e-5;
    /// Relative error of an f32 input's statistics computed in f64 with a good shift (the
    /// input is exact in f64, so only f64 rounding remains).
    pub const F32_VAR: f64 = 1e-9;

    use candle_core::DType;

    /// A GPU op against the CPU op, relative to max(1, |value|) ([`super::assert_close_rel`]):
    /// f32 arithmetic on both sides for f32/f16/bf16 in different summation orders, then one
    /// rounding to the storage type; f64 throughout for f64.
    pub fn gpu_vs_cpu(dtype: DType) -> f64 {
        match dtype {
            DType::F64 => 1e-10,
            DType::F32 => 1e-4,
            DType::F16 => 4e-3,
            _ => 3e-2,
        }
    }

    /// An emulated reduction kernel against the CPU op, relative to the scale of the sums: f32
    /// per-thread partial sums against the CPU's f64 ones (f64 kernels accumulate in f64).
    pub fn emulated_reduce(dtype: DType) -> f64 {
        if dtype == DType::F64 {
            1e-12
        } else {
            1e-5
        }
    }

    /// An emulated element-wise kernel against the CPU op, relative to max(1, |value|): one
    /// rounding to the storage type apart (f32 arithmetic both sides for f32/f16/bf16, f64
    /// for f64).
    pub fn emulated_elem(dtype: DType) -> f64 {
        match dtype {
            DType::F64 => 1e-12,
            DType::F32 => 1e-5,
            DType::F16 => 2e-3,
            _ => 1.6e-2,
        }
    }
}

/// Step of the central finite differences (f64).
pub const FD_H: f64 = 1e-6;
/// Allowed |analytic − numeric| / max(1, |analytic|) of a central difference in f64:
/// truncation O(h²) plus rounding ε·|L|/h, for the O(1)–O(100) losses of the tests.
pub const FD_TOL: f64 = 1e-6;

/// `(f(h) − f(−h)) / 2h` with `h = FD_H`: the derivative of `f` at 0.
pub fn central_difference(f: impl Fn(f64) -> f64) -> f64 {
    (f(FD_H) - f(-FD_H)) / (2.0 * FD_H)
}

/// Asserts that an analytic derivative matches a finite difference within [`FD_TOL`].
#[track_caller]
pub fn assert_fd(what: &str, analytic: f64, numeric: f64) {
    let err = (analytic - numeric).abs() / analytic.abs().max(1.0);
    assert!(
        err <= FD_TOL,
        "{what}: analytic {analytic:e} vs finite difference {numeric:e} (error {err:e})"
    );
}
