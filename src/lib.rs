//! Synchronized batch normalization and collectives for candle.
pub mod collective;
pub mod ops;
