//! The exchange after an overlapped backward: one all-reduce (max) of 64-bit integers, whose
//! length depends on the model only (never on the world size), read back on the host.

use candle_core::{bail, Device, Result, Tensor};

use candle_collective::{Collective, ReduceOp};

/// One rank's part.
pub(super) struct Mine<'a> {
    /// This rank's backward failed.
    pub failed: bool,
    /// Announcements this rank's backward saw.
    pub announced: usize,
    /// Per bucket: started before a gradient of it arrived (to be sent again).
    pub resend: &'a [bool],
    /// Per trainable variable: announcements before its gradient arrived here.
    pub arrived: &'a [Option<usize>],
    /// On the first step: the order this rank's gradients arrived in (rank 0's is everyone's).
    pub order: Option<&'a [usize]>,
    /// This rank's model computed with a stale hooked copy.
    pub stale: bool,
}

/// Every rank's parts combined.
#[derive(Debug)]
pub(super) struct Agreed {
    /// Some rank's backward failed.
    pub failed: bool,
    /// Some rank computed with a stale hooked copy.
    pub stale: bool,
    /// The most announcements any rank saw.
    pub announced: usize,
    /// The fewest (the same as the most when the ranks' models issue the same collectives).
    pub announced_least: usize,
    /// Per bucket: some rank needs it sent again.
    pub resend: Vec<bool>,
    /// Per trainable variable: the most announcements before its gradient arrived on any rank.
    pub arrived: Vec<Option<usize>>,
    /// On the first step: rank 0's order.
    pub order: Option<Vec<usize>>,
}

/// Runs the exchange on `comm` (collective: every rank calls it with parts of the same
/// lengths, which the model's plan decides).
pub(super) fn exchange(comm: &dyn Collective, device: &Device, mine: Mine<'_>) -> Result<Agreed> {
    let (b, p) = (mine.resend.len(), mine.arrived.len());
    let mut v: Vec<i64> = Vec::with_capacity(4 + b + 2 * p);
    v.push(i64::from(mine.failed));
    v.push(i64::from(mine.stale));
    v.push(mine.announced as i64);
    v.push(-(mine.announced as i64));
    v.extend(mine.resend.iter().map(|&r| i64::from(r)));
    v.extend(mine.arrived.iter().map(|a| a.map_or(0, |g| g as i64 + 1)));
    if let Some(order) = mine.order {
        let mut slots = vec![0i64; p];
        if comm.rank() == 0 {
            for (slot, &q) in slots.iter_mut().zip(order) {
                *slot = q as i64 + 1;
            }
        }
        v.extend(slots);
    }
    let all = Tensor::new(v.as_slice(), device)?;
    let got = comm.all_reduce(&all, ReduceOp::Max)?.to_vec1::<i64>()?;
    if got.len() != v.len() {
        bail!(
            "DataParallel::backward: the exchange after the backward came back with {} values, {} sent",
            got.len(),
            v.len()
        )
    }
    let mut at = 4;
    let mut take = |n: usize| {
        let s = &got[at..at + n];
        at += n;
        s
    };
    let resend = take(b).iter().map(|&r| r != 0).collect();
    let arrived = (take(p).iter())
        .map(|&g| (g > 0).then(|| (g - 1) as usize))
        .collect();
    let order = mine.order.map(|_| {
        (take(p).iter())
            .take_while(|&&q| q > 0)
            .map(|&q| (q - 1) as usize)
            .collect()
    });
    Ok(Agreed {
        failed: got[0] != 0,
        stale: got[1] != 0,
        announced: got[2].max(0) as usize,
        announced_least: (-got[3]).max(0) as usize,
        resend,
        arrived,
        order,
    })
}
