//! What overlapping the gradient all-reduce with the backward buys (`DataParallel::with_overlap`):
//! one training step of the example's ResNet-20 and ResNet-56 (plain batch norm, so that the
//! gradient buckets are the only communication) on 2 and 4 `ThreadGroup` ranks behind a
//! `Collective` wrapper standing in for a network link: every collective takes a latency plus
//! its bytes over a bandwidth, one transfer at a time per rank (a later call waits for the
//! link), and takes no CPU while it waits. Four variants per configuration, alternating step by
//! step in one process:
//!
//! - compute: forward, backward and the optimizer, no gradient exchange (the forward alone is
//!   measured too);
//! - communication: the gradient exchange alone (`sync_gradients` of saved gradients);
//! - plain: backward, then `sync_gradients`, then the optimizer;
//! - overlapped: `DataParallel::step` with the hooks (each bucket starts during the backward).
//!
//! Two link bandwidths per configuration, from the compute measured first: one where the
//! exchange alone takes about as long as the whole compute (the plain step is then about twice
//! the larger of the two), and one where it takes about as long as the compute after the forward
//! (backward and optimizer). No overlap can start a bucket before the backward does, so an
//! overlapped step takes at least max(compute, forward + communication): the first setting
//! leaves the forward exposed by construction, the second is the one where an ideal overlap
//! equals max(compute, communication).
//!
//! ```text
//! cargo bench --bench ddp_overlap
//! ```

#[allow(dead_code)]
#[path = "../examples/resnet/model.rs"]
mod model;

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::Result;
use candle_core::backprop::GradStore;
use candle_core::{DType, Device, Tensor};
use candle_distributed::collective::{Collective, Decorator, Op, Pending, ThreadGroup};
use candle_distributed::{DataParallel, GradHooks, OverlapStats};
use candle_nn::{Optimizer, VarMap, SGD};
use model::{Arch, NormKind, ResNet};

/// Per-call latency of the stand-in link.
const LATENCY: Duration = Duration::from_micros(25);
/// Bucket size: small enough for ResNet-20's 1.1 MB of gradients to make several buckets.
const BUCKET_BYTES: usize = 128 << 10;
/// Images per rank per step, and their side.
const PER_RANK: usize = 16;
const SIDE: usize = 16;
const WARMUP: usize = 1;
const STEPS: usize = 5;

/// One rank's link: a call's data leaves when the link is free, then takes `LATENCY` plus its
/// bytes over `bytes_per_sec`; the call returns (or its `Pending` completes) no earlier.
#[derive(Debug)]
struct Link {
    inner: Arc<dyn Collective>,
    bytes_per_sec: Mutex<f64>,
    free_at: Mutex<Instant>,
    /// When each call in flight is done, in call order (a rank issues one call at a time).
    done_at: Mutex<VecDeque<Instant>>,
}

impl Link {
    fn new(inner: Arc<dyn Collective>) -> Self {
        Self {
            inner,
            bytes_per_sec: Mutex::new(f64::INFINITY),
            free_at: Mutex::new(Instant::now()),
            done_at: Mutex::new(VecDeque::new()),
        }
    }

    fn set_bandwidth(&self, bytes_per_sec: f64) {
        *self.bytes_per_sec.lock().unwrap() = bytes_per_sec;
    }

    fn next_done(&self) -> Instant {
        self.done_at
            .lock()
            .unwrap()
            .pop_front()
            .unwrap_or_else(Instant::now)
    }
}

fn sleep_until(t: Instant) {
    std::thread::sleep(t.saturating_duration_since(Instant::now()));
}

impl Decorator for Link {
    fn inner(&self) -> &Arc<dyn Collective> {
        &self.inner
    }
    fn before(&self, _: Op, t: Option<&Tensor>) -> candle_core::Result<()> {
        let bytes = t.map_or(0, |t| t.elem_count() * t.dtype().size_in_bytes()) as f64;
        let bw = *self.bytes_per_sec.lock().unwrap();
        let mut free = self.free_at.lock().unwrap();
        let start = (*free).max(Instant::now());
        let done = if bw.is_finite() {
            start + LATENCY + Duration::from_secs_f64(bytes / bw)
        } else {
            start
        };
        *free = done;
        self.done_at.lock().unwrap().push_back(done);
        Ok(())
    }
    fn after(&self, _: Op, out: Tensor) -> candle_core::Result<Tensor> {
        sleep_until(self.next_done());
        Ok(out)
    }
    fn after_async(&self, _: Op, pending: Pending) -> candle_core::Result<Pending> {
        let done = self.next_done();
        Ok(Pending::new(move || {
            let r = pending.wait();
            sleep_until(done);
            r
        }))
    }
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum Variant {
    Forward,
    Compute,
    Communication,
    Plain,
    Overlapped,
}
const VARIANTS: [Variant; 4] = [
    Variant::Compute,
    Variant::Communication,
    Variant::Plain,
    Variant::Overlapped,
];

/// One row: the link's setting, its bandwidth, the median milliseconds of each variant of
/// `VARIANTS` and of the forward alone on rank 0, and the overlap statistics of the last
/// overlapped step.
struct Row {
    link: &'static str,
    bytes_per_sec: f64,
    ms: [f64; 4],
    forward_ms: f64,
    stats: OverlapStats,
}

/// The rows of one configuration (both link settings) and its gradient bytes.
fn measure(arch: Arch, world: usize) -> Result<(Vec<Row>, usize)> {
    let out = ThreadGroup::run(world, |comm| {
        let link = Arc::new(Link::new(comm.clone()));
        let dev = Device::Cpu;
        let vm = VarMap::new();
        let hooks = GradHooks::new();
        let model = ResNet::new(
            arch,
            10,
            &NormKind::Bn,
            hooks.var_builder(&vm, DType::F32, &dev),
        )
        .map_err(|e| candle_core::Error::Msg(e.to_string()))?;
        let dp_link: Arc<dyn Collective> = link.clone();
        let dp = DataParallel::new(&vm, dp_link)?
            .with_bucket_bytes(BUCKET_BYTES)
            .with_overlap(&hooks)?;
        let mut opt = SGD::new(dp.trainable(), 0.01)?;
        let x = Tensor::randn(0f32, 1f32, (PER_RANK, 3, SIDE, SIDE), &dev)?;
        let y = Tensor::new(
            (0..PER_RANK as u32)
                .map(|i| i % 10)
                .collect::<Vec<_>>()
                .as_slice(),
            &dev,
        )?;
        let loss = || -> candle_core::Result<Tensor> {
            let logits = model
                .forward(&x, true)
                .map_err(|e| candle_core::Error::Msg(e.to_string()))?;
            candle_nn::loss::cross_entropy(&logits, &y)
        };
        let trainable = dp.trainable();
        let bytes: usize = trainable
            .iter()
            .map(|v| v.elem_count() * v.dtype().size_in_bytes())
            .sum();
        // Saved gradients for the communication-only variant.
        let saved: Vec<Tensor> = {
            let g = loss()?.backward()?;
            trainable
                .iter()
                .map(|v| {
                    g.get(v.as_tensor())
                        .expect("every variable has a gradient")
                        .clone()
                })
                .collect()
        };
        let run = |v: Variant, opt: &mut SGD| -> candle_core::Result<f64> {
            comm.barrier()?;
            let t = Instant::now();
            match v {
                Variant::Forward => {
                    loss()?;
                }
                Variant::Compute => {
                    opt.step(&loss()?.backward()?)?;
                    dp.refresh()?;
                }
                Variant::Communication => {
                    let mut g = GradStore::default();
                    for (v, s) in trainable.iter().zip(&saved) {
                        g.insert(v.as_tensor(), s.clone());
                    }
                    dp.sync_gradients(g)?;
                }
                Variant::Plain => {
                    opt.step(&dp.sync_gradients(loss()?.backward()?)?)?;
                    dp.refresh()?;
                }
                Variant::Overlapped => dp.step(opt, &loss()?)?,
            }
            Ok(t.elapsed().as_secs_f64() * 1e3)
        };
        let median_on_root = |v: Variant, opt: &mut SGD, n: usize| -> candle_core::Result<f64> {
            let mut t = (0..n)
                .map(|_| run(v, opt))
                .collect::<candle_core::Result<Vec<f64>>>()?;
            t.sort_by(f64::total_cmp);
            let m = Tensor::new(&[t[t.len() / 2]], &dev)?;
            Ok(comm.broadcast(&m, 0)?.to_vec1::<f64>()?[0])
        };
        // The link's bandwidths: the gradient bytes in the median compute time, and in the
        // compute time after the forward.
        let compute = median_on_root(Variant::Compute, &mut opt, WARMUP + 3)?;
        let forward = median_on_root(Variant::Forward, &mut opt, WARMUP + 3)?;
        let mut rows = Vec::new();
        for (link_name, comm_ms) in [
            ("comm = compute", compute),
            ("comm = compute − forward", compute - forward),
        ] {
            let bw = bytes as f64 / (comm_ms.max(1e-3) / 1e3);
            link.set_bandwidth(bw);
            let mut ms: [Vec<f64>; 4] = Default::default();
            let mut fwd = Vec::new();
            for i in 0..WARMUP + STEPS {
                for (k, &v) in VARIANTS.iter().enumerate() {
                    let t = run(v, &mut opt)?;
                    if i >= WARMUP {
                        ms[k].push(t);
                    }
                }
                let t = run(Variant::Forward, &mut opt)?;
                if i >= WARMUP {
                    fwd.push(t);
                }
            }
            let med = |mut m: Vec<f64>| {
                m.sort_by(f64::total_cmp);
                m[m.len() / 2]
            };
            rows.push(Row {
                link: link_name,
                bytes_per_sec: bw,
                ms: ms.map(med),
                forward_ms: med(fwd),
                stats: dp.overlap_stats(),
            });
        }
        Ok((rows, bytes))
    })?;
    Ok(out.into_iter().next().expect("rank 0's rows"))
}

fn main() -> Result<()> {
    println!(
        "one step, {PER_RANK} images of {SIDE}×{SIDE} per rank, f32, plain batch norm, SGD, buckets of {} KiB, a link of {} µs per call + the bandwidth below; median of {STEPS} steps per variant, alternating, rank 0",
        BUCKET_BYTES >> 10,
        LATENCY.as_micros()
    );
    println!();
    println!("| model | ranks | link | gradients | buckets (in the backward, held back) | bandwidth | forward ms | compute ms | communication ms | plain ms | overlapped ms | overlapped / max | overlapped / bound | plain / overlapped |");
    println!("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|");
    for arch in [Arch::ResNet20, Arch::ResNet56] {
        for world in [2, 4] {
            let (rows, bytes) = measure(arch, world)?;
            for r in rows {
                let [compute, comm, plain, over] = r.ms;
                // No bucket can start before the backward does.
                let bound = compute.max(r.forward_ms + comm);
                println!(
                    "| {} | {world} | {} | {:.2} MB | {} ({}, {}) | {:.1} MB/s | {:.0} | {compute:.0} | {comm:.0} | {plain:.0} | {over:.0} | {:.2} | {:.2} | {:.2}× |",
                    arch.name(),
                    r.link,
                    bytes as f64 / 1e6,
                    r.stats.buckets,
                    r.stats.started_during_backward,
                    r.stats.held_back,
                    r.bytes_per_sec / 1e6,
                    r.forward_ms,
                    over / compute.max(comm),
                    over / bound,
                    plain / over
                );
            }
        }
    }
    Ok(())
}
