//! The whole training state in one call each way: [`save_training`] and [`restore_training`],
//! and [`read_model`], the weights alone without a communicator (inference, export).

use std::collections::HashSet;
use std::path::{Path, PathBuf};

use candle_core::{bail, Result, Tensor};
use candle_nn::VarMap;
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

use super::{load, manifest, save, shift_key, varmap_tensors, Loaded};
use crate::batch_norm::SyncBatchNorm;
use crate::optim::AdamW;
use candle_collective::{Collective, CollectiveError};

/// Where a run stands: the epoch it is in (0-based) and the steps of that epoch already taken;
/// a resumed run continues from there (`DistributedSampler::batches(epoch, per_rank, step)`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct Position {
    /// The epoch, from 0.
    pub epoch: u64,
    /// The steps of `epoch` taken (0: the epoch starts).
    pub step: usize,
}

/// What [`save_training`] saves and [`restore_training`] restores: the model's variables, the
/// optimizer's moments and step, every [`SyncBatchNorm`]'s shift (by the layer's
/// [`SyncBatchNorm::name`]), and the position.
#[derive(Clone, Copy)]
pub struct TrainingState<'a> {
    /// The model's variables (batch-norm buffers included).
    pub model: &'a VarMap,
    /// The optimizer, if it has state to keep.
    pub optimizer: Option<&'a AdamW>,
    /// The model's synchronized batch norms (clones of the layers: they share their state).
    pub norms: &'a [SyncBatchNorm],
    /// Where the run stands.
    pub position: Position,
}

/// What [`restore_training`] read besides the tensors it set.
#[derive(Debug, Clone)]
pub struct Restored<M> {
    /// The manifest loaded.
    pub path: PathBuf,
    /// Where the saved run stood.
    pub position: Position,
    /// The caller's metadata, as saved.
    pub metadata: M,
}

/// The library's part of the manifest's metadata; the caller's sits beside it under `user`.
#[derive(Serialize, Deserialize)]
struct Saved<M> {
    position: Position,
    optimizer_step: Option<usize>,
    user: M,
}

/// The norms' names, each once.
fn norm_names<'a>(op: &str, norms: &'a [SyncBatchNorm]) -> Result<Vec<&'a str>> {
    let mut seen = HashSet::new();
    for bn in norms {
        if !seen.insert(bn.name()) {
            bail!(
                "checkpoint::{op}: two synchronized batch norms are named {:?} (built under the same VarBuilder prefix): their shifts would share one key",
                bn.name()
            )
        }
    }
    Ok(norms.iter().map(SyncBatchNorm::name).collect())
}

/// Saves the training state and `metadata` (any `Serialize`: a struct of the caller's, the
/// run's configuration, the loss scaler's state) as one checkpoint in `dir`, with every
/// guarantee of [`save`]: written by rank 0, atomic, refused after a lost collective, every rank
/// returning rank 0's outcome. Collective: every rank calls it.
///
/// # Errors
///
/// As [`save`]; also, before anything is written, when two of `state.norms` have the same name
/// or `metadata` cannot be serialized.
pub fn save_training<M: Serialize>(
    dir: &Path,
    tag: &str,
    state: &TrainingState<'_>,
    metadata: &M,
    comm: &dyn Collective,
) -> Result<()> {
    let names = norm_names("save_training", state.norms)?;
    let mut tensors = varmap_tensors(state.model)?;
    let optimizer_step = state.optimizer.map(|opt| {
        let (step, moments) = opt.state();
        tensors.extend(moments);
        step
    });
    for (name, bn) in names.iter().zip(state.norms) {
        if let Some(shift) = bn.shift() {
            tensors.push((shift_key(name), shift));
        }
    }
    let saved = Saved {
        position: state.position,
        optimizer_step,
        user: metadata,
    };
    let json = serde_json::to_value(&saved).map_err(|e| {
        candle_core::Error::Msg(format!(
            "checkpoint::save_training: the metadata cannot be written as JSON: {e}"
        ))
    })?;
    save(dir, tag, &tensors, &json, comm)
}

/// Restores what [`save_training`] saved into the model, the optimizer and the norms, from the
/// checkpoint `path` names (a manifest or its folder; `None`, or [`super::latest`] of an empty
/// folder: a fresh start, `Ok(None)`), and returns the position and the caller's metadata.
/// Every rank loads the same checkpoint ([`load`]'s agreement), checks everything it would set
/// (every variable, every moment, every shift, the metadata's type), and the ranks agree on the
/// checks before any rank sets anything: a refused checkpoint changes nothing on any rank.
/// Collective: every rank calls it.
///
/// A norm whose shift the checkpoint lacks (saved before its first step) gets none, as before
/// its first step; each norm's `num_batches_tracked` (the host counter its next step uses)
/// follows its restored variable.
///
/// # Errors
///
/// As [`load`]; on every rank when some rank's checks failed (that rank with its reason: a
/// variable or moment missing or of another shape, naming it; metadata of another type; two
/// norms of one name; the others naming the ranks that failed); when an optimizer is given and
/// the checkpoint saved none.
pub fn restore_training<M: DeserializeOwned>(
    path: Option<&Path>,
    model: &VarMap,
    optimizer: Option<&mut AdamW>,
    norms: &[SyncBatchNorm],
    comm: &dyn Collective,
) -> Result<Option<Restored<M>>> {
    restore_training_checked(path, model, optimizer, norms, comm, |_, _| Ok(()))
}

/// [`restore_training`] with the caller's own check of the checkpoint among the checks every
/// rank runs before any rank sets anything: `accept(&metadata, path)` runs right after the
/// metadata is read, and an error from it on any rank refuses the checkpoint on every rank,
/// changing nothing. For what a run must share with the run it resumes (the model, the seed,
/// the batch size, the data: a resumed epoch under another order would skip or repeat samples
/// silently).
///
/// # Errors
///
/// As [`restore_training`]; also on every rank when `accept` failed on some rank (that rank
/// with `accept`'s error).
pub fn restore_training_checked<M: DeserializeOwned>(
    path: Option<&Path>,
    model: &VarMap,
    optimizer: Option<&mut AdamW>,
    norms: &[SyncBatchNorm],
    comm: &dyn Collective,
    accept: impl FnOnce(&M, &Path) -> Result<()>,
) -> Result<Option<Restored<M>>> {
    let Some(loaded) = load(path, comm)? else {
        return Ok(None);
    };
    let checked = check(&loaded, model, optimizer.as_deref(), norms, accept);
    let ok = Tensor::new(&[[f64::from(u8::from(checked.is_ok()))]], &comm.device())?;
    let all = comm.all_gather(&ok)?.to_vec2::<f64>()?;
    let failed: Vec<usize> = (0..all.len()).filter(|&r| all[r][0] == 0.0).collect();
    let checked = checked.map_err(|e| {
        e.context(format!(
            "checkpoint::restore_training: rank {} refused {}; nothing was restored on any rank",
            comm.rank(),
            loaded.path.display()
        ))
    })?;
    if !failed.is_empty() {
        return Err(CollectiveError::elsewhere(
            comm.rank(),
            format!(
                "checkpoint::restore_training: rank(s) {failed:?} refused {} (their errors say why); nothing was restored on any rank",
                loaded.path.display()
            ),
        ));
    }
    let Checked {
        saved,
        vars,
        moments,
        shifts,
    } = checked;
    for (v, t) in vars {
        v.set(&t)?;
    }
    if let (Some(opt), Some((step, found))) = (optimizer, moments) {
        opt.put_state(step, found)?;
    }
    for (bn, shift) in norms.iter().zip(shifts) {
        bn.put_shift(shift);
        // The layer's host copy of `num_batches_tracked` follows the variable just restored.
        bn.reread_num_batches_tracked()?;
    }
    Ok(Some(Restored {
        path: loaded.path,
        position: saved.position,
        metadata: saved.user,
    }))
}

/// Everything [`restore_training`] sets, checked.
struct Checked<M> {
    saved: Saved<M>,
    vars: Vec<(candle_core::Var, Tensor)>,
    moments: Option<(usize, Vec<(Tensor, Tensor)>)>,
    shifts: Vec<Option<Tensor>>,
}

fn check<M: DeserializeOwned>(
    loaded: &Loaded,
    model: &VarMap,
    optimizer: Option<&AdamW>,
    norms: &[SyncBatchNorm],
    accept: impl FnOnce(&M, &Path) -> Result<()>,
) -> Result<Checked<M>> {
    let saved: Saved<M> = serde_json::from_value(loaded.metadata.clone()).map_err(|e| {
        candle_core::Error::Msg(format!(
            "checkpoint {}: its metadata is not what save_training wrote with this type: {e}",
            loaded.path.display()
        ))
    })?;
    accept(&saved.user, &loaded.path)?;
    let names = norm_names("restore_training", norms)?;
    let vars = loaded.varmap_values(model)?;
    let moments = match (optimizer, saved.optimizer_step) {
        (None, _) => None,
        (Some(opt), Some(step)) => Some((step, opt.checked_state(&loaded.tensors)?)),
        (Some(_), None) => bail!(
            "checkpoint {}: no optimizer state was saved, and an optimizer was given to restore",
            loaded.path.display()
        ),
    };
    let shifts = (names.iter().zip(norms))
        .map(|(name, bn)| bn.checked_shift(loaded.tensors.get(&shift_key(name))))
        .collect::<Result<Vec<_>>>()?;
    Ok(Checked {
        saved,
        vars,
        moments,
        shifts,
    })
}

/// The model's variables from the checkpoint `path` names (a manifest or its folder), on this
/// process alone: for inference or export, where there is no communicator. Every check of
/// [`load`]'s read (size, CRC-32, format) and of [`Loaded::set_varmap`] (every variable there
/// with its shape; a refused checkpoint changes nothing). Returns what was read (the metadata
/// and every tensor).
///
/// # Errors
///
/// As [`load`]'s read and [`Loaded::set_varmap`].
pub fn read_model(path: &Path, model: &VarMap) -> Result<Loaded> {
    let (loaded, _) = manifest::read(path)?;
    loaded.set_varmap(model)?;
    Ok(loaded)
}
