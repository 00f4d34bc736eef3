//! The error type of collective operations.

use std::time::Duration;

/// Why a collective operation failed (new kinds may be added in a minor release: a `match`
/// needs a wildcard arm). Converted into [`candle_core::Error`] at the API boundary;
/// [`CollectiveError::find`] gets it back out of one, to match on the kind of failure:
///
/// ```
/// use candle_collective::{CollectiveError, ThreadGroup};
/// # fn main() -> candle_core::Result<()> {
/// let err = ThreadGroup::run(2, |comm| {
///     // Rank 1 passes another length than rank 0: every rank gets a `Mismatch`.
///     let t = candle_core::Tensor::zeros(2 + comm.rank(), candle_core::DType::F32, &candle_core::Device::Cpu)?;
///     comm.all_reduce(&t, candle_collective::ReduceOp::Sum)
/// })
/// .unwrap_err();
/// assert!(matches!(CollectiveError::find(&err), Some(CollectiveError::Mismatch { .. })));
/// # Ok(())
/// # }
/// ```
#[derive(Clone, thiserror::Error)]
#[non_exhaustive]
pub enum CollectiveError {
    /// Some ranks did not reach the collective before the timeout.
    #[error("{backend} {op} (call #{call}) on rank {rank}: timed out after {timeout:?} waiting for ranks {missing:?}{}", report_suffix(.behind))]
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
        /// Where each missing rank stood, from its flight recorder ("rank 2 never reached
        /// all_reduce #1207; its last collective: ..."), where the backend can see it.
        behind: Vec<String>,
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
    /// This rank's part went well, but another rank's failure, learned through an agreement
    /// (a flag every rank exchanged), fails the call here too; that rank's own error says why.
    #[error("{detail}")]
    Elsewhere {
        /// Rank that reports it.
        rank: usize,
        /// What failed where, and what this rank did about it.
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

/// `Debug` prints the message: candle shows a wrapped error through its `Debug`.
impl std::fmt::Debug for CollectiveError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        std::fmt::Display::fmt(self, f)
    }
}

impl From<CollectiveError> for candle_core::Error {
    /// As `candle_core::Error::Io`, whose payload can be downcast (so that
    /// [`CollectiveError::find`] recovers the value) and which prints the message alone (candle's
    /// `WrappedContext` would add a line of context after it). The `std::io::ErrorKind` says what
    /// kind of failure it was: `TimedOut` for [`CollectiveError::Timeout`], `ConnectionAborted`
    /// for [`CollectiveError::RankLeft`], `InvalidInput` for [`CollectiveError::Mismatch`] and
    /// [`CollectiveError::InvalidArgument`], `Other` for [`CollectiveError::Library`].
    fn from(e: CollectiveError) -> Self {
        use std::io::ErrorKind as K;
        let kind = match &e {
            CollectiveError::Timeout { .. } => K::TimedOut,
            CollectiveError::RankLeft { .. } => K::ConnectionAborted,
            CollectiveError::Mismatch { .. } | CollectiveError::InvalidArgument { .. } => {
                K::InvalidInput
            }
            CollectiveError::Library { .. } | CollectiveError::Elsewhere { .. } => K::Other,
        };
        candle_core::Error::Io(std::io::Error::new(kind, e)).bt()
    }
}

impl CollectiveError {
    /// [`CollectiveError::InvalidArgument`].
    pub(crate) fn invalid(backend: &'static str, op: &'static str, detail: String) -> Self {
        Self::InvalidArgument {
            backend,
            op,
            detail,
        }
    }

    /// [`CollectiveError::Elsewhere`] as a candle error: rank `rank` fails because another
    /// rank's failure was learned through an agreement (an agreement of the caller's own, too:
    /// `ThreadGroup::run` then reports the failing rank's error first).
    pub fn elsewhere(rank: usize, detail: String) -> candle_core::Error {
        Self::Elsewhere { rank, detail }.into()
    }

    /// Whether the error is another rank's failure seen from here (a rank that left, or a
    /// failure learned through an agreement), not one of this rank's own.
    pub fn is_consequence(&self) -> bool {
        matches!(self, Self::RankLeft { .. } | Self::Elsewhere { .. })
    }

    /// [`CollectiveError::RankLeft`] of a call on a communicator an earlier failure broke (no
    /// call number: 0).
    pub(crate) fn broken(
        backend: &'static str,
        op: &'static str,
        call: u64,
        rank: usize,
        reason: String,
    ) -> Self {
        Self::RankLeft {
            backend,
            op,
            call,
            rank,
            reason,
        }
    }

    /// The collective error inside `err`, through candle's wrappers (context, path,
    /// backtrace); `None` when `err` did not come from a collective.
    pub fn find(err: &candle_core::Error) -> Option<&CollectiveError> {
        use candle_core::Error as E;
        match err {
            E::Io(e) => e.get_ref()?.downcast_ref::<CollectiveError>(),
            E::WrappedContext { wrapped, .. } => wrapped.downcast_ref::<CollectiveError>(),
            E::Context { inner, .. }
            | E::WithPath { inner, .. }
            | E::WithBacktrace { inner, .. } => Self::find(inner),
            _ => None,
        }
    }
}

/// The flight recorder's lines of a timeout, after its message.
fn report_suffix(behind: &[String]) -> String {
    match behind.is_empty() {
        true => String::new(),
        false => format!(": {}", behind.join("; ")),
    }
}
