use candle_core::{DType, Device, Tensor, Var};
use candle_distributed::collective::ThreadGroup;
use candle_distributed::{sync_batch_norm, SyncBatchNormConfig};
use candle_nn::{ModuleT, VarBuilder, VarMap};
use std::time::Instant;
fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let cl = args.get(1).map(|s| s == "nhwc").unwrap_or(true);
    let iters: usize = args.get(2).map(|s| s.parse().unwrap()).unwrap_or(50);
    let comm = ThreadGroup::new(1)?.remove(0);
    let dev = Device::Cpu;
    let (n, c, h, w) = (64, 256, 14, 14);
    let dims = if cl {
        vec![n, h, w, c]
    } else {
        vec![n, c, h, w]
    };
    let x = Tensor::randn(1f32, 2f32, dims.as_slice(), &dev)?;
    let vm = VarMap::new();
    let bn = sync_batch_norm(
        c,
        SyncBatchNormConfig {
            channels_last: cl,
            ..Default::default()
        },
        VarBuilder::from_varmap(&vm, DType::F32, &dev),
        comm,
    )?;
    let xv = Var::from_tensor(&x)?;
    let mut tf = 0.0;
    let mut tb = 0.0;
    for i in 0..iters + 5 {
        let t0 = Instant::now();
        let y = bn.forward_t(xv.as_tensor(), true)?;
        let t1 = Instant::now();
        let g = y.backward()?;
        let t2 = Instant::now();
        drop(g);
        if i >= 5 {
            tf += (t1 - t0).as_secs_f64();
            tb += (t2 - t1).as_secs_f64();
        }
    }
    println!(
        "forward {:.3} ms, backward {:.3} ms",
        tf * 1e3 / iters as f64,
        tb * 1e3 / iters as f64
    );
    let t0 = Instant::now();
    for _ in 0..iters {
        let y = bn.forward_t(&x, true)?;
        drop(y);
    }
    println!(
        "forward untracked {:.3} ms",
        t0.elapsed().as_secs_f64() * 1e3 / iters as f64
    );
    let t0 = Instant::now();
    for _ in 0..iters {
        let y = bn.forward_t(xv.as_tensor(), true)?;
        drop(y);
    }
    println!(
        "forward tracked {:.3} ms",
        t0.elapsed().as_secs_f64() * 1e3 / iters as f64
    );
    let ones = Tensor::ones(dims.as_slice(), DType::F32, &dev)?;
    let t0 = Instant::now();
    for _ in 0..iters {
        let z = ones.zeros_like()?;
        let s = z.add(&ones)?;
        drop(s);
    }
    println!(
        "zeros_like + add {:.3} ms",
        t0.elapsed().as_secs_f64() * 1e3 / iters as f64
    );
    let t0 = Instant::now();
    for _ in 0..iters {
        let o = ones.ones_like()?.contiguous()?;
        drop(o);
    }
    println!(
        "ones_like {:.3} ms",
        t0.elapsed().as_secs_f64() * 1e3 / iters as f64
    );
    Ok(())
}
