//! The example's part of a checkpoint: the metadata it adds to the library's training state
//! (`candle_distributed::checkpoint::save_training`: variables, AdamW's state, the batch norms'
//! shifts, the position), what a resume must share with the run that saved it, and which
//! checkpoint `--resume` names. The files, their checks and the agreement between ranks are the
//! library's.

use std::path::Path;

use anyhow::{bail, Result};
use candle_distributed::checkpoint as lib;
use serde::{Deserialize, Serialize};

/// The loss scaler's state, when the run used one.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct ScalerMeta {
    pub scale: f64,
    pub growth_tracker: u64,
}

/// The example's metadata, beside the library's position and optimizer step.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Meta {
    /// Optimizer steps completed over the whole run (the learning-rate schedule's and the
    /// augmentation's position; the library's position counts the steps of the epoch).
    pub step: usize,
    pub scaler: Option<ScalerMeta>,
    /// Saved mid-epoch: the epoch's sums so far (loss, correct predictions, samples), so that
    /// its metrics row comes out as without the interruption.
    pub partial: Option<[f64; 3]>,
    /// What the resumed run must share with this one.
    pub identity: Identity,
}

/// What a run must share with the run whose checkpoint it resumes: the model, and what decides
/// where in which epoch order a step falls (the seed, the global batch size, the training
/// set). The world size may differ (the position is counted in global batches).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Identity {
    /// The architecture, as `--model` spells it.
    pub model: String,
    pub seed: u64,
    pub batch_size: usize,
    pub train_samples: usize,
}

/// Refuses (naming the file and the setting) a checkpoint of another model, or saved by a run
/// with another seed, global batch size or training set: the resumed epoch would skip or repeat
/// samples under another schedule, silently. Runs on every rank among the library's checks,
/// before anything is restored (`checkpoint::restore_training_checked`).
pub fn accept(saved: &Identity, path: &Path, run: &Identity) -> Result<()> {
    if saved.model != run.model {
        bail!(
            "{}: a checkpoint of {}, not of the --model {} of this run",
            path.display(),
            saved.model,
            run.model
        )
    }
    let differs = [
        ("--seed", saved.seed as usize, run.seed as usize),
        ("--batch-size", saved.batch_size, run.batch_size),
        ("training-set size", saved.train_samples, run.train_samples),
    ];
    for (what, saved, here) in differs {
        if saved != here {
            bail!(
                "{}: saved by a run with {what} {saved}, this run has {here}: resuming would put \
                 its steps at other places of other epochs; resume with the settings and data of \
                 the run that saved it, or start afresh in another --out-dir",
                path.display()
            )
        }
    }
    Ok(())
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
