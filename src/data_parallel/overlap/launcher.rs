//! Receives the hooks' gradients and the backward's announcements during one overlapped
//! backward, starts each bucket at its place, and after the backward sends the rest, runs the
//! exchange and hands back the averages.

use std::sync::Arc;

use candle_core::backprop::GradStore;
use candle_core::{bail, DType, Device, Result, Tensor, Var};

use super::exchange::{self, Mine};
use super::{Learned, OverlapStats, Plan};
use crate::data_parallel::pack;
use crate::ops;
use candle_collective::in_backward::Event;
use candle_collective::{AllReduce, Collective, CollectiveError, Pending, ReduceOp};

/// One started bucket.
#[derive(Debug)]
struct Started {
    bucket: usize,
    pending: Pending,
    missing_here: bool,
}

/// Receives the hooks' gradients during one backward and starts the buckets.
#[derive(Debug)]
pub(in crate::data_parallel) struct Launcher {
    comm: Arc<dyn Collective>,
    wire: Option<DType>,
    plan: Arc<Plan>,
    params: Vec<(String, Var)>,
    /// Where the exchange runs (the communicator's device).
    device: Device,
    /// The accumulated gradients of earlier micro-batches, by trainable index.
    prior: Vec<Option<Tensor>>,
    grads: Vec<Option<Tensor>>,
    next: usize,
    started: Vec<Started>,
    during_backward: usize,
    /// The trainable indices of the hooked gradients, in the order they arrived.
    arrival: Vec<usize>,
    /// Per trainable variable: the announcements before its gradient arrived.
    arrived: Vec<Option<usize>>,
    /// Announcements so far.
    announced: usize,
    /// Announced collectives that returned (a backward that fails between an announcement and
    /// its collective did not take part in it).
    done: usize,
    /// Per bucket: started before one of its gradients arrived.
    resend: Vec<bool>,
    /// Per bucket: whether all its gradients arrived while an earlier bucket was incomplete.
    held: Vec<bool>,
    /// A failure of this rank that leaves it in step with the others (reported through the
    /// exchange).
    error: Option<candle_core::Error>,
    /// A bucket that could not be started: this rank is out of step with the others.
    broken: Option<candle_core::Error>,
}

impl Launcher {
    pub fn new(
        comm: Arc<dyn Collective>,
        wire: Option<DType>,
        plan: Arc<Plan>,
        params: Vec<(String, Var)>,
        device: Device,
        prior: Option<&GradStore>,
    ) -> Self {
        let prior = params
            .iter()
            .map(|(_, v)| prior.and_then(|g| g.get(v.as_tensor()).cloned()))
            .collect();
        let (n, b) = (params.len(), plan.buckets.len());
        Self {
            comm,
            wire,
            plan,
            params,
            device,
            prior,
            grads: vec![None; n],
            next: 0,
            started: Vec::new(),
            during_backward: 0,
            arrival: Vec::new(),
            arrived: vec![None; n],
            announced: 0,
            done: 0,
            resend: vec![false; b],
            held: vec![false; b],
            error: None,
            broken: None,
        }
    }

    /// The hooked trainable variables in the order their gradients arrived, then those that did
    /// not arrive in the plan's order.
    fn seen_order(&self) -> Vec<usize> {
        let mut seen = self.arrival.clone();
        let arrived: std::collections::HashSet<usize> = seen.iter().copied().collect();
        let rest = self.plan.buckets.iter().flatten().copied();
        seen.extend(rest.filter(|&p| self.plan.hooked[p] && !arrived.contains(&p)));
        seen
    }

    fn complete(&self, b: usize) -> bool {
        self.plan.buckets[b]
            .iter()
            .all(|&q| self.grads[q].is_some())
    }

    /// Hooked variable `hook` has its complete gradient: records it (plus the earlier
    /// micro-batches'), then starts every bucket now due and complete, in order.
    pub fn ready(&mut self, hook: usize, grad: &Tensor) {
        let Some(p) = self.plan.of_hook.get(hook).copied().flatten() else {
            return; // a hooked variable that is not trainable: no gradient wanted
        };
        if self.grads[p].is_some() {
            self.error.get_or_insert(candle_core::Error::Msg(format!(
                "DataParallel::backward: the gradient of `{}` arrived twice in one backward",
                self.params[p].0
            )));
            return;
        }
        match self.with_prior(p, grad.clone()) {
            Ok(g) => self.grads[p] = Some(g),
            Err(e) => {
                self.error.get_or_insert(e);
                return;
            }
        }
        self.arrival.push(p);
        self.arrived[p] = Some(self.announced);
        let b = self.plan.bucket_of[p];
        if b < self.next {
            // Started at its place without this gradient: sent again after the backward.
            self.resend[b] = true;
        } else if b > self.next && self.plan.at.is_some() && self.complete(b) {
            self.held[b] = true;
        }
        self.start_due(false);
    }

    /// What the backward's collectives tell (`collective::in_backward::collective`): before
    /// them, every bucket whose place is before them starts now, complete or not; after them,
    /// they count as done.
    pub fn heard(&mut self, e: Event) {
        match e {
            Event::Before => {
                self.start_due(true);
                self.announced += 1;
            }
            Event::After => self.done += 1,
        }
    }

    /// Starts, in order, the buckets whose place has come: the complete ones, or at an
    /// announcement (`closing`) every one.
    fn start_due(&mut self, closing: bool) {
        let plan = self.plan.clone();
        let Some(at) = &plan.at else {
            return; // the first step: every bucket after the backward
        };
        while self.broken.is_none()
            && self.next < plan.buckets.len()
            && at[self.next] <= self.announced
        {
            if !closing && !self.complete(self.next) {
                break;
            }
            self.start(self.next);
            self.next += 1;
            self.during_backward += 1;
        }
    }

    fn with_prior(&self, p: usize, g: Tensor) -> Result<Tensor> {
        let (name, v) = &self.params[p];
        if g.elem_count() != v.elem_count() {
            bail!(
                "DataParallel::backward: the gradient of `{name}` has shape {:?}, the variable {:?}",
                g.dims(),
                v.dims()
            )
        }
        match &self.prior[p] {
            Some(before) => before.add(&g.to_dtype(before.dtype())?),
            None => Ok(g),
        }
    }

    /// Starts bucket `b` with the gradients there are (zeros and a zero flag for the others).
    /// A bucket that cannot be started leaves this rank out of step (`broken`).
    fn start(&mut self, b: usize) {
        if self.broken.is_some() {
            return;
        }
        match self.try_start(b) {
            Ok(s) => self.started.push(s),
            Err(e) => self.broken = Some(e),
        }
    }

    fn try_start(&self, b: usize) -> Result<Started> {
        let bucket = &self.plan.buckets[b];
        let (dtype, device): (DType, Device) = {
            let v = &self.params[bucket[0]].1;
            (v.dtype(), v.device().clone())
        };
        let lens: Vec<usize> = bucket
            .iter()
            .map(|&p| self.params[p].1.elem_count())
            .collect();
        let mut parts = Vec::with_capacity(bucket.len());
        let mut missing_here = false;
        for &p in bucket {
            // Not yet arrived (a bucket started at its place): the earlier micro-batches'
            // gradient, if any; an arrival after this start sends the bucket again.
            let g = self.grads[p].as_ref().or(self.prior[p].as_ref());
            missing_here |= g.is_none();
            parts.push(g.map(|g| g.to_dtype(dtype)?.contiguous()).transpose()?);
        }
        let flat = ops::pack::pack(&parts, &lens, dtype, &device)?;
        let options = AllReduce {
            wire: self.wire,
            ..ReduceOp::Avg.into()
        };
        let pending = self.comm.start_all_reduce(&[flat], options)?;
        Ok(Started {
            bucket: b,
            pending,
            missing_here,
        })
    }

    /// After the backward returned (`result`: its gradients, or its error): takes the
    /// gradients of the variables the model used without the hooks, starts the remaining
    /// buckets, runs the exchange, sends again the buckets that need it, waits for every bucket
    /// and puts the averages into the gradients (a variable no rank has a gradient for gets
    /// none). `announced`: the announcements the last step agreed on, if any; `stale`: this
    /// rank's error when its model computed with a stale hooked copy.
    ///
    /// # Errors
    ///
    /// On every rank when any rank's backward failed, any rank's model computed with a stale
    /// copy, or a hooked variable was also used without its hook (its gradient would be split):
    /// after every started bucket completed. Alone, without the exchange, when this rank cannot
    /// keep in step with the others (its backward failed before all the collectives the
    /// backward announces, or a bucket could not be started): the others fail at their
    /// timeout.
    pub fn finish(
        mut self,
        result: Result<GradStore>,
        announced: Option<usize>,
        stale: Option<String>,
        keep: impl FnOnce(Learned),
    ) -> Result<(GradStore, OverlapStats)> {
        let backward_failed = result.is_err();
        let (mut grads, mut failure) = match result {
            Ok(g) => (g, None),
            Err(e) => (GradStore::default(), Some(e)),
        };
        if let Some(e) = self.error.take() {
            failure.get_or_insert(e);
        }
        // A backward that failed before its last announced collective returned left the others
        // inside one: nothing this rank sends now would match theirs.
        let in_step = announced == Some(self.done) && self.done == self.announced;
        if backward_failed && (self.plan.at.is_none() || !in_step) {
            let e = failure.expect("the backward failed");
            return Err(e.context(format!(
                "DataParallel::backward: rank {}'s backward failed after {} of its announced \
                 collectives ({}); it leaves the step, and the other ranks fail at their timeout",
                self.comm.rank(),
                self.done,
                announced.map_or("a number not yet known on the first step".into(), |n| n
                    .to_string())
            )));
        }
        let mut mixed = Vec::new();
        for (p, (name, v)) in self.params.iter().enumerate() {
            let direct = grads.remove(v.as_tensor());
            if self.plan.hooked[p] {
                if direct.is_some() {
                    mixed.push(name.clone());
                }
            } else if let Some(g) = direct {
                self.grads[p] = Some(g);
            }
        }
        for p in 0..self.params.len() {
            if !self.plan.hooked[p] {
                self.grads[p] = match self.grads[p].take() {
                    Some(g) => match self.with_prior(p, g) {
                        Ok(g) => Some(g),
                        Err(e) => {
                            failure.get_or_insert(e);
                            None
                        }
                    },
                    None => self.prior[p].clone(),
                };
            } else if self.grads[p].is_none() {
                // A hooked variable that never fired may still have earlier micro-batches'.
                self.grads[p] = self.prior[p].clone();
            }
        }
        if !mixed.is_empty() {
            failure.get_or_insert(candle_core::Error::Msg(format!(
                "DataParallel::backward: {mixed:?} were used both through the hooked VarBuilder \
                 and directly (the variable's own tensor), so their gradients were split; take \
                 every use of a trainable variable from the builder"
            )));
        }
        // Every remaining bucket goes out, also after a failure here, so that the collectives
        // stay in step: the exchange tells every rank the outcome.
        while self.next < self.plan.buckets.len() {
            self.start(self.next);
            self.next += 1;
        }
        if let Some(e) = self.broken.take() {
            return Err(e.context(format!(
                "DataParallel::backward: rank {} could not start a bucket; it leaves the step, \
                 and the other ranks fail at their timeout",
                self.comm.rank()
            )));
        }
        let first_step = self.plan.at.is_none();
        let seen = self.seen_order();
        let agreed = exchange::exchange(
            &*self.comm,
            &self.device,
            Mine {
                failed: failure.is_some(),
                announced: self.announced,
                resend: &self.resend,
                arrived: &self.arrived,
                order: first_step.then_some(seen.as_slice()),
                stale: stale.is_some(),
            },
        );
        let agreed = match agreed {
            Ok(a) => a,
            Err(e) => return Err(failure.unwrap_or(e)),
        };
        if agreed.announced != agreed.announced_least && failure.is_none() {
            failure = Some(candle_core::Error::Msg(format!(
                "DataParallel::backward: rank {}: the ranks' backwards issued between {} and {} \
                 announced collectives: every rank's model must issue the same collectives in \
                 its backward",
                self.comm.rank(),
                agreed.announced_least,
                agreed.announced
            )));
        }
        if agreed.failed || agreed.stale || failure.is_some() {
            // The started buckets were issued on every rank: let them complete.
            for s in std::mem::take(&mut self.started) {
                let _ = s.pending.wait();
            }
            return Err(match (failure, stale) {
                (Some(e), _) => e,
                (None, Some(here)) => candle_core::Error::Msg(here),
                (None, None) if agreed.stale => CollectiveError::elsewhere(
                    self.comm.rank(),
                    format!(
                        "DataParallel::backward: rank {}: another rank's model computed with \
                         stale hooked copies of its variables (its error says which); nothing \
                         was returned on any rank",
                        self.comm.rank()
                    ),
                ),
                (None, None) => CollectiveError::elsewhere(
                    self.comm.rank(),
                    format!(
                        "DataParallel::backward: rank {}: another rank's backward failed (its \
                         error says why); this step's gradients are incomplete on every rank, so \
                         nothing was returned",
                        self.comm.rank()
                    ),
                ),
            });
        }
        let sent = self.started.len();
        let again: Vec<usize> = (0..self.plan.buckets.len())
            .filter(|&b| agreed.resend[b])
            .collect();
        for &b in &again {
            self.start(b);
        }
        if let Some(e) = self.broken.take() {
            return Err(e.context("DataParallel::backward: sending a bucket again"));
        }
        let order = match (first_step, agreed.order) {
            (true, Some(order)) => check_order(order, &seen)?,
            _ => Vec::new(),
        };
        keep(Learned {
            order,
            arrived: agreed.arrived,
            announced: agreed.announced,
        });
        let stats = OverlapStats {
            buckets: self.plan.buckets.len(),
            started_during_backward: self.during_backward,
            held_back: self.held.iter().filter(|&&h| h).count(),
            sent_again: again.len(),
            announced: self.announced,
        };
        let mut error = None;
        for (i, s) in std::mem::take(&mut self.started).into_iter().enumerate() {
            let superseded = i < sent && agreed.resend[s.bucket];
            match s.pending.wait() {
                Ok(_) if superseded => {}
                Ok(avg) => {
                    if error.is_none() {
                        let vars: Vec<&Var> = (self.plan.buckets[s.bucket].iter())
                            .map(|&p| &self.params[p].1)
                            .collect();
                        if let Err(e) = pack::unpack(&vars, &avg, s.missing_here, &mut grads) {
                            error = Some(e);
                        }
                    }
                }
                Err(e) => {
                    error.get_or_insert(e);
                }
            }
        }
        if let Some(e) = error {
            return Err(e);
        }
        Ok((grads, stats))
    }
}

/// Rank 0's order, checked to be an order of this rank's hooked variables (the same set on
/// every rank: `with_overlap` checked the build).
fn check_order(order: Vec<usize>, seen: &[usize]) -> Result<Vec<usize>> {
    let mut sorted_root = order.clone();
    let mut sorted_mine = seen.to_vec();
    sorted_root.sort_unstable();
    sorted_mine.sort_unstable();
    if sorted_root != sorted_mine {
        bail!(
            "DataParallel::backward: rank 0's gradient order names other variables than this \
             rank's ({} against {} hooked variables); every rank must build the same model",
            order.len(),
            seen.len()
        )
    }
    Ok(order)
}
