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
/// the hooks to [`super::DataParallel::with_overlap`], which copies the variables into them
/// and takes them: until then a backward through them is an error (an optimizer step would
/// reach the variables, never the copies the model computes with). After anything changes
/// the variables outside [`super::DataParallel::step`] (an optimizer step, a load), call
/// [`super::DataParallel::refresh`]; a backward whose model computed with copies that differ
/// from their variables is refused, naming the first. Cloning shares them.
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
    /// A `DataParallel` took the hooks (`with_overlap`): until then a backward through them is
    /// refused, since nothing would ever copy an optimizer's steps into the hooked copies.
    adopted: bool,
    /// The hooked copies may differ from their variables (gradients were handed out since the
    /// last refresh, or the hooks were just adopted): the next backward compares them.
    check_due: bool,
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
        if let Some(feature) = crate::device::missing_copy_feature(var.device()) {
            bail!(
                "GradHooks: `{name}` is on {:?}, where the gradient hook needs \
                 candle-distributed's `{feature}` feature: enable it, or build the model with \
                 VarBuilder::from_varmap and synchronize after the backward \
                 (DataParallel::sync_gradients) instead of overlapping",
                var.device()
            )
        }
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

    /// A guard that disarms the hooks when dropped (a backward that panics leaves them free
    /// for the next one).
    pub(super) fn armed_until_dropped(&self) -> Disarm<'_> {
        Disarm(self)
    }

    /// Copies every hooked variable's value into its hooked tensor (after an optimizer step).
    pub(super) fn refresh(&self) -> Result<()> {
        let mut st = lock(&self.state);
        for h in &st.hooked {
            h.tensor
                .flatten_all()?
                .slice_set(&h.var.as_tensor().flatten_all()?, 0, 0)?;
        }
        st.check_due = false;
        Ok(())
    }

    /// A `DataParallel` takes the hooks: backwards through them are allowed from now on, and
    /// the first one checks that the hooked copies still equal their variables.
    pub(super) fn adopt(&self) {
        let mut st = lock(&self.state);
        st.adopted = true;
        st.check_due = true;
    }

    /// Gradients were handed out: an optimizer may change the variables before the next
    /// backward, so that one checks the hooked copies unless a refresh comes first.
    pub(super) fn handed_out(&self) {
        lock(&self.state).check_due = true;
    }

    /// What the overlapped backward runs at each announced collective of the backward.
    pub(super) fn announcer(&self) -> candle_collective::in_backward::Listener {
        let state = self.state.clone();
        Arc::new(move |e| {
            if let Some(a) = lock(&state).armed.as_mut() {
                a.heard(e);
            }
        })
    }

    /// The error to give when the model computed with a hooked copy that differs from its
    /// variable (naming the first), or `None`. Compared bit for bit on every call when the
    /// variables live on the CPU (a memory comparison); elsewhere when a check is due (after
    /// the hooks were adopted, and after gradients were handed out without a refresh since),
    /// with five small device operations per variable and one read of all their flags.
    ///
    /// # Errors
    ///
    /// When a comparison fails.
    pub(super) fn stale(&self, device: &Device) -> Result<Option<String>> {
        let st = lock(&self.state);
        if !device.is_cpu() && !st.check_due {
            return Ok(None);
        }
        let differs = differing(&st.hooked)?;
        let first = differs.iter().position(|&d| d).map(|i| &st.hooked[i]);
        Ok(first.map(|h| {
            format!(
                "DataParallel::backward: the model computed with a stale copy of `{}`: its \
                 variable changed since the hooked copies were last refreshed (an optimizer step \
                 outside DataParallel::step, a checkpoint or VarMap loaded after with_overlap); \
                 call dp.refresh() after changing the variables, or step with dp.step; nothing \
                 was returned on any rank",
                h.name
            )
        }))
    }
}

/// Per hooked variable, whether its copy holds other values ([`same_values`]); on a device,
/// every comparison's flag read back in one copy to the host.
fn differing(hooked: &[Hooked]) -> Result<Vec<bool>> {
    let mut out = vec![false; hooked.len()];
    let mut on_device = Vec::new();
    for (i, h) in hooked.iter().enumerate() {
        match same_values(h.var.as_tensor(), &h.tensor)? {
            Compared::Host(same) => out[i] = !same,
            Compared::Device(flag) => on_device.push((i, flag)),
        }
    }
    if !on_device.is_empty() {
        let flags: Vec<Tensor> = on_device.iter().map(|(_, f)| f.clone()).collect();
        let read = Tensor::stack(&flags, 0)?.to_vec1::<f32>()?;
        for ((i, _), f) in on_device.iter().zip(read) {
            out[*i] = f != 0.0;
        }
    }
    Ok(out)
}

/// A comparison's outcome: known on the host, or a 0/1 flag on the device.
enum Compared {
    Host(bool),
    Device(Tensor),
}

/// Whether `var` and its hooked copy hold the same values: the same bits on the CPU (a NaN
/// equals its copy); elsewhere equal values, a NaN in the variable counting as equal.
fn same_values(var: &Tensor, copy: &Tensor) -> Result<Compared> {
    {
        let (a, la) = var.storage_and_layout();
        let (b, lb) = copy.storage_and_layout();
        if let (
            candle_core::Storage::Cpu(a),
            candle_core::Storage::Cpu(b),
            Some((a0, a1)),
            Some((b0, b1)),
        ) = (&*a, &*b, la.contiguous_offsets(), lb.contiguous_offsets())
        {
            macro_rules! bits {
                ($t:ty) => {{
                    let (x, y) = (&a.as_slice::<$t>()?[a0..a1], &b.as_slice::<$t>()?[b0..b1]);
                    return Ok(Compared::Host(
                        x.len() == y.len()
                            && x.iter().zip(y).all(|(p, q)| p.to_bits() == q.to_bits()),
                    ));
                }};
            }
            match var.dtype() {
                DType::F32 => bits!(f32),
                DType::F64 => bits!(f64),
                DType::F16 => bits!(half::f16),
                DType::BF16 => bits!(half::bf16),
                _ => {}
            }
        }
    }
    let differ = var.ne(copy)?.mul(&var.eq(var)?)?;
    let any = differ.flatten_all()?.to_dtype(DType::F32)?.max(0)?;
    Ok(Compared::Device(any))
}

/// Disarms its hooks when dropped.
pub(super) struct Disarm<'a>(&'a GradHooks);

impl Drop for Disarm<'_> {
    fn drop(&mut self) {
        drop(self.0.disarm());
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

/// The hook's forward: a copy of the variable in a buffer of its own (on Metal too, where `try_clone` would share
/// the variable's buffer, which an optimizer step writes into).
fn copy_of<S>(s: &S, l: &Layout) -> Result<(S, Shape)>
where
    S: BackendStorage,
    S::Device: candle_core::backend::BackendDevice<Storage = S>,
{
    if !l.is_contiguous() || l.start_offset() != 0 {
        bail!("data-parallel-grad-hook: the variable must be contiguous from its start")
    }
    crate::ops::attach::copy(s, l)
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

    #[cfg(feature = "metal")]
    fn metal_fwd(
        &self,
        s: &candle_core::MetalStorage,
        l: &Layout,
    ) -> Result<(candle_core::MetalStorage, Shape)> {
        copy_of(s, l)
    }

    /// Armed (inside `DataParallel::backward`): hands the gradient over and gives the variable
    /// none in the `GradStore` (the averaged one is put there afterwards). Otherwise (a plain
    /// `loss.backward()`, as for accumulated micro-batches): passes the gradient on to the
    /// variable, as if there were no hook, once a `DataParallel` adopted the hooks; before, an
    /// error (the model would compute with copies that no optimizer step ever reaches).
    fn bwd(&self, _arg: &Tensor, _res: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        let mut st = lock(&self.state);
        if !st.adopted {
            let name = &st.hooked[self.index].name;
            bail!(
                "GradHooks: `{name}` is a hooked copy, but no DataParallel took these hooks: \
                 an optimizer step would change the variable and never the copy the model \
                 computes with. Call DataParallel::new(..)?.with_overlap(&hooks)? and step with \
                 dp.step (or dp.backward and dp.refresh), or build the model with \
                 VarBuilder::from_varmap instead"
            )
        }
        match st.armed.as_mut() {
            Some(a) => {
                a.ready(self.index, grad);
                Ok(None)
            }
            None => Ok(Some(grad.clone())),
        }
    }
}
