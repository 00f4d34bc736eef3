//! Checkpoints of a data-parallel run that every rank agrees on: written by rank 0 so that a
//! kill at any moment leaves the previous checkpoint or the new one, whole; loaded by every
//! rank, with every rank failing together when one cannot read its copy or holds another.
//!
//! A checkpoint is a pair in one folder: `checkpoint-<tag>-<crc32>.safetensors` (the tensors:
//! the `VarMap`'s variables, the optimizer's state, the SyncBatchNorm shifts, anything else)
//! and `checkpoint.json`, the manifest, which names that file with its size and CRC-32 and
//! carries the caller's metadata (epoch, step, loss scaler, …, as JSON). Every file is
//! written to a temporary name, flushed to disk, renamed into place; the manifest goes last, so
//! it always names a complete tensor file, and the tensor file the replaced manifest named is
//! removed only after (that one file: nothing else in the folder). One writer at a time: a save
//! holds the folder's lock, and a second writer is refused rather than let the two delete each
//! other's files. Nothing is written after a collective was lost.
//!
//! ```
//! use candle_core::{DType, Device, Tensor};
//! use candle_distributed::checkpoint;
//! use candle_distributed::collective::ThreadGroup;
//! use candle_nn::{linear, VarBuilder, VarMap};
//!
//! let dir = std::env::temp_dir().join(format!("ckpt-doc-{}", std::process::id()));
//! ThreadGroup::run(2, |comm| {
//!     let vm = VarMap::new();
//!     linear(3, 2, VarBuilder::from_varmap(&vm, DType::F32, &Device::Cpu).pp("fc"))?;
//!     let meta = serde_json::json!({ "epoch": 1 });
//!     checkpoint::save(&dir, "e0001", &checkpoint::varmap_tensors(&vm)?, &meta, &*comm)?;
//!     // Later, or after a restart: every rank loads the same checkpoint or every rank fails.
//!     let fresh = VarMap::new();
//!     linear(3, 2, VarBuilder::from_varmap(&fresh, DType::F32, &Device::Cpu).pp("fc"))?;
//!     let loaded = checkpoint::load(checkpoint::latest(&dir).as_deref(), &*comm)?.unwrap();
//!     loaded.set_varmap(&fresh)?;
//!     assert_eq!(loaded.metadata["epoch"], 1);
//!     Ok(())
//! })?;
//! # std::fs::remove_dir_all(&dir).ok();
//! # Ok::<(), candle_core::Error>(())
//! ```
//!
//! Tested in `tests/checkpoint.rs` (round trip, damage of every kind refused naming the file,
//! a rank that cannot read or holds another checkpoint failing every rank, rank 0's failed
//! write failing every rank) and, through the ResNet example, by a resumed run equal to an
//! uninterrupted one bit for bit.

mod files;
mod manifest;
mod training;

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use candle_core::{bail, Device, Result, Tensor};
use candle_nn::VarMap;

use crate::batch_norm::SyncBatchNorm;
use candle_collective::{Collective, CollectiveError};
use files::{io_err, sync_file};
pub use files::{write_atomic, FileLock};
use manifest::Manifest;
pub use training::{
    read_model, restore_training, restore_training_checked, save_training, Position, Restored,
    TrainingState,
};

/// The version of the manifest's layout; a manifest of another is refused.
pub const FORMAT: u32 = 2;

/// The manifest's name in a checkpoint folder.
pub const MANIFEST: &str = "checkpoint.json";

/// The manifest of `dir` when there is one (a complete checkpoint: the manifest is written
/// last): what a run that may be a restart passes to [`load`] (`--resume auto`).
pub fn latest(dir: &Path) -> Option<PathBuf> {
    let m = dir.join(MANIFEST);
    m.is_file().then_some(m)
}

/// Every variable of `vm`, by name: what [`save`] takes for the model.
///
/// # Errors
///
/// When the `VarMap`'s lock is poisoned.
pub fn varmap_tensors(vm: &VarMap) -> Result<Vec<(String, Tensor)>> {
    let data = vm
        .data()
        .lock()
        .map_err(|_| candle_core::Error::Msg("checkpoint: the VarMap's lock is poisoned".into()))?;
    let mut out: Vec<(String, Tensor)> = (data.iter())
        .map(|(k, v)| (k.clone(), v.as_tensor().clone()))
        .collect();
    out.sort_by(|a, b| a.0.cmp(&b.0));
    Ok(out)
}

/// Where a SyncBatchNorm layer's shift is kept: `syncbn_shift.<layer>`.
pub fn shift_key(layer: &str) -> String {
    format!("syncbn_shift.{layer}")
}

/// The shifts of `layers` (name, layer) that have one ([`SyncBatchNorm::shift`]): without them a
/// resumed run rounds its first statistics differently.
pub fn shift_tensors<'a>(
    layers: impl IntoIterator<Item = (&'a str, &'a SyncBatchNorm)>,
) -> Vec<(String, Tensor)> {
    (layers.into_iter())
        .filter_map(|(name, bn)| bn.shift().map(|s| (shift_key(name), s)))
        .collect()
}

/// Saves `tensors` and `metadata` into `dir` as a new checkpoint, written by rank 0 alone; every
/// rank returns rank 0's outcome. `tag` (letters, digits, `-`, `_`) goes into the tensor file's
/// name with the content's CRC-32 (`checkpoint-e0003-1a2b3c4d.safetensors`), so a save never
/// overwrites the file the current manifest names with other bytes. Tensors on any device
/// (copied to the host on rank 0); the agreements travel on the communicator's device
/// ([`Collective::device`]). Collective: every rank calls it.
///
/// In order:
/// 1. every rank asks its communicator whether a collective enqueued earlier was lost
///    ([`Collective::deferred_error`]: an NCCL abort, say, after which the gradients and so the
///    tensors may be garbage) and the ranks agree on the answers (one all-gather of one value
///    per rank): if any rank lost one, nothing is written and every rank fails;
/// 2. rank 0 takes the folder's lock (`.checkpoint.lock`, an advisory lock that the operating
///    system releases when its holder dies): a second writer into the same folder (another run,
///    a sweep, a lingering rank 0 of an earlier attempt) is refused with an error naming the lock,
///    and neither run's checkpoint is touched;
/// 3. it removes the temporary files of saves that were killed midway, writes the tensor file
///    to a temporary name, flushes it, computes its CRC-32 by reading it back in 1 MiB pieces,
///    renames it into place, then writes the manifest the same way;
/// 4. it removes the one tensor file the replaced manifest named (nothing else);
/// 5. every rank receives the outcome.
///
/// Host memory on rank 0: one host copy of the tensors that are not on the CPU (CPU tensors
/// are not copied) plus one tensor's bytes at a time while the file is written; the other
/// ranks hold nothing extra. A kill between the tensor file's rename and the manifest's leaves
/// that tensor file unnamed, and no later save removes it (a few milliseconds of the save).
///
/// # Errors
///
/// On every rank when some rank lost a collective before the save (naming the ranks; nothing
/// written), when rank 0 could not write (rank 0 with its reason, among them another writer
/// holding the folder's lock, the others naming rank 0 and `dir`), and when the agreement's
/// collectives fail; on every rank when `tensors` is empty or `tag` has other characters
/// (checked before anything is written).
pub fn save(
    dir: &Path,
    tag: &str,
    tensors: &[(String, Tensor)],
    metadata: &serde_json::Value,
    comm: &dyn Collective,
) -> Result<()> {
    if tensors.is_empty() {
        bail!("checkpoint::save: no tensors to save")
    }
    if !manifest::is_tag(tag) {
        bail!("checkpoint::save: tag {tag:?} must be letters, digits, '-' or '_'")
    }
    // Every rank's word on its communicator before rank 0 writes: after a lost collective the
    // tensors may be garbage, and the last good checkpoint must stay.
    let lost = comm.deferred_error().err();
    let flag = Tensor::new(&[[f64::from(u8::from(lost.is_some()))]], &comm.device())?;
    let flags = comm.all_gather(&flag)?.to_vec2::<f64>()?;
    let lost_on: Vec<usize> = (0..flags.len()).filter(|&r| flags[r][0] != 0.0).collect();
    if let Some(e) = lost {
        return Err(e.context(format!(
            "checkpoint::save: rank {}: a collective enqueued before the save was lost, so the \
             tensors may be garbage; nothing was written into {} (its last checkpoint stays)",
            comm.rank(),
            dir.display()
        )));
    }
    if !lost_on.is_empty() {
        return Err(CollectiveError::elsewhere(
            comm.rank(),
            format!(
                "checkpoint::save: rank {}: rank(s) {lost_on:?} lost a collective enqueued before \
                 the save (their errors say which), so the tensors may be garbage; nothing was \
                 written into {} (its last checkpoint stays)",
                comm.rank(),
                dir.display()
            ),
        ));
    }
    let written = if comm.rank() == 0 {
        write(dir, tag, tensors, metadata)
    } else {
        Ok(0)
    };
    let (ok, crc) = match &written {
        Ok(crc) => (1.0, f64::from(*crc)),
        Err(_) => (0.0, 0.0),
    };
    let outcome = comm.broadcast(&Tensor::new(&[ok, crc], &comm.device())?, 0)?;
    let outcome = outcome.to_vec1::<f64>()?;
    match written {
        Err(e) => Err(e.context(format!(
            "checkpoint::save: rank 0 could not write the checkpoint into {}",
            dir.display()
        ))),
        Ok(_) if outcome[0] == 0.0 => Err(CollectiveError::elsewhere(
            comm.rank(),
            format!(
                "checkpoint::save: rank {}: rank 0 could not write the checkpoint into {} (its error says why)",
                comm.rank(),
                dir.display()
            ),
        )),
        Ok(_) => Ok(()),
    }
}

/// Rank 0's write, under the folder's lock: stale temporary files removed, the tensor file,
/// then the manifest, then the removal of the tensor file the replaced manifest named. Returns
/// the tensor file's CRC-32.
fn write(
    dir: &Path,
    tag: &str,
    tensors: &[(String, Tensor)],
    metadata: &serde_json::Value,
) -> Result<u32> {
    std::fs::create_dir_all(dir).map_err(|e| io_err("creating", dir, e))?;
    let _lock = FileLock::of_folder(dir)?;
    let stale = files::remove_stale_temps(dir);
    if stale > 0 {
        log::info!(
            "checkpoint: removed {stale} temporary file(s) of killed saves from {}",
            dir.display()
        );
    }
    // The file the current manifest names, removed once the new manifest replaced it: only a
    // tensor file of this crate's naming and of the size the manifest says (a manifest that
    // cannot be read, or names anything else, the manifest or the lock included, names
    // nothing to remove).
    let replaced = manifest::read_manifest(&dir.join(MANIFEST))
        .ok()
        .filter(|m| manifest::is_tensor_file_name(&m.tensors))
        .filter(|m| {
            std::fs::symlink_metadata(dir.join(&m.tensors))
                .is_ok_and(|f| f.is_file() && f.len() == m.tensors_bytes)
        })
        .map(|m| m.tensors);
    // A staging folder of a unique name: a kill leaves it to the next save's clean-up.
    let stage = files::Staging::new(dir, tag)?;
    {
        let map: HashMap<String, Tensor> = tensors
            .iter()
            .map(|(k, t)| Ok((k.clone(), t.to_device(&Device::Cpu)?)))
            .collect::<Result<_>>()?;
        candle_core::safetensors::save(&map, stage.file())
            .map_err(|e| io_err("writing", stage.file(), e))?;
    }
    sync_file(stage.file())?;
    let (crc, bytes) = files::crc32_of(stage.file())?;
    let name = format!("checkpoint-{tag}-{crc:08x}.safetensors");
    stage.publish(&dir.join(&name))?;
    let manifest = Manifest {
        format: FORMAT,
        tensors: name.clone(),
        tensors_bytes: bytes,
        tensors_crc32: crc,
        metadata: metadata.clone(),
    };
    let json = serde_json::to_vec_pretty(&manifest)
        .map_err(|e| candle_core::Error::Msg(format!("checkpoint: the manifest: {e}")))?;
    write_atomic(&dir.join(MANIFEST), &json)?;
    // The new pair is in place: the replaced manifest's tensor file is garbage now.
    if let Some(old) = replaced.filter(|old| *old != name) {
        let _ = std::fs::remove_file(dir.join(old));
    }
    Ok(crc)
}

/// A checkpoint as [`load`] read it: the caller's metadata and the tensors (on the host).
#[derive(Debug, Clone)]
pub struct Loaded {
    /// The manifest read.
    pub path: PathBuf,
    /// What [`save`] was given as metadata.
    pub metadata: serde_json::Value,
    /// Every tensor, by name, on the CPU.
    pub tensors: HashMap<String, Tensor>,
    /// The tensor file's CRC-32 (the same on every rank after [`load`]).
    pub crc32: u32,
}

impl Loaded {
    /// Sets every variable of `vm` from the tensors of the same name (moved to the variable's
    /// device and dtype), after checking that each is there with its shape: a refused
    /// checkpoint changes nothing.
    ///
    /// # Errors
    ///
    /// When a variable is missing from the checkpoint or has another shape there (naming it),
    /// the lock is poisoned, or a conversion fails.
    pub fn set_varmap(&self, vm: &VarMap) -> Result<()> {
        for (v, t) in self.varmap_values(vm)? {
            v.set(&t)?;
        }
        Ok(())
    }

    /// The values [`Self::set_varmap`] would set, checked and converted; nothing changes.
    pub(super) fn varmap_values(&self, vm: &VarMap) -> Result<Vec<(candle_core::Var, Tensor)>> {
        let data = vm.data().lock().map_err(|_| {
            candle_core::Error::Msg("checkpoint: the VarMap's lock is poisoned".into())
        })?;
        let mut found = Vec::with_capacity(data.len());
        for (name, v) in data.iter() {
            let Some(t) = self.tensors.get(name) else {
                bail!(
                    "checkpoint {}: no tensor {name} (another model?)",
                    self.path.display()
                )
            };
            if t.dims() != v.dims() {
                bail!(
                    "checkpoint {}: {name} is {:?}, the model's {:?}",
                    self.path.display(),
                    t.dims(),
                    v.dims()
                )
            }
            found.push((v.clone(), t.to_dtype(v.dtype())?.to_device(v.device())?));
        }
        Ok(found)
    }

    /// Restores the shifts [`shift_tensors`] saved into `layers` (a layer without one gets
    /// `None`, as before its first step).
    ///
    /// # Errors
    ///
    /// As [`SyncBatchNorm::set_shift`].
    pub fn restore_shifts<'a>(
        &self,
        layers: impl IntoIterator<Item = (&'a str, &'a SyncBatchNorm)>,
    ) -> Result<()> {
        for (name, bn) in layers {
            bn.set_shift(self.tensors.get(&shift_key(name)))?;
        }
        Ok(())
    }
}

/// Loads the checkpoint `path` names (a manifest, or the folder holding one) on every rank, or
/// nothing (`None`: a fresh start), and makes every rank agree: all load the same checkpoint
/// (the same tensor file, by CRC-32, and the same manifest: metadata included), or all start
/// fresh, or all fail. A manifest is refused when it is empty, larger than 16 MiB or malformed,
/// of another format, names its tensor file by anything but a plain file name beside it (a
/// path, `..`), or names a tensor file that is missing, not a regular file, of another size
/// (truncated: checked before anything is read) or another CRC-32 (corrupt), each naming the
/// file. Collective: every rank calls it (one all-gather of 3 values per rank, on the
/// communicator's device, [`Collective::device`]; [`load_on`] names another).
///
/// Host memory per rank: one copy of the checkpoint's tensors (the tensor file is mapped, not
/// read into memory; the ranks of one machine share its pages in the page cache).
///
/// # Errors
///
/// On every rank when any rank's load failed (that rank with its reason, the others naming the
/// ranks that failed), or the ranks loaded different checkpoints or some none (naming each
/// rank's), or the all-gather fails.
pub fn load(path: Option<&Path>, comm: &dyn Collective) -> Result<Option<Loaded>> {
    load_on(path, comm, &comm.device())
}

/// [`load`], with the agreement's all-gather on `device` (a GPU for NCCL).
///
/// # Errors
///
/// As [`load`].
pub fn load_on(
    path: Option<&Path>,
    comm: &dyn Collective,
    device: &Device,
) -> Result<Option<Loaded>> {
    let mine = path.map(manifest::read);
    let row: [f64; 3] = match &mine {
        None => [0.0, 0.0, 0.0],
        Some(Ok((l, manifest_crc))) => [1.0, f64::from(l.crc32), f64::from(*manifest_crc)],
        Some(Err(_)) => [2.0, 0.0, 0.0],
    };
    let all = comm
        .all_gather(&Tensor::new(&[row], device)?)?
        .to_vec2::<f64>()?;
    let failed: Vec<usize> = (0..all.len()).filter(|&r| all[r][0] == 2.0).collect();
    if let Some(Err(e)) = mine {
        return Err(e.context(format!(
            "checkpoint::load: rank {} could not load",
            comm.rank()
        )));
    }
    if !failed.is_empty() {
        return Err(CollectiveError::elsewhere(
            comm.rank(),
            format!(
                "checkpoint::load: rank {}: rank(s) {failed:?} could not load their checkpoint (their errors say why)",
                comm.rank()
            ),
        ));
    }
    if all.iter().any(|r| r != &all[0]) {
        let each: Vec<String> = (all.iter().enumerate())
            .map(|(r, row)| match row[0] {
                0.0 => format!("rank {r}: none"),
                _ => format!(
                    "rank {r}: tensors CRC-32 {:08x}, manifest CRC-32 {:08x}",
                    row[1] as u32, row[2] as u32
                ),
            })
            .collect();
        bail!(
            "checkpoint::load: the ranks hold different checkpoints ({}); every rank must load the same one",
            each.join("; ")
        )
    }
    Ok(mine.transpose()?.map(|(loaded, _)| loaded))
}
