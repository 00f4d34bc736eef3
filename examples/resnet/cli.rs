//! The command line (clap derive): every flag, its default and its allowed values, turned into
//! a [`Config`].

use std::path::PathBuf;

use anyhow::Result;
use clap::{Parser, ValueEnum};

use crate::model::Arch;
use crate::train::{Config, DeviceKind, Precision};

/// Trains a ResNet on data-parallel ranks with SyncBatchNorm (or plain batch norm).
///
/// Outputs (rank 0) in --out-dir: metrics.csv, curves.png, checkpoint.json with
/// checkpoint-e<epoch>-<crc32>.safetensors; then a one-line JSON summary on stdout. RUST_LOG=debug
/// shows the library's diagnostics.
#[derive(Parser, Debug)]
#[command(name = "resnet", version)]
pub struct Cli {
    /// The architecture (CIFAR ResNet-20/56, torchvision ResNet-18/34/50).
    #[arg(long, value_enum, default_value_t = Model::Resnet20)]
    model: Model,
    /// syncbn: statistics of the global batch; bn: each rank's own (the one-argument swap).
    #[arg(long, value_enum, default_value_t = Norm::Syncbn)]
    norm: Norm,
    /// threads: CPU thread ranks; nccl (feature nccl): one rank per GPU, a thread per GPU or a
    /// process per GPU under torchrun; mpi (feature mpi): one rank per process under mpirun.
    #[arg(long, value_enum, default_value_t = Backend::Threads)]
    backend: Backend,
    /// Where thread and MPI ranks compute (cuda: every thread rank shares GPU 0; feature cuda).
    /// Default: cuda with nccl, else cpu.
    #[arg(long, value_enum)]
    device: Option<DeviceArg>,
    /// Ranks for threads and nccl.
    #[arg(long, default_value_t = 4, value_parser = clap::value_parser!(u64).range(1..))]
    world_size: u64,
    #[arg(long, default_value_t = 3)]
    epochs: usize,
    /// Global batch, split across ranks; every sample of an epoch is used (the last batch may
    /// be smaller, and ranks whose share is empty take part with an empty batch).
    #[arg(long, default_value_t = 128, value_parser = clap::value_parser!(u64).range(1..))]
    batch_size: u64,
    /// Micro-batches per optimizer step: gradients summed locally, all-reduced once per step.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u64).range(1..))]
    accumulate: u64,
    /// MiB of gradients per all-reduce.
    #[arg(long, default_value_t = 25.0)]
    bucket_mb: f64,
    /// on: each bucket's all-reduce starts during the backward, as soon as its gradients are
    /// complete (DataParallel::with_overlap); off: after the backward (sync_gradients). The
    /// same steps bit for bit.
    #[arg(long, value_enum, default_value_t = OnOff::On)]
    overlap: OnOff,
    /// What convolutions and batch norms compute in (weights, AdamW and the classifier stay
    /// f32; f16 trains with dynamic loss scaling).
    #[arg(long, value_enum, default_value_t = PrecisionArg::F32)]
    precision: PrecisionArg,
    /// AdamW learning rate (cosine schedule with warm-up).
    #[arg(long, default_value_t = 4e-3)]
    lr: f64,
    #[arg(long, default_value_t = 5e-4)]
    weight_decay: f64,
    /// CIFAR-10 binary files (data_batch_1.bin .. data_batch_5.bin, test_batch.bin); without
    /// it, the built-in synthetic set.
    #[arg(long)]
    data_dir: Option<PathBuf>,
    /// Synthetic image side.
    #[arg(long, default_value_t = 16)]
    image_size: usize,
    /// Synthetic training images.
    #[arg(long, default_value_t = 8000)]
    train_size: usize,
    /// Synthetic validation images.
    #[arg(long, default_value_t = 2000)]
    val_size: usize,
    /// Data, initialisation and augmentation seed.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    #[arg(long, default_value = "out/resnet")]
    out_dir: PathBuf,
    /// The checkpoint.json of an earlier run (or its directory): the run continues as if never
    /// stopped (same --model, --seed, --batch-size and data); a truncated, corrupt or
    /// mismatched checkpoint is refused. The metrics CSV in --out-dir is continued. `auto`:
    /// --out-dir's checkpoint when it has one, else a fresh start (the same command for a
    /// first start and a restart).
    #[arg(long)]
    resume: Option<PathBuf>,
    /// Leave after this epoch's checkpoint, as if killed there (the schedule stays that of
    /// --epochs); --resume continues.
    #[arg(long)]
    stop_after_epoch: Option<usize>,
    /// Also checkpoint every N optimizer steps (mid-epoch too): a resume continues from the
    /// step, bit for bit.
    #[arg(long)]
    save_every: Option<usize>,
    /// Leave after step N's checkpoint, as if killed there (N a multiple of --save-every).
    #[arg(long)]
    stop_after_step: Option<usize>,
    /// Test aid: on a torchrun launch's first attempt, rank 1 exits with status 1 after step N.
    #[arg(long, hide = true)]
    exit_at_step: Option<usize>,
    /// Train --check-steps steps with N-rank SyncBatchNorm and with 1-rank plain batch norm on
    /// the same global batches (f64 weights); exit 1 above --check-tol.
    #[arg(long)]
    pub check: bool,
    #[arg(long, default_value_t = 3)]
    pub check_steps: usize,
    /// Default 1e-6 on the largest parameter difference (f32); with bf16/f16, 1.5 on
    /// ‖θ_N − θ_1‖ / ‖θ_1 − θ_1,f32‖ (see the README's Training section).
    #[arg(long)]
    pub check_tol: Option<f64>,
}

#[derive(Clone, Copy, Debug, ValueEnum)]
enum Model {
    Resnet20,
    Resnet56,
    Resnet18,
    Resnet34,
    Resnet50,
}

#[derive(Clone, Copy, Debug, ValueEnum, PartialEq)]
enum OnOff {
    On,
    Off,
}

#[derive(Clone, Copy, Debug, ValueEnum)]
enum Norm {
    Syncbn,
    Bn,
}

#[derive(Clone, Copy, Debug, ValueEnum, PartialEq)]
enum Backend {
    Threads,
    Nccl,
    Mpi,
}

#[derive(Clone, Copy, Debug, ValueEnum)]
enum DeviceArg {
    Cpu,
    Cuda,
}

#[derive(Clone, Copy, Debug, ValueEnum)]
enum PrecisionArg {
    F32,
    Bf16,
    F16,
}

impl Cli {
    /// The run's configuration.
    pub fn config(&self) -> Result<Config> {
        let arch = match self.model {
            Model::Resnet20 => Arch::ResNet20,
            Model::Resnet56 => Arch::ResNet56,
            Model::Resnet18 => Arch::ResNet18,
            Model::Resnet34 => Arch::ResNet34,
            Model::Resnet50 => Arch::ResNet50,
        };
        let backend = match self.backend {
            Backend::Threads => "threads",
            Backend::Nccl => "nccl",
            Backend::Mpi => "mpi",
        };
        let device = match (self.device, self.backend) {
            (Some(DeviceArg::Cpu), _) => DeviceKind::Cpu,
            (Some(DeviceArg::Cuda), _) | (None, Backend::Nccl) => DeviceKind::Cuda,
            (None, _) => DeviceKind::Cpu,
        };
        Ok(Config {
            arch,
            sync_bn: matches!(self.norm, Norm::Syncbn),
            backend: backend.into(),
            device,
            world_size: self.world_size as usize,
            epochs: self.epochs,
            batch_size: self.batch_size as usize,
            accumulate: self.accumulate as usize,
            bucket_bytes: (self.bucket_mb * 1048576.0).max(1.0) as usize,
            overlap: self.overlap == OnOff::On,
            precision: match self.precision {
                PrecisionArg::F32 => Precision::Full,
                PrecisionArg::Bf16 => Precision::Bf16,
                PrecisionArg::F16 => Precision::F16,
            },
            lr: self.lr,
            weight_decay: self.weight_decay,
            data_dir: self.data_dir.clone(),
            image_size: self.image_size,
            train_size: self.train_size,
            val_size: self.val_size,
            seed: self.seed,
            out_dir: self.out_dir.clone(),
            resume: crate::checkpoint::resolve_resume(self.resume.as_deref(), &self.out_dir),
            stop_after_epoch: self.stop_after_epoch,
            save_every: self.save_every,
            stop_after_step: self.stop_after_step,
            exit_at_step: self.exit_at_step,
            ..Config::default()
        })
    }
}
