//! The ResNet example's pieces: models build with both norms under torchvision's names and
//! parameter counts, checkpoints round-trip and resume bit for bit, data, chart and command line
//! are well-formed, and `--check` (N-rank SyncBatchNorm against 1-rank batch norm) passes.
//!
//! `models.rs`: the architectures; `outputs.rs`: data, chart and command line; `checkpoints.rs`:
//! saving, resuming and refusing damage; `equivalence.rs`: `--check` in f64, uneven batches and
//! reduced precision.

#[allow(dead_code)]
#[path = "../../examples/resnet/check.rs"]
mod check;
#[allow(dead_code)]
#[path = "../../examples/resnet/checkpoint.rs"]
mod checkpoint;
#[allow(dead_code)]
#[path = "../../examples/resnet/cli.rs"]
mod cli;
#[allow(dead_code)]
#[path = "../../examples/resnet/config.rs"]
mod config;

#[path = "../../examples/resnet/data.rs"]
mod data;
#[allow(dead_code)]
#[path = "../../examples/resnet/model.rs"]
mod model;
#[allow(dead_code)]
#[path = "../../examples/resnet/report.rs"]
mod report;
#[allow(dead_code)]
#[path = "../../examples/resnet/state.rs"]
mod state;

#[path = "../../examples/resnet/train.rs"]
mod train;

#[path = "../common/mod.rs"]
mod common;

mod checkpoints;
mod equivalence;
mod models;
mod outputs;

use candle_core::{DType, Device};
use candle_nn::{VarBuilder, VarMap};
use model::{Arch, NormKind, ResNet};

/// Builds `arch` and returns its VarMap (names → variables).
pub fn build(arch: Arch, norm: &NormKind, classes: usize) -> VarMap {
    let vm = VarMap::new();
    let vb = VarBuilder::from_varmap(&vm, DType::F32, &Device::Cpu);
    ResNet::new(arch, classes, norm, vb).unwrap();
    vm
}

pub fn trainable_count(vm: &VarMap) -> usize {
    let data = vm.data().lock().unwrap();
    data.iter()
        .filter(|(k, _)| {
            !(k.ends_with("running_mean")
                || k.ends_with("running_var")
                || k.ends_with("num_batches_tracked"))
        })
        .map(|(_, v)| v.elem_count())
        .sum()
}

/// The example's device for a test device (thread ranks on the CPU, or sharing GPU 0).
pub fn device_kind(dev: &Device) -> train::DeviceKind {
    if dev.is_cuda() {
        train::DeviceKind::Cuda
    } else {
        train::DeviceKind::Cpu
    }
}
