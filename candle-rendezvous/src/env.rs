//! Where a process sits in a multi-process job, read from the variables its launcher set.

use crate::{bail, launcher, secret, Result, Secret, RUN_ID_VAR};

/// Where a process sits in a multi-process job, as launchers describe it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DistEnv {
    /// `RANK`: this process's rank in `0..world_size`.
    pub rank: usize,
    /// `WORLD_SIZE`: number of processes.
    pub world_size: usize,
    /// `LOCAL_RANK`: this process's index on its machine (its GPU), 0 when unset.
    pub local_rank: usize,
    /// `LOCAL_WORLD_SIZE`: the processes on this machine, when the launcher says
    /// (for node-local groups: `candle_collective::groups_of`).
    pub local_world_size: Option<usize>,
    /// `MASTER_ADDR`: host name or address of rank 0 (or of torchrun's agent store).
    pub master_addr: String,
    /// `MASTER_PORT`: port rank 0 listens on (or torchrun's agent store).
    pub master_port: u16,
    /// The run id: `TORCHELASTIC_RUN_ID`, else `CANDLE_DISTRIBUTED_RUN_ID`; a launch without
    /// torchrun needs one (the same on every rank, new for each launch). Rank 0 refuses a rank
    /// of another run or restart (a leftover of an earlier run that reaches the port).
    pub run_id: String,
    /// `TORCHELASTIC_RESTART_COUNT` (0 when unset): torchrun's restart of the job.
    pub restart: u64,
    /// `TORCHELASTIC_USE_AGENT_STORE=True`: torchrun's agent serves a TCPStore at
    /// `MASTER_ADDR:MASTER_PORT`, and rank 0 must not listen there itself.
    pub agent_store: bool,
    /// `CANDLE_DISTRIBUTED_SECRET` or the file `CANDLE_DISTRIBUTED_SECRET_FILE` names: the
    /// shared key that ranks prove they hold (see the module documentation's trust model);
    /// `None` on a trusted network.
    pub secret: Option<Secret>,
}

/// The processes a launcher placed on this machine, when one is there and says (torchrun's
/// `LOCAL_WORLD_SIZE`, `srun`'s tasks on this node, Open MPI's `OMPI_COMM_WORLD_LOCAL_SIZE`:
/// the table of [`DistEnv::from_env`]); needs none of the rendezvous variables. For sharing a
/// machine's cores among its ranks before any work starts.
pub fn local_world_size() -> Option<usize> {
    local_world_size_from(|k| std::env::var(k).ok())
}

/// [`local_world_size`] with the variables looked up by `get`.
pub fn local_world_size_from(get: impl Fn(&str) -> Option<String>) -> Option<usize> {
    launcher::placement(&get)
        .ok()
        .and_then(|p| p.local_world_size)
}

impl DistEnv {
    /// Reads `RANK`, `WORLD_SIZE`, `LOCAL_RANK` (optional), `LOCAL_WORLD_SIZE` (optional),
    /// `MASTER_ADDR`, `MASTER_PORT`, torchrun's `TORCHELASTIC_*` variables,
    /// `CANDLE_DISTRIBUTED_RUN_ID` and `CANDLE_DISTRIBUTED_SECRET` (or `…_SECRET_FILE`) from the
    /// process environment.
    /// Without `RANK`, the rank, world size, local rank and local world size come from Slurm's
    /// `srun` or Open MPI's `mpirun`, which also name the launch (the run id, unless one is set);
    /// `MASTER_ADDR` and `MASTER_PORT` are the user's to export:
    ///
    /// | | torchrun / by hand | `srun` | Open MPI's `mpirun` |
    /// |---|---|---|---|
    /// | rank | `RANK` | `SLURM_PROCID` | `OMPI_COMM_WORLD_RANK` |
    /// | world size | `WORLD_SIZE` | `SLURM_STEP_NUM_TASKS` | `OMPI_COMM_WORLD_SIZE` |
    /// | local rank | `LOCAL_RANK` (0 when unset) | `SLURM_LOCALID` | `OMPI_COMM_WORLD_LOCAL_RANK` |
    /// | local world size | `LOCAL_WORLD_SIZE` | `SLURM_STEP_TASKS_PER_NODE` at `SLURM_NODEID` | `OMPI_COMM_WORLD_LOCAL_SIZE` |
    /// | run id, when none is set | — | `slurm-<SLURM_JOB_ID>.<SLURM_STEP_ID>` | `ompi-<PMIX_NAMESPACE>` |
    ///
    /// `RANK` wins when it is set. Slurm's step variables, not the allocation's
    /// (`SLURM_NTASKS`), give the world size, so that a batch script's own process is not
    /// taken for a rank of a larger job.
    ///
    /// # Errors
    /// When a required variable is missing or not a number, `RANK ≥ WORLD_SIZE`, the shared
    /// key is not a generated key (see [`secret`]), both of its variables are set or its file
    /// cannot be read, or a launch without torchrun (no agent store) has no run id.
    pub fn from_env() -> Result<Self> {
        Self::from_vars(|k| std::env::var(k).ok())
    }

    /// Like [`DistEnv::from_env`], with the variables looked up by `get`.
    ///
    /// # Errors
    /// As [`DistEnv::from_env`].
    pub fn from_vars(get: impl Fn(&str) -> Option<String>) -> Result<Self> {
        fn parse<T: std::str::FromStr>(name: &str, v: Option<String>) -> Result<T> {
            let v = match v {
                Some(v) => v,
                None => bail!(
                    "bootstrap: environment variable {name} is not set (launch with torchrun or set RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT)"
                ),
            };
            v.trim().parse().map_err(|_| {
                crate::Error::Msg(format!("bootstrap: {name}={v:?} is not a valid number"))
            })
        }
        let placement = launcher::placement(&get)?;
        let (rank, world_size, local_rank) =
            (placement.rank, placement.world_size, placement.local_rank);
        let master_addr = match get("MASTER_ADDR") {
            Some(a) if !a.trim().is_empty() => a.trim().to_string(),
            _ => bail!("bootstrap: environment variable MASTER_ADDR is not set"),
        };
        let master_port: u16 = parse("MASTER_PORT", get("MASTER_PORT"))?;
        if world_size == 0 || rank >= world_size {
            bail!("bootstrap: RANK={rank} must be below WORLD_SIZE={world_size}")
        }
        let restart = match get("TORCHELASTIC_RESTART_COUNT") {
            Some(v) => parse("TORCHELASTIC_RESTART_COUNT", Some(v))?,
            None => 0,
        };
        let run_id = get("TORCHELASTIC_RUN_ID")
            .or_else(|| get(RUN_ID_VAR))
            .or(placement.run_id)
            .unwrap_or_default()
            .trim()
            .to_string();
        let agent_store = get("TORCHELASTIC_USE_AGENT_STORE")
            .is_some_and(|v| v.trim().eq_ignore_ascii_case("true") || v.trim() == "1");
        let secret = secret::from_vars(&get)?;
        let env = Self {
            rank,
            world_size,
            local_rank,
            local_world_size: placement.local_world_size,
            master_addr,
            master_port,
            run_id,
            restart,
            agent_store,
            secret,
        };
        env.check_run_id()?;
        Ok(env)
    }

    /// A launch without torchrun needs a run id.
    pub(crate) fn check_run_id(&self) -> Result<()> {
        // One rank alone meets nobody: no identity is needed.
        if !self.agent_store && self.world_size > 1 && self.run_id.is_empty() {
            bail!(
                "bootstrap: rank {}: a launch without torchrun needs a run id, so that a process left over from an earlier run cannot join this one: set {RUN_ID_VAR} on every rank to the same value, new for each launch (for example the output of `uuidgen` or `date +%s%N`, generated once by the launch script)",
                self.rank
            )
        }
        Ok(())
    }
}
