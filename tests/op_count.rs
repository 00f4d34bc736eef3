//! How many tensors one layer call creates: every candle op (a kernel on a GPU, a pass and an
//! allocation on the CPU) and every view makes a tensor with a fresh id from one global
//! counter, so the difference between the ids of two marker tensors made around a call
//! counts them. The CUDA path performs the same candle calls as the CPU path measured here
//! (the ops dispatch on the storage inside), so this is the per-call op count of the GPU
//! path too. One test in its own binary: no other thread makes tensors meanwhile.

mod common;

use candle_core::{DType, Device, Tensor};
use candle_distributed::collective::ThreadGroup;
use candle_distributed::SyncBatchNormConfig;
use candle_nn::ModuleT;

/// The numeric id of a tensor (`TensorId` prints as `TensorId(n)`).
fn id(t: &Tensor) -> usize {
    let s = format!("{:?}", t.id());
    s.trim_start_matches("TensorId(")
        .trim_end_matches(')')
        .parse()
        .unwrap()
}

/// Tensors created by `f`, not counting the two markers.
fn created(f: impl FnOnce()) -> usize {
    let dev = Device::Cpu;
    let before = id(&Tensor::zeros(1, DType::F32, &dev).unwrap());
    f();
    let after = id(&Tensor::zeros(1, DType::F32, &dev).unwrap());
    after - before - 1
}

#[test]
fn a_training_forward_creates_a_handful_of_tensors() {
    ThreadGroup::run(1, |comm| {
        let (bn, _vm) = common::layer(
            8,
            SyncBatchNormConfig::default(),
            comm,
            None,
            DType::F32,
            &Device::Cpu,
        );
        let x = common::randn(1, &[4, 8, 3, 3], 1.0, 2.0);
        // The first step makes the zero shift.
        bn.forward_t(&x, true)?;
        let fwd = created(|| {
            bn.forward_t(&x, true).unwrap();
        });
        let y = bn.forward_t(&x, true)?;
        let loss = y.sum_all()?;
        let bwd = created(|| {
            loss.backward().unwrap();
        });
        let eval = created(|| {
            bn.forward_t(&x, false).unwrap();
        });
        eprintln!("forward {fwd}, backward {bwd}, eval {eval}");
        Ok(())
    })
    .unwrap();
}
