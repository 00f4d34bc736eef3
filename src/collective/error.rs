//! The error type of collective operations.

use std::time::Duration;

/// Why a collective operation failed. Converted into [`candle_core::Error`] at the API boundary.
#[derive(Debug, Clone, thiserror::Error)]
pub enum CollectiveError {
    /// Some ranks did not reach the collective before the timeout.
    #[error("{backend} {op} (call #{call}) on rank {rank}: timed out after {timeout:?} waiting for ranks {missing:?}")]
    Timeout {
        /// Backend name.
        backend: &'static str,
        /// Operation name.
        op: &'static str,
        /// Sequence number of the collective call in this group.
        call: u64,
        /// Rank that observed the timeout.
        rank: usize,
        /// The timeout in force.
        timeout: Duration,
        /// Ranks that had not arrived.
        missing: Vec<usize>,
    },
    /// A rank dropped its communicator (or panicked) while others still needed it.
    #[error("{backend} {op} (call #{call}) on rank {rank}: {reason}")]
    RankLeft {
        /// Backend name.
        backend: &'static str,
        /// Operation name.
        op: &'static str,
        /// Sequence number of the collective call in this group.
        call: u64,
        /// Rank that observed the failure.
        rank: usize,
        /// What happened to the group.
        reason: String,
    },
    /// Ranks called the same collective slot with incompatible arguments.
    #[error("{backend} call #{call}: ranks disagree: {detail}")]
    Mismatch {
        /// Backend name.
        backend: &'static str,
        /// Sequence number of the collective call in this group.
        call: u64,
        /// Per-rank description of what each rank passed.
        detail: String,
    },
    /// The communication library reported an error (NCCL's code and text).
    #[error("{backend} {op} on rank {rank}: {code}: {detail}")]
    Library {
        /// Backend name.
        backend: &'static str,
        /// Operation name.
        op: &'static str,
        /// Rank that observed the failure.
        rank: usize,
        /// The library's error code, by name.
        code: String,
        /// The library's description (and its last error message, when it has one).
        detail: String,
    },
    /// An argument is invalid on this rank alone (bad root, unsupported dtype, ...).
    #[error("{backend} {op}: {detail}")]
    InvalidArgument {
        /// Backend name.
        backend: &'static str,
        /// Operation name.
        op: &'static str,
        /// What is wrong.
        detail: String,
    },
}

impl From<CollectiveError> for candle_core::Error {
    fn from(e: CollectiveError) -> Self {
        candle_core::Error::wrap(e)
    }
}
