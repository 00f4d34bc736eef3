//! The sharded 2-layer MLP of `tests/parallel.rs` (thread ranks) and `tests/nccl.rs` (NCCL
//! ranks): Column(8 → 4·W) → ReLU → Row(4·W → 5) over W ranks against the unsharded MLP in one
//! process with candle autograd, on the same global input of 2·W rows, in f64. Also side by side
//! with `DataParallel`: D replicas of the W-rank MLP, each on its own data, whose gradients are
//! averaged over the replicas against the mean of D unsharded MLPs' gradients.

use std::sync::Arc;

use anyhow::Result;
use candle_core::{DType, Device, Module, Tensor, Var};
use candle_distributed::collective::Collective;
use candle_distributed::parallel::{ColumnParallelLinear, ParallelMode, RowParallelLinear};
use candle_distributed::DataParallel;
use candle_nn::{VarBuilder, VarMap};

use super::{assert_close, cpu, on, randn, tol};

/// The global problem for a world of `world` ranks: weights, biases, input and target.
pub struct Problem {
    world: usize,
    w1: Tensor,
    b1: Tensor,
    w2: Tensor,
    b2: Tensor,
    x: Tensor,
    target: Tensor,
}

/// One rank's results: its output, the gradients of its W1 and W2 shards, of its input, and of
/// the replicated output bias.
pub struct RankOut {
    y: Tensor,
    dw1: Tensor,
    dw2: Tensor,
    dx: Tensor,
    db2: Tensor,
}

/// Seeded weights sized for `world` ranks (hidden width 4·W, 2·W input rows).
pub fn problem(world: usize) -> Problem {
    let (h, rows) = (4 * world, 2 * world);
    Problem {
        world,
        w1: randn(1, &[h, 8], 0.0, 0.5),
        b1: randn(2, &[h], 0.0, 0.5),
        w2: randn(3, &[5, h], 0.0, 0.5),
        b2: randn(4, &[5], 0.0, 0.5),
        x: randn(5, &[rows, 8], 0.0, 1.0),
        target: randn(6, &[rows, 5], 0.0, 1.0),
    }
}

/// The weights of `problem(world)` with replica `replica`'s own input and target (replica 0's
/// are `problem(world)`'s): one data-parallel replica's share of a global batch.
pub fn replica(world: usize, replica: u64) -> Problem {
    let mut p = problem(world);
    p.x = randn(5 + 10 * replica, &[2 * world, 8], 0.0, 1.0);
    p.target = randn(6 + 10 * replica, &[2 * world, 5], 0.0, 1.0);
    p
}

/// Sets variable `name` to this rank's part of `full` along `dim`.
pub fn load_shard(
    vm: &VarMap,
    name: &str,
    full: &Tensor,
    dim: usize,
    c: &Arc<dyn Collective>,
) -> candle_core::Result<()> {
    let n = full.dims()[dim] / c.world_size();
    let part = full.narrow(dim, c.rank() * n, n)?.contiguous()?;
    let data = vm.data().lock().unwrap();
    data[name].set(&part.to_device(data[name].device())?)
}

/// This rank's forward and backward through the parallel layers on `dev`, under the loss
/// `Σ (y − target)²`: replicated in `AllReduce` mode (every rank holds all rows), summed over
/// ranks in `ReduceScatter` mode (each rank holds 2 rows). Either way the objective is the
/// full loss.
pub fn rank(
    p: &Problem,
    mode: ParallelMode,
    c: Arc<dyn Collective>,
    dev: &Device,
) -> Result<RankOut> {
    rank_in(p, mode, c, None, dev)
}

/// As [`rank`], with the layers' collectives on `tp` and a `DataParallel` over `dp` (made
/// before the forward, as a training loop makes it) averaging the weight gradients over the
/// replicas after the backward: tensor and data parallelism side by side.
pub fn rank_data_parallel(
    p: &Problem,
    mode: ParallelMode,
    tp: Arc<dyn Collective>,
    dp: Arc<dyn Collective>,
    dev: &Device,
) -> Result<RankOut> {
    rank_in(p, mode, tp, Some(dp), dev)
}

/// Rank `c` of a world of D·W ranks (`problems`: D replicas of W-rank problems) as
/// tensor-parallel rank `c.rank() % W` of replica `c.rank() / W`: `c` is split into its
/// replica's tensor-parallel group and its data-parallel group (the ranks with its
/// tensor-parallel rank), then [`rank_data_parallel`] runs on the two.
pub fn rank_2d(
    problems: &[Problem],
    mode: ParallelMode,
    c: Arc<dyn Collective>,
    dev: &Device,
) -> Result<RankOut> {
    let w = problems[0].world;
    assert_eq!(c.world_size(), w * problems.len(), "D·W ranks");
    let (d, t) = (c.rank() / w, c.rank() % w);
    let tp = c.split(Some(d as u32), t as u32)?.expect("a color");
    let dp = c.split(Some(t as u32), d as u32)?.expect("a color");
    rank_data_parallel(&problems[d], mode, tp, dp, dev)
}

/// [`rank_2d`]'s results in world-rank order, grouped by replica for [`check_data_parallel`].
pub fn by_replica(outs: Vec<RankOut>, w: usize) -> Vec<Vec<RankOut>> {
    let mut it = outs.into_iter();
    let mut groups = Vec::new();
    loop {
        let g: Vec<_> = it.by_ref().take(w).collect();
        if g.is_empty() {
            return groups;
        }
        groups.push(g);
    }
}

fn rank_in(
    p: &Problem,
    mode: ParallelMode,
    c: Arc<dyn Collective>,
    dp: Option<Arc<dyn Collective>>,
    dev: &Device,
) -> Result<RankOut> {
    let vm = VarMap::new();
    let vb = VarBuilder::from_varmap(&vm, DType::F64, dev);
    let h = p.w1.dim(0)?;
    let l1 = ColumnParallelLinear::new(8, h, true, mode, vb.pp("l1"), c.clone())?;
    let l2 = RowParallelLinear::new(h, 5, true, mode, vb.pp("l2"), c.clone())?;
    load_shard(&vm, "l1.weight", &p.w1, 0, &c)?;
    load_shard(&vm, "l1.bias", &p.b1, 0, &c)?;
    load_shard(&vm, "l2.weight", &p.w2, 1, &c)?;
    vm.data().lock().unwrap()["l2.bias"].set(&on(dev, &p.b2))?;
    let dp = dp.map(|d| DataParallel::new(&vm, d)).transpose()?;
    let (xin, tgt) = match mode {
        ParallelMode::AllReduce => (p.x.clone(), p.target.clone()),
        ParallelMode::ReduceScatter => (
            p.x.narrow(0, 2 * c.rank(), 2)?,
            p.target.narrow(0, 2 * c.rank(), 2)?,
        ),
    };
    let (xin, tgt) = (on(dev, &xin), on(dev, &tgt));
    let xr = Var::from_tensor(&xin)?;
    let y = l2.forward(&l1.forward(xr.as_tensor())?.relu()?)?;
    let mut g = (&y - &tgt)?.sqr()?.sum_all()?.backward()?;
    if let Some(dp) = &dp {
        g = dp.sync_gradients(g)?;
    }
    let get = |n: &str| cpu(g.get(vm.data().lock().unwrap()[n].as_tensor()).unwrap());
    Ok(RankOut {
        y: cpu(&y),
        dw1: get("l1.weight"),
        dw2: get("l2.weight"),
        dx: cpu(g.get(xr.as_tensor()).unwrap()),
        db2: get("l2.bias"),
    })
}

/// The MLP `relu(x·W1ᵀ + b1)·W2ᵀ + b2` in one process with candle autograd, under the loss
/// `Σ (y − target)²`: the output and the gradients of W1, W2, x and b2.
fn unsharded(p: &Problem) -> (Tensor, [Tensor; 4]) {
    let var = |t: &Tensor| Var::from_tensor(t).unwrap();
    let (xv, w1v, b1v, w2v, b2v) = (var(&p.x), var(&p.w1), var(&p.b1), var(&p.w2), var(&p.b2));
    let h = xv
        .as_tensor()
        .matmul(&w1v.as_tensor().t().unwrap())
        .unwrap()
        .broadcast_add(b1v.as_tensor())
        .unwrap()
        .relu()
        .unwrap();
    let y = h
        .matmul(&w2v.as_tensor().t().unwrap())
        .unwrap()
        .broadcast_add(b2v.as_tensor())
        .unwrap();
    let loss = (&y - &p.target).unwrap().sqr().unwrap().sum_all().unwrap();
    let g = loss.backward().unwrap();
    let want = [
        g.get(w1v.as_tensor()).unwrap().clone(),
        g.get(w2v.as_tensor()).unwrap().clone(),
        g.get(xv.as_tensor()).unwrap().clone(),
        g.get(b2v.as_tensor()).unwrap().clone(),
    ];
    (y, want)
}

/// Every rank's results (in rank order) against the unsharded MLP: outputs, the input
/// gradient, and every weight gradient (shards gathered = full).
pub fn check(p: &Problem, mode: ParallelMode, outs: &[RankOut]) {
    let (y, want) = unsharded(p);
    check_against(p, mode, outs, &y, &want, "");
}

/// `outs[d]`: replica `d`'s ranks (in tensor-parallel rank order) of
/// [`rank_data_parallel`] on `problems[d]`: each replica's outputs and input gradient against
/// its own unsharded MLP, its weight gradients against the mean over the replicas.
pub fn check_data_parallel(problems: &[Problem], mode: ParallelMode, outs: &[Vec<RankOut>]) {
    assert_eq!(outs.len(), problems.len(), "one result per replica");
    let all: Vec<_> = problems.iter().map(unsharded).collect();
    let mean = |i: usize| {
        let sum = all
            .iter()
            .skip(1)
            .fold(all[0].1[i].clone(), |acc, (_, w)| (acc + &w[i]).unwrap());
        (sum / all.len() as f64).unwrap()
    };
    let (dw1, dw2, db2) = (mean(0), mean(1), mean(3));
    for (d, ((p, (y, want)), outs)) in problems.iter().zip(&all).zip(outs).enumerate() {
        let want = [dw1.clone(), dw2.clone(), want[2].clone(), db2.clone()];
        check_against(
            p,
            mode,
            outs,
            y,
            &want,
            &format!(", replica {d} of {}", problems.len()),
        );
    }
}

fn check_against(
    p: &Problem,
    mode: ParallelMode,
    outs: &[RankOut],
    y: &Tensor,
    want: &[Tensor; 4],
    label: &str,
) {
    assert_eq!(outs.len(), p.world, "one result per rank");
    let what = format!("{mode:?} over {} ranks{label}", p.world);
    let cat = |f: fn(&RankOut) -> &Tensor, dim| {
        Tensor::cat(&outs.iter().map(f).collect::<Vec<_>>(), dim).unwrap()
    };
    let (y_all, dx) = match mode {
        ParallelMode::AllReduce => (outs[0].y.clone(), outs[0].dx.clone()),
        ParallelMode::ReduceScatter => (cat(|o| &o.y, 0), cat(|o| &o.dx, 0)),
    };
    assert_close(&format!("{what} output"), &y_all, y, tol::F64);
    assert_close(
        &format!("{what} dW1"),
        &cat(|o| &o.dw1, 0),
        &want[0],
        tol::F64,
    );
    assert_close(
        &format!("{what} dW2"),
        &cat(|o| &o.dw2, 1),
        &want[1],
        tol::F64,
    );
    assert_close(&format!("{what} dx"), &dx, &want[2], tol::F64);
    // The replicated output bias gets the full gradient on every rank, in both modes.
    for (r, o) in outs.iter().enumerate() {
        assert_close(&format!("{what} rank {r} db2"), &o.db2, &want[3], tol::F64);
    }
}
