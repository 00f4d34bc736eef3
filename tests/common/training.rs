//! A small conv + batch-norm network and the training loops of `tests/training.rs`, written
//! once per rank so that thread ranks and MPI processes (`tests/mpi.rs`) run the same ones.

use std::sync::Arc;

use anyhow::Result;
use candle_core::backprop::GradStore;
use candle_core::{DType, Device, Module, Tensor, Var, D};
use candle_distributed::collective::Collective;
use candle_distributed::{sync_batch_norm, DataParallel, SyncBatchNormConfig};
use candle_nn::{conv2d, linear, Conv2dConfig, ModuleT, Optimizer, VarBuilder, VarMap, SGD};

use super::{assert_close, randn, split_batch, Probe};

/// conv → batch norm + ReLU → conv → batch norm → spatial mean → linear, in `dtype`.
/// `comm` None: one process, SyncBatchNorm on a world of 1 (plain batch norm).
pub struct Net {
    conv1: candle_nn::Conv2d,
    bn1: candle_distributed::SyncBatchNorm,
    conv2: candle_nn::Conv2d,
    bn2: candle_distributed::SyncBatchNorm,
    fc: candle_nn::Linear,
}

pub fn net(vm: &VarMap, comm: Arc<dyn Collective>, dtype: DType) -> Net {
    let vb = VarBuilder::from_varmap(vm, dtype, &Device::Cpu);
    let relu = SyncBatchNormConfig::default().with_fuse_relu(true);
    let pad = Conv2dConfig {
        padding: 1,
        ..Default::default()
    };
    let net = Net {
        conv1: conv2d(3, 6, 3, pad, vb.pp("conv1")).unwrap(),
        bn1: sync_batch_norm(6, relu, vb.pp("bn1"), comm.clone()).unwrap(),
        conv2: conv2d(6, 5, 3, pad, vb.pp("conv2")).unwrap(),
        bn2: sync_batch_norm(
            5,
            candle_distributed::SyncBatchNormConfig::default(),
            vb.pp("bn2"),
            comm,
        )
        .unwrap(),
        fc: linear(5, 4, vb.pp("fc")).unwrap(),
    };
    seed(vm);
    net
}

/// Seeded parameters, by name (every rank and the reference alike).
fn seed(vm: &VarMap) {
    for (name, v) in vm.data().lock().unwrap().iter() {
        if name.contains("conv") || name.contains("fc") {
            let s = name
                .bytes()
                .fold(7u64, |h, b| h.wrapping_mul(31).wrapping_add(b as u64));
            let t = randn(s, v.dims(), 0.0, 0.4).to_dtype(v.dtype()).unwrap();
            v.set(&t).unwrap();
        }
    }
}

impl Net {
    pub fn logits(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let h = self.bn1.forward_t(&self.conv1.forward(x)?, true)?;
        let h = self.bn2.forward_t(&self.conv2.forward(&h)?, true)?;
        self.fc.forward(&h.mean(D::Minus1)?.mean(D::Minus1)?)
    }

    /// The sum over the batch of the per-sample cross-entropy (0 for an empty batch, still
    /// through every layer, so that the batch norms take part in their collectives).
    pub fn loss_sum(&self, x: &Tensor, y: &Tensor) -> candle_core::Result<Tensor> {
        let logits = self.logits(x)?;
        if x.dim(0)? == 0 {
            // candle's log-softmax refuses an empty tensor; a sum over dim 0 keeps the graph.
            // (candle drops an `affine` by 0 from the graph; a product with a zero tensor stays.)
            let s = logits.sum_keepdim(0)?.sum_all()?;
            return s.mul(&s.zeros_like()?);
        }
        let logp = candle_nn::ops::log_softmax(&logits, D::Minus1)?;
        logp.gather(&y.unsqueeze(1)?, 1)?.sum_all()?.neg()
    }
}

/// A batch-norm buffer's name (running statistics, counter), as opposed to a trainable one.
pub fn is_buffer(name: &str) -> bool {
    name.contains("running") || name.contains("num_batches")
}

/// Trainable variables (not the batch-norm buffers), in name order.
pub fn trainable(vm: &VarMap) -> Vec<(String, Var)> {
    let mut v: Vec<(String, Var)> = vm
        .data()
        .lock()
        .unwrap()
        .iter()
        .filter(|(k, _)| !is_buffer(k))
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    v.sort_by(|a, b| a.0.cmp(&b.0));
    v
}

/// Every variable, buffers included, copied, in name order.
pub fn snapshot(vm: &VarMap) -> Vec<(String, Tensor)> {
    let mut v: Vec<(String, Tensor)> = vm
        .data()
        .lock()
        .unwrap()
        .iter()
        .map(|(k, v)| (k.clone(), v.as_tensor().copy().unwrap()))
        .collect();
    v.sort_by(|a, b| a.0.cmp(&b.0));
    v
}

/// A batch of `n` images 3×4×4 and labels, seeded.
pub fn batch(seed: u64, n: usize) -> (Tensor, Tensor) {
    let x = randn(seed, &[n, 3, 4, 4], 0.5, 1.0);
    let y: Vec<u32> = (0..n).map(|i| ((i as u64 * 5 + seed) % 4) as u32).collect();
    (x, Tensor::new(y.as_slice(), &Device::Cpu).unwrap())
}

pub fn compare(what: &str, got: &[(String, Tensor)], want: &[(String, Tensor)], tol: f64) {
    assert_eq!(got.len(), want.len(), "{what}: variable count");
    for ((name, g), (wname, w)) in got.iter().zip(want) {
        assert_eq!(name, wname);
        let w = w.to_dtype(g.dtype()).unwrap();
        assert_close(&format!("{what}: {name}"), g, &w, tol);
    }
}

/// One process, SyncBatchNorm on a world of 1: the reference.
pub fn solo() -> Arc<dyn Collective> {
    candle_distributed::collective::ThreadGroup::new(1)
        .unwrap()
        .remove(0)
}

/// Uneven inputs: rank `r` has `batches[r]` batches of `sizes[r]` samples; it runs
/// `join_step` loops until every rank is out of data, serving the others with empty batches.
/// Returns the steps it took and its variables.
pub fn uneven_rank(
    comm: Arc<dyn Collective>,
    batches: &[usize],
    sizes: &[usize],
) -> Result<(usize, Vec<(String, Tensor)>)> {
    let r = comm.rank();
    let vm = VarMap::new();
    let model = net(&vm, comm.clone(), DType::F64);
    let dp = DataParallel::new(&vm, comm)?;
    let mut opt = SGD::new(dp.trainable(), 0.05)?;
    let mut steps = 0;
    for s in 0.. {
        let mine = (s < batches[r]).then(|| uneven_batch(sizes, r, s));
        let n = mine.as_ref().map_or(0, |(x, _)| x.dim(0).unwrap());
        let step = dp.join_step(n)?;
        if step.done() {
            break;
        }
        let (x, y) = match mine {
            Some(b) => b,
            None => (
                Tensor::zeros((0, 3, 4, 4), DType::F64, &Device::Cpu)?,
                Tensor::zeros(0, DType::U32, &Device::Cpu)?,
            ),
        };
        let loss = (model.loss_sum(&x, &y)? * step.loss_weight())?;
        opt.step(&dp.sync_gradients(loss.backward()?)?)?;
        steps += 1;
    }
    Ok((steps, snapshot(&vm)))
}

fn uneven_batch(sizes: &[usize], r: usize, s: usize) -> (Tensor, Tensor) {
    batch(300 + 10 * s as u64 + r as u64, sizes[r])
}

/// One process on the concatenation of each step's batches (of the ranks that still have
/// one), mean loss over the step's samples.
pub fn uneven_reference(batches: &[usize], sizes: &[usize]) -> Vec<(String, Tensor)> {
    let vm = VarMap::new();
    let model = net(&vm, solo(), DType::F64);
    let mut opt = SGD::new(trainable(&vm).into_iter().map(|(_, v)| v).collect(), 0.05).unwrap();
    let steps = batches.iter().copied().max().unwrap_or(0);
    for s in 0..steps {
        let parts: Vec<(Tensor, Tensor)> = (0..batches.len())
            .filter(|&r| s < batches[r])
            .map(|r| uneven_batch(sizes, r, s))
            .collect();
        let x = Tensor::cat(&parts.iter().map(|p| &p.0).collect::<Vec<_>>(), 0).unwrap();
        let y = Tensor::cat(&parts.iter().map(|p| &p.1).collect::<Vec<_>>(), 0).unwrap();
        let n = x.dim(0).unwrap() as f64;
        let loss = (model.loss_sum(&x, &y).unwrap() / n).unwrap();
        opt.step(&loss.backward().unwrap()).unwrap();
    }
    snapshot(&vm)
}

/// Gradient accumulation on one rank: 2 steps of `k` micro-batches of 8 samples shared
/// equally by the ranks, one gradient all-reduce per step, SGD. Returns the variables and the
/// number of collectives the rank issued.
pub fn accumulated_rank(
    comm: Arc<dyn Collective>,
    k: usize,
    wire: Option<DType>,
    dtype: DType,
) -> Result<(Vec<(String, Tensor)>, usize)> {
    let world = comm.world_size();
    let probe = Probe::new(comm);
    let comm: Arc<dyn Collective> = probe.clone();
    let vm = VarMap::new();
    let model = net(&vm, comm.clone(), dtype);
    let dp = DataParallel::new(&vm, comm.clone())?.with_wire_dtype(wire)?;
    let mut opt = SGD::new(dp.trainable(), 0.05)?;
    let start = probe.count();
    let sizes = vec![8 / world; world];
    for s in 0..2u64 {
        let mut acc: Option<GradStore> = None;
        for m in 0..k as u64 {
            let (x, y) = batch(200 + 10 * s + m, 8);
            let x = split_batch(&x.to_dtype(dtype)?, &sizes)[comm.rank()].clone();
            let y = split_batch(&y, &sizes)[comm.rank()].clone();
            // Mean over the global micro-batch, and over the k micro-batches.
            let w = world as f64 / (8 * k) as f64;
            let loss = (model.loss_sum(&x, &y)? * w)?;
            acc = Some(dp.accumulate(acc, loss.backward()?)?);
        }
        opt.step(&dp.sync_gradients(acc.unwrap_or_default())?)?;
    }
    Ok((snapshot(&vm), probe.count() - start))
}

/// One process, the same micro-batches, gradients summed over the k micro-batches.
pub fn accumulated_reference(k: usize, dtype: DType) -> Vec<(String, Tensor)> {
    let vm = VarMap::new();
    let model = net(&vm, solo(), dtype);
    let mut opt = SGD::new(trainable(&vm).into_iter().map(|(_, v)| v).collect(), 0.05).unwrap();
    for s in 0..2u64 {
        let mut total: Option<Tensor> = None;
        for m in 0..k as u64 {
            let (x, y) = batch(200 + 10 * s + m, 8);
            let l = (model.loss_sum(&x.to_dtype(dtype).unwrap(), &y).unwrap() / (8 * k) as f64)
                .unwrap();
            total = Some(match total {
                Some(t) => (t + l).unwrap(),
                None => l,
            });
        }
        opt.step(&total.unwrap().backward().unwrap()).unwrap();
    }
    snapshot(&vm)
}
