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
}

/// The metadata of a loaded checkpoint, refused (naming the file) when it is not the example's
/// or is of another model than `model`.
pub fn meta_of(loaded: &Loaded, model: &str) -> Result<Meta> {
    let meta: Meta = serde_json::from_value(loaded.metadata.clone()).with_context(|| {
        format!(
            "{}: not a checkpoint of this example",
            loaded.path.display()
        )
    })?;
    if meta.model != model {
        bail!(
            "{}: a checkpoint of {}, not of the --model {model} of this run",
            loaded.path.display(),
            meta.model
        )
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
