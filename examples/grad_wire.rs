//! What 16-bit gradients on the wire buy (`DataParallel::with_wire_dtype`): the time of
//! `sync_gradients` on one bucket of f32 gradients with f32, bf16 and f16 on the wire, the
//! payload handed to the backend, and the largest difference from the f32 result.
//!
//! ```text
//! cargo run --release --example grad_wire -- --ranks 4 --mib 25        # thread ranks
//! cargo build --release --features mpi --example grad_wire
//! mpirun -np 4 target/release/examples/grad_wire --backend mpi --mib 25
//! ```

use std::sync::Arc;
use std::time::Instant;

use anyhow::{ensure, Context, Result};
use candle_core::{DType, Device, Tensor, Var};
use candle_distributed::collective::{Collective, ThreadGroup};
use candle_distributed::DataParallel;

/// The collective backend the ranks use.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
enum Backend {
    /// Thread ranks in this process (`--ranks` of them).
    Threads,
    /// MPI processes (under `mpirun`; needs the `mpi` feature).
    Mpi,
}

/// The time of `DataParallel::sync_gradients` with f32, bf16 and f16 on the wire.
#[derive(Debug, clap::Parser)]
#[command(name = "grad_wire")]
struct Args {
    /// Collective backend.
    #[arg(long, value_enum, default_value_t = Backend::Threads)]
    backend: Backend,
    /// Thread ranks (with `--backend threads`; MPI takes mpirun's count).
    #[arg(long, default_value_t = 4, value_parser = clap::value_parser!(u16).range(1..))]
    ranks: u16,
    /// Size of the gradient bucket, in MiB of f32.
    #[arg(long, default_value_t = 25.0)]
    mib: f64,
    /// Syncs per wire dtype (the median is printed).
    #[arg(long, default_value_t = 10, value_parser = clap::value_parser!(u16).range(1..))]
    iters: u16,
}

/// Per wire dtype: its name, the payload handed to the backend (bytes), the median time of a
/// sync (s) and the largest difference from the f32 result.
type Row = (String, usize, f64, f64);

/// One rank's rows.
fn rank(comm: Arc<dyn Collective>, a: &Args) -> Result<Vec<Row>> {
    let n = (a.mib * 1048576.0 / 4.0) as usize;
    let var = Var::zeros(n, DType::F32, &Device::Cpu)?;
    // This rank's gradient: seeded, different per rank, of order 1.
    let g = Tensor::rand(-1f32, 1f32, n, &Device::Cpu)?
        .affine(1.0 + comm.rank() as f64, 0.0)?
        .contiguous()?;
    let vars = vec![("w".to_string(), var.clone())];
    let mut out = Vec::new();
    let mut exact: Option<Tensor> = None;
    for wire in [None, Some(DType::BF16), Some(DType::F16)] {
        let dp = DataParallel::from_vars(vars.clone(), vars.clone(), comm.clone())?
            .with_wire_dtype(wire)?;
        let mut times = Vec::with_capacity(usize::from(a.iters));
        let mut last = None;
        for i in 0..usize::from(a.iters) + 2 {
            let grads = (var.as_tensor() * &g)?.sum_all()?.backward()?;
            comm.barrier()?;
            let t = Instant::now();
            let synced = dp.sync_gradients(grads)?;
            if i >= 2 {
                times.push(t.elapsed().as_secs_f64());
            }
            last = synced.get(var.as_tensor()).cloned();
        }
        times.sort_by(f64::total_cmp);
        let result = last.context("no gradient")?;
        let err = match &exact {
            Some(e) => (&result - e)?.abs()?.max_all()?.to_scalar::<f32>()? as f64,
            None => {
                exact = Some(result);
                0.0
            }
        };
        let size = wire.map_or(4, |d| d.size_in_bytes());
        let name = wire.map_or("f32".to_string(), |d| d.as_str().to_string());
        out.push((name, n * size, times[times.len() / 2], err));
    }
    Ok(out)
}

fn main() -> Result<()> {
    let a = <Args as clap::Parser>::parse();
    ensure!(
        a.mib.is_finite() && a.mib > 0.0,
        "--mib must be a positive number of MiB, not {}",
        a.mib
    );
    let (rows, world) = match a.backend {
        Backend::Threads => {
            let ranks = usize::from(a.ranks);
            let mut all = ThreadGroup::run(ranks, |c| {
                rank(c, &a).map_err(|e| candle_core::Error::Msg(format!("{e:?}")))
            })?;
            (all.swap_remove(0), ranks)
        }
        Backend::Mpi => mpi_rows(&a)?,
    };
    if rows.is_empty() {
        return Ok(());
    }
    println!(
        "{} ranks ({}), one bucket of {:.1} MiB of f32 gradients, median of {} syncs",
        world,
        format!("{:?}", a.backend).to_lowercase(),
        a.mib,
        a.iters
    );
    println!("wire  payload/rank   time      vs f32   max |diff| from f32");
    let base = rows[0].2;
    for (name, bytes, t, err) in rows {
        println!(
            "{name:<5} {:>8.2} MiB  {:>7.2} ms  {:>5.2}×   {err:.2e}",
            bytes as f64 / 1048576.0,
            1e3 * t,
            t / base
        );
    }
    Ok(())
}

#[cfg(feature = "mpi")]
fn mpi_rows(a: &Args) -> Result<(Vec<Row>, usize)> {
    let mpi = candle_distributed::collective::Mpi::init()?;
    let comm = mpi.world()?;
    let world = comm.world_size();
    let rows = rank(comm.clone(), a)?;
    // Only rank 0 prints.
    Ok((if comm.rank() == 0 { rows } else { Vec::new() }, world))
}

#[cfg(not(feature = "mpi"))]
fn mpi_rows(_: &Args) -> Result<(Vec<Row>, usize)> {
    anyhow::bail!("--backend mpi needs the `mpi` feature")
}
