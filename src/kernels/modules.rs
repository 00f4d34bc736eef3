//! The kernel images of `kernels/*.cu` (compiled to fatbins by `build.rs`, feature `cuda`),
//! loaded once per device, entry points looked up by name, and the launch of a call that the
//! builders of [`super::args`] made.

use std::collections::hash_map::Entry;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use candle_core::cuda_backend::cudarc::driver::{CudaFunction, CudaModule};
use candle_core::cuda_backend::cudarc::nvrtc::Ptx;
use candle_core::cuda_backend::{DeviceId, WrapErr};
use candle_core::{CudaDevice, Result};

use crate::device::cuda::{launch_call, Buffers};
use crate::device::Call;

/// The fatbin of every `kernels/<file>.cu` (`pub const <FILE>: &[u8]`) and `SASS_ARCHS`.
mod images {
    include!(concat!(env!("OUT_DIR"), "/kernels.rs"));
}

/// The architectures whose machine code every kernel image holds (`sm_XX` as `XX`: 80 and 90,
/// and `CUDA_COMPUTE_CAP` at build time when it named another); the newest also ships as PTX,
/// which the driver compiles for GPUs newer than all of them.
pub(crate) fn shipped_archs() -> &'static [u32] {
    images::SASS_ARCHS
}

/// One compiled kernel file.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum Module {
    Stats,
    Apply,
    BackwardReduce,
    BackwardElemt,
    MaxPool,
    Pack,
}

impl Module {
    /// All of them, for the image checks.
    #[cfg(test)]
    pub const ALL: [Module; 6] = [
        Module::Stats,
        Module::Apply,
        Module::BackwardReduce,
        Module::BackwardElemt,
        Module::MaxPool,
        Module::Pack,
    ];

    /// `(kernel source, fatbin image)`.
    pub fn image(self) -> (&'static str, &'static [u8]) {
        match self {
            Module::Stats => ("kernels/stats.cu", images::STATS),
            Module::Apply => ("kernels/apply.cu", images::APPLY),
            Module::BackwardReduce => ("kernels/backward_reduce.cu", images::BACKWARD_REDUCE),
            Module::BackwardElemt => ("kernels/backward_elemt.cu", images::BACKWARD_ELEMT),
            Module::MaxPool => ("kernels/max_pool.cu", images::MAX_POOL),
            Module::Pack => ("kernels/pack.cu", images::PACK),
        }
    }
}

/// Loaded modules and kernels of each device. candle's own cache of custom kernels takes PTX
/// text only, which the driver compiles at first use (measured: docs/kernels.md, section
/// "Building"); the images here carry machine code and load without that compilation.
#[derive(Default)]
struct Loaded {
    modules: HashMap<(DeviceId, Module), Arc<CudaModule>>,
    functions: HashMap<(DeviceId, String), CudaFunction>,
}
static LOADED: Mutex<Option<Loaded>> = Mutex::new(None);

/// `module`'s entry point `name` on `dev`, loading the module's image on first use.
pub(crate) fn function(dev: &CudaDevice, module: Module, name: &str) -> Result<CudaFunction> {
    let mut guard = LOADED.lock().unwrap_or_else(|e| e.into_inner());
    let loaded = guard.get_or_insert_with(Loaded::default);
    let key = (dev.id(), name.to_string());
    if let Some(f) = loaded.functions.get(&key) {
        return Ok(f.clone());
    }
    let m = match loaded.modules.entry((dev.id(), module)) {
        Entry::Occupied(e) => e.into_mut(),
        Entry::Vacant(e) => {
            let (source, image) = module.image();
            let m = dev
                .cuda_stream()
                .context()
                .load_module(Ptx::from_binary(image.to_vec()))
                .map_err(|err| {
                    candle_core::Error::Msg(format!(
                        "loading the CUDA kernels of {source} on {dev:?} failed ({err}); the \
                         image holds machine code for sm_{:?} and PTX for newer GPUs",
                        shipped_archs()
                    ))
                })?;
            e.insert(m)
        }
    };
    let f = m.load_function(name).w()?;
    loaded.functions.insert(key, f.clone());
    Ok(f)
}

/// Enqueues `call` (built by [`super::args`], `None`: nothing to launch) from `module` on the
/// stream of `buffers`, then releases their guards.
pub(crate) fn launch(
    dev: &CudaDevice,
    module: Module,
    call: Option<Call>,
    buffers: Buffers<'_>,
) -> Result<()> {
    let Some(call) = call else {
        return Ok(());
    };
    let func = function(dev, module, &call.name)?;
    launch_call(&func, &call, buffers)
}
