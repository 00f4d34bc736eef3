//! What overlapping the backward's input-gradient collective with the weight-gradient matmul
//! buys in a column-parallel layer: forward + backward per step with overlap and with the layer
//! waiting for the collective first, on 2 ThreadGroup ranks behind a `Collective` wrapper that
//! adds a fixed latency to every collective (standing in for a network). Both variants run in
//! one process, alternating.
//!
//! ```text
//! cargo bench --bench overlap
//! ```

use std::sync::Arc;
use std::time::{Duration, Instant};

use candle_core::{DType, Device, Module, Result, Tensor};
use candle_distributed::collective::{Collective, Decorator, Op, Pending, ThreadGroup};
use candle_distributed::parallel::{ColumnParallelLinear, ParallelMode};
use candle_nn::{VarBuilder, VarMap};

/// Adds `delay` to every collective: a synchronous call sleeps first; an asynchronous one
/// starts at once and completes no earlier than `delay` after its start.
#[derive(Debug)]
struct Delayed {
    inner: Arc<dyn Collective>,
    delay: Duration,
}

impl Delayed {
    fn later(&self, p: Pending) -> Pending {
        let (start, delay) = (Instant::now(), self.delay);
        Pending::new(move || {
            let r = p.wait();
            std::thread::sleep(delay.saturating_sub(start.elapsed()));
            r
        })
    }
}

impl Decorator for Delayed {
    fn inner(&self) -> &Arc<dyn Collective> {
        &self.inner
    }
    /// A synchronous call returns `delay` late (a barrier on time).
    fn after(&self, _: Op, out: Tensor) -> Result<Tensor> {
        std::thread::sleep(self.delay);
        Ok(out)
    }
    fn after_async(&self, _: Op, pending: Pending) -> Result<Pending> {
        Ok(self.later(pending))
    }
}

const WORLD: usize = 2;
const STEPS: usize = 12;
const WARMUP: usize = 2;

/// Median milliseconds of forward + backward on rank 0.
fn step_ms(delay: Duration, overlap: bool, rows: usize, inp: usize, out: usize) -> Result<f64> {
    let times = ThreadGroup::run(WORLD, |comm| {
        let comm: Arc<dyn Collective> = Arc::new(Delayed { inner: comm, delay });
        let vm = VarMap::new();
        let vb = VarBuilder::from_varmap(&vm, DType::F32, &Device::Cpu);
        let layer =
            ColumnParallelLinear::new(inp, out, false, ParallelMode::AllReduce, vb, comm.clone())?
                .overlap(overlap);
        let x =
            candle_core::Var::from_tensor(&Tensor::randn(0f32, 1f32, (rows, inp), &Device::Cpu)?)?;
        let mut ms = Vec::new();
        for i in 0..WARMUP + STEPS {
            comm.barrier()?;
            let t = Instant::now();
            let y = layer.forward(x.as_tensor())?;
            let g = y.sum_all()?.backward()?;
            g.get(x.as_tensor()).expect("dx");
            if i >= WARMUP {
                ms.push(t.elapsed().as_secs_f64() * 1e3);
            }
        }
        ms.sort_by(f64::total_cmp);
        Ok(ms[ms.len() / 2])
    })?;
    Ok(times[0])
}

fn main() -> Result<()> {
    let (rows, inp, out) = (256, 1024, 2048);
    println!("column-parallel {inp} → {out} (shard {inp} → {}), {rows} rows, f32, {WORLD} ThreadGroup ranks, median of {STEPS} steps", out / WORLD);
    println!();
    println!("| injected latency | waiting first ms | overlapped ms | speed-up |");
    println!("|---|---|---|---|");
    for delay_ms in [0u64, 10, 30] {
        let delay = Duration::from_millis(delay_ms);
        let base = step_ms(delay, false, rows, inp, out)?;
        let over = step_ms(delay, true, rows, inp, out)?;
        println!(
            "| {delay_ms} ms | {base:.1} | {over:.1} | {:.2}× |",
            base / over
        );
    }
    Ok(())
}
