//! `SyncBatchNorm` where candle code had `candle_nn::BatchNorm`: the constructor takes what
//! `candle_nn::batch_norm` takes, the layer is `Clone` (one layer, shared) and `Debug`, and it
//! converts back to candle's layer with the same eval output.

mod common;

use candle_core::{DType, Device, Tensor};
use candle_distributed::collective::ThreadGroup;
use candle_distributed::{sync_batch_norm, ChannelLayout, SyncBatchNormConfig};
use candle_nn::{BatchNormConfig, ModuleT, VarBuilder, VarMap};
use common::randn;

/// An `f64` eps, a `candle_nn::BatchNormConfig` and our own config are all accepted, with
/// candle's meaning.
#[test]
fn the_constructor_takes_what_candles_takes() -> anyhow::Result<()> {
    let comm = ThreadGroup::new(1)?.remove(0);
    let vm = VarMap::new();
    let vb = VarBuilder::from_varmap(&vm, DType::F32, &Device::Cpu);
    let a = sync_batch_norm(3, 1e-3, vb.pp("a"), comm.clone())?;
    assert_eq!(a.config().eps, 1e-3);
    let cfg = BatchNormConfig {
        eps: 1e-4,
        momentum: 0.2,
        affine: false,
        ..Default::default()
    };
    let b = sync_batch_norm(3, cfg, vb.pp("b"), comm.clone())?;
    assert_eq!(
        (b.config().eps, b.config().momentum, b.config().affine),
        (1e-4, Some(0.2), false)
    );
    assert!(b.weight().is_none());
    let c = sync_batch_norm(
        3,
        SyncBatchNormConfig::default().with_fuse_relu(true),
        vb.pp("c"),
        comm,
    )?;
    assert!(c.config().fuse_relu);
    assert!(format!("{c:?}").contains("SyncBatchNorm"));
    Ok(())
}

/// A clone is the same layer: training through the clone moves the original's running
/// statistics, `num_batches_tracked` and shift, and both give the same eval output.
#[test]
fn a_clone_is_the_same_layer() -> anyhow::Result<()> {
    let outs = ThreadGroup::run(2, |comm| {
        let vm = VarMap::new();
        let vb = VarBuilder::from_varmap(&vm, DType::F32, &Device::Cpu);
        let bn = sync_batch_norm(4, 1e-5, vb, comm.clone())?;
        let copy = bn.clone();
        let x = randn(comm.rank() as u64 + 3, &[6, 4, 3, 3], 2.0, 1.5).to_dtype(DType::F32)?;
        copy.forward_t(&x, true)?;
        copy.forward_t(&x, true)?;
        let same = (bn.forward_t(&x, false)? - copy.forward_t(&x, false)?)?
            .abs()?
            .max_all()?
            .to_scalar::<f32>()?;
        let mean = bn.running_mean().unwrap().to_vec1::<f32>()?;
        Ok((bn.num_batches_tracked(), bn.shift().is_some(), same, mean))
    })?;
    for (rank, (tracked, shifted, diff, mean)) in outs.iter().enumerate() {
        assert_eq!((*tracked, *shifted, *diff), (2, true, 0.0), "rank {rank}");
        // The inputs' mean is 2: the running mean moved away from 0 towards it.
        assert!(mean.iter().all(|&m| m > 0.2), "rank {rank}: {mean:?}");
    }
    Ok(())
}

/// After a few synchronized training steps (so that the running statistics are not their
/// initial values), candle's layer made by `to_batch_norm` gives the same eval output as ours
/// within 2e-6 relative (f32; the two compute in another order), with and without the affine
/// parameters and with the fused ReLU applied after candle's layer; `TryFrom` gives the same.
/// A layer without running statistics and a channels-last one are refused, naming why.
#[test]
fn the_candle_batch_norm_gives_the_same_eval_output() -> anyhow::Result<()> {
    let configs = [
        SyncBatchNormConfig::default(),
        SyncBatchNormConfig::default().with_affine(false),
        SyncBatchNormConfig::default()
            .with_fuse_relu(true)
            .with_momentum(None),
    ];
    for cfg in configs {
        ThreadGroup::run(2, |comm| {
            let vm = VarMap::new();
            let vb = VarBuilder::from_varmap(&vm, DType::F32, &Device::Cpu);
            let bn = sync_batch_norm(5, cfg, vb, comm.clone())?;
            if let (Some(w), Some(b)) = (bn.weight(), bn.bias()) {
                // Not the initial 1 and 0, so that a swapped or missing parameter shows.
                let data = vm.data().lock().unwrap();
                for (seed, name) in [(1, "weight"), (2, "bias")] {
                    let t = randn(seed, &[5], 0.5, 1.0).to_dtype(DType::F32)?;
                    data[name].set(&t)?;
                }
                assert!(w.to_vec1::<f32>()? != b.to_vec1::<f32>()?);
            }
            for step in 0..3u64 {
                let seed = 10 * step + comm.rank() as u64;
                let x = randn(seed, &[7, 5, 4, 4], 3.0, 2.0).to_dtype(DType::F32)?;
                bn.forward_t(&x, true)?;
            }
            let x = randn(99, &[3, 5, 4, 4], 3.0, 2.0).to_dtype(DType::F32)?;
            let ours = bn.forward_t(&x, false)?;
            let candle = bn.to_batch_norm()?;
            let mut theirs = candle.forward_t(&x, false)?;
            if cfg.fuse_relu {
                theirs = theirs.relu()?;
            }
            let scale = ours.abs()?.max_all()?.to_scalar::<f32>()?;
            let diff = (&ours - &theirs)?.abs()?.max_all()?.to_scalar::<f32>()?;
            assert!(
                diff <= 2e-6 * scale,
                "{cfg:?}: max difference {diff}, scale {scale}"
            );
            let again = candle_nn::BatchNorm::try_from(&bn)?.forward_t(&x, false)?;
            let again = if cfg.fuse_relu { again.relu()? } else { again };
            let same = (&again - &theirs)?.abs()?.max_all()?.to_scalar::<f32>()?;
            assert_eq!(same, 0.0, "{cfg:?}: TryFrom");
            Ok(())
        })?;
    }
    let comm = ThreadGroup::new(1)?.remove(0);
    let vb = VarBuilder::zeros(DType::F32, &Device::Cpu);
    let no_stats = SyncBatchNormConfig::default().with_track_running_stats(false);
    let e = sync_batch_norm(3, no_stats, vb.clone(), comm.clone())?
        .to_batch_norm()
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("to_batch_norm") && e.contains("track_running_stats"),
        "{e}"
    );
    let nhwc = SyncBatchNormConfig::default().with_layout(ChannelLayout::ChannelsLast);
    let e = sync_batch_norm(3, nhwc, vb, comm)?
        .to_batch_norm()
        .unwrap_err()
        .to_string();
    assert!(e.contains("channels-last") && e.contains("permute"), "{e}");
    Ok(())
}

/// One model definition for both kinds of norm (`NormFactory`): a model trained with
/// synchronized norms on 2 ranks, its variables loaded into the same definition made with
/// `NormFactory::Local` (candle-nn's layer), gives the same eval output within 2e-6 of its
/// largest value; the same variable names either way; what candle-nn's layer cannot do is
/// refused by name.
#[test]
fn one_model_definition_serves_both_norms() -> anyhow::Result<()> {
    use candle_distributed::batch_norm::{Norm, NormFactory};
    fn model(norms: &NormFactory, vb: VarBuilder) -> candle_core::Result<(Norm, Norm)> {
        Ok((
            norms.make(5, 1e-5, vb.pp("bn1"))?,
            norms.make(5, 1e-5, vb.pp("bn2"))?,
        ))
    }
    fn run((a, b): &(Norm, Norm), x: &Tensor, train: bool) -> candle_core::Result<Tensor> {
        b.forward_t(&(a.forward_t(x, train)? * 2.0)?, train)
    }
    let x = randn(99, &[3, 5, 4, 4], 3.0, 2.0).to_dtype(DType::F32)?;
    let trained = ThreadGroup::run(2, |comm| {
        let vm = VarMap::new();
        let m = model(
            &NormFactory::Sync(comm.clone()),
            VarBuilder::from_varmap(&vm, DType::F32, &Device::Cpu),
        )?;
        for step in 0..3u64 {
            let seed = 10 * step + comm.rank() as u64;
            run(
                &m,
                &randn(seed, &[7, 5, 4, 4], 3.0, 2.0).to_dtype(DType::F32)?,
                true,
            )?;
        }
        Ok((common::training::snapshot(&vm), run(&m, &x, false)?))
    })?;
    let (vars, ours) = trained[0].clone();
    let vm = VarMap::new();
    let local = model(
        &NormFactory::Local,
        VarBuilder::from_varmap(&vm, DType::F32, &Device::Cpu),
    )?;
    {
        let data = vm.data().lock().unwrap();
        for (name, v) in data.iter() {
            let t = &vars
                .iter()
                .find(|(n, _)| n == name)
                .unwrap_or_else(|| panic!("{name} not in the synchronized model"))
                .1;
            v.set(t)?;
        }
        let mut names: Vec<&String> = data.keys().collect();
        names.sort();
        assert_eq!(
            names,
            [
                "bn1.bias",
                "bn1.running_mean",
                "bn1.running_var",
                "bn1.weight",
                "bn2.bias",
                "bn2.running_mean",
                "bn2.running_var",
                "bn2.weight"
            ]
        );
    }
    assert!(matches!(local.0, Norm::Local(_)));
    let theirs = run(&local, &x, false)?;
    let scale = ours.abs()?.max_all()?.to_scalar::<f32>()?;
    let diff = (&ours - &theirs)?.abs()?.max_all()?.to_scalar::<f32>()?;
    assert!(diff <= 2e-6 * scale, "max difference {diff}, scale {scale}");
    let vb = VarBuilder::from_varmap(&vm, DType::F32, &Device::Cpu);
    let e = NormFactory::Local
        .make(
            5,
            SyncBatchNormConfig::default().with_fuse_relu(true),
            vb.pp("bn3"),
        )
        .unwrap_err()
        .to_string();
    assert!(e.contains("does not support a fused ReLU"), "{e}");
    Ok(())
}
