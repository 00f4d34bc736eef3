//! Dynamic loss scaling for reduced-precision training ([`GradScaler`]), with PyTorch's
//! `torch.amp.GradScaler` defaults and rules.
//!
//! f16 gradients underflow to zero below 6·10⁻⁸; multiplying the loss by a large factor `S`
//! before `backward()` keeps them representable, and dividing the gradients by `S` before the
//! optimizer step undoes it. When a gradient overflows (an Inf or NaN anywhere), the step is
//! skipped and `S` is halved; after `growth_interval` clean steps in a row, `S` is doubled.
//!
//! **Every rank makes the same decision, with no extra collective.** [`GradScaler::step`] looks
//! at the gradients *after* [`crate::DataParallel::sync_gradients`]: a non-finite value on any
//! rank makes the averaged value non-finite (`±Inf + x` is `±Inf` or NaN, NaN + x is NaN), and
//! the averaged gradients are the same on every rank (the property that keeps data-parallel
//! replicas identical in the first place). So the found-inf flag travels inside the gradient
//! all-reduce itself. An overflow of the sum itself (finite values whose sum exceeds the
//! dtype's range) also reads as found-inf, which is the right call.

use candle_core::backprop::GradStore;
use candle_core::{bail, DType, Result, Tensor, Var};
use candle_nn::Optimizer;

/// The scaler's settings; the defaults are PyTorch's. Built from [`Default`] and the `with_*`
/// methods (new settings may be added in a minor release).
#[derive(Debug, Clone, Copy, PartialEq)]
#[non_exhaustive]
pub struct GradScalerConfig {
    /// The first scale factor (default 2¹⁶ = 65536).
    pub init_scale: f64,
    /// Factor applied after `growth_interval` clean steps in a row (default 2).
    pub growth_factor: f64,
    /// Factor applied after a step with a non-finite gradient (default 0.5).
    pub backoff_factor: f64,
    /// Clean steps in a row before the scale grows (default 2000).
    pub growth_interval: u64,
}

impl Default for GradScalerConfig {
    fn default() -> Self {
        Self {
            init_scale: 65536.0,
            growth_factor: 2.0,
            backoff_factor: 0.5,
            growth_interval: 2000,
        }
    }
}

impl GradScalerConfig {
    /// With [`Self::init_scale`] set.
    pub fn with_init_scale(mut self, init_scale: f64) -> Self {
        self.init_scale = init_scale;
        self
    }

    /// With [`Self::growth_factor`] set.
    pub fn with_growth_factor(mut self, growth_factor: f64) -> Self {
        self.growth_factor = growth_factor;
        self
    }

    /// With [`Self::backoff_factor`] set.
    pub fn with_backoff_factor(mut self, backoff_factor: f64) -> Self {
        self.backoff_factor = backoff_factor;
        self
    }

    /// With [`Self::growth_interval`] set.
    pub fn with_growth_interval(mut self, growth_interval: u64) -> Self {
        self.growth_interval = growth_interval;
        self
    }
}

/// What a checkpoint keeps of a [`GradScaler`] (its settings come from the code that builds it).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct GradScalerState {
    /// The current scale factor.
    pub scale: f64,
    /// Clean steps in a row since the last change of scale.
    pub growth_tracker: u64,
}

/// Dynamic loss scaling: scale the loss, step the optimizer on unscaled gradients unless one
/// is non-finite, adapt the scale.
///
/// ```
/// use candle_core::{DType, Device, Tensor};
/// use candle_distributed::amp::{GradScaler, GradScalerConfig};
/// use candle_nn::{linear, Module, Optimizer, VarBuilder, VarMap, SGD};
///
/// let vm = VarMap::new();
/// let model = linear(4, 1, VarBuilder::from_varmap(&vm, DType::F32, &Device::Cpu))?;
/// let mut opt = SGD::new(vm.all_vars(), 0.1)?;
/// let mut scaler = GradScaler::new(GradScalerConfig::default())?;
/// let x = Tensor::ones((3, 4), DType::F32, &Device::Cpu)?;
/// let loss = model.forward(&x)?.sqr()?.mean_all()?;
/// let grads = scaler.scale(&loss)?.backward()?; // with DataParallel: dp.sync_gradients(..)?
/// let stepped = scaler.step(&mut opt, grads, &vm.all_vars())?;
/// assert!(stepped);
/// # Ok::<(), candle_core::Error>(())
/// ```
#[derive(Debug, Clone)]
pub struct GradScaler {
    config: GradScalerConfig,
    state: GradScalerState,
}

impl GradScaler {
    /// A scaler at `config.init_scale`.
    ///
    /// # Errors
    /// A scale that is not positive and finite in f32, a growth factor not above 1, a backoff
    /// factor outside (0, 1), or a growth interval of 0.
    pub fn new(config: GradScalerConfig) -> Result<Self> {
        let c = &config;
        let valid = (c.init_scale as f32).is_finite()
            && c.init_scale > 0.0
            && c.growth_factor.is_finite()
            && c.growth_factor > 1.0
            && c.backoff_factor > 0.0
            && c.backoff_factor < 1.0
            && c.growth_interval > 0;
        if !valid {
            bail!(
                "grad_scaler: invalid config {config:?} (need init_scale > 0 and finite in f32, growth_factor > 1, 0 < backoff_factor < 1, growth_interval ≥ 1)"
            )
        }
        Ok(Self {
            config,
            state: GradScalerState {
                scale: config.init_scale,
                growth_tracker: 0,
            },
        })
    }

    /// The current scale factor `S`.
    pub fn scale_factor(&self) -> f64 {
        self.state.scale
    }

    /// The state to checkpoint.
    pub fn state(&self) -> GradScalerState {
        self.state
    }

    /// Restores a checkpointed state.
    ///
    /// # Errors
    /// A scale that is not positive and finite in f32; the scaler is then unchanged.
    pub fn load_state(&mut self, state: GradScalerState) -> Result<()> {
        if !((state.scale as f32).is_finite() && state.scale > 0.0) {
            bail!(
                "grad_scaler: cannot load a scale of {} (must be positive and finite in f32)",
                state.scale
            )
        }
        self.state = state;
        Ok(())
    }

    /// `loss · S` (any shape; usually a scalar), in f32 for an f16/bf16 loss (`S` itself
    /// overflows f16 at the default 2¹⁶, as would `loss · S`; PyTorch promotes likewise), else
    /// in the loss's dtype.
    ///
    /// # Errors
    /// Those of the multiplication.
    pub fn scale(&self, loss: &Tensor) -> Result<Tensor> {
        match loss.dtype() {
            DType::F16 | DType::BF16 => loss.to_dtype(DType::F32)?.affine(self.state.scale, 0.0),
            _ => loss.affine(self.state.scale, 0.0),
        }
    }

    /// Divides the gradient of every variable of `vars` in `grads` by `S`, in place in the
    /// store, and returns whether any of them holds an Inf or a NaN. One value is read back
    /// to the host. Gradients in f16/bf16 are unscaled in f32 and stored back in their dtype.
    ///
    /// # Errors
    /// Those of the arithmetic.
    pub fn unscale(&self, grads: &mut GradStore, vars: &[Var]) -> Result<bool> {
        let inv = 1.0 / self.state.scale;
        let mut probes = Vec::with_capacity(vars.len());
        for v in vars {
            let Some(g) = grads.get(v.as_tensor()) else {
                continue;
            };
            let unscaled = match g.dtype() {
                DType::F16 | DType::BF16 => g
                    .to_dtype(DType::F32)?
                    .affine(inv, 0.0)?
                    .to_dtype(g.dtype())?,
                _ => g.affine(inv, 0.0)?,
            };
            // 0·x is 0 for every finite x and NaN for ±Inf and NaN: the sum of these is 0 or
            // NaN, and cannot overflow.
            probes.push(unscaled.affine(0.0, 0.0)?.sum_all()?.to_dtype(DType::F32)?);
            grads.insert(v.as_tensor(), unscaled);
        }
        if probes.is_empty() {
            return Ok(false);
        }
        let probe = Tensor::stack(&probes, 0)?.sum_all()?.to_scalar::<f32>()?;
        Ok(!probe.is_finite())
    }

    /// Unscales `grads` (the synchronised ones, under data parallelism), steps `opt` unless a
    /// gradient of `vars` is non-finite, then updates the scale. Returns whether the optimizer
    /// stepped. `vars` are the variables the optimizer updates.
    ///
    /// # Errors
    /// Those of the unscaling and of the optimizer's step; on an error the scale is unchanged.
    pub fn step<O: Optimizer>(
        &mut self,
        opt: &mut O,
        mut grads: GradStore,
        vars: &[Var],
    ) -> Result<bool> {
        let found_inf = self.unscale(&mut grads, vars)?;
        if !found_inf {
            opt.step(&grads)?;
        }
        self.update(found_inf);
        Ok(!found_inf)
    }

    /// The scale rule alone (for loops that unscale and step themselves): a step with a
    /// non-finite gradient multiplies `S` by `backoff_factor` and restarts the count of clean
    /// steps; the `growth_interval`-th clean step in a row multiplies it by `growth_factor`
    /// (PyTorch keeps the old scale when the grown one would overflow f32; so does this).
    pub fn update(&mut self, found_inf: bool) {
        let s = &mut self.state;
        if found_inf {
            s.scale *= self.config.backoff_factor;
            s.growth_tracker = 0;
            return;
        }
        s.growth_tracker += 1;
        if s.growth_tracker >= self.config.growth_interval {
            let grown = s.scale * self.config.growth_factor;
            if (grown as f32).is_finite() {
                s.scale = grown;
            }
            s.growth_tracker = 0;
        }
    }
}
