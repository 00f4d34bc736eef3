//! Where a process sits in its job, as its launcher says: torchrun (or any launcher that sets
//! `RANK` and `WORLD_SIZE`), Slurm's `srun`, or Open MPI's `mpirun` (the table of variables: `DistEnv::from_env`).

use crate::{bail, Result};

/// A process's place in its job.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Placement {
    pub rank: usize,
    pub world_size: usize,
    pub local_rank: usize,
    pub local_world_size: Option<usize>,
    /// The launcher's own identity of this launch, when it has one.
    pub run_id: Option<String>,
}

fn parse(name: &str, v: Option<String>) -> Result<usize> {
    let Some(v) = v else {
        bail!("bootstrap: environment variable {name} is not set")
    };
    v.trim()
        .parse()
        .map_err(|_| crate::Error::Msg(format!("bootstrap: {name}={v:?} is not a valid number")))
}

fn optional(name: &str, get: &dyn Fn(&str) -> Option<String>) -> Result<Option<usize>> {
    get(name).map(|v| parse(name, Some(v))).transpose()
}

/// Reads the placement from the first launcher whose variables are there.
pub(super) fn placement(get: &dyn Fn(&str) -> Option<String>) -> Result<Placement> {
    if get("RANK").is_some() {
        return Ok(Placement {
            rank: parse("RANK", get("RANK"))?,
            world_size: parse("WORLD_SIZE", get("WORLD_SIZE"))?,
            local_rank: optional("LOCAL_RANK", get)?.unwrap_or(0),
            local_world_size: optional("LOCAL_WORLD_SIZE", get)?,
            run_id: None,
        });
    }
    if get("SLURM_PROCID").is_some() && get("SLURM_STEP_NUM_TASKS").is_some() {
        let node = optional("SLURM_NODEID", get)?;
        let local_world_size = match (get("SLURM_STEP_TASKS_PER_NODE"), node) {
            (Some(list), Some(node)) => Some(tasks_on_node(&list, node)?),
            _ => None,
        };
        let run_id = match (get("SLURM_JOB_ID"), get("SLURM_STEP_ID")) {
            (Some(job), Some(step)) => Some(format!("slurm-{}.{}", job.trim(), step.trim())),
            _ => None,
        };
        return Ok(Placement {
            rank: parse("SLURM_PROCID", get("SLURM_PROCID"))?,
            world_size: parse("SLURM_STEP_NUM_TASKS", get("SLURM_STEP_NUM_TASKS"))?,
            local_rank: optional("SLURM_LOCALID", get)?.unwrap_or(0),
            local_world_size,
            run_id,
        });
    }
    if get("OMPI_COMM_WORLD_RANK").is_some() {
        return Ok(Placement {
            rank: parse("OMPI_COMM_WORLD_RANK", get("OMPI_COMM_WORLD_RANK"))?,
            world_size: parse("OMPI_COMM_WORLD_SIZE", get("OMPI_COMM_WORLD_SIZE"))?,
            local_rank: optional("OMPI_COMM_WORLD_LOCAL_RANK", get)?.unwrap_or(0),
            local_world_size: optional("OMPI_COMM_WORLD_LOCAL_SIZE", get)?,
            run_id: get("PMIX_NAMESPACE").map(|n| format!("ompi-{}", n.trim())),
        });
    }
    bail!(
        "bootstrap: environment variable RANK is not set, and neither srun's (SLURM_PROCID, \
         SLURM_STEP_NUM_TASKS) nor Open MPI's (OMPI_COMM_WORLD_RANK) are: launch with torchrun, \
         srun or mpirun, or set RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT"
    )
}

/// The tasks on node `node` from Slurm's compressed list: `2(x3),1` is 2, 2, 2, 1.
fn tasks_on_node(list: &str, node: usize) -> Result<usize> {
    let bad = || {
        crate::Error::Msg(format!(
            "bootstrap: SLURM_STEP_TASKS_PER_NODE={list:?} is not a list like \"2(x3),1\""
        ))
    };
    let mut first = 0;
    for item in list.trim().split(',') {
        let (tasks, repeat) = match item.split_once("(x") {
            Some((t, r)) => (t, r.strip_suffix(')').ok_or_else(bad)?),
            None => (item, "1"),
        };
        let tasks: usize = tasks.trim().parse().map_err(|_| bad())?;
        let repeat: usize = repeat.trim().parse().map_err(|_| bad())?;
        if node < first + repeat {
            return Ok(tasks);
        }
        first += repeat;
    }
    bail!("bootstrap: SLURM_NODEID={node} is past the {first} nodes of SLURM_STEP_TASKS_PER_NODE={list:?}")
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn read(vars: &[(&str, &str)]) -> Result<Placement> {
        let m: HashMap<&str, &str> = vars.iter().copied().collect();
        placement(&|k| m.get(k).map(|v| v.to_string()))
    }

    #[test]
    fn reads_srun() {
        let p = read(&[
            ("SLURM_PROCID", "5"),
            ("SLURM_STEP_NUM_TASKS", "8"),
            ("SLURM_NTASKS", "16"),
            ("SLURM_LOCALID", "1"),
            ("SLURM_NODEID", "2"),
            ("SLURM_STEP_TASKS_PER_NODE", "2(x2),4"),
            ("SLURM_JOB_ID", "4242"),
            ("SLURM_STEP_ID", "3"),
        ])
        .unwrap();
        let want = Placement {
            rank: 5,
            world_size: 8,
            local_rank: 1,
            local_world_size: Some(4),
            run_id: Some("slurm-4242.3".into()),
        };
        assert_eq!(p, want);
        // A batch script's own process: no step variables, so not a rank of the allocation.
        let e = read(&[("SLURM_PROCID", "0"), ("SLURM_NTASKS", "16")]).unwrap_err();
        assert!(e.to_string().contains("RANK is not set"), "{e}");
    }

    #[test]
    fn reads_open_mpi() {
        let p = read(&[
            ("OMPI_COMM_WORLD_RANK", "3"),
            ("OMPI_COMM_WORLD_SIZE", "4"),
            ("OMPI_COMM_WORLD_LOCAL_RANK", "1"),
            ("OMPI_COMM_WORLD_LOCAL_SIZE", "2"),
            ("PMIX_NAMESPACE", "prterun-node0-123@1"),
        ])
        .unwrap();
        assert_eq!(
            (p.rank, p.world_size, p.local_rank, p.local_world_size),
            (3, 4, 1, Some(2))
        );
        assert_eq!(p.run_id.as_deref(), Some("ompi-prterun-node0-123@1"));
    }

    #[test]
    fn rank_wins_over_the_launchers() {
        let p = read(&[
            ("RANK", "1"),
            ("WORLD_SIZE", "2"),
            ("LOCAL_WORLD_SIZE", "2"),
            ("SLURM_PROCID", "7"),
            ("SLURM_STEP_NUM_TASKS", "8"),
            ("OMPI_COMM_WORLD_RANK", "3"),
        ])
        .unwrap();
        assert_eq!((p.rank, p.world_size, p.local_world_size), (1, 2, Some(2)));
    }

    #[test]
    fn slurm_task_lists() {
        assert_eq!(tasks_on_node("4", 0).unwrap(), 4);
        assert_eq!(tasks_on_node("2(x3),1", 2).unwrap(), 2);
        assert_eq!(tasks_on_node("2(x3),1", 3).unwrap(), 1);
        assert!(tasks_on_node("2(x3),1", 4)
            .unwrap_err()
            .to_string()
            .contains("past the 4 nodes"));
        assert!(tasks_on_node("2(x3", 0)
            .unwrap_err()
            .to_string()
            .contains("not a list"));
        assert!(tasks_on_node("a", 0).is_err());
    }
}
