//! The gradient all-reduce overlapped with the backward, as PyTorch's DDP does it.
//!
//! candle's `Tensor::backward` offers no gradient-ready callback, so the model is built from
//! tensors that carry one: [`GradHooks::var_builder`](super::GradHooks::var_builder) hands out, for every trainable variable,
//! `hook(var)`, a copy of the variable through an identity op whose backward receives the
//! variable's complete gradient (candle processes a node only once every consumer has added its
//! part, `candle_core::backprop`). While [`DataParallel::backward`] runs `loss.backward()`, each
//! hook records its gradient and starts the all-reduce of every bucket that is then complete,
//! in the fixed bucket order (bucket `k` only after buckets `< k`), so the communication of the
//! last layers runs while the backward computes the first ones. What is not ready when the
//! backward returns (unused variables, variables the model uses without the hook) is sent
//! afterwards, with the presence flags of [`DataParallel::sync_gradients`], so that every rank
//! issues the same collectives in the same order.
//!
//! On the first overlapped backward, buckets follow the reverse of the order in which the model
//! took its variables from the builder (the last layer's first), as PyTorch's first buckets
//! follow the reverse of `model.parameters()`: candle's backward reaches the weights of
//! candle-nn's layers from the last layer back (their weights are the right operands of
//! `conv2d`, `matmul` and `broadcast_add`, visited first). That backward records the order in
//! which the gradients actually arrived; rank 0's record is broadcast, and from the second
//! backward on the buckets follow it on every rank, as PyTorch rebuilds its buckets after the
//! first iteration. A model that builds its layers in another order than it uses them (a head
//! built before its backbone) thereby loses no overlap after the first step
//! ([`OverlapStats::held_back`] counts what a wrong order costs).
//!
//! Costs: the hooked copies are a second copy of the trainable variables, refreshed from the
//! variables after every optimizer step ([`DataParallel::step`] does it; otherwise call
//! [`DataParallel::refresh`]): one device copy of the parameters per step.
//!
//! [`DataParallel::backward`]: super::DataParallel::backward
//! [`DataParallel::sync_gradients`]: super::DataParallel::sync_gradients
//! [`DataParallel::with_overlap`]: super::DataParallel::with_overlap
//! [`DataParallel::step`]: super::DataParallel::step
//! [`DataParallel::refresh`]: super::DataParallel::refresh

use std::sync::Arc;

use candle_core::backprop::GradStore;
use candle_core::{bail, DType, Device, Result, Tensor, Var};

use super::pack;
use crate::collective::{Collective, Pending, ReduceOp};

/// The buckets of one step, as indices into the trainable variables: first the hooked ones in
/// the order their gradients arrive (learned on the first backward; before it, the reverse of
/// the order the model took them), then the trainable variables the model does not take through
/// the hooks, in name order.
#[derive(Debug)]
pub(super) struct Plan {
    pub buckets: Vec<Vec<usize>>,
    /// Trainable index of each hooked variable (by hook index; `None`: not trainable).
    pub of_hook: Vec<Option<usize>>,
    /// Whether each trainable variable is hooked.
    pub hooked: Vec<bool>,
    /// The bucket of each trainable variable.
    pub bucket_of: Vec<usize>,
}

impl Plan {
    /// `params`: the trainable variables; `hooked`: the hooked variables in the order the model
    /// took them; `learned`: the hooked trainable indices in the order their gradients arrived
    /// (from [`agree_order`]), if known. Buckets of at most `bucket_bytes` (or one variable) of
    /// one dtype and device.
    pub fn new(
        params: &[(String, Var)],
        hooked: &[Var],
        bucket_bytes: usize,
        learned: Option<&[usize]>,
    ) -> Self {
        let index: std::collections::HashMap<candle_core::TensorId, usize> = (params.iter())
            .enumerate()
            .map(|(i, (_, v))| (v.as_tensor().id(), i))
            .collect();
        let of_hook: Vec<Option<usize>> = (hooked.iter())
            .map(|v| index.get(&v.as_tensor().id()).copied())
            .collect();
        let mut is_hooked = vec![false; params.len()];
        for &p in of_hook.iter().flatten() {
            is_hooked[p] = true;
        }
        let mut placed = vec![false; params.len()];
        let mut order = Vec::with_capacity(params.len());
        let learned = learned.unwrap_or(&[]).iter().copied();
        let built = of_hook.iter().rev().flatten().copied();
        for p in learned
            .filter(|&p| p < params.len() && is_hooked[p])
            .chain(built)
        {
            if !std::mem::replace(&mut placed[p], true) {
                order.push(p);
            }
        }
        order.extend((0..params.len()).filter(|&p| !is_hooked[p]));
        let mut buckets: Vec<Vec<usize>> = Vec::new();
        let mut bucket_of = vec![0; params.len()];
        let mut bytes = 0;
        for p in order {
            let v = &params[p].1;
            let size = v.elem_count() * v.dtype().size_in_bytes();
            let fits = buckets.last().is_some_and(|b| {
                let first = &params[b[0]].1;
                // A bucket never mixes hooked and plain variables: a plain one would hold
                // the hooked ones back until the backward ends.
                is_hooked[b[0]] == is_hooked[p]
                    && first.dtype() == v.dtype()
                    && first.device().same_device(v.device())
                    && bytes + size <= bucket_bytes
            });
            if !fits {
                buckets.push(Vec::new());
                bytes = 0;
            }
            buckets.last_mut().unwrap().push(p);
            bucket_of[p] = buckets.len() - 1;
            bytes += size;
        }
        Self {
            buckets,
            of_hook,
            hooked: is_hooked,
            bucket_of,
        }
    }
}

/// The order of the hooked trainable variables every rank uses from now on: rank 0's `seen`
/// (the order its gradients arrived in), broadcast. Collective. Also checks that what arrived is
/// an order of this rank's hooked variables (the same set on every rank:
/// [`DataParallel::with_overlap`](super::DataParallel::with_overlap) checked the build).
pub(super) fn agree_order(
    comm: &dyn Collective,
    seen: &[usize],
    device: &Device,
) -> Result<Vec<usize>> {
    let mine: Vec<i64> = seen.iter().map(|&p| p as i64).collect();
    let root = comm.broadcast(&Tensor::new(mine.as_slice(), device)?, 0)?;
    let order: Vec<usize> = (root.to_vec1::<i64>()?.into_iter())
        .map(|p| usize::try_from(p).unwrap_or(usize::MAX))
        .collect();
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

/// What [`DataParallel::overlap_stats`](super::DataParallel::overlap_stats) reports of the last
/// overlapped backward.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct OverlapStats {
    /// Buckets (all-reduces) of the step.
    pub buckets: usize,
    /// Of those, started by the gradient hooks while the backward was still running (the rest
    /// were sent after it returned: buckets holding an unused variable or one the model does not
    /// take through the hooks, and every bucket after such a one).
    pub started_during_backward: usize,
    /// Of the buckets, those whose gradients were all in while an earlier bucket still waited
    /// for one, so that they started later than they could have: the buckets' order was not the
    /// order the gradients arrived in. After the first backward the buckets follow the observed
    /// order, and this is 0 unless the order changes from step to step.
    pub held_back: usize,
}

/// One started bucket.
#[derive(Debug)]
struct Started {
    bucket: usize,
    pending: Pending,
    missing_here: bool,
}

/// Receives the hooks' gradients during one backward and starts the buckets.
#[derive(Debug)]
pub(super) struct Launcher {
    comm: Arc<dyn Collective>,
    wire: Option<DType>,
    plan: Arc<Plan>,
    params: Vec<(String, Var)>,
    /// The accumulated gradients of earlier micro-batches, by trainable index.
    prior: Vec<Option<Tensor>>,
    grads: Vec<Option<Tensor>>,
    next: usize,
    started: Vec<Started>,
    during_backward: usize,
    /// The trainable indices of the hooked gradients, in the order they arrived.
    arrival: Vec<usize>,
    /// Per bucket: whether all its gradients arrived while an earlier bucket was incomplete.
    held: Vec<bool>,
    error: Option<candle_core::Error>,
}

impl Launcher {
    pub fn new(
        comm: Arc<dyn Collective>,
        wire: Option<DType>,
        plan: Arc<Plan>,
        params: Vec<(String, Var)>,
        prior: Option<&GradStore>,
    ) -> Self {
        let prior = params
            .iter()
            .map(|(_, v)| prior.and_then(|g| g.get(v.as_tensor()).cloned()))
            .collect();
        let n = params.len();
        let held = vec![false; plan.buckets.len()];
        Self {
            comm,
            wire,
            plan,
            params,
            prior,
            grads: vec![None; n],
            next: 0,
            started: Vec::new(),
            during_backward: 0,
            arrival: Vec::new(),
            held,
            error: None,
        }
    }

    /// The hooked trainable variables in the order their gradients arrived, then those that did
    /// not arrive in the plan's order.
    pub fn seen_order(&self) -> Vec<usize> {
        let mut seen = self.arrival.clone();
        let arrived: std::collections::HashSet<usize> = seen.iter().copied().collect();
        let rest = self.plan.buckets.iter().flatten().copied();
        seen.extend(rest.filter(|&p| self.plan.hooked[p] && !arrived.contains(&p)));
        seen
    }

    /// Hooked variable `hook` has its complete gradient: records it (plus the earlier
    /// micro-batches'), then starts every bucket now complete, in order.
    pub fn ready(&mut self, hook: usize, grad: &Tensor) {
        if self.error.is_some() {
            return;
        }
        let Some(p) = self.plan.of_hook.get(hook).copied().flatten() else {
            return; // a hooked variable that is not trainable: no gradient wanted
        };
        if self.grads[p].is_some() {
            self.error = Some(candle_core::Error::Msg(format!(
                "DataParallel::backward: the gradient of `{}` arrived twice in one backward",
                self.params[p].0
            )));
            return;
        }
        match self.with_prior(p, grad.clone()) {
            Ok(g) => self.grads[p] = Some(g),
            Err(e) => {
                self.error = Some(e);
                return;
            }
        }
        self.arrival.push(p);
        let b = self.plan.bucket_of[p];
        if b > self.next
            && self.plan.buckets[b]
                .iter()
                .all(|&q| self.grads[q].is_some())
        {
            self.held[b] = true;
        }
        while self.next < self.plan.buckets.len()
            && self.plan.buckets[self.next]
                .iter()
                .all(|&q| self.grads[q].is_some())
        {
            if let Err(e) = self.start(self.next) {
                self.error = Some(e);
                return;
            }
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
    fn start(&mut self, b: usize) -> Result<()> {
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
            missing_here |= self.grads[p].is_none();
            parts.push(
                (self.grads[p].as_ref())
                    .map(|g| g.to_dtype(dtype)?.contiguous())
                    .transpose()?,
            );
        }
        let flat = pack::pack(&parts, &lens, dtype, &device)?;
        let pending = match self.wire {
            Some(w) => self.comm.all_reduce_wire_async(&flat, ReduceOp::Avg, w)?,
            None => self.comm.all_reduce_async(&flat, ReduceOp::Avg)?,
        };
        self.started.push(Started {
            bucket: b,
            pending,
            missing_here,
        });
        Ok(())
    }

    /// After the backward returned: takes the gradients of the variables the model used
    /// without the hooks from `grads`, starts the remaining buckets, waits for every bucket and
    /// puts the averages into `grads` (a variable no rank has a gradient for gets none). Errors
    /// after every started bucket is waited for: the first failure, or a hooked variable that
    /// the model also used without its hook (its gradient would be split).
    pub fn finish(mut self, grads: &mut GradStore) -> Result<OverlapStats> {
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
                            self.error.get_or_insert(e);
                            None
                        }
                    },
                    None => self.prior[p].clone(),
                };
            }
        }
        // A hooked variable that never fired may still have earlier micro-batches' gradients.
        for p in 0..self.params.len() {
            if self.plan.hooked[p] && self.grads[p].is_none() {
                self.grads[p] = self.prior[p].clone();
            }
        }
        // Every remaining bucket goes out, also after an error here, so that no rank waits for
        // this one in a collective it never issues.
        while self.next < self.plan.buckets.len() {
            if let Err(e) = self.start(self.next) {
                self.error.get_or_insert(e);
            }
            self.next += 1;
        }
        let stats = OverlapStats {
            buckets: self.plan.buckets.len(),
            started_during_backward: self.during_backward,
            held_back: self.held.iter().filter(|&&h| h).count(),
        };
        for s in std::mem::take(&mut self.started) {
            match s.pending.wait() {
                Ok(avg) => {
                    if self.error.is_none() {
                        let vars: Vec<&Var> = (self.plan.buckets[s.bucket].iter())
                            .map(|&p| &self.params[p].1)
                            .collect();
                        if let Err(e) = pack::unpack(&vars, &avg, s.missing_here, grads) {
                            self.error = Some(e);
                        }
                    }
                }
                Err(e) => {
                    self.error.get_or_insert(e);
                }
            }
        }
        if let Some(e) = self.error {
            return Err(e);
        }
        if !mixed.is_empty() {
            bail!(
                "DataParallel::backward: {mixed:?} were used both through the hooked VarBuilder \
                 and directly (the variable's own tensor), so their gradients were split; take \
                 every use of a trainable variable from the builder"
            )
        }
        Ok(stats)
    }
}
