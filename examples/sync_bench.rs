//! The cost of gradient synchronisation on the CPU backends, against baselines timed in the
//! same run: one bucket of f32 gradients reduced by `DataParallel::sync_gradients` with f32,
//! bf16 and f16 on the wire, the bare all-reduce, a memcpy that moves as many bytes as the
//! all-reduce must (thread ranks), and MPI's own `MPI_Allreduce` on the same buffer (MPI).
//! The all-reduces and the memcpy are timed twice: on an input written long before, and on a
//! gradient fresh from `backward()`, the sync's own input (made the same way, outside the
//! timing; see `docs/benchmarks.md` for what that changes).
//! `scripts/bench-collectives.sh` runs it beside PyTorch's gloo and writes the table of
//! `docs/benchmarks.md`.
//!
//! ```text
//! cargo run --release --example sync_bench -- --ranks 4 --mib 25        # thread ranks
//! cargo build --release --features mpi --example sync_bench
//! mpirun -np 4 target/release/examples/sync_bench --backend mpi --mib 25
//! ```
//!
//! Every variant is timed once per round, from a barrier to a barrier on rank 0 (so a time is
//! that of the slowest rank); the median over the rounds is printed, after two rounds of
//! warm-up. The variants run in a new seeded random order each round: what ran just before
//! moved a time by up to a third on the machine measured (likely what it left in the caches;
//! not measured directly), and a fixed order would give each variant the same neighbour every
//! round. The script sets the allocator's environment (`MALLOC_MMAP_THRESHOLD_`,
//! `MALLOC_TRIM_THRESHOLD_`, `MALLOC_ARENA_MAX`; see the `collective::ThreadGroup` module
//! docs): without it, page faults dominate the thread ranks' times.

use std::sync::Arc;
use std::time::Instant;

use anyhow::{bail, ensure, Context, Result};
use candle_core::{CpuStorage, DType, Device, Storage, Tensor, Var};
use candle_distributed::collective::{AllReduce, Collective, ReduceOp, ThreadGroup};
use candle_distributed::DataParallel;
use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::SeedableRng;

/// The collective backend the ranks use.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
enum Backend {
    /// Thread ranks in this process (`--ranks` of them).
    Threads,
    /// MPI processes (under `mpirun`; needs the `mpi` feature).
    Mpi,
}

/// Times gradient synchronisation and the all-reduce against same-run baselines.
#[derive(Debug, clap::Parser)]
#[command(name = "sync_bench")]
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
    /// Timed rounds (the median is printed).
    #[arg(long, default_value_t = 10, value_parser = clap::value_parser!(u16).range(1..))]
    iters: u16,
    /// Also write the rows as JSON to this file (rank 0).
    #[arg(long)]
    json: Option<std::path::PathBuf>,
}

/// What is timed.
enum Variant {
    /// Every rank copies its share of `(W + 1)·S / 2` bytes (a memcpy of B bytes reads B and
    /// writes B: together the `W·S` bytes an all-reduce must read and the `S` it must write
    /// into one shared result). `fresh`: the source is a gradient fresh from `backward()`
    /// (made outside the timing, as the sync's); otherwise a buffer written once, before the
    /// first round.
    Memcpy { fresh: bool },
    /// `MPI_Allreduce` of the bucket into a buffer allocated once (MPI only).
    RawMpi,
    /// `MPI_Iallreduce` and `MPI_Wait`, the same buffers (MPI only): the non-blocking form the
    /// backend uses, so that it can time a collective out.
    RawMpiNonBlocking,
    /// `Collective::all_reduce(bucket, Avg)` (`wire: None`) or
    /// `Collective::all_reduce_with([bucket], AllReduce::new(Avg).wire(wire))`. `fresh`: the
    /// bucket is a gradient fresh from `backward()` (made outside the timing, as the sync's);
    /// otherwise the same tensor every round, written before the first.
    AllReduce { wire: Option<DType>, fresh: bool },
    /// `Collective::all_reduce(bucket, Sum)` of the reused bucket: what raw MPI computes, without
    /// the average's scaling.
    AllReduceSum,
    /// `DataParallel::sync_gradients` with this wire dtype (`None`: f32).
    Sync(Option<DType>),
}

impl Variant {
    fn name(&self) -> String {
        match self {
            Variant::Memcpy { fresh: false } => "memcpy of the minimum traffic".into(),
            Variant::Memcpy { fresh: true } => "memcpy of the minimum traffic, source fresh".into(),
            Variant::RawMpi => "raw MPI_Allreduce".into(),
            Variant::RawMpiNonBlocking => "raw MPI_Iallreduce + MPI_Wait".into(),
            Variant::AllReduceSum => "all_reduce (Sum)".into(),
            Variant::AllReduce { wire, fresh } => {
                let name = match wire {
                    None => "all_reduce (Avg)".to_string(),
                    Some(w) => format!("all_reduce_wire (Avg, {})", w.as_str()),
                };
                if *fresh {
                    format!("{name}, input fresh")
                } else {
                    name
                }
            }
            Variant::Sync(w) => format!("sync_gradients, {} wire", w.map_or("f32", |d| d.as_str())),
        }
    }
}

/// A timed variant: its name, the median time (s), and for a sync the largest difference of its
/// result from the f32 sync's.
#[derive(Debug, serde::Serialize)]
struct Row {
    name: String,
    median_s: f64,
    max_diff: Option<f64>,
}

/// `MPI_Allreduce` of a rank's bucket (`false`), or `MPI_Iallreduce` + `MPI_Wait` (`true`), when
/// the backend is MPI.
type Raw = Box<dyn FnMut(bool) -> Result<()>>;

/// One rank's rows.
fn rank(comm: Arc<dyn Collective>, a: &Args, raw: Option<Raw>) -> Result<Vec<Row>> {
    let n = (a.mib * 1048576.0 / 4.0) as usize;
    let world = comm.world_size();
    let var = Var::zeros(n, DType::F32, &Device::Cpu)?;
    // This rank's gradient: seeded, different per rank, uniform in ±(rank + 1).
    let g = Tensor::rand(-1f32, 1f32, n, &Device::Cpu)?
        .affine(1.0 + comm.rank() as f64, 0.0)?
        .contiguous()?;
    let vars = vec![("w".to_string(), var.clone())];
    let mut variants = vec![
        Variant::Memcpy { fresh: false },
        Variant::Memcpy { fresh: true },
    ];
    if raw.is_some() {
        variants.push(Variant::RawMpi);
        variants.push(Variant::RawMpiNonBlocking);
    }
    variants.push(Variant::AllReduceSum);
    for fresh in [false, true] {
        for wire in [None, Some(DType::BF16), Some(DType::F16)] {
            variants.push(Variant::AllReduce { wire, fresh });
        }
    }
    let mut dps = Vec::new();
    for wire in [None, Some(DType::BF16), Some(DType::F16)] {
        variants.push(Variant::Sync(wire));
        dps.push(
            DataParallel::from_vars(vars.clone(), vars.clone(), comm.clone())?
                .with_wire_dtype(wire)?,
        );
    }
    let share = (world + 1) * n / (2 * world);
    let (src, mut dst) = (vec![1f32; share], vec![0f32; share]);
    let mut raw = raw;
    let mut times = vec![Vec::new(); variants.len()];
    let mut results: Vec<Option<Tensor>> = vec![None; variants.len()];
    // One generator per rank, all seeded alike: every rank runs the variants in the same order.
    let mut rng = StdRng::seed_from_u64(0x5eed);
    let mut order: Vec<usize> = (0..variants.len()).collect();
    for round in 0..usize::from(a.iters) + 2 {
        order.shuffle(&mut rng);
        for &i in &order {
            let v = &variants[i];
            // A gradient fresh from `backward()`, for the variants that take one (made outside
            // the timing).
            let mut grads = match v {
                Variant::Sync(_)
                | Variant::AllReduce { fresh: true, .. }
                | Variant::Memcpy { fresh: true } => {
                    Some((var.as_tensor() * &g)?.sum_all()?.backward()?)
                }
                _ => None,
            };
            let fresh = match v {
                Variant::Sync(_) => None,
                _ => grads
                    .as_ref()
                    .and_then(|gs| gs.get(var.as_tensor()))
                    .cloned(),
            };
            // The previous round's result is freed outside the timing.
            results[i] = None;
            comm.barrier()?;
            let t = Instant::now();
            match v {
                Variant::Memcpy { .. } => match &fresh {
                    Some(x) => {
                        let (storage, layout) = x.storage_and_layout();
                        let (Storage::Cpu(CpuStorage::F32(x)), Some((a, _))) =
                            (&*storage, layout.contiguous_offsets())
                        else {
                            bail!("the gradient is not a contiguous f32 host tensor");
                        };
                        dst.copy_from_slice(&x[a..a + share]);
                    }
                    None => dst.copy_from_slice(&src),
                },
                Variant::RawMpi => raw.as_mut().context("raw MPI without MPI")?(false)?,
                Variant::RawMpiNonBlocking => raw.as_mut().context("raw MPI without MPI")?(true)?,
                Variant::AllReduceSum => _ = comm.all_reduce(&g, ReduceOp::Sum)?,
                Variant::AllReduce { wire, .. } => {
                    let x = fresh.as_ref().unwrap_or(&g);
                    _ = match wire {
                        None => comm.all_reduce(x, ReduceOp::Avg)?,
                        Some(w) => comm.all_reduce_with(
                            std::slice::from_ref(x),
                            AllReduce::new(ReduceOp::Avg).wire(*w),
                        )?,
                    }
                }
                Variant::Sync(_) => {
                    let dp = &dps[i - (variants.len() - dps.len())];
                    let synced = dp.sync_gradients(grads.take().context("no gradients")?)?;
                    results[i] = synced.get(var.as_tensor()).cloned();
                }
            }
            comm.barrier()?;
            if round >= 2 {
                times[i].push(t.elapsed().as_secs_f64());
            }
        }
    }
    std::hint::black_box(&dst);
    let exact = results.iter().flatten().next().cloned();
    let mut rows = Vec::new();
    for ((v, mut ts), result) in variants.iter().zip(times).zip(results) {
        ts.sort_by(f64::total_cmp);
        let max_diff = match (&result, &exact) {
            (Some(r), Some(e)) => Some((r - e)?.abs()?.max_all()?.to_scalar::<f32>()? as f64),
            _ => None,
        };
        rows.push(Row {
            name: v.name(),
            median_s: ts[ts.len() / 2],
            max_diff,
        });
    }
    Ok(rows)
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
                rank(c, &a, None).map_err(|e| candle_core::Error::Msg(format!("{e:?}")))
            })?;
            (all.swap_remove(0), ranks)
        }
        Backend::Mpi => mpi_rows(&a)?,
    };
    if rows.is_empty() {
        return Ok(());
    }
    let backend = format!("{:?}", a.backend).to_lowercase();
    println!(
        "{world} ranks ({backend}), one bucket of {:.1} MiB of f32, median of {} rounds",
        a.mib, a.iters
    );
    let base = rows[0].median_s;
    println!(
        "{:<44} {:>9}  {:>8}  max |diff| from f32",
        "", "time", "vs first"
    );
    for r in &rows {
        let diff = r.max_diff.map_or(String::new(), |d| format!("{d:.2e}"));
        println!(
            "{:<44} {:>6.2} ms  {:>7.2}×  {diff}",
            r.name,
            1e3 * r.median_s,
            r.median_s / base
        );
    }
    if let Some(path) = &a.json {
        let doc = serde_json::json!({
            "backend": backend, "ranks": world, "mib": a.mib, "iters": a.iters, "rows": rows,
        });
        std::fs::write(path, serde_json::to_string_pretty(&doc)?)
            .with_context(|| format!("writing {}", path.display()))?;
    }
    Ok(())
}

#[cfg(feature = "mpi")]
fn mpi_rows(a: &Args) -> Result<(Vec<Row>, usize)> {
    use mpi::collective::{CommunicatorCollectives, SystemOperation};
    use mpi::request::WaitGuard;
    let env = candle_distributed::collective::Mpi::init()?;
    let comm = env.world()?;
    let world = comm.world_size();
    // The same bucket as the rank's gradient, reduced by MPI itself into a buffer made once.
    let n = (a.mib * 1048576.0 / 4.0) as usize;
    let send: Vec<f32> = (0..n).map(|i| (i % 1000) as f32 * 1e-3).collect();
    let mut recv = vec![0f32; n];
    let raw_world = mpi::topology::SimpleCommunicator::world();
    let raw: Raw = Box::new(move |non_blocking| {
        if non_blocking {
            mpi::request::scope(|scope| {
                let req = raw_world.immediate_all_reduce_into(
                    scope,
                    &send[..],
                    &mut recv[..],
                    SystemOperation::sum(),
                );
                drop(WaitGuard::from(req));
            });
        } else {
            raw_world.all_reduce_into(&send[..], &mut recv[..], SystemOperation::sum());
        }
        std::hint::black_box(&recv);
        Ok(())
    });
    let rows = rank(comm.clone(), a, Some(raw))?;
    // Only rank 0 prints.
    Ok((if comm.rank() == 0 { rows } else { Vec::new() }, world))
}

#[cfg(not(feature = "mpi"))]
fn mpi_rows(_: &Args) -> Result<(Vec<Row>, usize)> {
    anyhow::bail!("--backend mpi needs the `mpi` feature")
}
