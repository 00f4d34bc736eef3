//! One rank's model, optimizer and position (`State`): built fresh or from a checkpoint, and
//! written back to one (with the metrics CSV and the chart) after every epoch.

use std::sync::Arc;

use anyhow::Result;
use candle_core::Device;
use candle_distributed::amp::{GradScaler, GradScalerConfig, GradScalerState};
use candle_distributed::checkpoint as lib_checkpoint;
use candle_distributed::collective::Collective;
use candle_distributed::optim::AdamW;
use candle_distributed::{DataParallel, GradHooks};
use candle_nn::{ParamsAdamW, VarBuilder, VarMap};

use crate::checkpoint;
use crate::config::{Config, Precision};
use crate::model::{NormKind, ResNet};
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
    /// Within an epoch resumed mid-way: the sums of its steps before the save.
    pub partial: Option<[f64; 3]>,
}

/// Builds the model (from `cfg.resume`'s checkpoint when given; refused if it does not match)
/// and the optimizer.
pub fn setup(
    comm: &Arc<dyn Collective>,
    device: &Device,
    cfg: &Config,
    classes: usize,
    train_samples: usize,
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
    // Every rank loads the same checkpoint or every rank fails (the library's agreement): the
    // weights would be re-broadcast anyway, but the optimizer's moments, the position and the
    // loss scale would diverge silently.
    let resumed = lib_checkpoint::load_on(cfg.resume.as_deref(), &**comm, device)?;
    let meta = (resumed.as_ref())
        .map(|l| checkpoint::meta_of(l, &identity(cfg, train_samples)))
        .transpose()?;
    if let (Some(loaded), Some(meta)) = (&resumed, &meta) {
        if comm.rank() == 0 {
            eprintln!(
                "resuming from {}: epoch {}, step {}",
                loaded.path.display(),
                meta.epoch,
                meta.step
            );
        }
        loaded.set_varmap(&vm)?;
        // Built again over the loaded variables: SyncBatchNorm reads `num_batches_tracked`
        // when it is built.
        model = ResNet::new(cfg.arch, classes, &norm, vb)?;
        loaded.restore_shifts(model.sync_norms())?;
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
    let mut opt = AdamW::new_named(dp.named_trainable(), params)?;
    let mut scaler = (cfg.precision == Precision::F16)
        .then(|| GradScaler::new(GradScalerConfig::default().with_init_scale(cfg.init_scale)))
        .transpose()?;
    let (mut epoch, mut step, mut partial) = (0, 0, None);
    if let (Some(meta), Some(loaded)) = (&meta, &resumed) {
        opt.load_state(meta.optimizer_step, &loaded.tensors)?;
        (epoch, step, partial) = (meta.epoch, meta.step, meta.partial);
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
        partial,
    })
}

/// Rank 0's CSV and chart into `cfg.out_dir`, each file written atomically.
pub fn write_reports(cfg: &Config, metrics: &[EpochMetrics]) -> Result<()> {
    std::fs::create_dir_all(&cfg.out_dir)?;
    report::write_csv(&cfg.out_dir.join("metrics.csv"), metrics)?;
    // The chart is a picture of what the CSV holds: a run does not fail for want of a font.
    if let Err(e) = report::write_plot(&cfg.out_dir.join("curves.png"), &cfg.title(), metrics) {
        log::warn!("curves.png not written: {e:#}");
    }
    Ok(())
}

/// What a checkpoint of this run records, and a resume of it must match.
pub fn identity(cfg: &Config, train_samples: usize) -> checkpoint::Identity {
    checkpoint::Identity {
        model: cfg.arch.name(),
        seed: cfg.seed,
        batch_size: cfg.batch_size,
        train_samples,
    }
}

/// A checkpoint into `cfg.out_dir`: variables, AdamW's state, SyncBatchNorm's shifts, and the
/// position and loss scale as metadata; `partial`: the sums of the epoch in progress, for a save
/// mid-epoch. Collective (rank 0 writes, every rank returns its outcome:
/// `candle_distributed::checkpoint::save`).
pub fn save_checkpoint(
    cfg: &Config,
    st: &State,
    comm: &Arc<dyn Collective>,
    partial: Option<[f64; 3]>,
    train_samples: usize,
) -> Result<()> {
    let mut tensors = lib_checkpoint::varmap_tensors(&st.vm)?;
    let (optimizer_step, moments) = st.opt.state();
    tensors.extend(moments);
    // SyncBatchNorm's shifts: without them a resumed run rounds differently.
    tensors.extend(lib_checkpoint::shift_tensors(st.model.sync_norms()));
    let meta = checkpoint::Meta {
        epoch: st.epoch,
        step: st.step,
        optimizer_step,
        scaler: st.scaler.as_ref().map(|s| checkpoint::ScalerMeta {
            scale: s.state().scale,
            growth_tracker: s.state().growth_tracker,
        }),
        model: cfg.arch.name(),
        partial,
        seed: Some(cfg.seed),
        batch_size: Some(cfg.batch_size),
        train_samples: Some(train_samples),
    };
    let tag = match partial {
        None => format!("e{:04}", st.epoch),
        Some(_) => format!("s{:08}", st.step),
    };
    let metadata = serde_json::to_value(&meta)?;
    lib_checkpoint::save(&cfg.out_dir, &tag, &tensors, &metadata, &**comm)?;
    Ok(())
}
