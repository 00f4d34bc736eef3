//! A flight recorder: the last collectives of one rank's communicator, kept in a ring, for the
//! report of a hang or an abort ("rank 2 never reached all_reduce #1207; its last collective:
//! all_reduce #1206, completed 0.4 s before").
//!
//! Every record holds the call's number in its group, the op, the dtype and element count of
//! its input, its state, and when it was enqueued, started and ended (seconds since the
//! communicator was created). The ring keeps [`RECORDER_VAR`] records per communicator
//! (default [`DEFAULT_RECORDS`]; 0 turns recording off); recording costs one short lock per
//! collective and no allocation once the ring is full.

use std::collections::VecDeque;
use std::fmt::Write as _;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use candle_core::DType;

/// Environment variable with the number of records each communicator keeps.
pub const RECORDER_VAR: &str = "CANDLE_DISTRIBUTED_RECORDER";
/// Records kept per communicator when [`RECORDER_VAR`] is unset.
pub const DEFAULT_RECORDS: usize = 64;

/// Where a recorded collective stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum CallState {
    /// Handed to the backend, not known started.
    Enqueued,
    /// Running (the backend saw every rank arrive, or its kernel started).
    Started,
    /// Finished with a result.
    Completed,
    /// Finished with an error.
    Failed,
}

/// One collective as the recorder saw it.
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub struct CallRecord {
    /// The call's number in its group (every rank numbers its calls alike).
    pub call: u64,
    /// The collective's name (`all_reduce`, `broadcast`, ...).
    pub op: &'static str,
    /// Its input's dtype, when it has an input.
    pub dtype: Option<DType>,
    /// Its input's element count (all parts together).
    pub elems: usize,
    /// Where it stands.
    pub state: CallState,
    /// When it was enqueued, started and ended, in seconds since the recorder was created.
    pub enqueued: f64,
    /// See `enqueued`.
    pub started: Option<f64>,
    /// See `enqueued`.
    pub ended: Option<f64>,
}

impl std::fmt::Display for CallRecord {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} #{}", self.op, self.call)?;
        if let Some(d) = self.dtype {
            write!(f, " {d:?}×{}", self.elems)?;
        }
        let state = match self.state {
            CallState::Enqueued => "enqueued",
            CallState::Started => "started",
            CallState::Completed => "completed",
            CallState::Failed => "failed",
        };
        write!(f, ", {state}, enqueued at {:.3} s", self.enqueued)?;
        if let Some(t) = self.started {
            write!(f, ", started at {t:.3} s")?;
        }
        if let Some(t) = self.ended {
            write!(f, ", ended at {t:.3} s")?;
        }
        Ok(())
    }
}

/// Most records a recorder keeps: larger settings of [`RECORDER_VAR`] are cut to it.
pub const MAX_RECORDS: usize = 1 << 20;

/// The ring of one communicator's last collectives.
#[derive(Debug)]
pub struct FlightRecorder {
    start: Instant,
    capacity: usize,
    ring: Mutex<VecDeque<CallRecord>>,
    /// One more than the newest call enqueued (0: none), kept with recording off too: what
    /// a hang report compares ranks by.
    reached: std::sync::atomic::AtomicU64,
}

impl FlightRecorder {
    /// A recorder of [`RECORDER_VAR`] records (default [`DEFAULT_RECORDS`]; an unreadable value
    /// is the default, with a warning).
    pub fn from_env() -> Self {
        let capacity = match std::env::var(RECORDER_VAR) {
            Ok(v) => v.trim().parse().unwrap_or_else(|_| {
                log::warn!(
                    "{RECORDER_VAR}={v:?} is not a number: keeping {DEFAULT_RECORDS} records"
                );
                DEFAULT_RECORDS
            }),
            Err(_) => DEFAULT_RECORDS,
        };
        Self::new(capacity)
    }

    /// A recorder keeping the last `capacity` collectives (0: none; at most [`MAX_RECORDS`],
    /// a larger number is cut to it with a warning).
    pub fn new(capacity: usize) -> Self {
        if capacity > MAX_RECORDS {
            log::warn!(
                "{RECORDER_VAR}: {capacity} records per communicator asked for, keeping {MAX_RECORDS}"
            );
        }
        let capacity = capacity.min(MAX_RECORDS);
        Self {
            start: Instant::now(),
            capacity,
            // Grown as records come: a large setting costs memory only once that many calls ran.
            ring: Mutex::new(VecDeque::with_capacity(capacity.min(1024))),
            reached: std::sync::atomic::AtomicU64::new(0),
        }
    }

    /// The newest call enqueued, whether or not recording is on.
    pub fn newest_call(&self) -> Option<u64> {
        self.reached
            .load(std::sync::atomic::Ordering::Relaxed)
            .checked_sub(1)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, VecDeque<CallRecord>> {
        self.ring.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn now(&self) -> f64 {
        self.start.elapsed().as_secs_f64()
    }

    /// Records call `call` as enqueued.
    pub(crate) fn enqueue(&self, call: u64, op: &'static str, dtype: Option<DType>, elems: usize) {
        self.reached
            .fetch_max(call + 1, std::sync::atomic::Ordering::Relaxed);
        if self.capacity == 0 {
            return;
        }
        let enqueued = self.now();
        let mut ring = self.lock();
        if ring.len() == self.capacity {
            ring.pop_front();
        }
        ring.push_back(CallRecord {
            call,
            op,
            dtype,
            elems,
            state: CallState::Enqueued,
            enqueued,
            started: None,
            ended: None,
        });
    }

    /// Moves call `call` to `state` (`Started`, `Completed` or `Failed`), stamping the time.
    pub(crate) fn mark(&self, call: u64, state: CallState) {
        let t = self.now();
        let mut ring = self.lock();
        if let Some(r) = ring.iter_mut().rev().find(|r| r.call == call) {
            r.state = state;
            match state {
                CallState::Started => r.started = Some(t),
                CallState::Completed | CallState::Failed => r.ended = Some(t),
                CallState::Enqueued => {}
            }
        }
    }

    /// Moves call `call` from `Started` to `Completed` (a backend that learns of a call's end
    /// only when the next one begins); any other state stays.
    #[cfg_attr(not(feature = "mpi"), allow(dead_code))]
    pub(crate) fn settle(&self, call: u64) {
        let t = self.now();
        let mut ring = self.lock();
        if let Some(r) = ring.iter_mut().rev().find(|r| r.call == call) {
            if r.state == CallState::Started {
                r.state = CallState::Completed;
                r.ended = Some(t);
            }
        }
    }

    /// The records, oldest first.
    pub fn records(&self) -> Vec<CallRecord> {
        self.lock().iter().cloned().collect()
    }

    /// The newest record, if any.
    pub fn last(&self) -> Option<CallRecord> {
        self.lock().back().cloned()
    }

    /// Seconds since the recorder was created (the records' clock).
    pub fn elapsed(&self) -> Duration {
        self.start.elapsed()
    }

    /// The records as lines of text, oldest first, headed by `title`.
    pub fn dump(&self, title: &str) -> String {
        let records = self.records();
        let mut s = format!(
            "{title}: the last {} collectives (of at most {}), at {:.3} s:",
            records.len(),
            self.capacity,
            self.now()
        );
        for r in &records {
            let _ = write!(s, "\n  {r}");
        }
        s
    }
}

/// Where rank `rank` stands, for a report naming the ranks that are behind call `call` (`op`):
/// "rank 2 never reached all_reduce #1207; its last collective: all_reduce #1206, completed ...".
pub(crate) fn behind(rank: usize, op: &str, call: u64, last: Option<&CallRecord>) -> String {
    behind_as(rank, op, call, last)
}

/// Whether the rank whose recorder is `r` never reached call `call` (`op`), and if so how it
/// stands ([`behind`]): by its newest call, which is known with recording off too (then the
/// line says so instead of describing the call).
pub(crate) fn behind_of(rank: usize, op: &str, call: u64, r: &FlightRecorder) -> Option<String> {
    let newest = r.newest_call();
    if newest.is_some_and(|n| n >= call) {
        return None;
    }
    Some(match (r.last(), newest) {
        (Some(last), _) => behind(rank, op, call, Some(&last)),
        (None, Some(n)) => format!(
            "rank {rank} never reached {op} #{call}; its last collective: #{n} (not recorded: {RECORDER_VAR}=0)"
        ),
        (None, None) => behind(rank, op, call, None),
    })
}

/// [`behind`] with the last collective as any text (another process's report of it).
pub(crate) fn behind_as(
    rank: usize,
    op: &str,
    call: u64,
    last: Option<impl std::fmt::Display>,
) -> String {
    match last {
        Some(r) => format!("rank {rank} never reached {op} #{call}; its last collective: {r}"),
        None => format!("rank {rank} never reached {op} #{call}; it recorded no collective"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The ring keeps the newest records, stamps the states in order, and its text names
    /// every kept call; a recorder of 0 records keeps none.
    #[test]
    fn the_ring_keeps_the_newest_calls() {
        let r = FlightRecorder::new(3);
        for call in 0..5u64 {
            r.enqueue(call, "all_reduce", Some(DType::F32), 10 * call as usize);
            r.mark(call, CallState::Started);
            if call < 4 {
                r.mark(call, CallState::Completed);
            }
        }
        let recs = r.records();
        assert_eq!(recs.iter().map(|c| c.call).collect::<Vec<_>>(), [2, 3, 4]);
        assert_eq!(recs[2].state, CallState::Started);
        assert!(recs[1].ended.unwrap() >= recs[1].started.unwrap());
        assert!(recs[1].started.unwrap() >= recs[1].enqueued);
        let text = r.dump("rank 0");
        assert!(
            text.contains("all_reduce #4 F32×40, started") && !text.contains("#1 "),
            "{text}"
        );
        // With recording off, the newest call is still known: a rank past the call is not
        // named, one before it is, with its newest call's number.
        let off = FlightRecorder::new(0);
        for call in 0..3u64 {
            off.enqueue(call, "all_reduce", Some(DType::F32), 4);
        }
        assert!(off.records().is_empty());
        assert_eq!(behind_of(1, "all_reduce", 2, &off), None);
        let line = behind_of(1, "all_reduce", 5, &off).unwrap();
        assert!(
            line.contains("its last collective: #2 (not recorded"),
            "{line}"
        );
        // A huge setting is cut, not allocated.
        assert_eq!(FlightRecorder::new(usize::MAX).capacity, MAX_RECORDS);
        let line = behind(1, "broadcast", 9, r.last().as_ref());
        assert!(
            line.starts_with(
                "rank 1 never reached broadcast #9; its last collective: all_reduce #4"
            ),
            "{line}"
        );
        // `settle` completes a started call only.
        r.settle(4);
        r.mark(3, CallState::Failed);
        r.settle(3);
        let states: Vec<_> = r.records().iter().map(|c| c.state).collect();
        assert_eq!(
            states,
            [
                CallState::Completed,
                CallState::Failed,
                CallState::Completed
            ]
        );
        let none = FlightRecorder::new(0);
        none.enqueue(0, "barrier", None, 0);
        assert!(none.records().is_empty());
    }
}
