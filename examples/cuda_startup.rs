//! Time of a process's first SyncBatchNorm training forward on GPU 0, which loads the crate's
//! kernel images: with machine code for the GPU's architecture in the image the driver compiles
//! nothing. Run it with the driver's cache disabled to see what a fresh machine pays:
//!
//! ```text
//! CUDA_CACHE_DISABLE=1 cargo run --release --features cuda --example cuda_startup -- 0.2
//! ```
//!
//! Prints the seconds; with a number as argument, exits 1 when the first forward took longer.
//! candle's own kernels (loaded by the tensor set-up before the timing) are not counted.

use std::process::ExitCode;
use std::time::Instant;

use anyhow::Result;
use candle_core::{DType, Device, Tensor};
use candle_distributed::collective::ThreadGroup;
use candle_distributed::{sync_batch_norm, SyncBatchNormConfig};
use candle_nn::{ModuleT, VarBuilder, VarMap};

/// The time of the first SyncBatchNorm training forward on GPU 0.
#[derive(Debug, clap::Parser)]
#[command(name = "cuda_startup")]
struct Args {
    /// Exit with status 1 when the first forward takes longer than this many seconds.
    limit: Option<f64>,
}

fn main() -> Result<ExitCode> {
    let limit = <Args as clap::Parser>::parse().limit;
    let dev = Device::new_cuda(0)?;
    let comm = ThreadGroup::new(1)?.remove(0);
    let vm = VarMap::new();
    let bn = sync_batch_norm(
        64,
        SyncBatchNormConfig::default(),
        VarBuilder::from_varmap(&vm, DType::F32, &dev),
        comm,
    )?;
    let x = Tensor::randn(0f32, 1f32, (8, 64, 16, 16), &dev)?;
    dev.synchronize()?;
    let t = Instant::now();
    let y = bn.forward_t(&x, true)?;
    dev.synchronize()?;
    let first = t.elapsed().as_secs_f64();
    let t = Instant::now();
    bn.forward_t(&x, true)?;
    dev.synchronize()?;
    let second = t.elapsed().as_secs_f64();
    println!(
        "first SyncBatchNorm forward: {first:.3} s (second: {second:.4} s); output {:?}; images ship sm_{:?}",
        y.dims(),
        candle_distributed::ops::cuda_archs()
    );
    Ok(match limit {
        Some(l) if first > l => {
            eprintln!("slower than {l} s");
            ExitCode::FAILURE
        }
        _ => ExitCode::SUCCESS,
    })
}
