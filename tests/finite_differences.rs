//! Central finite differences in f64 of the global objective `Σ_r L_r`, `L_r = Σ y_r·w_r` with a
//! random `w_r`: dx (one element on one rank at a time), dγ, dβ (replicated parameters: every
//! rank perturbed together, gradient = Σ_r of the local ones) and dz.

mod common;

use candle_core::{DType, Device, Tensor, Var};
use candle_distributed::SyncBatchNormConfig;
use candle_nn::ModuleT;
use common::*;

/// Elements of x (and z) checked per rank.
const SAMPLES: usize = 4;

struct Fd {
    batches: Vec<usize>,
    c: usize,
    spatial: Vec<usize>,
    config: SyncBatchNormConfig,
    residual: bool,
}

/// Per-rank inputs in the layer's layout.
struct Inputs {
    x: Vec<Tensor>,
    z: Vec<Tensor>,
    wl: Vec<Tensor>,
    params: Params,
}

impl Fd {
    fn new(batches: &[usize], c: usize, spatial: &[usize], channels_last: bool) -> Self {
        Self {
            batches: batches.to_vec(),
            c,
            spatial: spatial.to_vec(),
            config: SyncBatchNormConfig::default().with_layout(layout_of(channels_last)),
            residual: false,
        }
    }

    fn inputs(&self) -> Inputs {
        let gen = |seed: u64, r: usize, n: usize, mean: f64| {
            let mut d = vec![n];
            if self.config.layout.is_channels_last() {
                d.extend(&self.spatial);
                d.push(self.c);
            } else {
                d.push(self.c);
                d.extend(&self.spatial);
            }
            randn(seed + 10 * r as u64, &d, mean, 1.0)
        };
        let b = &self.batches;
        Inputs {
            x: b.iter()
                .enumerate()
                .map(|(r, &n)| gen(1, r, n, 0.7))
                .collect(),
            z: b.iter()
                .enumerate()
                .map(|(r, &n)| gen(2, r, n, 0.2))
                .collect(),
            wl: b
                .iter()
                .enumerate()
                .map(|(r, &n)| gen(3, r, n, 0.0))
                .collect(),
            params: Params::random(5, self.c),
        }
    }

    /// Σ_r L_r, and when `grads`, every rank's (dx, dz, dγ, dβ) on the CPU; computed on `dev`.
    fn run(&self, inp: &Inputs, grads: bool, dev: &Device) -> (f64, Vec<[Tensor; 4]>) {
        let outs = run_ranks_on(self.batches.len(), dev, |comm| {
            let r = comm.rank();
            let (bn, vm) = layer(
                self.c,
                self.config,
                comm,
                Some(&inp.params),
                DType::F64,
                dev,
            );
            let x = Var::from_tensor(&on(dev, &inp.x[r]))?;
            let z = Var::from_tensor(&on(dev, &inp.z[r]))?;
            let y = if self.residual {
                bn.forward_residual(x.as_tensor(), z.as_tensor(), true)?
            } else {
                bn.forward_t(x.as_tensor(), true)?
            };
            let loss = weighted_sum(&y, &on(dev, &inp.wl[r]))?;
            let value = loss.to_scalar::<f64>()?;
            if !grads {
                let e = Tensor::zeros(0, DType::F64, &candle_core::Device::Cpu)?;
                return Ok((value, [e.clone(), e.clone(), e.clone(), e]));
            }
            let g = loss.backward()?;
            let dz = match g.get(z.as_tensor()) {
                Some(t) => t.clone(),
                None => z.zeros_like()?,
            };
            let get = |t: &Tensor| cpu(g.get(t).expect("gradient"));
            Ok((
                value,
                [
                    get(x.as_tensor()),
                    cpu(&dz),
                    get(var(&vm, "weight").as_tensor()),
                    get(var(&vm, "bias").as_tensor()),
                ],
            ))
        });
        let total = outs.iter().map(|o| o.0).sum();
        (total, outs.into_iter().map(|o| o.1).collect())
    }

    fn check(&self, dev: &Device) {
        let inp = self.inputs();
        let (_, grads) = self.run(&inp, true, dev);
        let numeric = |perturb: &dyn Fn(&mut Inputs, f64)| {
            central_difference(|h| {
                let mut p = self.inputs();
                perturb(&mut p, h);
                self.run(&p, false, dev).0
            })
        };
        let compare = |what: String, analytic: f64, num: f64| assert_fd(&what, analytic, num);
        for (r, g) in grads.iter().enumerate() {
            let len = inp.x[r].elem_count();
            for k in 0..SAMPLES.min(len) {
                let i = (k * 7919 + 3) % len;
                let bump = |t: &Tensor, d: f64| {
                    let mut v = t.flatten_all().unwrap().to_vec1::<f64>().unwrap();
                    v[i] += d;
                    Tensor::from_vec(v, t.dims(), t.device()).unwrap()
                };
                let num = numeric(&|p: &mut Inputs, d| p.x[r] = bump(&p.x[r], d));
                let an = g[0].flatten_all().unwrap().to_vec1::<f64>().unwrap()[i];
                compare(format!("dx rank {r} element {i}"), an, num);
                if self.residual {
                    let num = numeric(&|p: &mut Inputs, d| p.z[r] = bump(&p.z[r], d));
                    let an = g[1].flatten_all().unwrap().to_vec1::<f64>().unwrap()[i];
                    compare(format!("dz rank {r} element {i}"), an, num);
                }
            }
        }
        for j in 0..self.c {
            for (which, name) in [(2usize, "dγ"), (3, "dβ")] {
                let num = numeric(&|p: &mut Inputs, d| {
                    let v = if which == 2 {
                        &mut p.params.weight
                    } else {
                        &mut p.params.bias
                    };
                    v[j] += d;
                });
                let an: f64 = grads
                    .iter()
                    .map(|g| g[which].to_vec1::<f64>().unwrap()[j])
                    .sum();
                compare(format!("Σ_r {name} channel {j}"), an, num);
            }
        }
    }
}

fn one_rank_nchw_2d_to_5d(dev: &Device) -> anyhow::Result<()> {
    Fd::new(&[6], 3, &[], false).check(dev);
    Fd::new(&[3], 2, &[5], false).check(dev);
    Fd::new(&[2], 3, &[3, 4], false).check(dev);
    Fd::new(&[2], 2, &[2, 3, 2], false).check(dev);
    Ok(())
}

fn one_rank_nhwc_3d_to_5d(dev: &Device) -> anyhow::Result<()> {
    Fd::new(&[3], 2, &[5], true).check(dev);
    Fd::new(&[2], 3, &[3, 4], true).check(dev);
    Fd::new(&[2], 2, &[2, 3, 2], true).check(dev);
    Ok(())
}

fn three_ranks_nchw_2d_to_5d(dev: &Device) -> anyhow::Result<()> {
    Fd::new(&[2, 3, 4], 3, &[], false).check(dev);
    Fd::new(&[1, 2, 2], 2, &[5], false).check(dev);
    Fd::new(&[2, 1, 1], 3, &[3, 2], false).check(dev);
    Fd::new(&[1, 1, 2], 2, &[2, 2, 2], false).check(dev);
    Ok(())
}

fn three_ranks_nhwc_with_an_empty_rank(dev: &Device) -> anyhow::Result<()> {
    Fd::new(&[2, 0, 3], 2, &[4], true).check(dev);
    Fd::new(&[1, 2, 0], 3, &[2, 3], true).check(dev);
    Fd::new(&[0, 1, 2], 2, &[2, 2, 2], true).check(dev);
    Ok(())
}

fn three_ranks_fused_residual_relu(dev: &Device) -> anyhow::Result<()> {
    for cl in [false, true] {
        let mut fd = Fd::new(&[2, 1, 2], 3, &[3, 3], cl);
        fd.config.fuse_relu = true;
        fd.residual = true;
        fd.check(dev);
    }
    Ok(())
}

fn one_rank_residual_2d_to_5d_with_and_without_relu(dev: &Device) -> anyhow::Result<()> {
    for (spatial, cl) in [(&[][..], false), (&[4][..], true), (&[2, 2, 3][..], false)] {
        for relu in [false, true] {
            let mut fd = Fd::new(&[3], 2, spatial, cl);
            fd.config.fuse_relu = relu;
            fd.residual = true;
            fd.check(dev);
        }
    }
    Ok(())
}

device_tests!(
    one_rank_nchw_2d_to_5d,
    one_rank_nhwc_3d_to_5d,
    three_ranks_nchw_2d_to_5d,
    three_ranks_nhwc_with_an_empty_rank,
    three_ranks_fused_residual_relu,
    one_rank_residual_2d_to_5d_with_and_without_relu,
);
