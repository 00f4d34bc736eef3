//! Progress reports through the job's store ([`JobStore`]: torchrun's, or the one rank 0
//! hosts in any other launch): each rank of a multi-process communicator
//! publishes its newest collective (its number, and the flight recorder's line for it), so that
//! a rank whose collective times out can name the ranks of other processes that never reached
//! it ("rank 5 never reached all_reduce #1207; its last collective: all_reduce #1206 ...").
//!
//! Keys: `candle-distributed/<run id>/<restart>/<rendezvous>/progress/<rank>`, next to the
//! rendezvous key of the communicator's start-up. A value is `<call>\n<unix ms>\n<line>`
//! (`call` -1 before the first collective), sealed with the shared secret when the ranks have
//! one, so that a party without the key cannot plant a false report.
//!
//! A rank publishes at most once every [`PUBLISH_EVERY`] when its newest collective changes,
//! and republishes an unchanged one every [`HEARTBEAT`] (a hung rank's publisher thread goes
//! on), so that a live rank's report is never older than that. A report older than
//! [`STALE_AFTER`] is called stale in a hang report: its rank's process stopped publishing, or
//! the value was written back from earlier in the launch (a sealed report carries its time,
//! which only the key can forge). Ages compare the clocks of two machines: a skew of more
//! than [`STALE_AFTER`] makes every report of the other machine look stale (or fresh). Reading never waits: one CHECK and one GET per rank, so that
//! a rank that never published costs one round trip, not the reader's deadline.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use crate::store::Store;
use crate::{peer_text, store_key, JobStore, Result};

/// How often a publisher looks for a newer collective to report.
pub const PUBLISH_EVERY: Duration = Duration::from_secs(1);
/// How often a publisher republishes an unchanged report.
pub const HEARTBEAT: Duration = Duration::from_secs(5);
/// Age past which a report is called stale (three heartbeats; clocks of two machines count).
pub const STALE_AFTER: Duration = Duration::from_secs(15);
/// Time one publication may take.
const PUBLISH_DEADLINE: Duration = Duration::from_secs(2);

/// One communicator's reports in the job's store.
#[derive(Debug)]
pub struct ProgressBoard {
    /// The store; on rank 0 of a launch without torchrun, holding it keeps the store hosted.
    job: JobStore,
    prefix: String,
    /// One connection, made on first use and again after a failure.
    store: Mutex<Option<Box<dyn Store>>>,
}

/// A rank's newest report.
#[derive(Debug, Clone, PartialEq)]
pub struct Report {
    /// The newest collective it had reached, `None` before its first.
    pub call: Option<u64>,
    /// How long before the reading the report was written (clocks of two machines: approximate).
    pub age: Duration,
    /// The flight recorder's line for that collective.
    pub line: String,
}

impl Report {
    /// Older than [`STALE_AFTER`]: its rank stopped publishing, or it was written back.
    pub fn stale(&self) -> bool {
        self.age > STALE_AFTER
    }
}

fn unix_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

impl ProgressBoard {
    /// The board of the communicator started by rendezvous `seq` of `job`'s job: `None` for
    /// a job of one process outside torchrun (no store, and no other rank to report on).
    pub fn new(job: &JobStore, seq: u64) -> Option<Self> {
        let env = job.env();
        (env.agent_store || env.world_size > 1).then(|| Self {
            job: job.clone(),
            prefix: format!("{}/progress", store_key(env, seq)),
            store: Mutex::new(None),
        })
    }

    /// This process's rank.
    pub fn rank(&self) -> usize {
        self.job.env().rank
    }

    /// The ranks of the communicator.
    pub fn world_size(&self) -> usize {
        self.job.env().world_size
    }

    fn key(&self, rank: usize) -> String {
        format!("{}/{rank}", self.prefix)
    }

    /// Runs `f` on the connection, connecting first if needed; a failed request drops the
    /// connection (the next use connects again).
    fn with_store<R>(
        &self,
        deadline: Instant,
        f: impl FnOnce(&mut dyn Store) -> Result<R>,
    ) -> Result<R> {
        let mut guard = self.store.lock().unwrap_or_else(|e| e.into_inner());
        if guard.is_none() {
            *guard = Some(self.job.connect(deadline)?);
        }
        let out = f(guard.as_mut().expect("connected above").as_mut());
        if out.is_err() {
            *guard = None;
        }
        out
    }

    /// Publishes this rank's newest collective, `call` (`None`: none yet), described by
    /// `line` (its flight recorder's record), by `deadline`.
    ///
    /// # Errors
    /// The store cannot be reached or the value not sent by `deadline`, or sealing fails.
    pub fn publish(&self, call: Option<u64>, line: &str, deadline: Instant) -> Result<()> {
        let call = call.map_or(-1, |c| c as i64);
        let key = self.key(self.job.env().rank);
        let text = format!("{call}\n{}\n{line}", unix_ms());
        let value = match &self.job.env().secret {
            Some(k) => k.seal(key.as_bytes(), text.as_bytes())?,
            None => text.into_bytes(),
        };
        self.with_store(deadline, |s| s.set(&key, &value, deadline))
    }

    /// Rank `rank`'s newest report, without waiting for one.
    ///
    /// # Errors
    /// No report (the rank never published one), the store unreachable by `deadline`, or a
    /// value this rank cannot open (another key) or read.
    pub fn read(&self, rank: usize, deadline: Instant) -> Result<Report> {
        let key = self.key(rank);
        let value = self.with_store(deadline, |s| match s.check(&key, deadline)? {
            true => s.get(&key, deadline),
            false => crate::bail!("rank {rank} published none"),
        })?;
        let value = match &self.job.env().secret {
            Some(k) => k.open(key.as_bytes(), &value).map_err(|e| {
                crate::Error::Msg(format!(
                    "the report under {key} does not open with this rank's key: {e}"
                ))
            })?,
            None => value,
        };
        let mut parts = value.splitn(3, |&b| b == b'\n');
        let bad = || crate::Error::Msg(format!("the report under {key} is garbled"));
        let mut number = || {
            let field = parts.next().ok_or_else(bad)?;
            std::str::from_utf8(field)
                .ok()
                .and_then(|f| f.parse::<i64>().ok())
                .ok_or_else(bad)
        };
        let call = number()?;
        let at = number()?;
        let line = parts.next().ok_or_else(bad)?;
        Ok(Report {
            call: u64::try_from(call).ok(),
            age: Duration::from_millis(unix_ms().saturating_sub(at.max(0) as u64)),
            line: peer_text(line),
        })
    }

    /// Starts a thread that publishes what `newest` returns (this rank's newest collective
    /// and its line) whenever it changes, checking every [`PUBLISH_EVERY`], and again every
    /// [`HEARTBEAT`] when it does not; it stops when `newest` returns `None` (its communicator
    /// is gone). A failure to publish is logged once and retried at the next check.
    ///
    /// # Errors
    /// The thread cannot be started.
    pub fn spawn_publisher(
        self: Arc<Self>,
        mut newest: impl FnMut() -> Option<(Option<u64>, String)> + Send + 'static,
    ) -> std::io::Result<()> {
        std::thread::Builder::new()
            .name(format!("progress-{}", self.job.env().rank))
            .spawn(move || {
                let mut published: Option<(Option<u64>, String)> = None;
                let mut at = Instant::now();
                let mut warned = false;
                while let Some(now) = newest() {
                    if published.as_ref() != Some(&now) || at.elapsed() >= HEARTBEAT {
                        let deadline = Instant::now() + PUBLISH_DEADLINE;
                        match self.publish(now.0, &now.1, deadline) {
                            Ok(()) => {
                                published = Some(now);
                                at = Instant::now();
                            }
                            Err(e) if !warned => {
                                warned = true;
                                log::warn!(
                                    "rank {}: cannot publish progress to the job's store (a hang report will lack it): {e}",
                                    self.job.env().rank
                                );
                            }
                            Err(_) => {}
                        }
                    }
                    std::thread::sleep(PUBLISH_EVERY);
                }
            })
            .map(drop)
    }
}
