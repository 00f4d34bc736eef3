//! How many tensors one layer call creates. Every candle op (a kernel launch on a GPU, a pass
//! and an allocation on the CPU) and every view makes a tensor with a fresh id from one global
//! counter, so the difference between the ids of two marker tensors made around a call counts
//! them. The CUDA path makes the same candle calls as the CPU path measured here (the ops
//! dispatch on the storage inside them), so these are the GPU path's per-call counts too. One
//! test in its own binary: no other thread makes tensors meanwhile.

mod common;

use candle_core::{DType, Device, Tensor};
use candle_distributed::collective::{AllReduce, ReduceOp, ThreadGroup};
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

/// A training forward of an affine layer with running statistics (after its first step, which
/// also makes the zero shift) creates 13 tensors, of which 3 are computed:
/// - `bn_stats` (1), then the all-reduce (none at world size 1; a backend's own on more);
/// - `bn_finalize`, which also updates `running_mean`, `running_var` and
///   `num_batches_tracked` in place (1), and views of its rows: the next shift, and the mean,
///   invstd and count the normalisation keeps for its backward;
/// - the output (1); `γ` and `β` reach the op as they are (their dtype is already the
///   arithmetic one), not stacked.
///
/// Before the finalize pass updated the running statistics it was 36: the blend, casts,
/// copies and `num_batches_tracked` upload were candle ops of their own, each a kernel on a
/// GPU. Stacking `[γ; β]` into one input of the op made it 15 (the stack a copy, a kernel on a
/// GPU), until the op took them as two inputs.
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
        bn.forward_t(&x, true)?;
        let nbt = bn.num_batches_tracked();
        let forward = created(|| {
            bn.forward_t(&x, true).unwrap();
        });
        assert_eq!(forward, 13, "tensors created by one training forward");
        assert_eq!(
            bn.num_batches_tracked(),
            nbt + 1,
            "the measured step counted"
        );
        let sums = Tensor::zeros((3, 8), DType::F64, &Device::Cpu)?;
        let given = [sums.clone()];
        let reduce = created(|| {
            bn.comm()
                .all_reduce_with(&given, AllReduce::new(ReduceOp::Sum).in_place())
                .unwrap();
        });
        assert_eq!(
            reduce, 0,
            "a world-size-1 all-reduce in place makes no tensor"
        );
        let reduce = created(|| {
            bn.comm().all_reduce(&sums, ReduceOp::Sum).unwrap();
        });
        assert_eq!(
            reduce, 0,
            "nor one of a tensor that is no variable's (a variable's is copied)"
        );
        Ok(())
    })
    .unwrap();
}
