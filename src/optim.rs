//! Optimizers whose state can be checkpointed.
//!
//! [`AdamW`] is candle-nn's `AdamW` (decoupled weight decay, bias-corrected moments, the same
//! operations in the same order, so its steps are bit for bit candle-nn's:
//! `tests/checkpoint.rs::adamw_steps_equal_candle_nns_and_resume_exactly`), with its moments and step count readable
//! ([`AdamW::state`]) and restorable ([`AdamW::load_state`]): candle-nn keeps them private, and a
//! run resumed without them differs from an uninterrupted one.

use std::collections::HashMap;

use candle_core::backprop::GradStore;
use candle_core::{bail, Result, Tensor, Var};
use candle_nn::ParamsAdamW;

/// One trainable variable and its two moment estimates (same shape and dtype).
#[derive(Debug)]
struct Slot {
    name: String,
    var: Var,
    m: Var,
    v: Var,
}

/// AdamW over named variables (the names key its state in a checkpoint).
#[derive(Debug)]
pub struct AdamW {
    slots: Vec<Slot>,
    /// Steps taken (the bias correction's `t`).
    step: usize,
    params: ParamsAdamW,
}

impl AdamW {
    /// Over `vars` (name, variable), for example `DataParallel::named_trainable()`; moments
    /// start at zero.
    ///
    /// # Errors
    ///
    /// When a moment cannot be allocated.
    pub fn new_named(vars: &[(String, Var)], params: ParamsAdamW) -> Result<Self> {
        let slots = vars
            .iter()
            .map(|(name, var)| {
                Ok(Slot {
                    name: name.clone(),
                    var: var.clone(),
                    m: Var::zeros(var.shape(), var.dtype(), var.device())?,
                    v: Var::zeros(var.shape(), var.dtype(), var.device())?,
                })
            })
            .collect::<Result<_>>()?;
        Ok(Self {
            slots,
            step: 0,
            params,
        })
    }

    /// One update of every variable that has a gradient in `grads`.
    fn update(&mut self, grads: &GradStore) -> Result<()> {
        self.step += 1;
        let p = &self.params;
        let (b1, b2) = (p.beta1, p.beta2);
        let scale_m = 1f64 / (1f64 - b1.powi(self.step as i32));
        let scale_v = 1f64 / (1f64 - b2.powi(self.step as i32));
        for s in &self.slots {
            let Some(g) = grads.get(s.var.as_tensor()) else {
                continue;
            };
            let next_m = ((s.m.as_tensor() * b1)? + (g * (1.0 - b1))?)?;
            let next_v = ((s.v.as_tensor() * b2)? + (g.sqr()? * (1.0 - b2))?)?;
            let m_hat = (&next_m * scale_m)?;
            let v_hat = (&next_v * scale_v)?;
            let decayed = (s.var.as_tensor() * (1f64 - p.lr * p.weight_decay))?;
            let adjusted = (m_hat / (v_hat.sqrt()? + p.eps)?)?;
            let next = (decayed - (adjusted * p.lr)?)?;
            s.m.set(&next_m)?;
            s.v.set(&next_v)?;
            s.var.set(&next)?;
        }
        Ok(())
    }

    /// Steps taken and the moments `[shape of the variable]`, named `adamw.m.<variable>` and
    /// `adamw.v.<variable>`: what a checkpoint saves.
    pub fn state(&self) -> (usize, Vec<(String, Tensor)>) {
        let mut out = Vec::with_capacity(2 * self.slots.len());
        for s in &self.slots {
            out.push((format!("adamw.m.{}", s.name), s.m.as_tensor().clone()));
            out.push((format!("adamw.v.{}", s.name), s.v.as_tensor().clone()));
        }
        (self.step, out)
    }

    /// Restores [`Self::state`]; every moment must be there with its variable's shape and
    /// dtype. Checked before anything is set: a refused state changes nothing.
    ///
    /// # Errors
    ///
    /// When a moment is missing or of another shape or dtype (naming it), or cannot be moved to
    /// its variable's device.
    pub fn load_state(&mut self, step: usize, tensors: &HashMap<String, Tensor>) -> Result<()> {
        let found = self.checked_state(tensors)?;
        self.put_state(step, found)
    }

    /// The moments [`Self::load_state`] would set, checked and on their variables' devices;
    /// nothing changes.
    pub(crate) fn checked_state(
        &self,
        tensors: &HashMap<String, Tensor>,
    ) -> Result<Vec<(Tensor, Tensor)>> {
        let mut found = Vec::with_capacity(self.slots.len());
        for s in &self.slots {
            let get = |kind: &str| -> Result<Tensor> {
                let key = format!("adamw.{kind}.{}", s.name);
                let Some(t) = tensors.get(&key) else {
                    bail!("AdamW::load_state: the checkpoint has no optimizer moment {key}")
                };
                if t.shape() != s.var.shape() || t.dtype() != s.var.dtype() {
                    bail!(
                        "AdamW::load_state: {key} is {:?} {:?} in the checkpoint, {:?} {:?} in the model",
                        t.dims(),
                        t.dtype(),
                        s.var.dims(),
                        s.var.dtype()
                    )
                }
                t.to_device(s.var.device())
            };
            found.push((get("m")?, get("v")?));
        }
        Ok(found)
    }

    /// Sets the moments [`Self::checked_state`] returned, and the step count.
    pub(crate) fn put_state(&mut self, step: usize, found: Vec<(Tensor, Tensor)>) -> Result<()> {
        for (s, (m, v)) in self.slots.iter().zip(found) {
            s.m.set(&m)?;
            s.v.set(&v)?;
        }
        self.step = step;
        Ok(())
    }
}

impl candle_nn::Optimizer for AdamW {
    type Config = ParamsAdamW;

    /// Over `vars` named by position (`0`, `1`, …): prefer [`AdamW::new_named`], whose state
    /// keys do not depend on the order of the list.
    fn new(vars: Vec<Var>, config: ParamsAdamW) -> Result<Self> {
        let named: Vec<(String, Var)> = (vars.into_iter().enumerate())
            .map(|(i, v)| (i.to_string(), v))
            .collect();
        Self::new_named(&named, config)
    }

    fn step(&mut self, grads: &GradStore) -> Result<()> {
        self.update(grads)
    }

    fn learning_rate(&self) -> f64 {
        self.params.lr
    }

    fn set_learning_rate(&mut self, lr: f64) {
        self.params.lr = lr;
    }
}
