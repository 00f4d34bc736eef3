//! Writes into a started collective's input and output: after `wait`, and after the handle was
//! dropped, as a training loop does with a gradient buffer it reuses. Every backend must order
//! them after the collective's own reads and writes (NCCL reads the input on its side stream;
//! `ThreadGroup` and MPI on a communication thread), so that what each rank receives is the sum
//! of what the inputs held when the calls were made, and the simulated GPU's race checker sees
//! no unordered use.

use std::sync::Arc;
use std::time::Duration;

use anyhow::{ensure, Result};
use candle_core::{DType, Device, Tensor};
use candle_distributed::collective::{Collective, Pending, ReduceOp};

/// Elements per rank: a multiple of every world size the suites use, for the reduce-scatter.
const LEN: usize = 840;

/// Rank `r`'s input on `dev`: `(r + 1)·i + 0.5` for `i < LEN`, whole numbers and halves whose
/// sums are exact in f32.
fn input(rank: usize, dev: &Device) -> Result<Tensor> {
    let i = Tensor::arange(0u32, LEN as u32, &Device::Cpu)?.to_dtype(DType::F32)?;
    Ok(((i * (rank as f64 + 1.0))? + 0.5)?.to_device(dev)?)
}

/// The exact sum of every rank's input, on the host.
fn sum_of_inputs(world: usize) -> Result<Vec<f32>> {
    let weight: usize = (1..=world).sum();
    Ok((0..LEN)
        .map(|i| (i * weight) as f32 + 0.5 * world as f32)
        .collect())
}

/// Overwrites every element of `t` (a contiguous 1-D tensor) in place with `value`, on `t`'s
/// device and stream (candle's `slice_set`, a device copy on a GPU).
fn overwrite(t: &Tensor, value: f64) -> Result<()> {
    let fill = (Tensor::ones(t.dims(), t.dtype(), t.device())? * value)?;
    t.slice_set(&fill, 0, 0)?;
    Ok(())
}

/// Which collective a case starts.
#[derive(Clone, Copy, Debug)]
pub enum Which {
    AllReduce,
    AllGather,
    ReduceScatter,
}

pub const EVERY: [Which; 3] = [Which::AllReduce, Which::AllGather, Which::ReduceScatter];

fn start(comm: &dyn Collective, which: Which, t: &Tensor) -> candle_core::Result<Pending> {
    match which {
        Which::AllReduce => comm.start_all_reduce(std::slice::from_ref(t), ReduceOp::Sum.into()),
        Which::AllGather => comm.all_gather_async(t),
        Which::ReduceScatter => comm.reduce_scatter_async(t, ReduceOp::Sum),
    }
}

/// What rank `rank` of `world` must receive from `which` over the inputs of [`input`].
fn expected(which: Which, rank: usize, world: usize) -> Result<Vec<f32>> {
    Ok(match which {
        Which::AllReduce => sum_of_inputs(world)?,
        Which::AllGather => (0..world)
            .map(|r| input(r, &Device::Cpu)?.to_vec1::<f32>().map_err(Into::into))
            .collect::<Result<Vec<_>>>()?
            .concat(),
        Which::ReduceScatter => {
            let k = LEN / world;
            sum_of_inputs(world)?[rank * k..(rank + 1) * k].to_vec()
        }
    })
}

/// On every rank: starts `which` on its input and waits, then at once overwrites the input
/// (enqueued behind the wait, before anything touches the result or synchronises the host).
/// Rank 0 also overwrites its result at once; after a barrier the others check theirs, which
/// must hold the sums of the inputs as they were at the call (not rank 0's write, whichever rank
/// read the result first), then overwrite it too.
pub fn write_after_wait(comm: &Arc<dyn Collective>, which: Which) -> Result<()> {
    let (rank, world) = (comm.rank(), comm.world_size());
    let dev = comm.device();
    let t = input(rank, &dev)?;
    let out = start(comm.as_ref(), which, &t)?.wait()?;
    // The input first: on NCCL, touching the result first would order the device's stream
    // after the collective through cudarc's per-buffer events, whatever `wait` did.
    overwrite(&t, -1e6)?;
    if rank == 0 {
        overwrite(&out, -2e6)?;
    }
    comm.barrier()?;
    let got = out.to_device(&Device::Cpu)?.to_vec1::<f32>()?;
    if rank == 0 {
        ensure!(
            got.iter().all(|&v| v == -2e6),
            "{which:?} on rank 0: the write into the result after the wait was lost"
        );
    } else {
        let want = expected(which, rank, world)?;
        ensure!(
            got == want,
            "{which:?} on rank {rank}: the result begins {:?}, not {:?}, the sum of the inputs as \
             they were at the call (rank 0 overwrote its own result after its wait)",
            &got[..3],
            &want[..3]
        );
        overwrite(&out, -2e6)?;
    }
    let t_now = t.to_device(&Device::Cpu)?.to_vec1::<f32>()?;
    ensure!(
        t_now.iter().all(|&v| v == -1e6),
        "{which:?} on rank {rank}: the write into the input after the wait was lost"
    );
    Ok(())
}

/// Rank 0 starts `which` and drops the handle at once, then overwrites its input; the other
/// ranks start theirs `delay` later (so that, on a backend that reads the input late, rank
/// 0's write would come first) and check what they receive. Then every rank runs one blocking
/// all-reduce, which also shows that rank 0's dropped call completed in step.
pub fn write_after_drop(comm: &Arc<dyn Collective>, which: Which, delay: Duration) -> Result<()> {
    let (rank, world) = (comm.rank(), comm.world_size());
    let dev = comm.device();
    let t = input(rank, &dev)?;
    if rank == 0 {
        drop(start(comm.as_ref(), which, &t)?);
        overwrite(&t, -1e6)?;
    } else {
        std::thread::sleep(delay);
        let got = start(comm.as_ref(), which, &t)?.wait()?;
        let got = got.to_device(&Device::Cpu)?.to_vec1::<f32>()?;
        ensure!(
            got == expected(which, rank, world)?,
            "{which:?} on rank {rank}: rank 0 overwrote its input after dropping its handle, \
             and the write reached the collective"
        );
    }
    let one = Tensor::ones(1, DType::F32, &dev)?;
    let n = comm.all_reduce(&one, ReduceOp::Sum)?;
    ensure!(
        n.to_device(&Device::Cpu)?.to_vec1::<f32>()? == [world as f32],
        "{which:?} on rank {rank}: the all-reduce after the dropped call"
    );
    Ok(())
}
