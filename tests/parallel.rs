//! Differentiable collectives and tensor-parallel layers on thread ranks: central finite
//! differences of the stated objective for every op and both layers in both modes; a sharded
//! 2-layer MLP against the unsharded one; asynchronous collectives making progress while the
//! caller does something else. (A contrastive loss over all-gathered features:
//! `tests/contrastive.rs`.)

mod common;

use std::sync::{mpsc, Arc, Mutex};
use std::time::Duration;

use candle_core::{DType, Device, Module, Tensor, Var};
use candle_distributed::collective::{Collective, ReduceOp, ThreadGroup};
use candle_distributed::parallel::{self, ColumnParallelLinear, ParallelMode, RowParallelLinear};
use candle_nn::{VarBuilder, VarMap};
use common::mlp::load_shard;
use common::*;

/// What a rank computes from its input: the op under test.
type Forward = dyn Fn(&Arc<dyn Collective>, &Tensor) -> candle_core::Result<Tensor> + Sync;

/// The objective: `Σ_r Σ(y_r·w_r)` (sum of per-rank losses), or `Σ(y·w)` once for a replicated
/// loss (every rank's `y` and `w` identical).
#[derive(Clone, Copy, PartialEq)]
enum Objective {
    SumOverRanks,
    Replicated,
}

/// Weights of the objective for rank `r` and an output shape.
fn weights(r: usize, dims: &[usize], obj: Objective) -> Tensor {
    let seed = if obj == Objective::Replicated {
        900
    } else {
        900 + r as u64
    };
    randn(seed, dims, 0.0, 1.0)
}

/// The objective's value for per-rank inputs `xs` (on the CPU), computed on `dev`.
fn objective(world: usize, xs: &[Tensor], f: &Forward, obj: Objective, dev: &Device) -> f64 {
    let vals = run_ranks_on(world, dev, |comm| {
        let y = f(&comm, &on(dev, &xs[comm.rank()]))?;
        let w = on(dev, &weights(comm.rank(), y.dims(), obj));
        Ok(weighted_sum(&y, &w)?.to_scalar::<f64>()?)
    });
    match obj {
        Objective::SumOverRanks => vals.iter().sum(),
        Objective::Replicated => vals[0],
    }
}

/// Checks every rank's input gradient on `dev` against central differences.
/// `replicated_input`: the ranks hold one shared input (perturbed on every rank at once).
fn fd_check(
    what: &str,
    world: usize,
    xs: Vec<Tensor>,
    f: &Forward,
    obj: Objective,
    replicated_input: bool,
    dev: &Device,
) {
    let grads = run_ranks_on(world, dev, |comm| {
        let x = Var::from_tensor(&on(dev, &xs[comm.rank()]))?;
        let y = f(&comm, x.as_tensor())?;
        let w = on(dev, &weights(comm.rank(), y.dims(), obj));
        let g = weighted_sum(&y, &w)?.backward()?;
        Ok(cpu(g.get(x.as_tensor()).expect("a gradient")))
    });
    let ranks: Vec<usize> = if replicated_input {
        vec![0]
    } else {
        (0..world).collect()
    };
    for q in ranks {
        let n = xs[q].elem_count();
        let flat: Vec<f64> = xs[q].flatten_all().unwrap().to_vec1().unwrap();
        for i in 0..n {
            let shifted = |d: f64| -> Vec<Tensor> {
                let mut v = flat.clone();
                v[i] += d;
                let t = Tensor::from_vec(v, xs[q].dims(), &Device::Cpu).unwrap();
                (0..world)
                    .map(|r| {
                        if r == q || replicated_input {
                            t.clone()
                        } else {
                            xs[r].clone()
                        }
                    })
                    .collect()
            };
            let fd = central_difference(|h| objective(world, &shifted(h), f, obj, dev));
            let got: f64 = grads[q]
                .flatten_all()
                .unwrap()
                .get(i)
                .unwrap()
                .to_scalar()
                .unwrap();
            assert_fd(&format!("{what}: rank {q} element {i}"), got, fd);
        }
    }
}

fn per_rank(world: usize, dims: &[usize], seed: u64) -> Vec<Tensor> {
    (0..world)
        .map(|r| randn(seed + r as u64, dims, 0.0, 1.0))
        .collect()
}

fn replicated(world: usize, dims: &[usize], seed: u64) -> Vec<Tensor> {
    vec![randn(seed, dims, 0.0, 1.0); world]
}

fn collectives_match_finite_differences(dev: &Device) -> anyhow::Result<()> {
    let sum = Objective::SumOverRanks;
    // all_gather along dim 1 with unequal sizes (2, 1, 3) per rank.
    let uneven: Vec<Tensor> = (0..3)
        .map(|r| randn(10 + r, &[2, [2, 1, 3][r as usize]], 0.0, 1.0))
        .collect();
    fd_check(
        "all_gather dim 1, unequal",
        3,
        uneven,
        &|c, x| parallel::all_gather(x, c, 1),
        sum,
        false,
        dev,
    );
    fd_check(
        "all_gather dim 0",
        2,
        per_rank(2, &[2, 3], 20),
        &|c, x| parallel::all_gather(x, c, 0),
        sum,
        false,
        dev,
    );
    fd_check(
        "reduce_scatter dim 1",
        2,
        per_rank(2, &[2, 4], 30),
        &|c, x| parallel::reduce_scatter(x, c, 1),
        sum,
        false,
        dev,
    );
    fd_check(
        "all_reduce",
        3,
        per_rank(3, &[2, 2], 40),
        &|c, x| parallel::all_reduce(x, c),
        sum,
        false,
        dev,
    );
    Ok(())
}

/// The tensor-parallel region helpers (copy in, reduce out, scatter in, gather out) against
/// finite differences of the objective their gradient is documented for.
fn parallel_region_helpers_match_finite_differences(dev: &Device) -> anyhow::Result<()> {
    let sum = Objective::SumOverRanks;
    let rep = Objective::Replicated;
    fd_check(
        "copy_to_parallel",
        3,
        replicated(3, &[2, 3], 50),
        &|c, x| parallel::copy_to_parallel(x, c),
        sum,
        true,
        dev,
    );
    fd_check(
        "reduce_from_parallel",
        3,
        per_rank(3, &[2, 3], 60),
        &|c, x| parallel::reduce_from_parallel(x, c),
        rep,
        false,
        dev,
    );
    fd_check(
        "scatter_to_parallel",
        2,
        replicated(2, &[4, 3], 70),
        &|c, x| parallel::scatter_to_parallel(x, c, 0),
        sum,
        true,
        dev,
    );
    fd_check(
        "gather_from_parallel",
        4,
        per_rank(4, &[1, 3], 80),
        &|c, x| parallel::gather_from_parallel(x, c, 0),
        rep,
        false,
        dev,
    );
    Ok(())
}

/// The shard layers on `dev` with weights drawn from one full matrix (same on every run and
/// rank).
fn column(
    c: &Arc<dyn Collective>,
    mode: ParallelMode,
    regather: bool,
    dev: &Device,
) -> candle_core::Result<ColumnParallelLinear> {
    let vm = VarMap::new();
    let layer = ColumnParallelLinear::new(
        3,
        4,
        true,
        mode,
        VarBuilder::from_varmap(&vm, DType::F64, dev),
        c.clone(),
    )?
    .regather_input(regather);
    load_shard(&vm, "weight", &randn(5, &[4, 3], 0.0, 1.0), 0, c)?;
    load_shard(&vm, "bias", &randn(6, &[4], 0.0, 1.0), 0, c)?;
    Ok(layer)
}

fn row(
    c: &Arc<dyn Collective>,
    mode: ParallelMode,
    dev: &Device,
) -> candle_core::Result<RowParallelLinear> {
    let vm = VarMap::new();
    let layer = RowParallelLinear::new(
        4,
        3,
        true,
        mode,
        VarBuilder::from_varmap(&vm, DType::F64, dev),
        c.clone(),
    )?;
    load_shard(&vm, "weight", &randn(7, &[3, 4], 0.0, 1.0), 1, c)?;
    vm.data().lock().unwrap()["bias"].set(&on(dev, &randn(8, &[3], 0.0, 1.0)))?;
    Ok(layer)
}

fn parallel_layers_match_finite_differences(dev: &Device) -> anyhow::Result<()> {
    let sum = Objective::SumOverRanks;
    let rep = Objective::Replicated;
    for regather in [false, true] {
        fd_check(
            "column, all-reduce mode",
            2,
            replicated(2, &[3, 3], 100),
            &move |c, x| column(c, ParallelMode::AllReduce, regather, x.device())?.forward(x),
            sum,
            true,
            dev,
        );
        fd_check(
            "column, reduce-scatter mode",
            2,
            per_rank(2, &[2, 3], 110),
            &move |c, x| column(c, ParallelMode::ReduceScatter, regather, x.device())?.forward(x),
            sum,
            false,
            dev,
        );
    }
    fd_check(
        "row, all-reduce mode",
        2,
        per_rank(2, &[3, 2], 120),
        &|c, x| row(c, ParallelMode::AllReduce, x.device())?.forward(x),
        rep,
        false,
        dev,
    );
    fd_check(
        "row, reduce-scatter mode",
        2,
        per_rank(2, &[4, 2], 130),
        &|c, x| row(c, ParallelMode::ReduceScatter, x.device())?.forward(x),
        sum,
        false,
        dev,
    );
    Ok(())
}

/// Column(8 → 16) → ReLU → Row(16 → 5) over 4 ranks against the unsharded MLP on the same global
/// input (`common::mlp`): outputs, the input gradient, and every weight gradient.
fn sharded_mlp_matches_the_unsharded_one(dev: &Device) -> anyhow::Result<()> {
    let p = mlp::problem(4);
    for mode in [ParallelMode::AllReduce, ParallelMode::ReduceScatter] {
        let outs = run_ranks_on(4, dev, |c| mlp::rank(&p, mode, c, dev));
        mlp::check(&p, mode, &outs);
    }
    Ok(())
}

/// Tensor and data parallelism side by side over 4 ranks: 2 replicas, each the sharded MLP
/// over 2 ranks on its own data, with `DataParallel` over the replicas (`common::mlp`): each
/// replica's outputs and input gradient against its unsharded MLP, the weight gradients
/// against the mean of the two unsharded MLPs'.
fn sharded_mlp_beside_data_parallel(dev: &Device) -> anyhow::Result<()> {
    let ps = [mlp::replica(2, 0), mlp::replica(2, 1)];
    for mode in [ParallelMode::AllReduce, ParallelMode::ReduceScatter] {
        let outs = run_ranks_on(4, dev, |c| mlp::rank_2d(&ps, mode, c, dev));
        mlp::check_data_parallel(&ps, mode, &mlp::by_replica(outs, 2));
    }
    Ok(())
}

/// An async all-reduce returns before the other rank has even called its part: rank 1 only
/// calls after rank 0 reports that its start returned (a blocking start would deadlock into
/// the timeout).
#[test]
fn async_collectives_return_before_the_peers_arrive() {
    let comms = ThreadGroup::with_timeout(2, Duration::from_secs(20)).unwrap();
    let (tx, rx) = mpsc::channel();
    let rx = Mutex::new(rx);
    let outs: Vec<Vec<f32>> = std::thread::scope(|s| {
        let hs: Vec<_> = comms
            .into_iter()
            .map(|c| {
                let tx = tx.clone();
                let rx = &rx;
                s.spawn(move || -> candle_core::Result<Vec<f32>> {
                    let t = Tensor::new(&[c.rank() as f32 + 1.0, 2.0], &Device::Cpu)?;
                    if c.rank() == 0 {
                        let sum =
                            c.start_all_reduce(std::slice::from_ref(&t), ReduceOp::Sum.into())?;
                        let gather = c.all_gather_async(&t.reshape((1, 2))?)?;
                        tx.send(()).unwrap();
                        let g = gather.wait()?.flatten_all()?.to_vec1::<f32>()?;
                        let mut v = sum.wait()?.to_vec1::<f32>()?;
                        v.extend(g);
                        Ok(v)
                    } else {
                        rx.lock().unwrap().recv().unwrap();
                        let mut v = c.all_reduce(&t, ReduceOp::Sum)?.to_vec1::<f32>()?;
                        v.extend(
                            c.all_gather(&t.reshape((1, 2))?)?
                                .flatten_all()?
                                .to_vec1::<f32>()?,
                        );
                        Ok(v)
                    }
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap().unwrap()).collect()
    });
    for o in outs {
        assert_eq!(o, vec![3.0, 4.0, 1.0, 2.0, 2.0, 2.0]);
    }
}

device_tests!(
    collectives_match_finite_differences,
    parallel_region_helpers_match_finite_differences,
    parallel_layers_match_finite_differences,
    sharded_mlp_matches_the_unsharded_one,
    sharded_mlp_beside_data_parallel,
);
