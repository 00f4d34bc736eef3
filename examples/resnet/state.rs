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
    let model = ResNet::new(cfg.arch, classes, &norm, vb)?;
    init_weights(&vm, cfg.seed)?;
    let mut dp = DataParallel::new(&vm, comm.clone())?.with_bucket_bytes(cfg.bucket_bytes);
    if let Some(h) = &hooks {
        dp = dp.with_overlap(h)?;
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
    // Every rank restores the same checkpoint or none does (the library's agreement), and only
    // one saved by a run of the same model, seed, batch size and data (checked on every rank
    // before anything is set): the optimizer's moments, the position and the loss scale would
    // otherwise diverge or land at other places of other epochs, silently.
    let run = identity(cfg, train_samples);
    let restored = lib_checkpoint::restore_training_checked::<checkpoint::Meta>(
        cfg.resume.as_deref(),
        &vm,
        Some(&mut opt),
        &model.sync_norms(),
        &**comm,
        |meta, path| {
            checkpoint::accept(&meta.identity, path, &run)
                .map_err(|e| candle_core::Error::Msg(format!("{e:#}")))
        },
    )?;
    let (mut epoch, mut step, mut partial) = (0, 0, None);
    if let Some(r) = restored {
        // The hooked copies the model computes with (--overlap) take the restored values.
        dp.refresh()?;
        if comm.rank() == 0 {
            eprintln!(
                "resuming from {}: epoch {}, step {}",
                r.path.display(),
                r.position.epoch,
                r.metadata.step
            );
        }
        (epoch, step, partial) = (
            r.position.epoch as usize,
            r.metadata.step,
            r.metadata.partial,
        );
        if let (Some(s), Some(m)) = (scaler.as_mut(), r.metadata.scaler) {
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

/// A checkpoint into `cfg.out_dir` (`candle_distributed::checkpoint::save_training`): the
/// variables, AdamW's state, SyncBatchNorm's shifts and the position, with the run's step, loss
/// scale and identity as metadata; `partial`: the sums of the epoch in progress, for a save
/// mid-epoch. Collective (rank 0 writes, every rank returns its outcome).
pub fn save_checkpoint(
    cfg: &Config,
    st: &State,
    comm: &Arc<dyn Collective>,
    partial: Option<[f64; 3]>,
    train_samples: usize,
) -> Result<()> {
    let steps_per_epoch = train_samples.div_ceil(cfg.batch_size);
    let state = lib_checkpoint::TrainingState {
        model: &st.vm,
        optimizer: Some(&st.opt),
        // Without the shifts a resumed run rounds differently.
        norms: &st.model.sync_norms(),
        position: lib_checkpoint::Position {
            epoch: st.epoch as u64,
            step: st.step.saturating_sub(st.epoch * steps_per_epoch),
        },
    };
    let meta = checkpoint::Meta {
        step: st.step,
        scaler: st.scaler.as_ref().map(|s| checkpoint::ScalerMeta {
            scale: s.state().scale,
            growth_tracker: s.state().growth_tracker,
        }),
        partial,
        identity: identity(cfg, train_samples),
    };
    let tag = match partial {
        None => format!("e{:04}", st.epoch),
        Some(_) => format!("s{:08}", st.step),
    };
    lib_checkpoint::save_training(&cfg.out_dir, &tag, &state, &meta, &**comm)?;
    Ok(())
}
