//! Groups of consecutive ranks, such as the ranks of one machine: what a SyncBatchNorm over
//! one node's GPUs only (PyTorch's `new_subgroups(group_size)`) is built with.

use std::sync::Arc;

use candle_core::{bail, Result, Tensor};

use super::Collective;

/// The group of consecutive ranks this rank belongs to, where each rank gives the size of its
/// own group: with `size` the number of ranks on this rank's machine
/// ([`DistEnv::local_world_size`](candle_rendezvous::DistEnv::local_world_size), from torchrun's
/// `LOCAL_WORLD_SIZE`, Slurm or Open MPI), each machine's group when the launcher numbers the
/// ranks machine by machine (torchrun, `srun`'s default block distribution, `mpirun --map-by
/// slot`), machines of different sizes included (`SLURM_STEP_TASKS_PER_NODE=2(x2),4`: groups of
/// 2, 2 and 4). The ranks first all-gather their sizes (one value each, on the communicator's
/// device) and cut the world into blocks from rank 0 on: a block starts at rank `s` and holds
/// the `size` that rank `s` gave; every rank of it must have given the same. Collective over
/// `comm`, as [`Collective::split`].
///
/// ```
/// use candle_core::{Device, Tensor};
/// use candle_collective::{groups_of, ReduceOp, ThreadGroup};
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
/// On every rank (after the all-gather, before the split) when the sizes do not cut the world
/// into blocks (a size of 0, a block whose ranks gave different sizes, one that runs past the
/// last rank: each rank's size is named); and as [`Collective::split`].
pub fn groups_of(comm: &dyn Collective, size: usize) -> Result<Arc<dyn Collective>> {
    let world = comm.world_size();
    let mine = Tensor::new(&[size as i64], &comm.device())?;
    let sizes: Vec<usize> = (comm.all_gather(&mine)?.to_vec1::<i64>()?.into_iter())
        .map(|s| usize::try_from(s).unwrap_or(0))
        .collect();
    let blocks = blocks_of(&sizes).map_err(|why| {
        candle_core::Error::Msg(format!(
            "groups_of: the ranks' group sizes {sizes:?} do not cut a world of {world} into groups of consecutive ranks: {why}"
        ))
    })?;
    let color = u32::try_from(blocks[comm.rank()])
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

/// Each rank's block: blocks start at rank 0 and hold the size their first rank gave, which
/// every rank of the block must have given too.
fn blocks_of(sizes: &[usize]) -> std::result::Result<Vec<usize>, String> {
    let mut block = Vec::with_capacity(sizes.len());
    let (mut start, mut index) = (0, 0);
    while start < sizes.len() {
        let n = sizes[start];
        if n == 0 {
            return Err(format!("rank {start} gave 0"));
        }
        let end = start + n;
        if end > sizes.len() {
            return Err(format!(
                "rank {start} starts a group of {n}, past the last rank"
            ));
        }
        if let Some(r) = (start..end).find(|&r| sizes[r] != n) {
            return Err(format!(
                "rank {start} starts a group of {n}, but rank {r} in it gave {}",
                sizes[r]
            ));
        }
        block.extend(std::iter::repeat_n(index, n));
        (start, index) = (end, index + 1);
    }
    Ok(block)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ThreadGroup;

    #[test]
    fn a_size_that_does_not_divide_the_world_is_refused_on_every_rank() {
        let errs =
            ThreadGroup::run(4, |comm| Ok(groups_of(&*comm, 3).unwrap_err().to_string())).unwrap();
        for e in errs {
            assert!(
                e.contains("[3, 3, 3, 3]")
                    && e.contains("rank 3 starts a group of 3, past the last rank"),
                "{e}"
            );
        }
        let sizes = ThreadGroup::run(4, |comm| Ok(groups_of(&*comm, 4)?.world_size())).unwrap();
        assert_eq!(sizes, [4, 4, 4, 4]);
    }

    /// Machines of different sizes (`2(x2),4` and `4,2`): each machine's ranks form one group;
    /// sizes that cut no blocks are refused on every rank, naming every rank's size (they used
    /// to split machines across groups, or leave some ranks waiting in the split).
    #[test]
    fn uneven_machines_get_their_own_groups() {
        for local in [vec![2, 2, 2, 2, 4, 4, 4, 4], vec![4, 4, 4, 4, 2, 2]] {
            let got = ThreadGroup::run(local.len(), |comm| {
                let g = groups_of(&*comm, local[comm.rank()])?;
                Ok((g.world_size(), g.rank()))
            })
            .unwrap();
            let sizes: Vec<usize> = got.iter().map(|g| g.0).collect();
            assert_eq!(sizes, local, "{local:?}");
        }
        assert_eq!(
            blocks_of(&[2, 2, 2, 2, 4, 4, 4, 4]),
            Ok(vec![0, 0, 1, 1, 2, 2, 2, 2])
        );
        let bad = [2, 4, 4, 4, 4, 2];
        let errs = ThreadGroup::run(bad.len(), |comm| {
            Ok(groups_of(&*comm, bad[comm.rank()]).unwrap_err().to_string())
        })
        .unwrap();
        for e in errs {
            assert!(
                e.contains("[2, 4, 4, 4, 4, 2]")
                    && e.contains("rank 0 starts a group of 2, but rank 1 in it gave 4"),
                "{e}"
            );
        }
        assert!(blocks_of(&[0, 1]).unwrap_err().contains("rank 0 gave 0"));
    }
}
