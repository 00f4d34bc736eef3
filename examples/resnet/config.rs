//! The run's settings (`Config`, filled from the command line by `cli.rs`) and what it ends
//! with (`Summary`).

use std::path::PathBuf;

use anyhow::{Context, Result};
use candle_core::{DType, Device, Tensor};

use crate::model::Arch;
use crate::report::EpochMetrics;

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
    /// Start each bucket's all-reduce during the backward (`--overlap`).
    pub overlap: bool,
    /// Random crop padding and flips (off in `--check`).
    pub augment: bool,
    /// Stop after this many steps in total (`--check`), else run every epoch.
    pub max_steps: Option<usize>,
    /// Leave after this epoch's outputs, as if killed there (the schedule is still that of
    /// `epochs`): `--resume` then continues the run.
    pub stop_after_epoch: Option<usize>,
    /// Also checkpoint every this many optimizer steps, mid-epoch included (`--save-every`).
    pub save_every: Option<usize>,
    /// Leave after this step's checkpoint, as if killed there (`--stop-after-step`; with
    /// `save_every` dividing it): `--resume` then continues mid-epoch.
    pub stop_after_step: Option<usize>,
    /// A fault for the restart test (`--exit-at-step`, hidden): on the first attempt of a
    /// torchrun launch (`TORCHELASTIC_RESTART_COUNT` 0), rank 1 exits with status 1 after this
    /// step, as a crashed worker; thread ranks (no such variable) never do.
    pub exit_at_step: Option<usize>,
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
            overlap: true,
            augment: true,
            max_steps: None,
            stop_after_epoch: None,
            save_every: None,
            stop_after_step: None,
            exit_at_step: None,
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
