//! `--check`: N ranks of SyncBatchNorm against one process of plain batch norm on the same
//! global batches.

use std::collections::HashMap;

use anyhow::{Context, Result};
use candle_core::{DType, Tensor};

use crate::train::{run, Config, Precision, Summary};

/// How far the N-rank run ended from the one-process run.
#[derive(Debug, Clone, Copy)]
pub struct Difference {
    /// The ranks of the N-rank run (under torchrun the launch's, not `--world-size`).
    pub world_size: usize,
    /// The largest absolute difference over the trainable parameters.
    pub max_abs: f64,
    /// ‖θ_N − θ_1‖₂ / ‖θ_1 − θ_0‖₂ over all trainable parameters: the difference relative to
    /// how far training moved them. With reduced precision the largest difference says little
    /// (AdamW turns a gradient near 0 whose sign rounding flipped into a full step of the
    /// learning rate); this measures the update as a whole.
    pub relative_update: f64,
    /// With bf16/f16: the same measure between the one-process run in that precision and in
    /// full precision, i.e. how far the reduced precision alone moves the result; the N-rank
    /// run passes when it is not much farther than that from the one-process run. `None` in
    /// full precision.
    pub precision_noise: Option<f64>,
}

impl Difference {
    /// `relative_update / precision_noise` (bf16/f16 only).
    pub fn noise_ratio(&self) -> Option<f64> {
        self.precision_noise
            .map(|n| self.relative_update / n.max(f64::MIN_POSITIVE))
    }
}

/// `steps` steps with `cfg.world_size` ranks of SyncBatchNorm (of plain per-rank batch norm
/// when `sync` is false, to see the check fail) on `cfg`'s backend, device and precision, and
/// with one thread rank of plain batch norm on the same device, precision and global batches
/// (f64 weights, no augmentation). Under NCCL or MPI every process computes the one-rank
/// reference itself.
///
/// With bf16/f16 activations AdamW's ε is 1 on both sides: steps of `lr·m̂/(√v̂ + 1)`, close to
/// proportional to the gradients (which here are well below 1), instead of steps of about
/// `±lr` whatever the gradient's size, which would turn rounding noise in a gradient near 0
/// into a full step and drown the comparison. With f16 the loss scaler starts at 2¹⁰.
pub fn check(cfg: &Config, steps: usize, sync: bool) -> Result<Difference> {
    let adam_eps = match cfg.precision {
        Precision::Full => cfg.adam_eps,
        Precision::Bf16 | Precision::F16 => 1.0,
    };
    let base = Config {
        adam_eps,
        // f16: a first scale that no side overflows with (each rank's gradients are W times
        // one process's: a step skipped on one side only would be compared with a step taken).
        init_scale: 1024.0,
        dtype: DType::F64,
        augment: false,
        max_steps: Some(steps),
        epochs: 1,
        write_outputs: false,
        resume: None,
        stop_after_epoch: None,
        ..cfg.clone()
    };
    let multi = run(&Config {
        sync_bn: sync,
        ..base.clone()
    })?;
    let single_cfg = Config {
        sync_bn: false,
        world_size: 1,
        backend: "threads".into(),
        ..base
    };
    let single = run(&single_cfg)?;
    let start = run(&Config {
        max_steps: Some(0),
        ..single_cfg.clone()
    })?;
    let (max_abs, relative_update) = compare(&multi, &single, &start)?;
    let precision_noise = match cfg.precision {
        Precision::Full => None,
        Precision::Bf16 | Precision::F16 => {
            let exact = run(&Config {
                precision: Precision::Full,
                ..single_cfg
            })?;
            Some(compare(&single, &exact, &start)?.1)
        }
    };
    Ok(Difference {
        world_size: multi.world_size,
        max_abs,
        relative_update,
        precision_noise,
    })
}

/// The largest absolute difference between `a` and `b`'s trainable parameters, and
/// ‖θ_a − θ_b‖₂ / ‖θ_b − θ_start‖₂.
fn compare(a: &Summary, b: &Summary, start: &Summary) -> Result<(f64, f64)> {
    let (b, start) = (trainable(b), trainable(start));
    let (mut max_abs, mut diff2, mut moved2) = (0f64, 0f64, 0f64);
    for (name, t) in trainable(a) {
        let other = b
            .get(name)
            .with_context(|| format!("{name} missing from the single-process model"))?;
        let d = (t - *other)?.flatten_all()?;
        max_abs = max_abs.max(d.abs()?.max(0)?.to_scalar::<f64>()?);
        diff2 += d.sqr()?.sum_all()?.to_scalar::<f64>()?;
        let moved = (*other - start[name])?;
        moved2 += moved.sqr()?.sum_all()?.to_scalar::<f64>()?;
    }
    Ok((max_abs, diff2.sqrt() / moved2.sqrt().max(f64::MIN_POSITIVE)))
}

/// The trainable parameters of a run's end state, by name.
fn trainable(s: &Summary) -> HashMap<&str, &Tensor> {
    s.params
        .iter()
        .filter(|(name, _)| {
            !(name.ends_with("running_mean")
                || name.ends_with("running_var")
                || name.ends_with("num_batches_tracked"))
        })
        .map(|(k, v)| (k.as_str(), v))
        .collect()
}
