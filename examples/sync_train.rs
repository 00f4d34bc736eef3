//! Data-parallel training in one file: a small convolutional network with `SyncBatchNorm`
//! trained by `DataParallel` on 4 thread ranks of unequal batches, and the same network with
//! `candle_nn::BatchNorm` trained in one process on the concatenated global batch. Prints the
//! loss, the eval accuracy and the largest parameter / running-statistic difference between the
//! two, which must stay at rounding level; exits non-zero when it does not.
//!
//! `cargo run --release --example sync_train [-- --steps 60 --world-size 4 --overlap]`
//!
//! The loop is the README's: `DataParallel::new` gives every rank rank 0's weights,
//! `sync_gradients` averages the gradients over ranks. With `--overlap`, the model is built
//! through `GradHooks` and `DataParallel::step` starts each bucket's all-reduce during the
//! backward (the same steps, bit for bit). Rank r's loss is its batch mean scaled by
//! `W·n_r / N` (N the global batch), so the average is the gradient of the global mean loss.

use std::collections::HashMap;
use std::sync::Arc;

use anyhow::{bail, Result};
use candle_core::{DType, Device, Module, ModuleT, Tensor, D};
use candle_distributed::collective::{Collective, ReduceOp, ThreadGroup};
use candle_distributed::{sync_batch_norm, DataParallel, GradHooks, SyncBatchNormConfig};
use candle_nn::{Conv2dConfig, Optimizer, VarBuilder, VarMap};
use clap::Parser;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

const CLASSES: usize = 4;
const SIDE: usize = 16;
/// Largest allowed |SyncBatchNorm run − single-process run| / max(1, |single-process run|) over
/// parameters and running statistics (f32 rounding, accumulated over the steps).
const CHECK_TOL: f32 = 1e-3;

/// Builds the normalisation layer of `c` channels under `vb`.
type NormFactory<'a> = dyn Fn(usize, VarBuilder) -> Result<Box<dyn ModuleT + Send + Sync>> + 'a;

struct Net {
    c1: candle_nn::Conv2d,
    n1: Box<dyn ModuleT + Send + Sync>,
    c2: candle_nn::Conv2d,
    n2: Box<dyn ModuleT + Send + Sync>,
    head: candle_nn::Linear,
}

impl Net {
    /// `norm(c, vb)` builds the normalisation layer: this is the one-argument swap.
    fn new(vb: VarBuilder, norm: &NormFactory) -> Result<Self> {
        let cfg = Conv2dConfig {
            padding: 1,
            ..Default::default()
        };
        let cfg2 = Conv2dConfig {
            padding: 1,
            stride: 2,
            ..Default::default()
        };
        Ok(Self {
            c1: candle_nn::conv2d_no_bias(3, 16, 3, cfg, vb.pp("conv1"))?,
            n1: norm(16, vb.pp("bn1"))?,
            c2: candle_nn::conv2d_no_bias(16, 32, 3, cfg2, vb.pp("conv2"))?,
            n2: norm(32, vb.pp("bn2"))?,
            head: candle_nn::linear(32, CLASSES, vb.pp("fc"))?,
        })
    }

    /// `x`: `(N, 3, 16, 16)` → logits `(N, 4)`.
    fn forward(&self, x: &Tensor, train: bool) -> Result<Tensor> {
        let x = self.n1.forward_t(&self.c1.forward(x)?, train)?.relu()?;
        let x = self.n2.forward_t(&self.c2.forward(&x)?, train)?.relu()?;
        Ok(self.head.forward(&x.mean(D::Minus1)?.mean(D::Minus1)?)?)
    }
}

/// Deterministic synthetic images: stripes of four orientations/frequencies plus noise.
fn batch(seed: u64, n: usize) -> Result<(Tensor, Tensor)> {
    let mut s = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    let mut rnd = move || {
        s = s
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((s >> 33) as f32) / (1u64 << 31) as f32
    };
    let (mut xs, mut ys) = (
        Vec::with_capacity(n * 3 * SIDE * SIDE),
        Vec::with_capacity(n),
    );
    for _ in 0..n {
        let class = (rnd() * CLASSES as f32) as usize % CLASSES;
        let phase = rnd() * std::f32::consts::TAU;
        let tint = [rnd(), rnd(), rnd()];
        for tint in tint {
            for i in 0..SIDE {
                for j in 0..SIDE {
                    let (fi, fj) = (i as f32, j as f32);
                    let t = match class {
                        0 => fi * 0.8,
                        1 => fj * 0.8,
                        2 => (fi + fj) * 0.6,
                        _ => (fi - fj) * 0.6,
                    };
                    xs.push((t + phase).sin() * (0.5 + tint) + 0.8 * (rnd() - 0.5));
                }
            }
        }
        ys.push(class as u32);
    }
    Ok((
        Tensor::from_vec(xs, (n, 3, SIDE, SIDE), &Device::Cpu)?,
        Tensor::new(ys, &Device::Cpu)?,
    ))
}

/// The command line.
#[derive(Parser)]
#[command(about = "SyncBatchNorm + DataParallel on thread ranks against one process")]
struct Args {
    /// Optimizer steps.
    #[arg(long, default_value_t = 60)]
    steps: usize,
    /// Thread ranks (the global batch of 48 is split unequally among them).
    #[arg(long, default_value_t = 4, value_parser = clap::value_parser!(u64).range(1..=16))]
    world_size: u64,
    /// Seed of the initial weights (candle's CPU initialisers cannot be seeded).
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Start each gradient bucket's all-reduce during the backward (`GradHooks`,
    /// `DataParallel::with_overlap`, `DataParallel::step`).
    #[arg(long)]
    overlap: bool,
}

/// Per-rank batch sizes of a global batch: deliberately unequal (pairs of ranks with 2 more and
/// 2 fewer than the even share, the remainder on the last rank). `world` ≤ 16: every rank keeps
/// at least one sample of the 48.
fn split(global: usize, world: usize) -> Vec<usize> {
    let base = global / world;
    let mut sizes: Vec<usize> = (0..world)
        .map(|r| match (r % 2, r + 1 < world) {
            (0, true) => base + 2,
            (1, _) => base - 2,
            _ => base,
        })
        .collect();
    sizes[world - 1] += global - base * world;
    sizes
}

/// Replaces the convolution and linear weights and biases of `vm` with U(−1/√fan_in, 1/√fan_in)
/// draws from `seed` (candle's own initialisation, reproducibly); batch-norm variables keep
/// their ones and zeros.
fn seeded_init(vm: &VarMap, seed: u64) -> Result<()> {
    let mut rng = StdRng::seed_from_u64(seed);
    let data = vm.data().lock().unwrap();
    let mut names: Vec<&String> = data.keys().collect();
    names.sort();
    for name in names.into_iter().filter(|n| !n.starts_with("bn")) {
        let var = &data[name];
        let dims = var.dims();
        let fan_in = if name.ends_with("bias") {
            data[&name.replace("bias", "weight")].elem_count() / dims[0]
        } else {
            var.elem_count() / dims[0]
        };
        let bound = 1.0 / (fan_in as f32).sqrt();
        let values: Vec<f32> = (0..var.elem_count())
            .map(|_| rng.gen_range(-bound..bound))
            .collect();
        var.set(&Tensor::from_vec(values, dims, &Device::Cpu)?)?;
    }
    Ok(())
}

fn snapshot(vm: &VarMap) -> HashMap<String, Tensor> {
    vm.data()
        .lock()
        .unwrap()
        .iter()
        .map(|(k, v)| (k.clone(), v.as_tensor().copy().unwrap()))
        .collect()
}

/// What every rank needs to know about the run.
struct Setup {
    steps: usize,
    world: usize,
    global: usize,
    lr: f64,
    sizes: Vec<usize>,
    init: HashMap<String, Tensor>,
    overlap: bool,
}

/// One rank's training: returns its final variables and the eval accuracy of the whole group.
fn rank_main(comm: Arc<dyn Collective>, setup: &Setup) -> Result<(HashMap<String, Tensor>, f32)> {
    let Setup {
        steps,
        world,
        global,
        lr,
        ref sizes,
        ref init,
        overlap,
    } = *setup;
    let rank = comm.rank();
    let vm = VarMap::new();
    let sync = |c: usize, vb: VarBuilder| -> Result<Box<dyn ModuleT + Send + Sync>> {
        Ok(Box::new(sync_batch_norm(
            c,
            SyncBatchNormConfig::default(),
            vb,
            comm.clone(),
        )?))
    };
    let hooks = GradHooks::new();
    let vb = if overlap {
        hooks.var_builder(&vm, DType::F32, &Device::Cpu)
    } else {
        VarBuilder::from_varmap(&vm, DType::F32, &Device::Cpu)
    };
    let net = Net::new(vb, &sync)?;
    if rank == 0 {
        // The reference's initial weights (as a checkpoint load would); `DataParallel::new`
        // hands rank 0's to every rank. SyncBatchNorm's `num_batches_tracked` keeps its 0.
        for (name, var) in vm.data().lock().unwrap().iter() {
            if let Some(t) = init.get(name) {
                var.set(t)?;
            }
        }
    }
    let mut dp = DataParallel::new(&vm, comm.clone())?;
    if overlap {
        dp = dp.with_overlap(&hooks)?; // also copies rank 0's weights into the hooked copies
    }
    let mut opt = candle_nn::SGD::new(dp.trainable(), lr)?;
    let offset: usize = sizes[..rank].iter().sum();
    for step in 0..steps {
        let (x, y) = batch(step as u64, global)?;
        let (x, y) = (
            x.narrow(0, offset, sizes[rank])?,
            y.narrow(0, offset, sizes[rank])?,
        );
        let logits = net.forward(&x, true)?;
        // W·n_r/N: the average over ranks is then the gradient of the global mean loss.
        let weight = (world * sizes[rank]) as f64 / global as f64;
        let loss = (candle_nn::loss::cross_entropy(&logits, &y)? * weight)?;
        if overlap {
            dp.step(&mut opt, &loss)?; // backward with the all-reduce overlapped, step, refresh
        } else {
            opt.step(&dp.sync_gradients(loss.backward()?)?)?;
        }
        let total = (comm.all_reduce(&loss, ReduceOp::Sum)? / world as f64)?.to_scalar::<f32>()?;
        if rank == 0 && (step % 10 == 0 || step + 1 == steps) {
            println!("step {step:3}  global loss {total:.4}");
        }
    }
    // Eval on held-out data, each rank on its own slice, accuracy summed over ranks.
    let (x, y) = batch(1_000_000, 256)?;
    let per = 256 / world;
    let (x, y) = (x.narrow(0, rank * per, per)?, y.narrow(0, rank * per, per)?);
    let pred = net.forward(&x, false)?.argmax(D::Minus1)?;
    let correct = pred.eq(&y)?.to_dtype(DType::F32)?.sum_all()?;
    let acc = comm
        .all_reduce(&correct, ReduceOp::Sum)?
        .to_scalar::<f32>()?
        / (per * world) as f32;
    Ok((snapshot(&vm), acc))
}

fn main() -> Result<()> {
    let args = Args::parse();
    let (steps, world) = (args.steps, args.world_size as usize);
    let global = 48;
    let lr = 0.1;
    let sizes = split(global, world);
    let start = std::time::Instant::now();

    // Single-process reference with candle-nn's BatchNorm; its initial weights seed every rank.
    let ref_vm = VarMap::new();
    let plain = |c: usize, vb: VarBuilder| -> Result<Box<dyn ModuleT + Send + Sync>> {
        Ok(Box::new(candle_nn::batch_norm(c, 1e-5, vb)?))
    };
    let reference = Net::new(
        VarBuilder::from_varmap(&ref_vm, DType::F32, &Device::Cpu),
        &plain,
    )?;
    seeded_init(&ref_vm, args.seed)?;
    let init = snapshot(&ref_vm);

    let setup = Setup {
        steps,
        world,
        global,
        lr,
        sizes: sizes.clone(),
        init,
        overlap: args.overlap,
    };
    let results = ThreadGroup::run(world, |comm| {
        rank_main(comm, &setup).map_err(|e| candle_core::Error::Msg(format!("{e:#}")))
    })?;
    let mut opt = candle_nn::SGD::new(ref_vm.all_vars(), lr)?;
    for step in 0..steps {
        let (x, y) = batch(step as u64, global)?;
        let loss = candle_nn::loss::cross_entropy(&reference.forward(&x, true)?, &y)?;
        opt.backward_step(&loss)?;
    }
    let trained = snapshot(&ref_vm);
    let mut worst = (0f32, String::new());
    for (rank, (vars, _)) in results.iter().enumerate() {
        for (name, t) in vars {
            if name.ends_with("num_batches_tracked") {
                continue;
            }
            let want = trained[name].to_dtype(DType::F32)?;
            // |a − b| / max(1, |b|): absolute for small values, relative for large ones.
            let scale = want.abs()?.maximum(1f32)?;
            let d = ((t.to_dtype(DType::F32)? - &want)?.abs()? / scale)?
                .flatten_all()?
                .max(0)?
                .to_scalar::<f32>()?;
            if d > worst.0 {
                worst = (d, format!("{name} on rank {rank}"));
            }
        }
    }
    let acc = results[0].1;
    println!(
        "per-rank batches {sizes:?}; eval accuracy {:.1} %",
        100.0 * acc
    );
    println!(
        "largest (relative) difference from the single-process run: {:.2e} ({})",
        worst.0, worst.1
    );
    println!(
        "{{\"steps\":{steps},\"world_size\":{world},\"val_acc\":{acc:.4},\"max_param_diff\":{:.3e},\"seconds\":{:.1}}}",
        worst.0,
        start.elapsed().as_secs_f64()
    );
    if worst.0 > CHECK_TOL {
        bail!("SyncBatchNorm on {world} ranks diverged from single-process batch norm by {:.2e} > {CHECK_TOL:e}", worst.0);
    }
    Ok(())
}
