//! Trains a ResNet with data-parallel ranks and SyncBatchNorm: the crate's main job.
//!
//! ```text
//! cargo run --release --example resnet                     # 4 CPU thread ranks, synthetic data
//! cargo run --release --example resnet -- --help           # every flag
//! cargo run --release --example resnet -- --check          # N-rank SyncBN vs 1-rank BN, exits 1 on a difference
//! cargo run --release --features cuda --example resnet -- --device cuda --world-size 4   # 4 thread ranks on GPU 0
//! cargo run --release --features nccl --example resnet -- --backend nccl --world-size 8 --model resnet50 --data-dir cifar-10-batches-bin
//! ```
//!
//! Outputs (rank 0) in `--out-dir` (default `out/resnet`): `metrics.csv`, `curves.png`,
//! `checkpoint.json` + `checkpoint-e<epoch>-<crc32>.safetensors` (weights, batch-norm statistics,
//! AdamW's moments and step; `--resume out/resnet` continues bit for bit), each written
//! atomically; then a one-line JSON summary on stdout.

mod check;
mod checkpoint;
mod cli;
mod config;
mod data;
mod model;
mod report;
mod state;
mod train;

use std::process::ExitCode;

use anyhow::Result;
use clap::Parser;

/// `--check`'s default tolerance with bf16/f16 activations: the N-rank run may be at most this
/// many times farther from the one-process run than the one-process run in that precision is
/// from the one in full precision (see check::Difference; measured in the README's Training
/// section).
const HALF_TOL: f64 = 1.5;

fn main() -> Result<ExitCode> {
    // The library's diagnostics (retries, aborts) through `log`; RUST_LOG=debug shows more.
    env_logger::Builder::from_env(env_logger::Env::default().default_filter_or("warn")).init();
    let args = cli::Cli::parse();
    let cfg = args.config()?;
    if args.check {
        let (steps, tol) = (args.check_steps, args.check_tol);
        let d = check::check(&cfg, steps, true)?;
        // Full precision: the largest parameter difference; bf16/f16: the difference relative
        // to the update (see check::Difference).
        let (what, diff, tol) = match (cfg.precision, tol) {
            (train::Precision::Full, t) => {
                ("largest parameter difference", d.max_abs, t.unwrap_or(1e-6))
            }
            (_, t) => (
                "update difference over the precision's own",
                d.noise_ratio().unwrap_or(f64::INFINITY),
                t.unwrap_or(HALF_TOL),
            ),
        };
        println!(
            "check: {} ranks SyncBatchNorm vs 1 rank BatchNorm, {steps} steps, {:?} precision: {what} {diff:.3e} (tolerance {tol:.1e}; largest parameter difference {:.3e}, relative update difference {:.3e}, reduced precision alone {:.3e})",
            d.world_size, cfg.precision, d.max_abs, d.relative_update, d.precision_noise.unwrap_or(0.0)
        );
        return Ok(if diff <= tol {
            ExitCode::SUCCESS
        } else {
            ExitCode::FAILURE
        });
    }
    let summary = train::run(&cfg)?;
    if summary.rank == 0 {
        println!("{}", summary.json()?);
    }
    Ok(ExitCode::SUCCESS)
}
