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
//! Buckets follow the reverse of the order in which the model took its variables from the
//! builder (the last layer's first), as PyTorch's first buckets follow the reverse of
//! `model.parameters()`: candle's backward reaches the weights of candle-nn's layers from the
//! last layer back (their weights are the right operands of `conv2d`, `matmul` and
//! `broadcast_add`, visited first). The order is the same on every rank because the model code
//! is ([`DataParallel::with_overlap`] checks it).
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
/// the reverse of the order the model took them (the order their gradients complete in), then
/// the trainable variables the model does not take through the hooks, in name order.
#[derive(Debug)]
pub(super) struct Plan {
    pub buckets: Vec<Vec<usize>>,
    /// Trainable index of each hooked variable (by hook index; `None`: not trainable).
    pub of_hook: Vec<Option<usize>>,
    /// Whether each trainable variable is hooked.
    pub hooked: Vec<bool>,
}

impl Plan {
    /// `params`: the trainable variables; `hooked`: the hooked variables in the order the model
    /// took them. Buckets of at most `bucket_bytes` (or one variable) of one dtype and device.
    pub fn new(params: &[(String, Var)], hooked: &[Var], bucket_bytes: usize) -> Self {
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
        let mut order: Vec<usize> = of_hook.iter().rev().flatten().copied().collect();
        order.extend((0..params.len()).filter(|&p| !is_hooked[p]));
        let mut buckets: Vec<Vec<usize>> = Vec::new();
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
            bytes += size;
        }
        Self {
            buckets,
            of_hook,
            hooked: is_hooked,
        }
    }
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
            error: None,
        }
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
