//! Synchronized batch normalization and collectives for candle.
pub mod batch_norm;
pub mod collective;
pub mod ops;

pub use batch_norm::{sync_batch_norm, SyncBatchNorm, SyncBatchNormConfig};
