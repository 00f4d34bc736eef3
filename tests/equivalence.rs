//! R thread ranks with unequal (and empty) per-rank batches against single-process batch norm
//! over the concatenated batch: outputs, input gradients, summed parameter gradients, running
//! statistics after several steps, eval outputs; NCHW and NHWC; 2-D to 5-D.

mod common;

use candle_core::{DType, Device, Tensor, Var};
use candle_distributed::SyncBatchNormConfig;
use candle_nn::ModuleT;
use common::*;

const STEPS: usize = 3;

#[derive(Clone)]
struct Case {
    batches: Vec<usize>,
    c: usize,
    spatial: Vec<usize>,
    config: SyncBatchNormConfig,
    residual: bool,
}

impl Case {
    fn new(batches: &[usize], c: usize, spatial: &[usize]) -> Self {
        Self {
            batches: batches.to_vec(),
            c,
            spatial: spatial.to_vec(),
            config: SyncBatchNormConfig::default(),
            residual: false,
        }
    }
    fn dims(&self, n: usize) -> Vec<usize> {
        let mut d = vec![n, self.c];
        d.extend(&self.spatial);
        d
    }
}

struct RankOut {
    y: Vec<Tensor>,
    dx: Tensor,
    dz: Option<Tensor>,
    dw: Option<Tensor>,
    db: Option<Tensor>,
    running: Option<(Vec<f64>, Vec<f64>)>,
    num_batches: u64,
    eval_y: Tensor,
}

/// Global data of one step, channels-first: (x, z, loss weights).
fn step_data(case: &Case, step: usize) -> (Tensor, Tensor, Tensor) {
    let n: usize = case.batches.iter().sum();
    let d = case.dims(n);
    let s = 100 * step as u64;
    (
        randn(s + 1, &d, 2.0, 1.5),
        randn(s + 2, &d, -0.3, 1.0),
        randn(s + 3, &d, 0.1, 1.0),
    )
}

fn run_case(case: &Case, dev: &Device) {
    let params = Params::random(7, case.c);
    let eval_x = randn(999, &case.dims(case.batches.iter().sum()), 1.0, 2.0);
    let outs = run_ranks(case, &params, &eval_x, dev);
    // Reference: one process, concatenated batch.
    let reference = Reference::new(case, &params);
    let (rm, rv) = check_steps(case, &reference, &outs);
    if case.config.track_running_stats {
        check_running(&outs, &rm, &rv);
        check_eval_with_running(case, &params, &eval_x, &outs, (&rm, &rv));
    } else {
        check_eval_with_local(case, &reference, &eval_x, &outs);
    }
}

/// The layer on `case.batches.len()` ranks for `STEPS` training steps, then one eval step on
/// `eval_x`: each rank's outputs, gradients and state.
fn run_ranks(case: &Case, params: &Params, eval_x: &Tensor, dev: &Device) -> Vec<RankOut> {
    let world = case.batches.len();
    let cl = case.config.layout.is_channels_last();
    let to_layout = |t: &Tensor| if cl { to_channels_last(t) } else { t.clone() };
    let from_layout = |t: &Tensor| if cl { to_channels_first(t) } else { t.clone() };
    run_ranks_on(world, dev, |comm| {
        let r = comm.rank();
        let (bn, vm) = layer(case.c, case.config, comm, Some(params), DType::F64, dev);
        let mut ys = Vec::new();
        let mut last = None;
        for step in 0..STEPS {
            let (x, z, wl) = step_data(case, step);
            let (x, z, wl) = [x, z, wl]
                .map(|t| on(dev, &to_layout(&split_batch(&t, &case.batches)[r])))
                .into();
            let xv = Var::from_tensor(&x)?;
            let zv = Var::from_tensor(&z)?;
            let y = if case.residual {
                bn.forward_residual(xv.as_tensor(), zv.as_tensor(), true)?
            } else {
                bn.forward_t(xv.as_tensor(), true)?
            };
            ys.push(from_layout(&cpu(&y)));
            last = Some((xv, zv, y, wl));
        }
        let (xv, zv, y, wl) = last.unwrap();
        let grads = weighted_sum(&y, &wl)?.backward()?;
        let get = |name: &str| grads.get(var(&vm, name).as_tensor()).map(cpu);
        let dx = from_layout(&cpu(grads.get(xv.as_tensor()).expect("dx")));
        let dz = if case.residual {
            Some(from_layout(&cpu(grads.get(zv.as_tensor()).expect("dz"))))
        } else {
            None
        };
        let x_eval = on(dev, &to_layout(&split_batch(eval_x, &case.batches)[r]));
        let z_eval = on(
            dev,
            &to_layout(&split_batch(&step_data(case, 0).1, &case.batches)[r]),
        );
        let eval_y = if case.residual {
            bn.forward_residual(&x_eval, &z_eval, false)?
        } else {
            bn.forward_t(&x_eval, false)?
        };
        Ok(RankOut {
            y: ys,
            dx,
            dz,
            dw: if case.config.affine {
                get("weight")
            } else {
                None
            },
            db: if case.config.affine {
                get("bias")
            } else {
                None
            },
            running: bn.running_mean().map(|m| {
                (
                    m.to_vec1().unwrap(),
                    bn.running_var().unwrap().to_vec1().unwrap(),
                )
            }),
            num_batches: bn.num_batches_tracked(),
            eval_y: from_layout(&cpu(&eval_y)),
        })
    })
}

/// The single-process reference's parameters (variables, for their gradients).
struct Reference {
    w: Var,
    b: Var,
    affine: bool,
}

impl Reference {
    fn new(case: &Case, params: &Params) -> Self {
        Self {
            w: Var::new(params.weight.as_slice(), &candle_core::Device::Cpu).unwrap(),
            b: Var::new(params.bias.as_slice(), &candle_core::Device::Cpu).unwrap(),
            affine: case.config.affine,
        }
    }

    fn wt_bt(&self) -> (Option<&Tensor>, Option<&Tensor>) {
        if self.affine {
            (Some(self.w.as_tensor()), Some(self.b.as_tensor()))
        } else {
            (None, None)
        }
    }
}

/// Every training step's outputs, then the last step's gradients, against the reference on
/// the concatenated batch; returns the reference's running mean and variance.
fn check_steps(case: &Case, reference: &Reference, outs: &[RankOut]) -> (Vec<f64>, Vec<f64>) {
    let eps = case.config.eps;
    let (wt, bt) = reference.wt_bt();
    let (w, b) = (&reference.w, &reference.b);
    let relu = case.config.fuse_relu;
    let (mut rm, mut rv) = (vec![0.0; case.c], vec![1.0; case.c]);
    for step in 0..STEPS {
        let (x, z, wl) = step_data(case, step);
        let xv = Var::from_tensor(&x).unwrap();
        let zv = Var::from_tensor(&z).unwrap();
        let (y, mean, var) = reference_bn(
            xv.as_tensor(),
            wt,
            bt,
            case.residual.then_some(zv.as_tensor()),
            relu,
            eps,
        );
        for (r, (piece, out)) in split_batch(&y, &case.batches).iter().zip(outs).enumerate() {
            assert_close(
                &format!("output, step {step}, rank {r}"),
                &out.y[step],
                piece,
                tol::F64,
            );
        }
        let n = x.elem_count() as f64 / case.c as f64;
        let m = case.config.momentum.unwrap_or(1.0 / (step + 1) as f64);
        let (mean, var): (Vec<f64>, Vec<f64>) = (mean.to_vec1().unwrap(), var.to_vec1().unwrap());
        for j in 0..case.c {
            rm[j] = (1.0 - m) * rm[j] + m * mean[j];
            rv[j] = (1.0 - m) * rv[j] + m * var[j] * n / (n - 1.0);
        }
        if step + 1 < STEPS {
            continue;
        }
        let grads = (y * wl).unwrap().sum_all().unwrap().backward().unwrap();
        let dx = split_batch(grads.get(xv.as_tensor()).unwrap(), &case.batches);
        for (r, out) in outs.iter().enumerate() {
            assert_close(&format!("dx, rank {r}"), &out.dx, &dx[r], tol::F64);
        }
        if case.residual {
            let dz = split_batch(grads.get(zv.as_tensor()).unwrap(), &case.batches);
            for (r, out) in outs.iter().enumerate() {
                assert_close(
                    &format!("dz, rank {r}"),
                    out.dz.as_ref().unwrap(),
                    &dz[r],
                    tol::F64,
                );
            }
        }
        if case.config.affine {
            let sum = |f: &dyn Fn(&RankOut) -> Tensor| {
                outs.iter().map(f).reduce(|a, b| (a + b).unwrap()).unwrap()
            };
            assert_close(
                "Σ_r dγ",
                &sum(&|o| o.dw.clone().unwrap()),
                grads.get(w.as_tensor()).unwrap(),
                tol::F64,
            );
            assert_close(
                "Σ_r dβ",
                &sum(&|o| o.db.clone().unwrap()),
                grads.get(b.as_tensor()).unwrap(),
                tol::F64,
            );
        }
    }
    (rm, rv)
}

/// Running statistics and `num_batches_tracked` on every rank: the reference's, bitwise the
/// same on every rank.
fn check_running(outs: &[RankOut], rm: &[f64], rv: &[f64]) {
    for (r, out) in outs.iter().enumerate() {
        let (m, v) = out.running.as_ref().unwrap();
        assert_eq!(
            out.num_batches, STEPS as u64,
            "num_batches_tracked on rank {r}"
        );
        let t = |v: &[f64]| Tensor::new(v, &candle_core::Device::Cpu).unwrap();
        assert_close(&format!("running_mean rank {r}"), &t(m), &t(rm), tol::F64);
        assert_close(&format!("running_var rank {r}"), &t(v), &t(rv), tol::F64);
        // Every rank holds bitwise the same running statistics.
        assert_eq!(
            out.running, outs[0].running,
            "running stats of rank {r} differ from rank 0"
        );
    }
}

/// Eval with running statistics: normalised with them, no communication.
fn check_eval_with_running(
    case: &Case,
    params: &Params,
    eval_x: &Tensor,
    outs: &[RankOut],
    (rm, rv): (&[f64], &[f64]),
) {
    let (eps, relu) = (case.config.eps, case.config.fuse_relu);
    let bshape: Vec<usize> = (0..eval_x.rank())
        .map(|i| if i == 1 { case.c } else { 1 })
        .collect();
    let col = |v: &[f64]| {
        Tensor::new(v, &candle_core::Device::Cpu)
            .unwrap()
            .reshape(bshape.as_slice())
            .unwrap()
    };
    let sd: Vec<f64> = rv.iter().map(|v| (v + eps).sqrt()).collect();
    let mut y = eval_x
        .broadcast_sub(&col(rm))
        .unwrap()
        .broadcast_div(&col(&sd))
        .unwrap();
    if case.config.affine {
        y = y
            .broadcast_mul(&col(&params.weight))
            .unwrap()
            .broadcast_add(&col(&params.bias))
            .unwrap();
    }
    if case.residual {
        y = (y + step_data(case, 0).1).unwrap();
    }
    if relu {
        y = y.relu().unwrap();
    }
    for (r, (piece, out)) in split_batch(&y, &case.batches).iter().zip(outs).enumerate() {
        assert_close(
            &format!("eval output rank {r}"),
            &out.eval_y,
            piece,
            tol::F64,
        );
    }
}

/// Eval without running statistics: each rank normalises with its own batch statistics.
fn check_eval_with_local(case: &Case, reference: &Reference, eval_x: &Tensor, outs: &[RankOut]) {
    let (eps, relu) = (case.config.eps, case.config.fuse_relu);
    let (wt, bt) = reference.wt_bt();
    let zs = split_batch(&step_data(case, 0).1, &case.batches);
    for (r, (piece, out)) in split_batch(eval_x, &case.batches)
        .iter()
        .zip(outs)
        .enumerate()
    {
        if piece.dim(0).unwrap() == 0 {
            assert_eq!(out.eval_y.dims(), piece.dims());
            continue;
        }
        let (y, _, _) = reference_bn(piece, wt, bt, case.residual.then_some(&zs[r]), relu, eps);
        assert_close(
            &format!("local eval output rank {r}"),
            &out.eval_y,
            &y,
            tol::F64,
        );
    }
}

const BATCHES: [usize; 4] = [3, 5, 0, 4];

fn nchw_4d_momentum(dev: &Device) -> anyhow::Result<()> {
    run_case(&Case::new(&BATCHES, 3, &[4, 5]), dev);
    Ok(())
}

fn nchw_4d_cumulative_average(dev: &Device) -> anyhow::Result<()> {
    let mut c = Case::new(&BATCHES, 3, &[4, 5]);
    c.config.momentum = None;
    run_case(&c, dev);
    Ok(())
}

fn nhwc_4d(dev: &Device) -> anyhow::Result<()> {
    let mut c = Case::new(&BATCHES, 6, &[3, 3]);
    c.config.layout = ChannelLayout::ChannelsLast;
    run_case(&c, dev);
    Ok(())
}

fn nhwc_4d_cumulative_average(dev: &Device) -> anyhow::Result<()> {
    let mut c = Case::new(&BATCHES, 5, &[2, 3]);
    c.config.layout = ChannelLayout::ChannelsLast;
    c.config.momentum = None;
    run_case(&c, dev);
    Ok(())
}

fn two_d(dev: &Device) -> anyhow::Result<()> {
    run_case(&Case::new(&BATCHES, 7, &[]), dev);
    Ok(())
}

fn three_d_nchw_and_nlc(dev: &Device) -> anyhow::Result<()> {
    run_case(&Case::new(&BATCHES, 4, &[9]), dev);
    let mut c = Case::new(&BATCHES, 4, &[9]);
    c.config.layout = ChannelLayout::ChannelsLast;
    run_case(&c, dev);
    Ok(())
}

fn five_d_nchw_and_ndhwc(dev: &Device) -> anyhow::Result<()> {
    run_case(&Case::new(&BATCHES, 2, &[2, 3, 2]), dev);
    let mut c = Case::new(&BATCHES, 3, &[2, 2, 3]);
    c.config.layout = ChannelLayout::ChannelsLast;
    run_case(&c, dev);
    Ok(())
}

fn fused_residual_relu_nchw_and_nhwc(dev: &Device) -> anyhow::Result<()> {
    for cl in [false, true] {
        let mut c = Case::new(&BATCHES, 3, &[4, 4]);
        c.config.fuse_relu = true;
        c.config.layout = layout_of(cl);
        c.residual = true;
        run_case(&c, dev);
    }
    Ok(())
}

fn residual_without_relu_and_relu_without_residual(dev: &Device) -> anyhow::Result<()> {
    let mut c = Case::new(&BATCHES, 3, &[3, 2]);
    c.residual = true;
    run_case(&c, dev);
    let mut c = Case::new(&BATCHES, 3, &[3, 2]);
    c.config.fuse_relu = true;
    run_case(&c, dev);
    Ok(())
}

fn no_affine(dev: &Device) -> anyhow::Result<()> {
    let mut c = Case::new(&BATCHES, 3, &[4, 5]);
    c.config.affine = false;
    run_case(&c, dev);
    Ok(())
}

fn no_running_stats(dev: &Device) -> anyhow::Result<()> {
    let mut c = Case::new(&BATCHES, 3, &[4, 5]);
    c.config.track_running_stats = false;
    run_case(&c, dev);
    Ok(())
}

fn many_ranks_and_one_rank(dev: &Device) -> anyhow::Result<()> {
    run_case(&Case::new(&[2, 1, 3, 0, 2, 4, 1, 1], 3, &[2, 2]), dev);
    run_case(&Case::new(&[6], 3, &[2, 2]), dev);
    Ok(())
}

/// Per-rank batches large enough that each channel's reduction is split over several blocks
/// on a GPU (the "last block sums the partials" path, `launch::reduction`'s grid y > 1), in
/// both layouts: C = 2 channels-first over 64×64, C = 40 channels-last over 16×32 (two
/// column blocks, the second partly empty). The CPU variant runs the same sizes.
fn grid_split_reductions_nchw_and_nhwc(dev: &Device) -> anyhow::Result<()> {
    let split = |n: usize, c: usize, hw: usize, cl: bool| {
        candle_distributed::launch::reduction(n, c, hw, cl).map_or(1, |r| r.launch.grid[1])
    };
    for &n in BATCHES.iter().filter(|&&n| n > 0) {
        assert!(
            split(n, 2, 64 * 64, false) > 1,
            "NCHW, {n} entries: not split"
        );
        assert!(
            split(n, 40, 16 * 32, true) > 1,
            "NHWC, {n} entries: not split"
        );
    }
    run_case(&Case::new(&BATCHES, 2, &[64, 64]), dev);
    let mut c = Case::new(&BATCHES, 40, &[16, 32]);
    c.config.layout = ChannelLayout::ChannelsLast;
    run_case(&c, dev);
    Ok(())
}

/// A channel whose pre-activation is exactly 0 (a constant input, so `x − mean = 0`, and
/// β = 0: a dead channel at initialisation) gets no gradient through the fused ReLU, whose
/// derivative at 0 is 0 as in PyTorch; a live channel beside it does.
fn fused_relu_passes_no_gradient_at_zero(dev: &Device) -> anyhow::Result<()> {
    let params = Params {
        weight: vec![1.0, 1.25],
        bias: vec![0.0, 0.5],
    };
    let grads = run_ranks_on(2, dev, |comm| {
        let r = comm.rank();
        let config = SyncBatchNormConfig::default().with_fuse_relu(true);
        let (bn, vm) = layer(2, config, comm, Some(&params), DType::F32, dev);
        let dead = Tensor::full(3f32, (2 + r, 1, 3), &Device::Cpu)?;
        let live = randn(40 + r as u64, &[2 + r, 1, 3], 1.0, 2.0).to_dtype(DType::F32)?;
        let x = Var::from_tensor(&on(dev, &Tensor::cat(&[&dead, &live], 1)?))?;
        let y = bn.forward_t(x.as_tensor(), true)?;
        let g = y.sum_all()?.backward()?;
        let of = |name: &str| -> anyhow::Result<Vec<f32>> {
            Ok(cpu(g.get(var(&vm, name).as_tensor()).expect(name)).to_vec1::<f32>()?)
        };
        let dx = cpu(g.get(x.as_tensor()).expect("dx")).narrow(1, 0, 1)?;
        let y_dead = cpu(&y).narrow(1, 0, 1)?.flatten_all()?.to_vec1::<f32>()?;
        Ok((
            of("bias")?,
            of("weight")?,
            dx.flatten_all()?.to_vec1::<f32>()?,
            y_dead,
        ))
    });
    for (r, (db, dw, dx, y)) in grads.iter().enumerate() {
        assert!(y.iter().all(|v| *v == 0.0), "rank {r}: dead outputs {y:?}");
        assert_eq!(
            (db[0], dw[0]),
            (0.0, 0.0),
            "rank {r}: dβ, dγ of the dead channel"
        );
        assert!(
            dx.iter().all(|v| *v == 0.0),
            "rank {r}: dx of the dead channel {dx:?}"
        );
        assert!(db[1] > 0.0, "rank {r}: dβ of the live channel {}", db[1]);
    }
    Ok(())
}

device_tests!(
    fused_relu_passes_no_gradient_at_zero,
    grid_split_reductions_nchw_and_nhwc,
    nchw_4d_momentum,
    nchw_4d_cumulative_average,
    nhwc_4d,
    nhwc_4d_cumulative_average,
    two_d,
    three_d_nchw_and_nlc,
    five_d_nchw_and_ndhwc,
    fused_residual_relu_nchw_and_nhwc,
    residual_without_relu_and_relu_without_residual,
    no_affine,
    no_running_stats,
    many_ranks_and_one_rank,
);
