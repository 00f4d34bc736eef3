//! The gradient all-reduce overlapped with the backward, as PyTorch's DDP does it, with one
//! collective order on every rank whatever the model routes.
//!
//! candle's `Tensor::backward` offers no gradient-ready callback, so the model is built from
//! tensors that carry one: [`GradHooks::var_builder`](super::GradHooks::var_builder) hands out, for every trainable variable,
//! `hook(var)`, a copy of the variable through an identity op whose backward receives the
//! variable's complete gradient (candle processes a node only once every consumer has added its
//! part, `candle_core::backprop`). While [`DataParallel::backward`] runs `loss.backward()`, each
//! hook records its gradient and starts the buckets that are then due and complete, in the
//! fixed bucket order (bucket `k` only after buckets `< k`), so the communication of the last
//! layers runs while the backward computes the first ones.
//!
//! # Where a bucket starts
//!
//! Layers whose backward communicates too (`SyncBatchNorm`, the tensor-parallel layers) issue
//! their collectives at fixed points of the graph, announced through
//! [`crate::collective::in_backward`]. When a bucket's last gradient arrives depends on this
//! rank's graph: with a variable used on some ranks only (stochastic depth, expert routing, a
//! data-dependent branch) a bucket would start before such a collective on one rank and after
//! it on another, and the ranks' collectives would no longer match. So every bucket has an
//! agreed place: it starts after `at[b]` announcements of this backward and before the next
//! one, as soon as its gradients are in; still incomplete when that next announcement comes, it
//! starts with what it has, and is sent again, whole, after the backward (every rank learns
//! which buckets from the exchange below). `at` is the same on every rank: the most
//! announcements any rank saw before each variable's gradient arrived, learned on the step
//! before. On the first overlapped backward nothing is known, and every bucket goes after the
//! backward.
//!
//! # The exchange after the backward
//!
//! After the backward (and after every bucket is started), one all-reduce (max) of
//! `4 + B + P` (`+ P` on the first step) 64-bit integers, whatever the world size, carries:
//! whether any rank's backward failed, whether any rank's model computed with a stale hooked
//! copy, which buckets need sending again, per variable where its gradient arrived (the next
//! step's places), the number of announcements, and on the first step the order in which rank
//! 0's gradients arrived (the buckets follow it from then on, as PyTorch rebuilds its buckets
//! after the first iteration). Its result is read on the host: one small copy and wait per
//! step. So a backward that fails on one rank fails the step on every rank, with nothing
//! returned, instead of leaving the others a partial average; a rank whose backward failed
//! before all of the backward's announced collectives (it cannot take part in them) sends
//! nothing more, and the others fail at the communicator's timeout.
//!
//! Costs: the hooked copies are a second copy of the trainable variables, refreshed from the
//! variables after every optimizer step ([`DataParallel::step`] does it; otherwise call
//! [`DataParallel::refresh`]): one device copy of the parameters per step. The exchange: one
//! all-reduce of a few hundred bytes and one host read per step.
//!
//! [`DataParallel::backward`]: super::DataParallel::backward
//! [`DataParallel::step`]: super::DataParallel::step
//! [`DataParallel::refresh`]: super::DataParallel::refresh

mod exchange;
mod launcher;
mod plan;

pub(super) use launcher::Launcher;
pub(super) use plan::Plan;

/// What the ranks agreed on after an overlapped backward, for the next one.
#[derive(Debug, Clone)]
pub(super) struct Learned {
    /// The hooked trainable indices in the order rank 0's gradients arrived on the first step.
    pub order: Vec<usize>,
    /// Per trainable variable: the most announcements any rank saw before its gradient arrived
    /// (`None`: it arrived on no rank).
    pub arrived: Vec<Option<usize>>,
    /// Announcements in the backward.
    pub announced: usize,
}

/// What [`DataParallel::overlap_stats`](super::DataParallel::overlap_stats) reports of the last
/// overlapped backward.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct OverlapStats {
    /// Buckets (all-reduces) of the step, not counting those sent again.
    pub buckets: usize,
    /// Of those, started while the backward was still running (the rest were sent after it
    /// returned: on the first step every bucket; later, buckets holding a variable the model
    /// does not take through the hooks, and those whose place is after the backward's last
    /// announced collective and that were still incomplete when the backward ended).
    pub started_during_backward: usize,
    /// Of the buckets, those whose gradients were all in while an earlier bucket still waited
    /// for one, so that they started later than they could have: the buckets' order was not the
    /// order the gradients arrived in. After the first backward the buckets follow the observed
    /// order, and this is 0 unless the order changes from step to step.
    pub held_back: usize,
    /// Buckets started at their place before all their gradients were in (a variable whose
    /// gradient came later on this step than the place learned on the step before), and sent
    /// again, whole, after the backward on every rank.
    pub sent_again: usize,
    /// Collectives the backward announced (`SyncBatchNorm`'s and the tensor-parallel layers'
    /// backward all-reduces, [`crate::collective::in_backward`]).
    pub announced: usize,
}
