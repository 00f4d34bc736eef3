//! What overlapping the gradient all-reduce with the backward buys (`DataParallel::with_overlap`):
//! one training step of the example's ResNet-20 and ResNet-56 (plain batch norm, so that the
//! gradient buckets are the only communication) on 2 and 4 `ThreadGroup` ranks behind a
//! `Collective` wrapper standing in for a network link: every collective takes a latency plus
//! its bytes over a bandwidth, one transfer at a time per rank (a later call waits for the
//! link), and takes no CPU while it waits. Four variants per configuration, alternating step by
//! step in one process:
//!
//! - compute: forward, backward and the optimizer, no gradient exchange;
//! - communication: the gradient exchange alone (`sync_gradients` of saved gradients);
//! - plain: backward, then `sync_gradients`, then the optimizer;
//! - overlapped: `DataParallel::step` with the hooks (each bucket starts during the backward).
//!
//! The link's bandwidth is set so that the exchange alone takes about as long as the compute
//! (measured first), where overlapping matters most: the plain step is then about twice the
//! larger of the two, and an ideal overlap equal to it.
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

/// Median milliseconds of each variant on rank 0, the gradient bytes, the overlap statistics
/// of the last overlapped step (buckets, and those started inside the backward), and the
/// link's bandwidth.
fn measure(arch: Arch, world: usize) -> Result<([f64; 4], usize, OverlapStats, f64)> {
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
        // The link's bandwidth: the gradient bytes in the median compute time.
        let mut compute = Vec::new();
        for _ in 0..WARMUP + 3 {
            compute.push(run(Variant::Compute, &mut opt)?);
        }
        compute.sort_by(f64::total_cmp);
        let median_compute = comm
            .broadcast(&Tensor::new(&[compute[compute.len() / 2]], &dev)?, 0)?
            .to_vec1::<f64>()?[0];
        let bw = bytes as f64 / (median_compute / 1e3);
        link.set_bandwidth(bw);
        let mut ms: [Vec<f64>; 4] = Default::default();
        for i in 0..WARMUP + STEPS {
            for (k, &v) in VARIANTS.iter().enumerate() {
                let t = run(v, &mut opt)?;
                if i >= WARMUP {
                    ms[k].push(t);
                }
            }
        }
        let med = ms.map(|mut m| {
            m.sort_by(f64::total_cmp);
            m[m.len() / 2]
        });
        Ok((med, bytes, dp.overlap_stats(), bw))
    })?;
    Ok(out[0])
}

fn main() -> Result<()> {
    println!(
        "one step, {PER_RANK} images of {SIDE}×{SIDE} per rank, f32, plain batch norm, SGD, buckets of {} KiB, a link of {} µs per call + the bandwidth below; median of {STEPS} steps per variant, alternating, rank 0",
        BUCKET_BYTES >> 10,
        LATENCY.as_micros()
    );
    println!();
    println!("| model | ranks | gradients | buckets (started in the backward) | link | compute ms | communication ms | plain ms | overlapped ms | overlapped / max | plain / overlapped |");
    println!("|---|---|---|---|---|---|---|---|---|---|---|");
    for arch in [Arch::ResNet20, Arch::ResNet56] {
        for world in [2, 4] {
            let ([compute, comm, plain, over], bytes, stats, bw) = measure(arch, world)?;
            println!(
                "| {} | {world} | {:.2} MB | {} ({}) | {:.1} MB/s | {compute:.0} | {comm:.0} | {plain:.0} | {over:.0} | {:.2} | {:.2}× |",
                arch.name(),
                bytes as f64 / 1e6,
                stats.buckets,
                stats.started_during_backward,
                bw / 1e6,
                over / compute.max(comm),
                plain / over
            );
        }
    }
    Ok(())
}
