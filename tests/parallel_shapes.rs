//! The tensor-parallel layers' shapes and refusals on thread ranks: gathered column shards,
//! uneven shards, and bad inputs named with their shapes (the numerics are `tests/parallel.rs`).

mod common;

use std::sync::Arc;

use candle_core::{DType, Device, Module, Tensor};
use candle_distributed::collective::Collective;
use candle_distributed::parallel::{self, gather_features, ColumnParallelLinear, ParallelMode};
use candle_nn::{VarBuilder, VarMap};
use common::*;

#[test]
fn gather_features_reassembles_column_shards() {
    let outs = run_ranks(2, |c| {
        let x = Tensor::new(&[[1.0f64, 2.0]], &Device::Cpu)?;
        let y = column2(&c)?.forward(&x)?;
        Ok(gather_features(&y, &c)?.dims().to_vec())
    });
    assert_eq!(outs, vec![vec![1, 4]; 2]);
}

fn column2(c: &Arc<dyn Collective>) -> candle_core::Result<ColumnParallelLinear> {
    let vm = VarMap::new();
    ColumnParallelLinear::new(
        2,
        4,
        false,
        ParallelMode::AllReduce,
        VarBuilder::from_varmap(&vm, DType::F64, &Device::Cpu),
        c.clone(),
    )
}

#[test]
fn uneven_shards_are_refused() {
    let errs = run_ranks(3, |c| {
        let vm = VarMap::new();
        let vb = VarBuilder::from_varmap(&vm, DType::F64, &Device::Cpu);
        Ok(
            ColumnParallelLinear::new(2, 4, false, ParallelMode::AllReduce, vb, c.clone())
                .unwrap_err()
                .to_string(),
        )
    });
    assert!(
        errs[0].contains("4 features do not split evenly over 3 ranks"),
        "{}",
        errs[0]
    );
}

/// A scalar or a wrong feature count is an error naming the layer and the shape (a scalar was
/// a panic); an out-of-range dimension is named as such (it was reported as "size 0 ... not a
/// multiple of the world size").
#[test]
fn bad_inputs_are_named() {
    let errs = run_ranks(2, |c| {
        let layer = column2(&c)?;
        let scalar = Tensor::new(1.0f64, &Device::Cpu)?;
        let three = Tensor::new(&[[1.0f64, 2.0, 3.0]], &Device::Cpu)?;
        let matrix = Tensor::new(&[[1.0f64, 2.0], [3.0, 4.0]], &Device::Cpu)?;
        Ok([
            layer.forward(&scalar).unwrap_err().to_string(),
            layer.forward(&three).unwrap_err().to_string(),
            parallel::scatter_to_parallel(&matrix, &c, 2)
                .unwrap_err()
                .to_string(),
        ])
    });
    for e in &errs {
        assert!(
            e[0].contains("ColumnParallelLinear: the input [] does not end in the layer's 2"),
            "{}",
            e[0]
        );
        assert!(e[1].contains("the input [1, 3] does not end"), "{}", e[1]);
        assert!(
            e[2].contains("dimension 2 is out of range for [2, 2]"),
            "{}",
            e[2]
        );
    }
}
