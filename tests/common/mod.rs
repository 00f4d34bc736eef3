//! Helpers shared by the integration tests: seeded data, layers with given parameters, thread
//! ranks, a counting communicator and an obviously-correct reference batch norm.
#![allow(dead_code)]

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use anyhow::Result;
use candle_core::{DType, Device, Tensor, Var, D};
use candle_distributed::collective::{Collective, Pending, ReduceOp, ThreadGroup};
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

/// A layer whose variables live in a fresh `VarMap` (returned, to read gradients by name).
pub fn layer(
    c: usize,
    config: SyncBatchNormConfig,
    comm: Arc<dyn Collective>,
    params: Option<&Params>,
    dtype: DType,
) -> (SyncBatchNorm, VarMap) {
    let vm = VarMap::new();
    if let Some(p) = params {
        let mut data = vm.data().lock().unwrap();
        for (name, v) in [("weight", &p.weight), ("bias", &p.bias)] {
            let t = Tensor::new(v.as_slice(), &Device::Cpu)
                .unwrap()
                .to_dtype(dtype)
                .unwrap();
            data.insert(name.to_string(), Var::from_tensor(&t).unwrap());
        }
    }
    let vb = VarBuilder::from_varmap(&vm, dtype, &Device::Cpu);
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

/// Largest absolute difference of two tensors of the same shape.
pub fn max_abs_diff(a: &Tensor, b: &Tensor) -> f64 {
    assert_eq!(a.dims(), b.dims(), "shapes differ");
    if a.elem_count() == 0 {
        return 0.0;
    }
    let a = a.to_dtype(DType::F64).unwrap();
    let b = b.to_dtype(DType::F64).unwrap();
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

/// A communicator that counts the collectives it forwards.
#[derive(Debug)]
pub struct Counting {
    pub inner: Arc<dyn Collective>,
    pub calls: AtomicUsize,
}

impl Counting {
    pub fn new(inner: Arc<dyn Collective>) -> Arc<Self> {
        Arc::new(Self {
            inner,
            calls: AtomicUsize::new(0),
        })
    }

    pub fn count(&self) -> usize {
        self.calls.load(Ordering::SeqCst)
    }
}

impl Collective for Counting {
    fn rank(&self) -> usize {
        self.inner.rank()
    }
    fn world_size(&self) -> usize {
        self.inner.world_size()
    }
    fn all_reduce(&self, t: &Tensor, op: ReduceOp) -> candle_core::Result<Tensor> {
        self.calls.fetch_add(1, Ordering::SeqCst);
        self.inner.all_reduce(t, op)
    }
    fn all_gather(&self, t: &Tensor) -> candle_core::Result<Tensor> {
        self.calls.fetch_add(1, Ordering::SeqCst);
        self.inner.all_gather(t)
    }
    fn broadcast(&self, t: &Tensor, root: usize) -> candle_core::Result<Tensor> {
        self.calls.fetch_add(1, Ordering::SeqCst);
        self.inner.broadcast(t, root)
    }
    fn barrier(&self) -> candle_core::Result<()> {
        self.calls.fetch_add(1, Ordering::SeqCst);
        self.inner.barrier()
    }
    fn reduce_scatter(&self, t: &Tensor, op: ReduceOp) -> candle_core::Result<Tensor> {
        self.calls.fetch_add(1, Ordering::SeqCst);
        self.inner.reduce_scatter(t, op)
    }
    fn split(
        &self,
        color: Option<u32>,
        key: u32,
    ) -> candle_core::Result<Option<Arc<dyn Collective>>> {
        self.calls.fetch_add(1, Ordering::SeqCst);
        self.inner.split(color, key)
    }
    fn all_reduce_async(&self, t: &Tensor, op: ReduceOp) -> candle_core::Result<Pending> {
        self.calls.fetch_add(1, Ordering::SeqCst);
        self.inner.all_reduce_async(t, op)
    }
    fn all_gather_async(&self, t: &Tensor) -> candle_core::Result<Pending> {
        self.calls.fetch_add(1, Ordering::SeqCst);
        self.inner.all_gather_async(t)
    }
    fn reduce_scatter_async(&self, t: &Tensor, op: ReduceOp) -> candle_core::Result<Pending> {
        self.calls.fetch_add(1, Ordering::SeqCst);
        self.inner.reduce_scatter_async(t, op)
    }
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
