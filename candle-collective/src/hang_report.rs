//! What a hang report says of the ranks of other processes, read from their progress reports
//! ([`candle_rendezvous::progress`]): the NCCL watchdog's report of a collective that timed out.

use std::time::Instant;

use candle_rendezvous::progress::{ProgressBoard, Report, HEARTBEAT};

use super::recorder::behind_as;

/// The ranks other than this one whose newest report is before call `call` (`op`), each as
/// "rank q never reached op #call; its last collective: ... (reported 1.2 s before)", "stale"
/// added past [`candle_rendezvous::progress::STALE_AFTER`]; a rank whose report cannot be read
/// is named with the reason. In rank order; reads stop at `deadline` (the ranks not read are
/// named so).
///
/// The NCCL watchdog calls it when a collective times out; it is public for launches that keep
/// their own [`ProgressBoard`].
pub fn ranks_behind(board: &ProgressBoard, op: &str, call: u64, deadline: Instant) -> Vec<String> {
    let mut out = Vec::new();
    for q in (0..board.world_size()).filter(|&q| q != board.rank()) {
        if Instant::now() >= deadline {
            out.push(format!(
                "ranks {q} and on: not read within the report's time"
            ));
            break;
        }
        match board.read(q, deadline) {
            Ok(r) => out.extend(describe(q, op, call, &r)),
            Err(e) => out.push(format!("rank {q}: no progress report read ({e})")),
        }
    }
    out
}

/// Rank `q`'s report as a hang report names it, when it is before call `call` (`op`).
fn describe(q: usize, op: &str, call: u64, r: &Report) -> Option<String> {
    if r.call.is_some_and(|c| c >= call) {
        return None;
    }
    let stale = match r.stale() {
        true => format!(
            ": stale, its rank republishes every {} s, so its process stopped publishing or the value was written back",
            HEARTBEAT.as_secs()
        ),
        false => String::new(),
    };
    let line = format!(
        "{} (reported {:.1} s before{stale})",
        r.line,
        r.age.as_secs_f64()
    );
    Some(behind_as(q, op, call, r.call.map(|_| line)))
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    /// A report at or past the call names nothing; one before it names its line and age, and
    /// "stale" once older than three heartbeats (a rank that stopped publishing, or a report of
    /// earlier in the launch written back); a rank that reported nothing yet is named so.
    #[test]
    fn reports_are_described_with_their_age() {
        let report = |call: Option<u64>, secs: u64| Report {
            call,
            age: Duration::from_secs(secs),
            line: "all_reduce #5 F32×6, completed".into(),
        };
        assert_eq!(describe(1, "all_reduce", 5, &report(Some(5), 1)), None);
        let fresh = describe(1, "all_reduce", 1207, &report(Some(5), 2)).unwrap();
        assert!(
            fresh.starts_with(
                "rank 1 never reached all_reduce #1207; its last collective: all_reduce #5"
            ) && fresh.ends_with("(reported 2.0 s before)"),
            "{fresh}"
        );
        let old = describe(1, "all_reduce", 1207, &report(Some(5), 40)).unwrap();
        assert!(old.contains("(reported 40.0 s before: stale,"), "{old}");
        let none = describe(2, "all_reduce", 3, &report(None, 1)).unwrap();
        assert!(none.ends_with("it recorded no collective"), "{none}");
    }
}
