//! Trains a ResNet with data-parallel ranks and SyncBatchNorm: the crate's main job.
//!
//! ```text
//! cargo run --release --example resnet                     # 4 CPU thread ranks, synthetic data
//! cargo run --release --example resnet -- --help           # every flag
//! cargo run --release --example resnet -- --check          # N-rank SyncBN vs 1-rank BN, exits 1 on a difference
//! cargo run --release --features cuda --example resnet -- --device cuda --world-size 4   # 4 thread ranks on GPU 0
//! cargo run --release --features nccl --example resnet -- --backend nccl --world-size 8 --model resnet50 --data-dir cifar-10-batches-bin
//! ```
//!
//! Outputs (rank 0) in `--out-dir` (default `out/resnet`): `metrics.csv`, `curves.png`,
//! `checkpoint.json` + `checkpoint-e<epoch>.safetensors` (weights, batch-norm statistics,
//! AdamW's moments and step; `--resume out/resnet` continues bit for bit), each written
//! atomically; then a one-line JSON summary on stdout.

mod check;
mod checkpoint;
mod data;
mod model;
mod optim;
mod report;
mod train;

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{bail, Context, Result};

use model::Arch;
use train::{Config, DeviceKind};

const HELP: &str = "\
Trains a ResNet on data-parallel ranks with SyncBatchNorm (or plain batch norm).

  --model M          resnet20 (default), resnet56, resnet18, resnet34, resnet50
  --norm N           syncbn (default) or bn (each rank's own statistics)
  --backend B        threads (default: CPU thread ranks), nccl (feature nccl, one rank per GPU:
                     a thread per GPU, or a process per GPU under torchrun), mpi (feature mpi,
                     run under mpirun; one rank per process)
  --device D         cpu (default) or cuda (feature cuda): where thread and MPI ranks compute;
                     with cuda every thread rank shares GPU 0. nccl always uses one GPU per rank
  --world-size N     ranks for threads and nccl (default 4)
  --epochs N         default 3
  --batch-size N     global batch, split across ranks (default 128); every sample of an epoch is
                     used: the last batch may be smaller, and ranks whose share is empty take
                     part in the step with an empty batch
  --precision P      f32 (default), bf16 or f16: the dtype convolutions and batch norms compute
                     in; weights, AdamW and the classifier stay f32, batch-norm statistics f64
                     and parameters f32. f16 trains with dynamic loss scaling (GradScaler)
  --accumulate K     micro-batches per optimizer step (default 1): each rank's share is split in
                     K, gradients are summed locally and all-reduced once per step
  --bucket-mb X      MiB of gradients per all-reduce (default 25)
  --lr X             AdamW learning rate, cosine schedule with warm-up (default 0.004)
  --weight-decay X   default 0.0005
  --data-dir DIR     CIFAR-10 binary files (data_batch_1.bin .. data_batch_5.bin, test_batch.bin);
                     without it, the built-in synthetic set
  --image-size N     synthetic image side (default 16)
  --train-size N     synthetic training images (default 8000)
  --val-size N       synthetic validation images (default 2000)
  --seed N           data, initialisation and augmentation seed (default 0)
  --out-dir DIR      default out/resnet
  --resume PATH      the checkpoint.json of an earlier run (or its directory): weights, batch-norm
                     statistics, AdamW's moments and step, the epoch and step reached; the run
                     continues as if never stopped (same --model, --seed, --batch-size and data).
                     A truncated, corrupt or mismatched checkpoint is refused. The metrics CSV
                     in --out-dir is continued
  --stop-after-epoch N
                     leave after epoch N's checkpoint, as if killed there (the learning-rate
                     schedule stays that of --epochs); --resume continues
  --check            train --check-steps steps with N-rank SyncBN and with 1-rank plain BN on the
                     same global batches (f64), print the largest parameter difference, exit 1
                     above --check-tol
  --check-steps N    default 3
  --check-tol X      default 1e-6 on the largest parameter difference (f32); with bf16/f16,
                     1.5 on ‖θ_N − θ_1‖ / ‖θ_1 − θ_1,f32‖: the N-rank run may be at most 1.5×
                     as far from the one-process run as reduced precision alone moves that
";

/// `--check`'s default tolerance with bf16/f16 activations: the N-rank run may be at most this
/// many times farther from the one-process run than the one-process run in that precision is
/// from the one in full precision (see check::Difference; measured in the README's Training
/// section).
const HALF_TOL: f64 = 1.5;

/// `--check`'s steps and tolerance (None: the precision's default).
type CheckArgs = (usize, Option<f64>);

fn parse() -> Result<(Config, Option<CheckArgs>)> {
    let mut cfg = Config::default();
    let mut check = None;
    let mut steps = 3usize;
    let mut tol = None;
    let mut device = None;
    let mut args = std::env::args().skip(1);
    while let Some(flag) = args.next() {
        let mut value = || args.next().with_context(|| format!("{flag} needs a value"));
        match flag.as_str() {
            "--help" | "-h" => {
                print!("{HELP}");
                std::process::exit(0);
            }
            "--model" => cfg.arch = Arch::parse(&value()?)?,
            "--norm" => {
                cfg.sync_bn = match value()?.as_str() {
                    "syncbn" => true,
                    "bn" => false,
                    n => bail!("--norm {n:?}: expected syncbn or bn"),
                }
            }
            "--backend" => cfg.backend = value()?,
            "--device" => device = Some(DeviceKind::parse(&value()?)?),
            "--world-size" => cfg.world_size = value()?.parse()?,
            "--epochs" => cfg.epochs = value()?.parse()?,
            "--batch-size" => cfg.batch_size = value()?.parse()?,
            "--precision" => cfg.precision = train::Precision::parse(&value()?)?,
            "--accumulate" => cfg.accumulate = value()?.parse()?,
            "--bucket-mb" => cfg.bucket_bytes = (value()?.parse::<f64>()? * 1048576.0) as usize,
            "--lr" => cfg.lr = value()?.parse()?,
            "--weight-decay" => cfg.weight_decay = value()?.parse()?,
            "--data-dir" => cfg.data_dir = Some(PathBuf::from(value()?)),
            "--image-size" => cfg.image_size = value()?.parse()?,
            "--train-size" => cfg.train_size = value()?.parse()?,
            "--val-size" => cfg.val_size = value()?.parse()?,
            "--seed" => cfg.seed = value()?.parse()?,
            "--out-dir" => cfg.out_dir = PathBuf::from(value()?),
            "--resume" => cfg.resume = Some(PathBuf::from(value()?)),
            "--stop-after-epoch" => cfg.stop_after_epoch = Some(value()?.parse()?),
            "--check" => check = Some(()),
            "--check-steps" => steps = value()?.parse()?,
            "--check-tol" => tol = Some(value()?.parse()?),
            f => bail!("unknown flag {f:?} (see --help)"),
        }
    }
    cfg.device = device.unwrap_or(if cfg.backend == "nccl" {
        DeviceKind::Cuda
    } else {
        DeviceKind::Cpu
    });
    if cfg.world_size == 0 {
        bail!("--world-size must be at least 1");
    }
    Ok((cfg, check.map(|_| (steps, tol))))
}

fn main() -> Result<ExitCode> {
    // The library's diagnostics (retries, aborts) through `log`; RUST_LOG=debug shows more.
    env_logger::Builder::from_env(env_logger::Env::default().default_filter_or("warn")).init();
    let (cfg, check) = parse()?;
    if let Some((steps, tol)) = check {
        let d = check::check(&cfg, steps, true)?;
        // Full precision: the largest parameter difference; bf16/f16: the difference relative
        // to the update (see check::Difference).
        let (what, diff, tol) = match (cfg.precision, tol) {
            (train::Precision::Full, t) => {
                ("largest parameter difference", d.max_abs, t.unwrap_or(1e-6))
            }
            (_, t) => (
                "update difference over the precision's own",
                d.noise_ratio().unwrap_or(f64::INFINITY),
                t.unwrap_or(HALF_TOL),
            ),
        };
        println!(
            "check: {} ranks SyncBatchNorm vs 1 rank BatchNorm, {steps} steps, {:?} precision: {what} {diff:.3e} (tolerance {tol:.1e}; largest parameter difference {:.3e}, relative update difference {:.3e}, reduced precision alone {:.3e})",
            cfg.world_size, cfg.precision, d.max_abs, d.relative_update, d.precision_noise.unwrap_or(0.0)
        );
        return Ok(if diff <= tol {
            ExitCode::SUCCESS
        } else {
            ExitCode::FAILURE
        });
    }
    let summary = train::run(&cfg)?;
    if summary.rank == 0 {
        println!("{}", summary.json());
    }
    Ok(ExitCode::SUCCESS)
}
