//! One rank's training loop, the run over all ranks of a backend, and the `--check` comparison.

use std::sync::Arc;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use candle_core::{DType, Device, Tensor, D};
use candle_distributed::amp::GradScaler;
use candle_distributed::collective::{Collective, CollectiveError, ReduceOp, ThreadGroup};
use candle_distributed::DistributedSampler;
use candle_nn::{Optimizer, VarMap};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use crate::checkpoint;
pub use crate::config::{Config, DeviceKind, Precision, Summary};
use crate::data::{self, Dataset};
use crate::model::{self, ResNet};
use crate::report::{self, EpochMetrics, Progress};
use crate::state::{save_checkpoint, setup, write_reports, State};

/// The datasets: CIFAR-10 from `data_dir`, else the synthetic set.
pub fn datasets(cfg: &Config) -> Result<(Dataset, Dataset)> {
    match &cfg.data_dir {
        Some(dir) => data::cifar10(dir),
        None => Ok((
            data::synthetic(cfg.train_size, cfg.image_size, cfg.seed),
            data::synthetic(cfg.val_size, cfg.image_size, cfg.seed + 1_000_003),
        )),
    }
}

/// Deterministic initial weights from `seed` (every rank and every run alike): convolutions
/// Kaiming-normal (fan-out, as torchvision), the classifier uniform ±1/sqrt(fan-in); batch-norm
/// parameters and buffers keep their construction values (γ = 1, β = 0, mean 0, var 1).
pub fn init_weights(vm: &VarMap, seed: u64) -> Result<()> {
    let data = vm.data().lock().expect("VarMap lock");
    for name in data.keys() {
        let v = &data[name];
        let dims = v.dims().to_vec();
        // Seeded by name: models with other buffers (plain vs synchronized batch norm) get the
        // same weights.
        let by_name = name
            .bytes()
            .fold(0u64, |h, b| h.wrapping_mul(31).wrapping_add(b as u64));
        let mut rng = StdRng::seed_from_u64(seed.wrapping_mul(1_000_003) ^ by_name);
        let n = v.elem_count();
        let vals: Vec<f64> = if dims.len() == 4 {
            let std = (2.0 / (dims[0] * dims[2] * dims[3]) as f64).sqrt();
            (0..n).map(|_| std * gauss(&mut rng)).collect()
        } else if name.starts_with("fc.") {
            let fan_in = if dims.len() == 2 {
                dims[1]
            } else {
                data["fc.weight"].dims()[1]
            };
            let b = 1.0 / (fan_in as f64).sqrt();
            (0..n).map(|_| rng.gen_range(-b..b)).collect()
        } else {
            continue;
        };
        let t = Tensor::from_vec(vals, dims, &Device::Cpu)?
            .to_dtype(v.dtype())?
            .to_device(v.device())?;
        v.set(&t)?;
    }
    Ok(())
}

fn gauss(rng: &mut StdRng) -> f64 {
    let (u, v): (f64, f64) = (rng.gen_range(1e-12..1.0), rng.gen());
    (-2.0 * u.ln()).sqrt() * (2.0 * std::f64::consts::PI * v).cos()
}

/// `total` split into `parts` contiguous sizes differing by at most one.
pub fn split_sizes(total: usize, parts: usize) -> Vec<usize> {
    (0..parts)
        .map(|r| total / parts + usize::from(r < total % parts))
        .collect()
}

/// The learning rate at `step` of `total`: linear warm-up over the first 3 %, then cosine decay.
fn lr_at(base: f64, step: usize, total: usize) -> f64 {
    let warm = (total / 33).max(1);
    if step < warm {
        return base * (step + 1) as f64 / warm as f64;
    }
    let p = (step - warm) as f64 / (total - warm).max(1) as f64;
    base * 0.5 * (1.0 + (std::f64::consts::PI * p).cos())
}

/// The sum over the batch of the per-sample cross-entropy. An empty batch (a rank with no
/// data this step) gives 0 through every layer, so that its batch norms still take part in
/// their collectives (candle's log-softmax refuses an empty tensor, and drops a product by the
/// constant 0 from the graph; a product with a zero tensor stays in it).
fn loss_sum(logits: &Tensor, y: &Tensor) -> Result<Tensor> {
    let n = logits.dim(0)?;
    if n == 0 {
        let s = logits.sum_keepdim(0)?.sum_all()?;
        return Ok(s.mul(&s.zeros_like()?)?);
    }
    Ok((candle_nn::loss::cross_entropy(logits, y)? * n as f64)?)
}

/// What every step of one rank's run reads.
struct Run<'a> {
    comm: &'a Arc<dyn Collective>,
    device: &'a Device,
    cfg: &'a Config,
    train: &'a Dataset,
    /// The training set's per-channel mean and standard deviation (input normalisation).
    stats: ([f32; 3], [f32; 3]),
    /// Every sample of every epoch: the last global batch may be smaller, and then some ranks'
    /// shares may be empty (they serve the collectives with empty batches).
    steps_per_epoch: usize,
    total_steps: usize,
}

/// Trains on this rank; every rank returns the same summary.
pub fn train_rank(
    comm: Arc<dyn Collective>,
    device: Device,
    cfg: &Config,
    train: &Dataset,
    val: &Dataset,
) -> Result<Summary> {
    if cfg.batch_size == 0 || cfg.accumulate == 0 {
        bail!("--batch-size and --accumulate must be at least 1");
    }
    // One live run per output folder: a second one (a sweep, a second launch with the default
    // --out-dir) is refused at its start instead of overwriting this one's files.
    let _run_lock = if cfg.write_outputs {
        let held = match comm.rank() {
            0 => lock_out_dir(&cfg.out_dir).map(Some),
            _ => Ok(None),
        };
        agree_on(&comm, &device, "take the output folder", held)?
    } else {
        None
    };
    let mut st = setup(&comm, &device, cfg, train.classes, train.len())?;
    let steps_per_epoch = train.len().div_ceil(cfg.batch_size);
    if steps_per_epoch == 0 {
        bail!("the training set is empty");
    }
    let run = Run {
        comm: &comm,
        device: &device,
        cfg,
        train,
        stats: data::channel_stats(train),
        steps_per_epoch,
        total_steps: cfg.max_steps.unwrap_or(steps_per_epoch * cfg.epochs),
    };
    let start = Instant::now();
    // On resume, the earlier epochs' rows: the CSV beside the checkpoint, written by the run
    // that wrote it (the new run's --out-dir may be another folder). Only rank 0 uses them, so
    // only rank 0 reads them, and every rank learns whether it could (a malformed copy must
    // not stop rank 0 alone while the others wait in their next collective).
    let earlier = match (&cfg.resume, comm.rank()) {
        (Some(resume), 0) => report::read_csv(&checkpoint::dir_of(resume).join("metrics.csv")),
        _ => Ok(Vec::new()),
    };
    let mut metrics: Vec<EpochMetrics> = agree_on(&comm, &device, "read the metrics", earlier)?
        .into_iter()
        .filter(|m| m.epoch <= st.epoch)
        .collect();
    let earlier_seconds = metrics.last().map_or(0.0, |m| m.seconds);
    let mut images_seen = 0usize;
    for epoch in st.epoch..cfg.epochs {
        let epoch_start = Instant::now();
        let Some([loss, correct, samples]) = run_epoch(&run, &mut st, epoch, &mut images_seen)?
        else {
            break; // --stop-after-step: left after a checkpoint mid-epoch
        };
        let (val_loss, val_acc) = evaluate(&comm, &st.model, val, &run.stats, cfg, &device)?;
        metrics.push(EpochMetrics {
            epoch: epoch + 1,
            train_loss: loss / samples.max(1.0),
            train_acc: correct / samples.max(1.0),
            val_loss,
            val_acc,
            images_per_sec: samples / epoch_start.elapsed().as_secs_f64(),
            // Continued across a resume: the run's time so far, the earlier rows' included.
            seconds: earlier_seconds + start.elapsed().as_secs_f64(),
        });
        st.epoch = epoch + 1;
        // Nothing of the epoch was lost to an aborted collective (the evaluation's all-reduce
        // included) before rank 0 writes what it computed.
        comm.deferred_error()?;
        if comm.rank() == 0 {
            print_epoch(&metrics[metrics.len() - 1]);
        }
        if cfg.write_outputs {
            // The checkpoint first (rank 0 writes, every rank learns the outcome), then rank
            // 0's CSV and chart, whose outcome every rank learns too.
            save_checkpoint(cfg, &st, &comm, None, run.train.len())?;
            let written = if comm.rank() == 0 {
                write_reports(cfg, &metrics)
            } else {
                Ok(())
            };
            agree_on_write(&comm, &device, written)?;
        }
        if st.step >= run.total_steps || cfg.stop_after_epoch == Some(st.epoch) {
            break;
        }
    }
    let seconds = start.elapsed().as_secs_f64();
    Ok(Summary {
        rank: comm.rank(),
        epochs: metrics,
        world_size: comm.world_size(),
        seconds,
        images_per_sec: images_seen as f64 / seconds,
        params: host_params(&st.vm)?,
    })
}

/// The steps of `epoch` (0-based; until the run's last step), in the epoch's shuffled order,
/// from the step a mid-epoch checkpoint reached, with a progress bar on rank 0; with
/// `--save-every`, a checkpoint every so many steps. Returns the loss sum, correct predictions
/// and samples, or `None` after `--stop-after-step`'s checkpoint.
fn run_epoch(
    run: &Run,
    st: &mut State,
    epoch: usize,
    images_seen: &mut usize,
) -> Result<Option<[f64; 3]>> {
    let cfg = run.cfg;
    // The epoch's order of the whole training set: the library sampler's (a function of the
    // seed and the epoch only, stable across platforms and dependency versions); each step
    // takes the next global batch of it and shares it among the ranks (`micro_shares`).
    let order = DistributedSampler::new(run.train.len(), 0, 1)?
        .with_seed(cfg.seed)
        .epoch_order(epoch as u64);
    let progress = Progress::new(
        run.steps_per_epoch,
        epoch + 1,
        cfg.epochs,
        run.comm.rank() == 0,
    )?;
    // A resume mid-epoch starts at the step its checkpoint reached, with the sums so far.
    let first = st.step.saturating_sub(epoch * run.steps_per_epoch);
    let mut sums = st.partial.take().unwrap_or([0f64; 3]);
    for s in first..run.steps_per_epoch {
        if st.step >= run.total_steps {
            break;
        }
        let global = &order[s * cfg.batch_size..((s + 1) * cfg.batch_size).min(order.len())];
        let g = train_step(run, st, global)?;
        for (a, b) in sums.iter_mut().zip(g) {
            *a += b;
        }
        *images_seen += global.len();
        st.step += 1;
        progress.update(
            s + 1,
            sums[0] / sums[2].max(1.0),
            sums[1] / sums[2].max(1.0),
            *images_seen,
        );
        if cfg.exit_at_step == Some(st.step) && run.comm.rank() == 1 && first_attempt() {
            eprintln!("rank 1: exiting after step {} (--exit-at-step)", st.step);
            std::process::exit(1);
        }
        let last = s + 1 == run.steps_per_epoch;
        if cfg.write_outputs
            && !last
            && cfg
                .save_every
                .is_some_and(|n| st.step.is_multiple_of(n.max(1)))
        {
            run.comm.deferred_error()?;
            save_checkpoint(cfg, st, run.comm, Some(sums), run.train.len())?;
            if cfg.stop_after_step == Some(st.step) {
                progress.finish();
                return Ok(None);
            }
        }
    }
    progress.finish();
    Ok(Some(sums))
}

/// Whether this process is a torchrun worker on the launch's first attempt.
fn first_attempt() -> bool {
    std::env::var("TORCHELASTIC_RESTART_COUNT").is_ok_and(|c| c.trim() == "0")
}

/// Rank 0's line per epoch on stdout.
fn print_epoch(m: &EpochMetrics) {
    println!(
        "epoch {:>3}  train loss {:.4}  acc {:5.1}%  val loss {:.4}  acc {:5.1}%  {:.0} img/s  {:.1} s",
        m.epoch,
        m.train_loss,
        100.0 * m.train_acc,
        m.val_loss,
        100.0 * m.val_acc,
        m.images_per_sec,
        m.seconds
    );
}

/// Every variable of `vm` on the host, sorted by name (the summary's parameters).
fn host_params(vm: &VarMap) -> Result<Vec<(String, Tensor)>> {
    let mut params: Vec<(String, Tensor)> = vm
        .data()
        .lock()
        .expect("VarMap lock")
        .iter()
        .map(|(k, v)| Ok((k.clone(), v.as_tensor().to_device(&Device::Cpu)?)))
        .collect::<Result<_>>()?;
    params.sort_by(|a, b| a.0.cmp(&b.0));
    Ok(params)
}

/// One optimizer step on the global batch `global` (sample indices), in `cfg.accumulate`
/// micro-batches: the global batch is cut into micro-batches first and each is shared among
/// the ranks, so a micro-batch holds the same samples whatever the world size (its batch-norm
/// statistics are those of one process accumulating over the same micro-batches). Gradients
/// are summed locally and all-reduced once. Returns the step's global loss sum, correct
/// predictions and sample count.
fn train_step(run: &Run, st: &mut State, global: &[usize]) -> Result<[f64; 3]> {
    let (cfg, device) = (run.cfg, run.device);
    let (rank, world) = (run.comm.rank(), run.comm.world_size());
    let k = cfg.accumulate;
    let micro = micro_shares(global, k, rank, world);
    let local: usize = micro.iter().map(|m| m.len()).sum();
    // Every rank knows every rank's share here, so `join_step` serves as a check that the
    // ranks agree on the step, and gives the loss weight.
    let join = st.dp.join_step(local)?;
    if join.samples != global.len() {
        bail!(
            "step {}: the ranks' batches add up to {}, not {}",
            st.step,
            join.samples,
            global.len()
        );
    }
    st.opt
        .set_learning_rate(lr_at(cfg.lr, st.step, run.total_steps));
    let mut grads = None;
    let (overlap, last) = (cfg.overlap, micro.len());
    let mut synced = None;
    // Per micro-batch loss sums and hit counts, kept on the device until the step's one
    // all-reduce (no host read per micro-batch).
    let mut totals: Vec<Tensor> = Vec::with_capacity(2 * k);
    for (m, idx) in micro.into_iter().enumerate() {
        // The step's augmentation seed; each sample draws from (seed, its index).
        let aug_seed = cfg.seed ^ ((st.step as u64 + 7) * 0x2545_f491);
        let augment = cfg.augment.then_some((aug_seed, 2usize));
        let (x, y) = data::batch(run.train, idx, &run.stats, augment, device)?;
        let logits = st
            .model
            .forward(&model::cast(&x, cfg.compute_dtype())?, true)?;
        let loss = loss_sum(&logits, &y)?;
        // Weighted by W / N: DataParallel's average over the W ranks is then the gradient of
        // the mean loss over the step's N samples.
        // With f16, also multiplied by the loss scale (exact: a power of two).
        let scale = st.scaler.as_ref().map_or(1.0, GradScaler::scale_factor);
        let weighted = (&loss * (join.loss_weight() * scale))?;
        if overlap && m + 1 == last {
            // The last micro-batch's backward starts the buckets as their gradients complete
            // (the earlier micro-batches' sum riding along) and returns the averages.
            synced = Some(st.dp.backward_accumulated(&weighted, grads.take())?);
        } else {
            grads = Some(st.dp.accumulate(grads, weighted.backward()?)?);
        }
        totals.push(Tensor::stack(
            &[loss.to_dtype(DType::F64)?, hits(&logits, &y)?],
            0,
        )?);
    }
    let synced = match synced {
        Some(g) => g,
        None => st.dp.sync_gradients(grads.unwrap_or_default())?,
    };
    optimizer_step(st, synced)?;
    // Global loss, accuracy and count of this step: one small all-reduce.
    let mut mine = Tensor::new(&[0f64, 0.0], device)?;
    for t in &totals {
        mine = (mine + t)?;
    }
    let mine = Tensor::cat(&[mine, Tensor::new(&[local as f64], device)?], 0)?;
    let g = run
        .comm
        .all_reduce(&mine, ReduceOp::Sum)?
        .to_vec1::<f64>()?;
    Ok([g[0], g[1], g[2]])
}

/// This rank's share of each non-empty micro-batch of `global`, cut into `k` micro-batches
/// (possibly empty: the rank still takes part, with an empty batch, in the micro-batch's
/// batch-norm collectives).
fn micro_shares(global: &[usize], k: usize, rank: usize, world: usize) -> Vec<&[usize]> {
    let mut micro = Vec::with_capacity(k);
    let mut at = 0;
    for n in split_sizes(global.len(), k) {
        let batch = &global[at..at + n];
        at += n;
        if n > 0 {
            let shares = split_sizes(n, world);
            let offset: usize = shares[..rank].iter().sum();
            micro.push(&batch[offset..offset + shares[rank]]);
        }
    }
    micro
}

/// Steps the optimizer with the averaged gradients, through the loss scaler with f16: an
/// overflow on any rank is in every rank's averaged gradients, so every rank skips the same
/// steps. Then refreshes the model's hooked copies of the variables (with `--overlap`).
fn optimizer_step(st: &mut State, mut grads: candle_core::backprop::GradStore) -> Result<()> {
    match &mut st.scaler {
        Some(scaler) => {
            let found_inf = scaler.unscale(&mut grads, &st.dp.trainable())?;
            if !found_inf {
                st.opt.step(&grads)?;
            }
            scaler.update(found_inf);
        }
        None => st.opt.step(&grads)?,
    }
    st.dp.refresh()?;
    Ok(())
}

/// Correct predictions among `logits`' rows, as an f64 scalar on their device (0 for none).
fn hits(logits: &Tensor, y: &Tensor) -> Result<Tensor> {
    if logits.dim(0)? == 0 {
        // candle's argmax refuses an empty tensor.
        return Ok(Tensor::new(0f64, logits.device())?);
    }
    Ok(logits
        .argmax(D::Minus1)?
        .eq(y)?
        .to_dtype(DType::F64)?
        .sum_all()?)
}

/// Validation loss and accuracy over the whole set, each rank evaluating its share (running
/// statistics: no communication but the final sums).
fn evaluate(
    comm: &Arc<dyn Collective>,
    model: &ResNet,
    val: &Dataset,
    stats: &([f32; 3], [f32; 3]),
    cfg: &Config,
    device: &Device,
) -> Result<(f64, f64)> {
    let (rank, world) = (comm.rank(), comm.world_size());
    let sizes = split_sizes(val.len(), world);
    let lo: usize = sizes[..rank].iter().sum();
    let idx: Vec<usize> = (lo..lo + sizes[rank]).collect();
    let (mut loss, mut correct) = (0.0, 0.0);
    for chunk in idx.chunks(256) {
        let (x, y) = data::batch(val, chunk, stats, None, device)?;
        let logits = model.forward(&model::cast(&x, cfg.compute_dtype())?, false)?;
        loss += candle_nn::loss::cross_entropy(&logits, &y)?
            .to_dtype(DType::F64)?
            .to_scalar::<f64>()?
            * chunk.len() as f64;
        correct += hits(&logits, &y)?.to_scalar::<f64>()?;
    }
    let g = comm
        .all_reduce(&Tensor::new(&[loss, correct], device)?, ReduceOp::Sum)?
        .to_vec1::<f64>()?;
    let n = val.len().max(1) as f64;
    Ok((g[0] / n, g[1] / n))
}

/// After rank 0's write of the epoch's metrics and chart: every rank learns its outcome now
/// (one all-reduce of a flag), instead of at its next collective's timeout. Rank 0 fails with
/// the write's error, the others with a message pointing to it.
fn agree_on_write(comm: &Arc<dyn Collective>, device: &Device, written: Result<()>) -> Result<()> {
    agree_on(comm, device, "write the metrics", written)
}

/// The lock of a run's output folder (`.run.lock`), held while the run lives and released by
/// the operating system when its process ends, however it ends.
fn lock_out_dir(dir: &std::path::Path) -> Result<candle_distributed::checkpoint::FileLock> {
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    Ok(candle_distributed::checkpoint::FileLock::take(
        &dir.join(".run.lock"),
        "run writing into this folder",
    )?)
}

/// Rank 0's outcome of `what` (the others pass `Ok`), learned by every rank: one all-reduce of
/// one value, after which every rank returns an error when rank 0 failed.
fn agree_on<T>(
    comm: &Arc<dyn Collective>,
    device: &Device,
    what: &str,
    outcome: Result<T>,
) -> Result<T> {
    let failed = f32::from(u8::from(outcome.is_err()));
    let any = comm
        .all_reduce(&Tensor::new(&[failed], device)?, ReduceOp::Max)?
        .to_vec1::<f32>()?[0];
    let value = outcome.with_context(|| format!("rank 0 could not {what}"))?;
    if any > 0.0 {
        return Err(CollectiveError::elsewhere(
            comm.rank(),
            format!(
                "rank {}: rank 0 could not {what} (its error says why); stopping with it",
                comm.rank()
            ),
        )
        .into());
    }
    Ok(value)
}

/// Trains on every rank of `cfg.backend` and returns rank 0's summary.
pub fn run(cfg: &Config) -> Result<Summary> {
    let (train, val) = datasets(cfg)?;
    match cfg.backend.as_str() {
        "threads" => {
            let device = cfg.device.device()?;
            let mut out = ThreadGroup::run(cfg.world_size, |comm| {
                let rank = comm.rank();
                train_rank(comm, device.clone(), cfg, &train, &val).map_err(|e| {
                    // Kept a consequence when it is one (a rank that left, another rank's
                    // failure learned through an agreement): `ThreadGroup::run` then reports
                    // the rank where the failure started.
                    let consequence = e.chain().any(|c| {
                        (c.downcast_ref::<candle_core::Error>())
                            .and_then(CollectiveError::find)
                            .is_some_and(CollectiveError::is_consequence)
                    });
                    match consequence {
                        true => CollectiveError::elsewhere(rank, format!("{e:?}")),
                        false => candle_core::Error::Msg(format!("{e:?}")),
                    }
                })
            })?;
            Ok(out.swap_remove(0))
        }
        "nccl" => run_nccl(cfg, &train, &val),
        "mpi" => run_mpi(cfg, &train, &val),
        b => bail!("unknown backend {b:?} (threads, nccl, mpi)"),
    }
}

/// One rank per GPU: under torchrun (`RANK` and `WORLD_SIZE` set) this process is one rank on
/// GPU `LOCAL_RANK`; otherwise one process drives `--world-size` GPUs, a thread each.
#[cfg(feature = "nccl")]
fn run_nccl(cfg: &Config, train: &Dataset, val: &Dataset) -> Result<Summary> {
    use candle_distributed::collective::{NcclCollective, NcclGroup};
    if cfg.device != DeviceKind::Cuda {
        bail!("--backend nccl runs one rank per GPU: use --device cuda (the default with nccl)");
    }
    if std::env::var_os("RANK").is_some() && std::env::var_os("WORLD_SIZE").is_some() {
        let comm = NcclCollective::from_env()?;
        let device = comm.device();
        return train_rank(comm, device, cfg, train, val);
    }
    let comms = NcclGroup::new(&(0..cfg.world_size).collect::<Vec<_>>())?;
    let mut out: Vec<Summary> = std::thread::scope(|s| {
        let hs: Vec<_> = comms
            .into_iter()
            .map(|c| s.spawn(move || train_rank(c.clone(), c.device(), cfg, train, val)))
            .collect();
        hs.into_iter()
            .map(|h| h.join().expect("rank thread"))
            .collect::<Result<_>>()
    })?;
    Ok(out.swap_remove(0))
}

#[cfg(not(feature = "nccl"))]
fn run_nccl(_: &Config, _: &Dataset, _: &Dataset) -> Result<Summary> {
    bail!("--backend nccl needs the `nccl` feature: cargo run --release --features nccl --example resnet -- --backend nccl")
}

#[cfg(feature = "mpi")]
fn run_mpi(cfg: &Config, train: &Dataset, val: &Dataset) -> Result<Summary> {
    let mpi = candle_distributed::collective::Mpi::init()?;
    let comm = mpi.world()?;
    let summary = train_rank(comm, cfg.device.device()?, cfg, train, val)?;
    Ok(summary)
}

#[cfg(not(feature = "mpi"))]
fn run_mpi(_: &Config, _: &Dataset, _: &Dataset) -> Result<Summary> {
    bail!("--backend mpi needs the `mpi` feature: cargo build --release --features mpi --example resnet, then mpirun -np N target/release/examples/resnet --backend mpi")
}
