//! The start-up exchange on its own: every process of a job launched by torchrun (or with
//! `RANK`, `WORLD_SIZE`, `MASTER_ADDR`, `MASTER_PORT` and `CANDLE_DISTRIBUTED_RUN_ID` set by
//! hand; `CANDLE_DISTRIBUTED_SECRET` optional, on every rank) receives rank 0's bytes, twice
//! (two rendezvous, as two communicators would make), and prints them. Under torchrun it goes
//! through torchrun's own TCPStore; otherwise through a store that rank 0 hosts for each
//! exchange.
//!
//! ```text
//! cargo build --example rendezvous
//! torchrun --nproc_per_node 2 --no-python target/debug/examples/rendezvous
//! ```
//!
//! Each process prints `rank R of W: <hex of round 1> <hex of round 2> via <store|standalone>`.

use std::time::Duration;

use anyhow::Result;
use candle_distributed::collective::rendezvous::{share_bytes, DistEnv};

fn main() -> Result<()> {
    let env = DistEnv::from_env()?;
    let mut rounds = Vec::new();
    for round in 0..2u8 {
        // Rank 0's bytes: its process id and the round, so that every process can tell them.
        let mine: Vec<u8> = std::process::id()
            .to_le_bytes()
            .into_iter()
            .chain([round])
            .collect();
        let got = share_bytes(
            &env,
            (env.rank == 0).then_some(&mine[..]),
            Duration::from_secs(60),
        )?;
        rounds.push(got.iter().map(|b| format!("{b:02x}")).collect::<String>());
    }
    println!(
        "rank {} of {}: {} via {}",
        env.rank,
        env.world_size,
        rounds.join(" "),
        if env.agent_store {
            "store"
        } else {
            "standalone"
        }
    );
    Ok(())
}
