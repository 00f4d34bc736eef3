//! A contrastive loss over all-gathered features (the reason `parallel::all_gather` is
//! differentiable), trained with data-parallel gradient averaging, against one process on the
//! whole batch.

mod common;

use candle_core::{DType, Device, Tensor, Var};
use candle_distributed::parallel;
use candle_distributed::DataParallel;
use candle_nn::{Optimizer, VarMap, SGD};
use common::*;

/// InfoNCE: 4 ranks embed their 3 pairs, all-gather the embeddings, compute the same global loss
/// and average gradients with DataParallel: the steps equal one process on the 12 pairs.
fn contrastive_loss_over_gathered_features_matches_one_process(dev: &Device) -> anyhow::Result<()> {
    let a = randn(11, &[12, 6], 0.0, 1.0);
    let b = (&a + randn(12, &[12, 6], 0.0, 0.3)).unwrap();
    let w0 = randn(13, &[4, 6], 0.0, 0.5);
    let info_nce = |za: &Tensor, zb: &Tensor| -> candle_core::Result<Tensor> {
        let logits = (za.matmul(&zb.t()?)? / 0.5)?;
        let labels = Tensor::arange(0u32, za.dim(0)? as u32, za.device())?;
        candle_nn::loss::cross_entropy(&logits, &labels)
    };
    const STEPS: usize = 3;
    let dist = run_ranks_on(4, dev, |c| {
        let vm = VarMap::new();
        let w = vm.get((4, 6), "w", candle_nn::Init::Const(0.0), DType::F64, dev)?;
        vm.data().lock().unwrap()["w"].set(&on(dev, &w0))?;
        let dp = DataParallel::new(&vm, c.clone())?;
        let mut opt = SGD::new(dp.trainable(), 0.5)?;
        let (ar, br) = (a.narrow(0, 3 * c.rank(), 3)?, b.narrow(0, 3 * c.rank(), 3)?);
        let (ar, br) = (on(dev, &ar), on(dev, &br));
        for _ in 0..STEPS {
            let za = parallel::all_gather(&ar.matmul(&w.t()?)?, &c, 0)?;
            let zb = parallel::all_gather(&br.matmul(&w.t()?)?, &c, 0)?;
            let loss = info_nce(&za, &zb)?;
            opt.step(&dp.sync_gradients(loss.backward()?)?)?;
        }
        Ok(cpu(&w.copy()?))
    });
    let w = Var::from_tensor(&w0).unwrap();
    let mut opt = SGD::new(vec![w.clone()], 0.5).unwrap();
    for _ in 0..STEPS {
        let loss = info_nce(
            &a.matmul(&w.as_tensor().t().unwrap()).unwrap(),
            &b.matmul(&w.as_tensor().t().unwrap()).unwrap(),
        )
        .unwrap();
        opt.step(&loss.backward().unwrap()).unwrap();
    }
    for (r, got) in dist.iter().enumerate() {
        assert_close(&format!("rank {r} weights"), got, w.as_tensor(), tol::F64);
    }
    Ok(())
}

device_tests!(contrastive_loss_over_gathered_features_matches_one_process);
