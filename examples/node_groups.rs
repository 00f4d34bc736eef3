//! One rank of a launch on several machines: the NCCL communicator from the launcher's
//! variables, this machine's group cut from it with `groups_of` and the launcher's
//! `LOCAL_WORLD_SIZE`, and one collective in each. Prints one JSON line:
//! `{"rank":…,"world_size":…,"host":…,"local_world_size":…,"node_ranks":[…],"world_sum":…}`,
//! where `node_ranks` are the global ranks of this machine's group (an all-gather in it) and
//! `world_sum` the all-reduce of one per rank over every machine.
//!
//! ```text
//! torchrun --nnodes 2 --nproc_per_node 4 --rdzv-backend c10d --rdzv-endpoint HOST:29400 \
//!     --no-python target/release/examples/node_groups
//! ```
//!
//! `scripts/test-two-nodes.sh` runs it on two simulated machines (even and uneven).

use anyhow::{Context, Result};
use candle_core::{DType, Tensor};
use candle_distributed::collective::{groups_of, rendezvous, Collective, NcclCollective, ReduceOp};

fn main() -> Result<()> {
    let comm = NcclCollective::from_env()?;
    let local = rendezvous::local_world_size()
        .context("the launcher says nothing of this machine's processes (LOCAL_WORLD_SIZE)")?;
    let node = groups_of(&*comm, local)?;
    let dev = comm.device();
    let me = Tensor::new(&[comm.rank() as f32], &dev)?;
    let node_ranks: Vec<usize> = node
        .all_gather(&me)?
        .to_vec1::<f32>()?
        .into_iter()
        .map(|r| r as usize)
        .collect();
    let world_sum = comm.all_reduce(&Tensor::ones(1, DType::F32, &dev)?, ReduceOp::Sum)?;
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .unwrap_or_default()
        .trim()
        .to_string();
    println!(
        "{}",
        serde_json::json!({
            "rank": comm.rank(),
            "world_size": comm.world_size(),
            "host": host,
            "local_world_size": local,
            "node_ranks": node_ranks,
            "world_sum": world_sum.to_vec1::<f32>()?[0],
        })
    );
    Ok(())
}
