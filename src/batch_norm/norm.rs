//! [`Norm`] and [`NormFactory`]: one model definition for a synchronized training run and for
//! candle's own batch norm (inference, export, a single process), with the same variables.

use std::sync::Arc;

use candle_core::{bail, Result, Tensor};
use candle_nn::{ModuleT, VarBuilder};

use super::{sync_batch_norm, SyncBatchNorm, SyncBatchNormConfig, OP};
use crate::layout::ChannelLayout;
use candle_collective::Collective;

/// A batch norm of either kind, as a [`NormFactory`] makes it: [`SyncBatchNorm`] (statistics of
/// the global batch) or candle-nn's `BatchNorm` (this process's batch). Both read and write the
/// same variables (`weight`, `bias`, `running_mean`, `running_var`), so a model trained with one
/// kind loads into the other; in eval both normalise with the running statistics.
///
/// Input `(N, C, *)` (or `(N, *, C)` for a channels-last `Sync`), output the same shape.
#[derive(Clone, Debug)]
pub enum Norm {
    /// Synchronized over a communicator.
    Sync(SyncBatchNorm),
    /// candle-nn's layer.
    Local(candle_nn::BatchNorm),
}

impl ModuleT for Norm {
    fn forward_t(&self, x: &Tensor, train: bool) -> Result<Tensor> {
        match self {
            Norm::Sync(bn) => bn.forward_t(x, train),
            Norm::Local(bn) => bn.forward_t(x, train),
        }
    }
}

/// What makes a model's batch norms: [`NormFactory::Sync`] for a data-parallel training run
/// (every layer synchronized over the communicator), [`NormFactory::Local`] for inference,
/// export or a single process (candle-nn's layer). A model takes the factory instead of calling
/// `candle_nn::batch_norm` or [`crate::sync_batch_norm`] itself, and serves both:
///
/// ```
/// use candle_core::{DType, Device, Tensor};
/// use candle_distributed::batch_norm::{Norm, NormFactory};
/// use candle_nn::{ModuleT, VarBuilder, VarMap};
///
/// fn block(norms: &NormFactory, vb: VarBuilder) -> candle_core::Result<Norm> {
///     norms.make(8, 1e-5, vb.pp("bn"))
/// }
/// let vm = VarMap::new();
/// let vb = VarBuilder::from_varmap(&vm, DType::F32, &Device::Cpu);
/// let bn = block(&NormFactory::Local, vb)?; // inference: candle-nn's layer
/// let y = bn.forward_t(&Tensor::ones((2, 8, 4, 4), DType::F32, &Device::Cpu)?, false)?;
/// assert_eq!(y.dims(), [2, 8, 4, 4]);
/// # Ok::<(), candle_core::Error>(())
/// ```
#[derive(Clone)]
pub enum NormFactory {
    /// [`SyncBatchNorm`] over this communicator.
    Sync(Arc<dyn Collective>),
    /// candle-nn's `BatchNorm`.
    Local,
}

impl std::fmt::Debug for NormFactory {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            NormFactory::Sync(c) => write!(
                f,
                "NormFactory::Sync(rank {} of {})",
                c.rank(),
                c.world_size()
            ),
            NormFactory::Local => f.write_str("NormFactory::Local"),
        }
    }
}

impl NormFactory {
    /// A batch norm of `num_features` channels with `config` (an eps, or a
    /// [`SyncBatchNormConfig`]), its variables under `vb`'s prefix.
    ///
    /// # Errors
    ///
    /// As [`crate::sync_batch_norm`] for `Sync`. For `Local`, also when `config` asks for what
    /// candle-nn's layer does not have (naming it): a channels-last layout, a fused ReLU, no
    /// running statistics, or a cumulative average (`momentum: None`).
    pub fn make(
        &self,
        num_features: usize,
        config: impl Into<SyncBatchNormConfig>,
        vb: VarBuilder,
    ) -> Result<Norm> {
        let config = config.into();
        match self {
            NormFactory::Sync(comm) => {
                sync_batch_norm(num_features, config, vb, comm.clone()).map(Norm::Sync)
            }
            NormFactory::Local => {
                let missing = [
                    (
                        config.layout == ChannelLayout::ChannelsLast,
                        "a channels-last layout",
                    ),
                    (config.fuse_relu, "a fused ReLU"),
                    (
                        !config.track_running_stats,
                        "a layer without running statistics",
                    ),
                    (
                        config.momentum.is_none(),
                        "a cumulative average (momentum: None)",
                    ),
                ];
                if let Some((_, what)) = missing.iter().find(|(m, _)| *m) {
                    bail!("{OP}: NormFactory::Local makes candle-nn's BatchNorm, which does not support {what}: use NormFactory::Sync, or leave it out of the config")
                }
                let candle = candle_nn::BatchNormConfig {
                    eps: config.eps,
                    remove_mean: true,
                    affine: config.affine,
                    momentum: config.momentum.unwrap_or(0.1),
                };
                candle_nn::batch_norm(num_features, candle, vb).map(Norm::Local)
            }
        }
    }
}
