//! Checkpoints that survive a kill at any moment: every file is written to a temporary name,
//! flushed to disk (`fsync`) and renamed into place, and a checkpoint is a pair — the tensors
//! in `checkpoint-e<epoch>-<crc32>.safetensors` (weights, batch-norm buffers, optimizer moments) and
//! `checkpoint.json`, which names that file with its size and CRC-32 and carries the epoch,
//! step, optimizer step and loss-scaler state. The JSON is renamed last, so it always names a
//! complete tensor file; the previous tensor file is removed only after. Loading checks the
//! pair and refuses anything truncated, corrupt or from another model, naming the file.

use std::collections::HashMap;
use std::io::Write;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use candle_core::{Device, Tensor};
use serde::{Deserialize, Serialize};

/// The version of the layout below; a checkpoint of another is refused.
pub const FORMAT: u32 = 1;

/// The loss scaler's state, when the run used one.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct ScalerMeta {
    pub scale: f64,
    pub growth_tracker: u64,
}

/// `checkpoint.json`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Meta {
    pub format: u32,
    /// Epochs completed.
    pub epoch: usize,
    /// Optimizer steps completed (the learning-rate schedule's and the augmentation's position).
    pub step: usize,
    /// The optimizer's own step count (its bias correction).
    pub optimizer_step: usize,
    pub scaler: Option<ScalerMeta>,
    /// The architecture, as `--model` spells it.
    pub model: String,
    /// The tensor file, next to this one.
    pub weights: String,
    pub weights_bytes: u64,
    pub weights_crc32: u32,
}

/// Writes `bytes` to `path` atomically: a temporary file in the same directory, `fsync`, rename,
/// `fsync` of the directory. A kill at any point leaves the old file or the new one, whole.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    let tmp = tmp_name(path);
    let mut f =
        std::fs::File::create(&tmp).with_context(|| format!("creating {}", tmp.display()))?;
    f.write_all(bytes)
        .and_then(|()| f.sync_all())
        .with_context(|| format!("writing {}", tmp.display()))?;
    drop(f);
    publish(&tmp, path)
}

fn tmp_name(path: &Path) -> PathBuf {
    let mut name = path.file_name().unwrap_or_default().to_os_string();
    name.push(".tmp");
    path.with_file_name(name)
}

/// Renames `tmp` to `path` and flushes the directory entry.
fn publish(tmp: &Path, path: &Path) -> Result<()> {
    std::fs::rename(tmp, path)
        .with_context(|| format!("renaming {} to {}", tmp.display(), path.display()))?;
    let dir = path.parent().filter(|d| !d.as_os_str().is_empty());
    let dir = dir.unwrap_or(Path::new("."));
    sync_dir(dir).with_context(|| format!("syncing directory {}", dir.display()))
}

/// Flushes a written file to disk through a handle with write access (Windows'
/// `FlushFileBuffers`, behind `sync_all`, refuses a read-only one; Unix accepts either).
pub fn sync_file(path: &Path) -> Result<()> {
    std::fs::OpenOptions::new()
        .write(true)
        .open(path)
        .and_then(|f| f.sync_all())
        .with_context(|| format!("syncing {}", path.display()))
}

/// Flushes a directory's entries (a rename into it) to disk: `fsync` of the directory on Unix.
#[cfg(unix)]
pub fn sync_dir(dir: &Path) -> std::io::Result<()> {
    std::fs::File::open(dir)?.sync_all()
}

/// Elsewhere (Windows) a directory cannot be opened as a file without flags the standard
/// library does not expose, and NTFS journals the rename itself: nothing to do.
#[cfg(not(unix))]
pub fn sync_dir(_dir: &Path) -> std::io::Result<()> {
    Ok(())
}

/// Saves `tensors` and `meta` (whose `weights*` fields are filled in here) into `dir`. The
/// tensor file's name carries the epoch and the content's CRC-32
/// (`checkpoint-e0003-1a2b3c4d.safetensors`), so it never overwrites the file the current
/// `checkpoint.json` names with other bytes (say, a run restarted into the same directory).
pub fn save(dir: &Path, mut meta: Meta, tensors: &[(String, Tensor)]) -> Result<()> {
    std::fs::create_dir_all(dir)?;
    let tmp = dir.join(format!("checkpoint-e{:04}.safetensors.tmp", meta.epoch));
    let map: HashMap<String, Tensor> = tensors
        .iter()
        .map(|(k, t)| Ok((k.clone(), t.to_device(&Device::Cpu)?)))
        .collect::<Result<_>>()?;
    candle_core::safetensors::save(&map, &tmp)
        .with_context(|| format!("writing {}", tmp.display()))?;
    sync_file(&tmp)?;
    let bytes = std::fs::read(&tmp)?;
    let crc = crc32fast::hash(&bytes);
    let weights = format!("checkpoint-e{:04}-{crc:08x}.safetensors", meta.epoch);
    publish(&tmp, &dir.join(&weights))?;
    meta.format = FORMAT;
    meta.weights = weights.clone();
    meta.weights_bytes = bytes.len() as u64;
    meta.weights_crc32 = crc;
    let json = serde_json::to_vec_pretty(&meta)?;
    write_atomic(&dir.join("checkpoint.json"), &json)?;
    // The new pair is in place: older tensor files are garbage now.
    for entry in std::fs::read_dir(dir)?.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        if name.starts_with("checkpoint-e") && name.ends_with(".safetensors") && name != weights {
            let _ = std::fs::remove_file(entry.path());
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
        Some(p) if p == Path::new("auto") => {
            let json = out_dir.join("checkpoint.json");
            json.is_file().then_some(json)
        }
        other => other.map(Path::to_path_buf),
    }
}

/// Loads the checkpoint `path` names: a `checkpoint.json` or the directory holding one.
/// Refuses, with the file and the reason, an empty or malformed JSON, another format, a
/// missing, truncated or corrupt tensor file, or a model other than `model`.
/// The folder a `--resume` path names: the path itself when it is a folder, else the folder of
/// its `checkpoint.json` (where the run that wrote it also left `metrics.csv`).
pub fn dir_of(path: &Path) -> std::path::PathBuf {
    if path.is_dir() {
        path.to_path_buf()
    } else {
        path.parent().unwrap_or(Path::new(".")).to_path_buf()
    }
}

pub fn load(path: &Path, model: &str) -> Result<(Meta, HashMap<String, Tensor>)> {
    let json = if path.is_dir() {
        path.join("checkpoint.json")
    } else if path.extension().is_some_and(|e| e == "safetensors") {
        bail!(
            "--resume {}: pass the checkpoint.json next to it (or its directory): the tensor file alone does not say which epoch it holds",
            path.display()
        )
    } else {
        path.to_path_buf()
    };
    let text = std::fs::read(&json).with_context(|| format!("reading {}", json.display()))?;
    if text.is_empty() {
        bail!("{} is empty: not a checkpoint", json.display())
    }
    let meta: Meta = serde_json::from_slice(&text)
        .with_context(|| format!("{} is not a valid checkpoint", json.display()))?;
    if meta.format != FORMAT {
        bail!(
            "{}: checkpoint format {} (this build reads {FORMAT})",
            json.display(),
            meta.format
        )
    }
    if meta.model != model {
        bail!(
            "{}: a checkpoint of {}, not of the --model {model} of this run",
            json.display(),
            meta.model
        )
    }
    let file = json.with_file_name(&meta.weights);
    let bytes = std::fs::read(&file).with_context(|| {
        format!(
            "{} names {}, which cannot be read",
            json.display(),
            file.display()
        )
    })?;
    if bytes.len() as u64 != meta.weights_bytes {
        bail!(
            "{}: {} bytes, {} expected by {} (truncated or replaced)",
            file.display(),
            bytes.len(),
            meta.weights_bytes,
            json.display()
        )
    }
    let crc = crc32fast::hash(&bytes);
    if crc != meta.weights_crc32 {
        bail!(
            "{}: CRC-32 {crc:08x}, {:08x} expected by {} (corrupt)",
            file.display(),
            meta.weights_crc32,
            json.display()
        )
    }
    let tensors = candle_core::safetensors::load_buffer(&bytes, &Device::Cpu)
        .with_context(|| format!("{}: not a safetensors file", file.display()))?;
    Ok((meta, tensors))
}
