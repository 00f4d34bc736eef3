//! One rank's model, optimizer and position (`State`): built fresh or from a checkpoint, and
//! written back to one (with the metrics CSV and the chart) after every epoch.

use std::collections::HashMap;
use std::sync::Arc;

use anyhow::{bail, Context, Result};
use candle_core::{Device, Tensor};
use candle_distributed::amp::{GradScaler, GradScalerConfig, GradScalerState};
use candle_distributed::collective::Collective;
use candle_distributed::{DataParallel, GradHooks};
use candle_nn::{ParamsAdamW, VarBuilder, VarMap};

use crate::checkpoint;
use crate::config::{Config, Precision};
use crate::model::{NormKind, ResNet};
use crate::optim::AdamW;
use crate::report::{self, EpochMetrics};
use crate::train::init_weights;

/// One rank's model, optimizer and position, as a checkpoint restores them.
pub struct State {
    pub vm: VarMap,
    pub model: ResNet,
    pub dp: DataParallel,
    pub opt: AdamW,
    /// Loss scaling (f16 only).
    pub scaler: Option<GradScaler>,
    /// Epochs completed.
    pub epoch: usize,
    /// Optimizer steps completed.
    pub step: usize,
}

/// Refuses a start where the ranks did not restore the same checkpoint (another file on
/// another node, a stale copy, a rank launched without `--resume`): one small all-gather of
/// every rank's (resumed, epoch, step, optimizer step, CRC-32 of the weights), compared on
/// every rank, so that all refuse together, naming the ranks and what they hold. (Weights are
/// broadcast from rank 0 anyway; the optimizer's moments, the position and the loss scale are
/// not, and would diverge silently.)
fn agree_on_resume(
    comm: &Arc<dyn Collective>,
    device: &Device,
    meta: Option<&checkpoint::Meta>,
) -> Result<()> {
    let mine: [f64; 5] = match meta {
        Some(m) => [
            1.0,
            m.epoch as f64,
            m.step as f64,
            m.optimizer_step as f64,
            f64::from(m.weights_crc32),
        ],
        None => [0.0; 5],
    };
    let all = comm
        .all_gather(&Tensor::new(&[mine], device)?)?
        .to_vec2::<f64>()?;
    if all.iter().all(|row| row.as_slice() == mine.as_slice()) {
        return Ok(());
    }
    let describe = |row: &[f64]| {
        if row[0] == 0.0 {
            "no checkpoint".to_string()
        } else {
            format!(
                "epoch {}, step {}, optimizer step {}, weights CRC-32 {:08x}",
                row[1], row[2], row[3], row[4] as u32
            )
        }
    };
    let ranks: Vec<String> = all
        .iter()
        .enumerate()
        .map(|(r, row)| format!("rank {r}: {}", describe(row)))
        .collect();
    bail!(
        "--resume: the ranks restored different checkpoints ({}); every rank must load the same one",
        ranks.join("; ")
    )
}

/// Builds the model (from `cfg.resume`'s checkpoint when given; refused if it does not match)
/// and the optimizer.
pub fn setup(
    comm: &Arc<dyn Collective>,
    device: &Device,
    cfg: &Config,
    classes: usize,
) -> Result<State> {
    let vm = VarMap::new();
    // With --overlap, the model computes with hooked copies of its trainable variables, whose
    // backward starts each bucket's all-reduce as soon as its gradients are complete.
    let hooks = cfg.overlap.then(GradHooks::new);
    let vb = match &hooks {
        Some(h) => h.var_builder(&vm, cfg.dtype, device),
        None => VarBuilder::from_varmap(&vm, cfg.dtype, device),
    };
    let norm = if cfg.sync_bn {
        NormKind::SyncBn(comm.clone())
    } else {
        NormKind::Bn
    };
    let mut model = ResNet::new(cfg.arch, classes, &norm, vb.clone())?;
    init_weights(&vm, cfg.seed)?;
    let resumed = match &cfg.resume {
        Some(path) => Some(checkpoint::load(path, &cfg.arch.name())?),
        None => None,
    };
    agree_on_resume(comm, device, resumed.as_ref().map(|(meta, _)| meta))?;
    if let Some((_, tensors)) = &resumed {
        load_vars(&vm, tensors)?;
        // Built again over the loaded variables: SyncBatchNorm reads `num_batches_tracked`
        // when it is built.
        model = ResNet::new(cfg.arch, classes, &norm, vb)?;
        for (name, bn) in model.sync_norms() {
            bn.set_shift(tensors.get(&shift_key(name)))?;
        }
    }
    let mut dp = DataParallel::new(&vm, comm.clone())?.with_bucket_bytes(cfg.bucket_bytes);
    if let Some(h) = &hooks {
        dp = dp.with_overlap(h)?; // also copies the (loaded, broadcast) variables in
    }
    let params = ParamsAdamW {
        lr: cfg.lr,
        weight_decay: cfg.weight_decay,
        eps: cfg.adam_eps,
        ..Default::default()
    };
    let mut opt = AdamW::new(dp.named_trainable(), params)?;
    let mut scaler = (cfg.precision == Precision::F16)
        .then(|| GradScaler::new(GradScalerConfig::default().with_init_scale(cfg.init_scale)))
        .transpose()?;
    let (mut epoch, mut step) = (0, 0);
    if let Some((meta, tensors)) = &resumed {
        opt.load_state(meta.optimizer_step, tensors)?;
        (epoch, step) = (meta.epoch, meta.step);
        if let (Some(s), Some(m)) = (scaler.as_mut(), meta.scaler) {
            s.load_state(GradScalerState {
                scale: m.scale,
                growth_tracker: m.growth_tracker,
            })?;
        }
    }
    Ok(State {
        vm,
        model,
        dp,
        opt,
        scaler,
        epoch,
        step,
    })
}

/// Sets every variable of `vm` from `tensors`, after checking that each is there with its
/// shape: a refused checkpoint changes nothing.
pub fn load_vars(vm: &VarMap, tensors: &HashMap<String, Tensor>) -> Result<()> {
    let data = vm.data().lock().expect("VarMap lock");
    let mut found = Vec::with_capacity(data.len());
    for (name, v) in data.iter() {
        let t = tensors
            .get(name)
            .with_context(|| format!("the checkpoint has no {name}: another model?"))?;
        if t.dims() != v.dims() {
            bail!(
                "{name}: {:?} in the checkpoint, {:?} in the model",
                t.dims(),
                v.dims()
            )
        }
        found.push((v, t.to_dtype(v.dtype())?.to_device(v.device())?));
    }
    for (v, t) in found {
        v.set(&t)?;
    }
    Ok(())
}

/// Where a SyncBatchNorm layer's shift is kept in a checkpoint.
pub fn shift_key(layer: &str) -> String {
    format!("syncbn_shift.{layer}")
}

/// CSV, plot and checkpoint into `cfg.out_dir`, each file written atomically
/// ([`checkpoint::write_atomic`]).
pub fn write_outputs(cfg: &Config, st: &State, metrics: &[EpochMetrics]) -> Result<()> {
    std::fs::create_dir_all(&cfg.out_dir)?;
    report::write_csv(&cfg.out_dir.join("metrics.csv"), metrics)?;
    // The chart is a picture of what the CSV holds: a run does not fail for want of a font.
    if let Err(e) = report::write_plot(&cfg.out_dir.join("curves.png"), &cfg.title(), metrics) {
        log::warn!("curves.png not written: {e:#}");
    }
    let mut tensors: Vec<(String, Tensor)> = st
        .vm
        .data()
        .lock()
        .expect("VarMap lock")
        .iter()
        .map(|(k, v)| (k.clone(), v.as_tensor().clone()))
        .collect();
    let (optimizer_step, moments) = st.opt.state();
    tensors.extend(moments);
    // SyncBatchNorm's shifts: without them a resumed run rounds differently.
    for (name, bn) in st.model.sync_norms() {
        if let Some(shift) = bn.shift() {
            tensors.push((shift_key(name), shift));
        }
    }
    let meta = checkpoint::Meta {
        format: checkpoint::FORMAT,
        epoch: st.epoch,
        step: st.step,
        optimizer_step,
        scaler: st.scaler.as_ref().map(|s| checkpoint::ScalerMeta {
            scale: s.state().scale,
            growth_tracker: s.state().growth_tracker,
        }),
        model: cfg.arch.name(),
        weights: String::new(),
        weights_bytes: 0,
        weights_crc32: 0,
    };
    checkpoint::save(&cfg.out_dir, meta, &tensors)
}
