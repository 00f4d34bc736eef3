//! One rank's training loop, the run over all ranks of a backend, and the `--check` comparison.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use candle_core::{DType, Device, Tensor, D};
use candle_distributed::amp::{GradScaler, GradScalerConfig, GradScalerState};
use candle_distributed::collective::{Collective, ReduceOp, ThreadGroup};
use candle_distributed::DataParallel;
use candle_nn::{ParamsAdamW, VarBuilder, VarMap};
use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};

use crate::checkpoint;
use crate::data::{self, Dataset};
use crate::model::{Arch, NormKind, ResNet};
use crate::optim::AdamW;
use crate::report::{self, EpochMetrics, Progress};

/// Everything a run needs.
#[derive(Debug, Clone)]
pub struct Config {
    pub arch: Arch,
    pub sync_bn: bool,
    pub backend: String,
    /// Where thread and MPI ranks keep their tensors (NCCL ranks use their GPU).
    pub device: DeviceKind,
    pub world_size: usize,
    pub epochs: usize,
    /// Global batch size, split across the ranks.
    pub batch_size: usize,
    pub lr: f64,
    pub weight_decay: f64,
    /// The loss scaler's first scale (f16 only; PyTorch's default 2¹⁶).
    pub init_scale: f64,
    /// AdamW's ε (candle's default 1e-8; `--check` in bf16/f16 uses 1, see check.rs).
    pub adam_eps: f64,
    pub data_dir: Option<PathBuf>,
    /// Side of the synthetic images.
    pub image_size: usize,
    pub train_size: usize,
    pub val_size: usize,
    pub seed: u64,
    pub out_dir: PathBuf,
    /// A `checkpoint.json` (or its directory) to continue from.
    pub resume: Option<PathBuf>,
    pub dtype: DType,
    /// What convolutions and batch norms compute in (`--precision`); the weights, optimizer
    /// and classifier stay in `dtype`.
    pub precision: Precision,
    /// Micro-batches per optimizer step (gradients all-reduced once per step).
    pub accumulate: usize,
    /// Bytes of gradients per all-reduce.
    pub bucket_bytes: usize,
    /// Random crop padding and flips (off in `--check`).
    pub augment: bool,
    /// Stop after this many steps in total (`--check`), else run every epoch.
    pub max_steps: Option<usize>,
    /// Leave after this epoch's outputs, as if killed there (the schedule is still that of
    /// `epochs`): `--resume` then continues the run.
    pub stop_after_epoch: Option<usize>,
    /// Write the CSV, plot and checkpoint (rank 0).
    pub write_outputs: bool,
}

impl Default for Config {
    fn default() -> Self {
        Self {
            arch: Arch::ResNet20,
            sync_bn: true,
            backend: "threads".into(),
            device: DeviceKind::Cpu,
            world_size: 4,
            epochs: 3,
            batch_size: 128,
            lr: 4e-3,
            weight_decay: 5e-4,
            init_scale: 65536.0,
            adam_eps: 1e-8,
            data_dir: None,
            image_size: 16,
            train_size: 8000,
            val_size: 2000,
            seed: 0,
            out_dir: PathBuf::from("out/resnet"),
            resume: None,
            dtype: DType::F32,
            precision: Precision::Full,
            accumulate: 1,
            bucket_bytes: candle_distributed::data_parallel::DEFAULT_BUCKET_BYTES,
            augment: true,
            max_steps: None,
            stop_after_epoch: None,
            write_outputs: true,
        }
    }
}

/// `--precision`: the activations' dtype.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Precision {
    /// The weights' dtype throughout.
    Full,
    /// bf16 activations (no loss scaling: bf16 has f32's range).
    Bf16,
    /// f16 activations with dynamic loss scaling (`GradScaler`).
    F16,
}

impl Config {
    /// The run in a line, for the chart's title: model, norm, ranks, precision, batch.
    pub fn title(&self) -> String {
        let precision = match self.precision {
            Precision::Full => format!("{:?}", self.dtype).to_lowercase(),
            Precision::Bf16 => "bf16".into(),
            Precision::F16 => "f16 + loss scaling".into(),
        };
        format!(
            "{} with {}, {} {} ranks, {precision}, global batch {}, seed {}",
            self.arch.name(),
            if self.sync_bn {
                "SyncBatchNorm"
            } else {
                "per-rank BatchNorm"
            },
            self.world_size,
            match self.backend.as_str() {
                "threads" => "thread",
                other => other,
            },
            self.batch_size,
            self.seed
        )
    }

    /// The dtype of the activations.
    pub fn compute_dtype(&self) -> DType {
        match self.precision {
            Precision::Full => self.dtype,
            Precision::Bf16 => DType::BF16,
            Precision::F16 => DType::F16,
        }
    }
}

/// `--device`: the CPU, or GPU 0 shared by every thread rank of the process (the way to run
/// multi-rank SyncBatchNorm on a one-GPU machine).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeviceKind {
    Cpu,
    Cuda,
}

impl DeviceKind {
    /// The candle device: one `Device` for every rank of this process, so that their tensors
    /// are on the same device (candle tells two `Device::new_cuda(0)` apart).
    pub fn device(self) -> Result<Device> {
        Ok(match self {
            DeviceKind::Cpu => Device::Cpu,
            DeviceKind::Cuda => Device::new_cuda(0).context(
                "--device cuda needs a CUDA GPU and the example built with --features cuda",
            )?,
        })
    }
}

/// What a run ends with (rank 0's view; every rank computes the same global numbers).
#[derive(Debug, Clone)]
pub struct Summary {
    /// The rank that produced it.
    pub rank: usize,
    pub epochs: Vec<EpochMetrics>,
    pub world_size: usize,
    pub seconds: f64,
    pub images_per_sec: f64,
    /// Trainable variables at the end, by name, on the CPU.
    pub params: Vec<(String, Tensor)>,
}

impl Summary {
    /// The one-line JSON summary (serde_json; a loss or accuracy of no epoch is `null`).
    pub fn json(&self) -> Result<String> {
        /// Rounded to `digits` decimals, for a readable line.
        fn round(x: f64, digits: i32) -> f64 {
            let p = 10f64.powi(digits);
            (x * p).round() / p
        }
        #[derive(serde::Serialize)]
        struct Line {
            epochs: usize,
            world_size: usize,
            train_loss: Option<f64>,
            val_acc: Option<f64>,
            images_per_sec: f64,
            seconds: f64,
        }
        let last = self.epochs.last();
        Ok(serde_json::to_string(&Line {
            epochs: self.epochs.len(),
            world_size: self.world_size,
            train_loss: last.map(|m| round(m.train_loss, 6)),
            val_acc: last.map(|m| round(m.val_acc, 4)),
            images_per_sec: round(self.images_per_sec, 1),
            seconds: round(self.seconds, 1),
        })?)
    }
}

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

/// One rank's model, optimizer and position, as a checkpoint restores them.
struct State {
    vm: VarMap,
    model: ResNet,
    dp: DataParallel,
    opt: AdamW,
    /// Loss scaling (f16 only).
    scaler: Option<GradScaler>,
    /// Epochs completed.
    epoch: usize,
    /// Optimizer steps completed.
    step: usize,
}

/// Builds the model (from `cfg.resume`'s checkpoint when given; refused if it does not match)
/// and the optimizer.
fn setup(
    comm: &Arc<dyn Collective>,
    device: &Device,
    cfg: &Config,
    classes: usize,
) -> Result<State> {
    let vm = VarMap::new();
    let vb = VarBuilder::from_varmap(&vm, cfg.dtype, device);
    let norm = if cfg.sync_bn {
        NormKind::SyncBn(comm.clone())
    } else {
        NormKind::Bn
    };
    let mut model = ResNet::new(cfg.arch, classes, &norm, vb.clone())?;
    init_weights(&vm, cfg.seed)?;
    let resumed = match &cfg.resume {
        Some(path) => Some(checkpoint::load(path, &cfg.arch.name())?),
        None => None,
    };
    if let Some((_, tensors)) = &resumed {
        load_vars(&vm, tensors)?;
        // Built again over the loaded variables: SyncBatchNorm reads `num_batches_tracked`
        // when it is built.
        model = ResNet::new(cfg.arch, classes, &norm, vb)?;
        for (name, bn) in model.sync_norms() {
            bn.set_shift(tensors.get(&shift_key(name)))?;
        }
    }
    let dp = DataParallel::new(&vm, comm.clone())?.with_bucket_bytes(cfg.bucket_bytes);
    let params = ParamsAdamW {
        lr: cfg.lr,
        weight_decay: cfg.weight_decay,
        eps: cfg.adam_eps,
        ..Default::default()
    };
    let mut opt = AdamW::new(dp.named_trainable(), params)?;
    let mut scaler = (cfg.precision == Precision::F16)
        .then(|| {
            GradScaler::new(GradScalerConfig {
                init_scale: cfg.init_scale,
                ..Default::default()
            })
        })
        .transpose()?;
    let (mut epoch, mut step) = (0, 0);
    if let Some((meta, tensors)) = &resumed {
        opt.load_state(meta.optimizer_step, tensors)?;
        (epoch, step) = (meta.epoch, meta.step);
        if let (Some(s), Some(m)) = (scaler.as_mut(), meta.scaler) {
            s.load_state(GradScalerState {
                scale: m.scale,
                growth_tracker: m.growth_tracker,
            })?;
        }
    }
    Ok(State {
        vm,
        model,
        dp,
        opt,
        scaler,
        epoch,
        step,
    })
}

/// Sets every variable of `vm` from `tensors`, after checking that each is there with its
/// shape: a refused checkpoint changes nothing.
fn load_vars(vm: &VarMap, tensors: &HashMap<String, Tensor>) -> Result<()> {
    let data = vm.data().lock().expect("VarMap lock");
    let mut found = Vec::with_capacity(data.len());
    for (name, v) in data.iter() {
        let t = tensors
            .get(name)
            .with_context(|| format!("the checkpoint has no {name}: another model?"))?;
        if t.dims() != v.dims() {
            bail!(
                "{name}: {:?} in the checkpoint, {:?} in the model",
                t.dims(),
                v.dims()
            )
        }
        found.push((v, t.to_dtype(v.dtype())?.to_device(v.device())?));
    }
    for (v, t) in found {
        v.set(&t)?;
    }
    Ok(())
}

/// Where a SyncBatchNorm layer's shift is kept in a checkpoint.
fn shift_key(layer: &str) -> String {
    format!("syncbn_shift.{layer}")
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

/// Trains on this rank; every rank returns the same summary.
pub fn train_rank(
    comm: Arc<dyn Collective>,
    device: Device,
    cfg: &Config,
    train: &Dataset,
    val: &Dataset,
) -> Result<Summary> {
    let (rank, world) = (comm.rank(), comm.world_size());
    if cfg.batch_size == 0 || cfg.accumulate == 0 {
        bail!("--batch-size and --accumulate must be at least 1");
    }
    let mut st = setup(&comm, &device, cfg, train.classes)?;
    let stats = data::channel_stats(train);
    // Every sample of every epoch: the last global batch may be smaller, and then some ranks'
    // shares may be empty (they serve the collectives with empty batches).
    let steps_per_epoch = train.len().div_ceil(cfg.batch_size);
    if steps_per_epoch == 0 {
        bail!("the training set is empty");
    }
    let total_steps = cfg.max_steps.unwrap_or(steps_per_epoch * cfg.epochs);
    let start = Instant::now();
    // On resume, the earlier epochs' rows (the CSV of the run that wrote the checkpoint).
    let mut metrics: Vec<EpochMetrics> = if cfg.resume.is_some() {
        report::read_csv(&cfg.out_dir.join("metrics.csv"))?
            .into_iter()
            .filter(|m| m.epoch <= st.epoch)
            .collect()
    } else {
        Vec::new()
    };
    let mut images_seen = 0usize;
    for epoch in st.epoch..cfg.epochs {
        let epoch_start = Instant::now();
        let mut order: Vec<usize> = (0..train.len()).collect();
        order.shuffle(&mut StdRng::seed_from_u64(
            cfg.seed ^ ((epoch as u64 + 1) * 0x9e37_79b9),
        ));
        let progress = Progress::new(steps_per_epoch, epoch + 1, cfg.epochs, rank == 0)?;
        let mut sums = [0f64; 3]; // loss sum, correct, samples
        for s in 0..steps_per_epoch {
            if st.step >= total_steps {
                break;
            }
            let global = &order[s * cfg.batch_size..((s + 1) * cfg.batch_size).min(order.len())];
            let g = train_step(
                &comm,
                &mut st,
                cfg,
                train,
                &stats,
                global,
                total_steps,
                &device,
            )?;
            for (a, b) in sums.iter_mut().zip(g) {
                *a += b;
            }
            images_seen += global.len();
            st.step += 1;
            progress.update(
                s + 1,
                sums[0] / sums[2].max(1.0),
                sums[1] / sums[2].max(1.0),
                images_seen,
            );
        }
        progress.finish();
        let (val_loss, val_acc) = evaluate(&comm, &st.model, val, &stats, cfg, &device)?;
        let m = EpochMetrics {
            epoch: epoch + 1,
            train_loss: sums[0] / sums[2].max(1.0),
            train_acc: sums[1] / sums[2].max(1.0),
            val_loss,
            val_acc,
            images_per_sec: sums[2] / epoch_start.elapsed().as_secs_f64(),
            seconds: start.elapsed().as_secs_f64(),
        };
        metrics.push(m);
        st.epoch = epoch + 1;
        if rank == 0 {
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
            if cfg.write_outputs {
                write_outputs(cfg, &st, &metrics)?;
            }
        }
        if st.step >= total_steps || cfg.stop_after_epoch == Some(st.epoch) {
            break;
        }
    }
    let seconds = start.elapsed().as_secs_f64();
    let mut params: Vec<(String, Tensor)> = st
        .vm
        .data()
        .lock()
        .expect("VarMap lock")
        .iter()
        .map(|(k, v)| Ok((k.clone(), v.as_tensor().to_device(&Device::Cpu)?)))
        .collect::<Result<_>>()?;
    params.sort_by(|a, b| a.0.cmp(&b.0));
    Ok(Summary {
        rank,
        epochs: metrics,
        world_size: world,
        seconds,
        images_per_sec: images_seen as f64 / seconds,
        params,
    })
}

/// One optimizer step on the global batch `global` (sample indices), in `cfg.accumulate`
/// micro-batches: the global batch is cut into micro-batches first and each is shared among
/// the ranks, so a micro-batch holds the same samples whatever the world size (its batch-norm
/// statistics are those of one process accumulating over the same micro-batches). Gradients
/// are summed locally and all-reduced once. Returns the step's global loss sum, correct
/// predictions and sample count.
#[allow(clippy::too_many_arguments)]
fn train_step(
    comm: &Arc<dyn Collective>,
    st: &mut State,
    cfg: &Config,
    train: &Dataset,
    stats: &([f32; 3], [f32; 3]),
    global: &[usize],
    total_steps: usize,
    device: &Device,
) -> Result<[f64; 3]> {
    let (rank, world) = (comm.rank(), comm.world_size());
    let k = cfg.accumulate;
    // This rank's share of each non-empty micro-batch (possibly empty: the rank still takes
    // part, with an empty batch, in the micro-batch's batch-norm collectives).
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
        .set_learning_rate(lr_at(cfg.lr, st.step, total_steps));
    let mut grads = None;
    // Per micro-batch loss sums and hit counts, kept on the device until the step's one
    // all-reduce (no host read per micro-batch).
    let mut totals: Vec<Tensor> = Vec::with_capacity(2 * k);
    for (m, idx) in micro.into_iter().enumerate() {
        let mut aug_rng = StdRng::seed_from_u64(
            cfg.seed ^ ((((st.step * world + rank) * k + m) as u64 + 7) * 0x2545_f491),
        );
        let augment = cfg.augment.then_some((&mut aug_rng, 2usize));
        let (x, y) = data::batch(train, idx, stats, augment, device)?;
        let logits = st.model.forward(&x.to_dtype(cfg.compute_dtype())?, true)?;
        let loss = loss_sum(&logits, &y)?;
        // Weighted by W / N: DataParallel's average over the W ranks is then the gradient of
        // the mean loss over the step's N samples.
        // With f16, also multiplied by the loss scale (exact: a power of two).
        let scale = st.scaler.as_ref().map_or(1.0, GradScaler::scale_factor);
        let g = (&loss * (join.loss_weight() * scale))?.backward()?;
        grads = Some(st.dp.accumulate(grads, g)?);
        totals.push(Tensor::stack(
            &[loss.to_dtype(DType::F64)?, hits(&logits, &y)?],
            0,
        )?);
    }
    let mut grads = st.dp.sync_gradients(grads.unwrap_or_default())?;
    match &mut st.scaler {
        // An overflow on any rank is in every rank's averaged gradients: every rank skips.
        Some(scaler) => {
            let found_inf = scaler.unscale(&mut grads, &st.dp.trainable())?;
            if !found_inf {
                st.opt.step(&grads)?;
            }
            scaler.update(found_inf);
        }
        None => st.opt.step(&grads)?,
    }
    // Global loss, accuracy and count of this step: one small all-reduce.
    let mut mine = Tensor::new(&[0f64, 0.0], device)?;
    for t in &totals {
        mine = (mine + t)?;
    }
    let mine = Tensor::cat(&[mine, Tensor::new(&[local as f64], device)?], 0)?;
    let g = comm.all_reduce(&mine, ReduceOp::Sum)?.to_vec1::<f64>()?;
    Ok([g[0], g[1], g[2]])
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
        let logits = model.forward(&x.to_dtype(cfg.compute_dtype())?, false)?;
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

/// CSV, plot and checkpoint into `cfg.out_dir`, each file written atomically
/// ([`checkpoint::write_atomic`]).
fn write_outputs(cfg: &Config, st: &State, metrics: &[EpochMetrics]) -> Result<()> {
    std::fs::create_dir_all(&cfg.out_dir)?;
    report::write_csv(&cfg.out_dir.join("metrics.csv"), metrics)?;
    // The chart is a picture of what the CSV holds: a run does not fail for want of a font.
    if let Err(e) = report::write_plot(&cfg.out_dir.join("curves.png"), &cfg.title(), metrics) {
        log::warn!("curves.png not written: {e:#}");
    }
    let mut tensors: Vec<(String, Tensor)> = st
        .vm
        .data()
        .lock()
        .expect("VarMap lock")
        .iter()
        .map(|(k, v)| (k.clone(), v.as_tensor().clone()))
        .collect();
    let (optimizer_step, moments) = st.opt.state();
    tensors.extend(moments);
    // SyncBatchNorm's shifts: without them a resumed run rounds differently.
    for (name, bn) in st.model.sync_norms() {
        if let Some(shift) = bn.shift() {
            tensors.push((shift_key(name), shift));
        }
    }
    let meta = checkpoint::Meta {
        format: checkpoint::FORMAT,
        epoch: st.epoch,
        step: st.step,
        optimizer_step,
        scaler: st.scaler.as_ref().map(|s| checkpoint::ScalerMeta {
            scale: s.state().scale,
            growth_tracker: s.state().growth_tracker,
        }),
        model: cfg.arch.name(),
        weights: String::new(),
        weights_bytes: 0,
        weights_crc32: 0,
    };
    checkpoint::save(&cfg.out_dir, meta, &tensors)
}

/// Trains on every rank of `cfg.backend` and returns rank 0's summary.
pub fn run(cfg: &Config) -> Result<Summary> {
    let (train, val) = datasets(cfg)?;
    match cfg.backend.as_str() {
        "threads" => {
            let device = cfg.device.device()?;
            let mut out = ThreadGroup::run(cfg.world_size, |comm| {
                train_rank(comm, device.clone(), cfg, &train, &val)
                    .map_err(|e| candle_core::Error::Msg(format!("{e:?}")))
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
