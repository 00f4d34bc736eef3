//! The example's part of a checkpoint: what it puts in the manifest's metadata (epoch, step,
//! optimizer step, loss scaler, model) and which checkpoint `--resume` names. The files, their
//! checks and the agreement between ranks are the library's (`candle_distributed::checkpoint`).

use std::path::Path;

use anyhow::{bail, Context, Result};
use candle_distributed::checkpoint::{self as lib, Loaded};
use serde::{Deserialize, Serialize};

/// The loss scaler's state, when the run used one.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct ScalerMeta {
    pub scale: f64,
    pub growth_tracker: u64,
}

/// The manifest's metadata.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Meta {
    /// Epochs completed (the epoch in progress, for a save mid-epoch).
    pub epoch: usize,
    /// Optimizer steps completed (the learning-rate schedule's and the augmentation's position).
    pub step: usize,
    /// The optimizer's own step count (its bias correction).
    pub optimizer_step: usize,
    pub scaler: Option<ScalerMeta>,
    /// The architecture, as `--model` spells it.
    pub model: String,
    /// Saved mid-epoch: the epoch's sums so far (loss, correct predictions, samples), so that
    /// its metrics row comes out as without the interruption.
    #[serde(default)]
    pub partial: Option<[f64; 3]>,
    /// What decides each epoch's order and each step's place in it (checkpoints written before
    /// these were recorded have none, and are not checked for them).
    #[serde(default)]
    pub seed: Option<u64>,
    /// The global batch size.
    #[serde(default)]
    pub batch_size: Option<usize>,
    /// The training set's size.
    #[serde(default)]
    pub train_samples: Option<usize>,
}

/// What a run must share with the run whose checkpoint it resumes: the model, and what decides
/// where in which epoch order a step falls (the seed, the global batch size, the training
/// set). The world size may differ (the position is counted in global batches).
#[derive(Debug, Clone, PartialEq)]
pub struct Identity {
    pub model: String,
    pub seed: u64,
    pub batch_size: usize,
    pub train_samples: usize,
}

/// The metadata of a loaded checkpoint, refused (naming the file and the setting) when it is
/// not the example's, is of another model, or was saved by a run with another seed, global
/// batch size or training set: the resumed epoch would skip or repeat samples under another
/// schedule, silently.
pub fn meta_of(loaded: &Loaded, run: &Identity) -> Result<Meta> {
    let meta: Meta = serde_json::from_value(loaded.metadata.clone()).with_context(|| {
        format!(
            "{}: not a checkpoint of this example",
            loaded.path.display()
        )
    })?;
    if meta.model != run.model {
        bail!(
            "{}: a checkpoint of {}, not of the --model {} of this run",
            loaded.path.display(),
            meta.model,
            run.model
        )
    }
    let differs = [
        ("--seed", meta.seed.map(|s| s as usize), run.seed as usize),
        ("--batch-size", meta.batch_size, run.batch_size),
        ("training-set size", meta.train_samples, run.train_samples),
    ];
    for (what, saved, here) in differs {
        if let Some(saved) = saved.filter(|&s| s != here) {
            bail!(
                "{}: saved by a run with {what} {saved}, this run has {here}: resuming would put \
                 its steps at other places of other epochs; resume with the settings and data of \
                 the run that saved it, or start afresh in another --out-dir",
                loaded.path.display()
            )
        }
    }
    Ok(meta)
}

/// What `--resume` names, `auto` resolved: with `auto`, the newest complete checkpoint of
/// `out_dir` (its `checkpoint.json`, which a save writes last and atomically, after its tensor
/// file) when there is one, else nothing (a fresh start). So one command serves a first start
/// and every restart under `torchrun --max-restarts N`.
pub fn resolve_resume(arg: Option<&Path>, out_dir: &Path) -> Option<std::path::PathBuf> {
    match arg {
        Some(p) if p == Path::new("auto") => lib::latest(out_dir),
        other => other.map(Path::to_path_buf),
    }
}

/// The folder a `--resume` path names: the path itself when it is a folder, else the folder of
/// its `checkpoint.json` (where the run that wrote it also left `metrics.csv`).
pub fn dir_of(path: &Path) -> std::path::PathBuf {
    if path.is_dir() {
        path.to_path_buf()
    } else {
        path.parent().unwrap_or(Path::new(".")).to_path_buf()
    }
}
