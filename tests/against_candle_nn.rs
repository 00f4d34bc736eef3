//! World size 1 against `candle_nn::BatchNorm`: training forward, running statistics over
//! several steps, eval forward; plus channels-last equals the permuted NCHW result.

mod common;

use candle_core::{DType, Device, Tensor, Var};
use candle_distributed::collective::ThreadGroup;
use candle_distributed::SyncBatchNormConfig;
use candle_nn::{BatchNormConfig, ModuleT, VarBuilder, VarMap};
use common::*;

/// candle-nn computes in f32 with a different summation order.
const TOL_F32: f64 = 2e-5;
/// The two layouts sum in different orders; f64 rounding only.
const TOL_F64_LAYOUT: f64 = 1e-12;

#[test]
fn world_size_one_matches_candle_nn_batch_norm() -> anyhow::Result<()> {
    let comm = ThreadGroup::new(1)?.remove(0);
    let c = 8;
    // Non-trivial γ and β in both layers.
    let params = Params::random(21, c);
    let with_params = || {
        let vm = VarMap::new();
        let mut data = vm.data().lock().unwrap();
        for (name, v) in [("weight", &params.weight), ("bias", &params.bias)] {
            let t = Tensor::new(v.as_slice(), &Device::Cpu).and_then(|t| t.to_dtype(DType::F32));
            data.insert(name.to_string(), Var::from_tensor(&t.unwrap()).unwrap());
        }
        drop(data);
        vm
    };
    let vm_ref = with_params();
    let reference = candle_nn::batch_norm(
        c,
        BatchNormConfig {
            momentum: 0.1,
            ..Default::default()
        },
        VarBuilder::from_varmap(&vm_ref, DType::F32, &Device::Cpu),
    )?;
    let vm = with_params();
    let vb = VarBuilder::from_varmap(&vm, DType::F32, &Device::Cpu);
    let bn = candle_distributed::sync_batch_norm(c, BatchNormConfig::default(), vb, comm)?;
    for step in 0..4u64 {
        let x = randn(step, &[4, c, 5, 3], 1.5, 2.0).to_dtype(DType::F32)?;
        assert_close(
            &format!("train output step {step}"),
            &bn.forward_t(&x, true)?,
            &reference.forward_t(&x, true)?,
            TOL_F32,
        );
        assert_close(
            "running_mean",
            bn.running_mean().unwrap(),
            reference.running_mean(),
            TOL_F32,
        );
        assert_close(
            "running_var",
            bn.running_var().unwrap(),
            reference.running_var(),
            TOL_F32,
        );
    }
    assert_eq!(bn.num_batches_tracked(), 4);
    let x = randn(77, &[3, c, 2, 2], -1.0, 0.5).to_dtype(DType::F32)?;
    assert_close(
        "eval output",
        &bn.forward_t(&x, false)?,
        &reference.forward_t(&x, false)?,
        TOL_F32,
    );
    // The running statistics live in the VarMap under PyTorch's names.
    let data = vm.data().lock().unwrap();
    for name in [
        "weight",
        "bias",
        "running_mean",
        "running_var",
        "num_batches_tracked",
    ] {
        assert!(data.contains_key(name), "VarMap lacks {name}");
    }
    assert_eq!(
        data["num_batches_tracked"].as_tensor().to_scalar::<i64>()?,
        4
    );
    Ok(())
}

#[test]
fn channels_last_equals_permuted_channels_first() -> anyhow::Result<()> {
    let c = 5;
    let x = randn(3, &[4, c, 3, 6], 0.5, 1.0);
    let z = randn(4, &[4, c, 3, 6], 0.0, 1.0);
    let w = randn(8, &[4, c, 3, 6], 0.0, 1.0);
    let params = Params::random(9, c);
    let outs = run_ranks(1, |comm| {
        let mut ys = Vec::new();
        for cl in [false, true] {
            let cfg = SyncBatchNormConfig::default()
                .with_layout(layout_of(cl))
                .with_fuse_relu(true);
            let (bn, _) = layer(
                c,
                cfg,
                comm.clone(),
                Some(&params),
                DType::F64,
                &Device::Cpu,
            );
            let (xi, zi) = if cl {
                (to_channels_last(&x), to_channels_last(&z))
            } else {
                (x.clone(), z.clone())
            };
            let (xv, zv) = (Var::from_tensor(&xi)?, Var::from_tensor(&zi)?);
            let y = bn.forward_residual(xv.as_tensor(), zv.as_tensor(), true)?;
            // A loss that weights every element differently, in the NCHW order.
            let wl = if cl { to_channels_last(&w) } else { w.clone() };
            let g = (&y * &wl)?.sum_all()?.backward()?;
            let back = |t: &Tensor| if cl { to_channels_first(t) } else { t.clone() };
            ys.push(back(&y));
            ys.push(back(g.get(xv.as_tensor()).unwrap()));
            ys.push(back(g.get(zv.as_tensor()).unwrap()));
            ys.push(bn.running_mean().unwrap().clone());
            ys.push(bn.running_var().unwrap().clone());
        }
        Ok(ys)
    });
    let ys = &outs[0];
    for (i, what) in ["output", "dx", "dz", "running_mean", "running_var"]
        .iter()
        .enumerate()
    {
        assert_close(what, &ys[i], &ys[i + 5], TOL_F64_LAYOUT);
    }
    Ok(())
}

#[test]
fn loads_a_checkpoint_without_num_batches_tracked() -> anyhow::Result<()> {
    let c = 3;
    let mut ts = std::collections::HashMap::new();
    ts.insert(
        "bn.weight".to_string(),
        Tensor::new(&[2f32, 3., 4.], &Device::Cpu)?,
    );
    ts.insert(
        "bn.bias".to_string(),
        Tensor::new(&[0.5f32, 0., -0.5], &Device::Cpu)?,
    );
    ts.insert(
        "bn.running_mean".to_string(),
        Tensor::new(&[1f32, 2., 3.], &Device::Cpu)?,
    );
    ts.insert(
        "bn.running_var".to_string(),
        Tensor::new(&[4f32, 9., 16.], &Device::Cpu)?,
    );
    let vb = VarBuilder::from_tensors(ts, DType::F32, &Device::Cpu);
    let comm = ThreadGroup::new(1)?.remove(0);
    let cfg = SyncBatchNormConfig::default().with_eps(0.0);
    let bn = candle_distributed::sync_batch_norm(c, cfg, vb.pp("bn"), comm)?;
    assert_eq!(bn.num_batches_tracked(), 0);
    let x = Tensor::new(&[[3f32, 5., 7.]], &Device::Cpu)?;
    // (x − mean)/sqrt(var)·γ + β = [1·2 + 0.5, 1·3, 1·4 − 0.5]
    let y = bn.forward_t(&x, false)?;
    assert_close(
        "eval from checkpoint",
        &y,
        &Tensor::new(&[[2.5f32, 3., 3.5]], &Device::Cpu)?,
        1e-6,
    );
    Ok(())
}
