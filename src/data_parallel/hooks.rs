//! Gradient hooks: a `VarBuilder` whose trainable tensors are copies of the variables through
//! an identity op whose backward reports each variable's complete gradient, for the overlapped
//! backward of [`super::overlap`].

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};

use candle_core::backend::BackendStorage;
use candle_core::{bail, CpuStorage, CustomOp1, DType, Device, Layout, Result, Shape, Tensor, Var};
use candle_nn::var_builder::SimpleBackend;
use candle_nn::{VarBuilder, VarMap};

use super::overlap::Launcher;
use super::BUFFER_SUFFIXES;

/// The hooked tensors of one model: build the model with [`GradHooks::var_builder`], then hand
/// the hooks to [`super::DataParallel::with_overlap`]. Cloning shares them.
#[derive(Clone, Debug, Default)]
pub struct GradHooks {
    state: Arc<Mutex<HookState>>,
}

/// One hooked variable: its name, the variable, and the copy the model computes with.
#[derive(Debug)]
pub(super) struct Hooked {
    pub name: String,
    pub var: Var,
    pub tensor: Tensor,
}

#[derive(Debug, Default)]
struct HookState {
    /// In the order the model took them from the builder.
    hooked: Vec<Hooked>,
    by_name: HashMap<String, usize>,
    /// Set while `DataParallel::backward` runs the backward: where gradients go.
    armed: Option<Launcher>,
}

fn lock(m: &Mutex<HookState>) -> MutexGuard<'_, HookState> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl GradHooks {
    /// No hooked variables yet.
    pub fn new() -> Self {
        Self::default()
    }

    /// A `VarBuilder` over `varmap` (variables created or reused as `VarBuilder::from_varmap`
    /// does) whose trainable tensors are hooked copies: float variables whose names do not end
    /// in `running_mean`, `running_var` or `num_batches_tracked` (those, like other dtypes, come
    /// back as the variables themselves, so that batch-norm layers update them in place). A
    /// name asked for twice (a shared weight) gets the same hooked tensor.
    pub fn var_builder(
        &self,
        varmap: &VarMap,
        dtype: DType,
        device: &Device,
    ) -> VarBuilder<'static> {
        VarBuilder::from_backend(
            Box::new(Backend {
                varmap: varmap.clone(),
                hooks: self.clone(),
            }),
            dtype,
            device.clone(),
        )
    }

    /// How many variables are hooked.
    pub fn len(&self) -> usize {
        lock(&self.state).hooked.len()
    }

    /// Whether no variable is hooked.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The hooked tensor of `name` for `var`, made on first use.
    fn hooked(&self, name: &str, var: Var) -> Result<Tensor> {
        let mut st = lock(&self.state);
        if let Some(&i) = st.by_name.get(name) {
            let h = &st.hooked[i];
            if h.var.as_tensor().id() != var.as_tensor().id() {
                bail!("GradHooks: `{name}` was hooked for another variable (two VarMaps?)")
            }
            return Ok(h.tensor.clone());
        }
        let index = st.hooked.len();
        if !var.as_tensor().is_contiguous() {
            bail!("GradHooks: variable `{name}` is not contiguous")
        }
        let tensor = var.as_tensor().apply_op1(Hook {
            state: self.state.clone(),
            index,
        })?;
        st.hooked.push(Hooked {
            name: name.to_string(),
            var,
            tensor: tensor.clone(),
        });
        st.by_name.insert(name.to_string(), index);
        Ok(tensor)
    }

    /// Runs `f` on the hooked variables.
    pub(super) fn with_hooked<R>(&self, f: impl FnOnce(&[Hooked]) -> R) -> R {
        f(&lock(&self.state).hooked)
    }

    /// Routes the hooks' gradients to `armed` until [`GradHooks::disarm`]. Errors if already armed.
    pub(super) fn arm(&self, armed: Launcher) -> Result<()> {
        let mut st = lock(&self.state);
        if st.armed.is_some() {
            bail!("DataParallel::backward: called from inside another backward of the same model")
        }
        st.armed = Some(armed);
        Ok(())
    }

    pub(super) fn disarm(&self) -> Option<Launcher> {
        lock(&self.state).armed.take()
    }

    /// Copies every hooked variable's value into its hooked tensor (after an optimizer step).
    pub(super) fn refresh(&self) -> Result<()> {
        for h in &lock(&self.state).hooked {
            h.tensor
                .flatten_all()?
                .slice_set(&h.var.as_tensor().flatten_all()?, 0, 0)?;
        }
        Ok(())
    }
}

/// The builder's backend: the `VarMap`'s variables, trainable ones through their hook.
struct Backend {
    varmap: VarMap,
    hooks: GradHooks,
}

impl SimpleBackend for Backend {
    fn get(
        &self,
        s: Shape,
        name: &str,
        h: candle_nn::Init,
        dtype: DType,
        dev: &Device,
    ) -> Result<Tensor> {
        let t = self.varmap.get(s, name, h, dtype, dev)?;
        if !t.dtype().is_float() || BUFFER_SUFFIXES.iter().any(|b| name.ends_with(b)) {
            return Ok(t);
        }
        let var = self.varmap.data().lock().unwrap()[name].clone();
        self.hooks.hooked(name, var)
    }

    fn get_unchecked(&self, name: &str, _dtype: DType, _dev: &Device) -> Result<Tensor> {
        bail!("GradHooks: `{name}`: get_unchecked is not available over a VarMap, use get")
    }

    fn contains_tensor(&self, name: &str) -> bool {
        self.varmap.data().lock().unwrap().contains_key(name)
    }
}

/// The identity whose backward reports hooked variable `index`'s gradient.
struct Hook {
    state: Arc<Mutex<HookState>>,
    index: usize,
}

/// The hook's forward: a copy of the variable (contiguous, from its first element).
fn copy_of<S: BackendStorage>(s: &S, l: &Layout) -> Result<(S, Shape)> {
    if !l.is_contiguous() || l.start_offset() != 0 {
        bail!("data-parallel-grad-hook: the variable must be contiguous from its start")
    }
    Ok((s.try_clone(l)?, l.shape().clone()))
}

impl CustomOp1 for Hook {
    fn name(&self) -> &'static str {
        "data-parallel-grad-hook"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        copy_of(s, l)
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s: &candle_core::CudaStorage,
        l: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        copy_of(s, l)
    }

    /// Armed (inside `DataParallel::backward`): hands the gradient over and gives the variable
    /// none in the `GradStore` (the averaged one is put there afterwards). Otherwise (a plain
    /// `loss.backward()`): passes the gradient on to the variable, as if there were no hook.
    fn bwd(&self, _arg: &Tensor, _res: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        let mut st = lock(&self.state);
        match st.armed.as_mut() {
            Some(a) => {
                a.ready(self.index, grad);
                Ok(None)
            }
            None => Ok(Some(grad.clone())),
        }
    }
}
