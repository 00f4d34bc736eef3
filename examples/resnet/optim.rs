//! AdamW whose state can be checkpointed. The update is candle-nn's `AdamW` (decoupled weight
//! decay, bias-corrected moments, the same operations in the same order, so the steps are bit
//! for bit the same), but candle-nn keeps its moments private, and a run resumed without them
//! differs from an uninterrupted one.

use std::collections::HashMap;

use anyhow::{bail, Context, Result};
use candle_core::backprop::GradStore;
use candle_core::{Tensor, Var};
use candle_nn::ParamsAdamW;

/// One trainable variable and its two moment estimates (same shape and dtype).
struct Slot {
    name: String,
    var: Var,
    m: Var,
    v: Var,
}

/// AdamW over named variables.
pub struct AdamW {
    slots: Vec<Slot>,
    /// Steps taken (the bias correction's `t`).
    step: usize,
    params: ParamsAdamW,
}

impl AdamW {
    pub fn new(vars: &[(String, Var)], params: ParamsAdamW) -> Result<Self> {
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

    pub fn set_learning_rate(&mut self, lr: f64) {
        self.params.lr = lr;
    }

    /// One update of every variable that has a gradient in `grads`.
    pub fn step(&mut self, grads: &GradStore) -> Result<()> {
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

    /// Steps taken and the moments, named `adamw.m.<variable>` and `adamw.v.<variable>`.
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
    pub fn load_state(&mut self, step: usize, tensors: &HashMap<String, Tensor>) -> Result<()> {
        let mut found = Vec::with_capacity(self.slots.len());
        for s in &self.slots {
            let get = |kind: &str| -> Result<Tensor> {
                let key = format!("adamw.{kind}.{}", s.name);
                let t = tensors
                    .get(&key)
                    .with_context(|| format!("the checkpoint has no optimizer moment {key}"))?;
                if t.shape() != s.var.shape() || t.dtype() != s.var.dtype() {
                    bail!(
                        "optimizer moment {key}: {:?} {:?} in the checkpoint, {:?} {:?} in the model",
                        t.dims(),
                        t.dtype(),
                        s.var.dims(),
                        s.var.dtype()
                    )
                }
                Ok(t.to_device(s.var.device())?)
            };
            found.push((get("m")?, get("v")?));
        }
        for (s, (m, v)) in self.slots.iter().zip(found) {
            s.m.set(&m)?;
            s.v.set(&v)?;
        }
        self.step = step;
        Ok(())
    }
}
