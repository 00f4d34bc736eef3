//! Groups of consecutive ranks, such as the ranks of one machine: what a SyncBatchNorm over
//! one node's GPUs only (PyTorch's `new_subgroups(group_size)`) is built with.

use std::sync::Arc;

use candle_core::{bail, Result};

use super::Collective;

/// The group of `size` consecutive ranks this rank belongs to: ranks `0..size`, `size..2·size`,
/// … of `comm`, ranked in order. With `size` the number of ranks per machine
/// ([`DistEnv::local_world_size`](super::bootstrap::DistEnv::local_world_size), from torchrun's
/// `LOCAL_WORLD_SIZE`, Slurm or Open MPI), this is each machine's group when the launcher
/// numbers the ranks machine by machine (torchrun, `srun`'s default block distribution,
/// `mpirun --map-by slot`). Collective over `comm`, as [`Collective::split`].
///
/// ```
/// use candle_core::{Device, Tensor};
/// use candle_distributed::collective::{groups_of, ReduceOp, ThreadGroup};
///
/// let sums = ThreadGroup::run(4, |comm| {
///     let node = groups_of(&*comm, 2)?; // ranks {0, 1} and {2, 3}
///     let t = Tensor::new(&[comm.rank() as f32], &Device::Cpu)?;
///     node.all_reduce(&t, ReduceOp::Sum)?.to_vec1::<f32>()
/// })?;
/// assert_eq!(sums, [[1.0], [1.0], [5.0], [5.0]]);
/// # Ok::<(), candle_core::Error>(())
/// ```
///
/// # Errors
///
/// When `size` is 0 or does not divide the world size (on every rank, before any
/// communication), and as [`Collective::split`].
pub fn groups_of(comm: &dyn Collective, size: usize) -> Result<Arc<dyn Collective>> {
    let world = comm.world_size();
    if size == 0 || !world.is_multiple_of(size) {
        bail!("groups_of: groups of {size} ranks do not divide a world of {world}")
    }
    let color = u32::try_from(comm.rank() / size)
        .map_err(|_| candle_core::Error::Msg("groups_of: too many groups".into()))?;
    let key = u32::try_from(comm.rank()).unwrap_or(u32::MAX);
    match comm.split(Some(color), key)? {
        Some(group) => Ok(group),
        None => bail!(
            "groups_of: the split left rank {} out of every group",
            comm.rank()
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::collective::ThreadGroup;

    #[test]
    fn a_size_that_does_not_divide_the_world_is_refused_on_every_rank() {
        let errs =
            ThreadGroup::run(4, |comm| Ok(groups_of(&*comm, 3).unwrap_err().to_string())).unwrap();
        for e in errs {
            assert!(
                e.contains("groups of 3 ranks do not divide a world of 4"),
                "{e}"
            );
        }
        let sizes = ThreadGroup::run(4, |comm| Ok(groups_of(&*comm, 4)?.world_size())).unwrap();
        assert_eq!(sizes, [4, 4, 4, 4]);
    }
}
