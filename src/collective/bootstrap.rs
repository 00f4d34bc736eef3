//! Start-up of multi-process groups from the environment that `torchrun` and similar launchers
//! set, and the TCP exchange with which rank 0 hands a small secret (NCCL's 128-byte unique id)
//! to every other rank. Pure Rust, no GPU: the NCCL backend builds on it.
//!
//! Protocol: rank 0 listens on `MASTER_PORT` (all interfaces); every other rank connects to
//! `MASTER_ADDR:MASTER_PORT`, retrying until the timeout, and sends `MAGIC`, its rank and the
//! world size (u32 little-endian); rank 0 checks them (world size equal, rank in range and not
//! seen before) and answers `MAGIC` followed by the payload. Rank 0 returns once every other rank
//! has been served.

use std::collections::HashSet;
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream, ToSocketAddrs};
use std::time::{Duration, Instant};

use candle_core::{bail, Result};

/// Bytes that open every message of the exchange (protocol name and version).
const MAGIC: &[u8; 8] = b"CDBOOT01";

/// Where a process sits in a multi-process job, as launchers describe it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DistEnv {
    /// `RANK`: this process's rank in `0..world_size`.
    pub rank: usize,
    /// `WORLD_SIZE`: number of processes.
    pub world_size: usize,
    /// `LOCAL_RANK`: this process's index on its machine (its GPU), 0 when unset.
    pub local_rank: usize,
    /// `MASTER_ADDR`: host name or address of rank 0.
    pub master_addr: String,
    /// `MASTER_PORT`: port rank 0 listens on.
    pub master_port: u16,
}

impl DistEnv {
    /// Reads `RANK`, `WORLD_SIZE`, `LOCAL_RANK` (optional), `MASTER_ADDR` and `MASTER_PORT`
    /// from the process environment.
    pub fn from_env() -> Result<Self> {
        Self::from_vars(|k| std::env::var(k).ok())
    }

    /// Like [`DistEnv::from_env`], with the variables looked up by `get`.
    pub fn from_vars(get: impl Fn(&str) -> Option<String>) -> Result<Self> {
        fn parse<T: std::str::FromStr>(name: &str, v: Option<String>) -> Result<T> {
            let v = match v {
                Some(v) => v,
                None => bail!(
                    "bootstrap: environment variable {name} is not set (launch with torchrun or set RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT)"
                ),
            };
            v.trim().parse().map_err(|_| {
                candle_core::Error::Msg(format!("bootstrap: {name}={v:?} is not a valid number"))
            })
        }
        let rank: usize = parse("RANK", get("RANK"))?;
        let world_size: usize = parse("WORLD_SIZE", get("WORLD_SIZE"))?;
        let local_rank = match get("LOCAL_RANK") {
            Some(v) => parse("LOCAL_RANK", Some(v))?,
            None => 0,
        };
        let master_addr = match get("MASTER_ADDR") {
            Some(a) if !a.trim().is_empty() => a.trim().to_string(),
            _ => bail!("bootstrap: environment variable MASTER_ADDR is not set"),
        };
        let master_port: u16 = parse("MASTER_PORT", get("MASTER_PORT"))?;
        if world_size == 0 || rank >= world_size {
            bail!("bootstrap: RANK={rank} must be below WORLD_SIZE={world_size}")
        }
        Ok(Self {
            rank,
            world_size,
            local_rank,
            master_addr,
            master_port,
        })
    }
}

/// Hands rank 0's `payload` to every rank of `env`'s job over TCP and returns it on every rank.
///
/// Rank 0 passes `Some(payload)`, the others `None` (what they pass is ignored). Fails on every
/// rank that does not complete within `timeout`, naming what it waited for.
pub fn share_bytes(env: &DistEnv, payload: Option<&[u8]>, timeout: Duration) -> Result<Vec<u8>> {
    let deadline = Instant::now() + timeout;
    if env.rank == 0 {
        let payload = match payload {
            Some(p) => p,
            None => bail!("bootstrap: rank 0 must provide the payload"),
        };
        serve(env, payload, deadline, timeout)?;
        Ok(payload.to_vec())
    } else {
        fetch(env, deadline, timeout)
    }
}

fn serve(env: &DistEnv, payload: &[u8], deadline: Instant, timeout: Duration) -> Result<()> {
    let listener = TcpListener::bind(("0.0.0.0", env.master_port)).map_err(|e| {
        candle_core::Error::Msg(format!(
            "bootstrap: rank 0 cannot listen on port {}: {e}",
            env.master_port
        ))
    })?;
    listener.set_nonblocking(true)?;
    let mut served: HashSet<usize> = HashSet::new();
    while served.len() + 1 < env.world_size {
        match listener.accept() {
            Ok((mut stream, peer)) => {
                stream.set_nonblocking(false)?;
                stream.set_read_timeout(Some(remaining(deadline)))?;
                stream.set_write_timeout(Some(remaining(deadline)))?;
                let mut hello = [0u8; 16];
                if stream.read_exact(&mut hello).is_err() || &hello[..8] != MAGIC {
                    // Not one of ours (a port scanner, a stale job): ignore it.
                    continue;
                }
                let rank = u32::from_le_bytes(hello[8..12].try_into().expect("4 bytes")) as usize;
                let world = u32::from_le_bytes(hello[12..16].try_into().expect("4 bytes")) as usize;
                if world != env.world_size || rank == 0 || rank >= world {
                    bail!(
                        "bootstrap: {peer} says it is rank {rank} of {world}, but rank 0 runs a job of {} ranks",
                        env.world_size
                    )
                }
                if !served.insert(rank) {
                    bail!("bootstrap: rank {rank} connected twice (the second from {peer})")
                }
                let mut reply = MAGIC.to_vec();
                reply.extend_from_slice(&(payload.len() as u32).to_le_bytes());
                reply.extend_from_slice(payload);
                stream.write_all(&reply)?;
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                if Instant::now() >= deadline {
                    let mut missing: Vec<usize> = (1..env.world_size)
                        .filter(|r| !served.contains(r))
                        .collect();
                    missing.truncate(16);
                    bail!(
                        "bootstrap: rank 0 timed out after {timeout:?} waiting for ranks {missing:?} to connect to port {}",
                        env.master_port
                    )
                }
                std::thread::sleep(Duration::from_millis(5));
            }
            Err(e) => return Err(e.into()),
        }
    }
    Ok(())
}

fn fetch(env: &DistEnv, deadline: Instant, timeout: Duration) -> Result<Vec<u8>> {
    let addr = (env.master_addr.as_str(), env.master_port);
    loop {
        let attempt = (|| -> std::io::Result<Vec<u8>> {
            let sock = addr
                .to_socket_addrs()?
                .next()
                .ok_or_else(|| std::io::Error::other("the address resolves to nothing"))?;
            let mut stream = TcpStream::connect_timeout(&sock, remaining(deadline))?;
            stream.set_read_timeout(Some(remaining(deadline)))?;
            stream.set_write_timeout(Some(remaining(deadline)))?;
            let mut hello = MAGIC.to_vec();
            hello.extend_from_slice(&(env.rank as u32).to_le_bytes());
            hello.extend_from_slice(&(env.world_size as u32).to_le_bytes());
            stream.write_all(&hello)?;
            let mut head = [0u8; 12];
            stream.read_exact(&mut head)?;
            if &head[..8] != MAGIC {
                return Err(std::io::Error::other(
                    "the answer is not from candle-distributed",
                ));
            }
            let len = u32::from_le_bytes(head[8..12].try_into().expect("4 bytes")) as usize;
            let mut payload = vec![0u8; len];
            stream.read_exact(&mut payload)?;
            Ok(payload)
        })();
        let last_err = match attempt {
            Ok(p) => return Ok(p),
            Err(e) => e,
        };
        if Instant::now() >= deadline {
            bail!(
                "bootstrap: rank {} timed out after {timeout:?} reaching rank 0 at {}:{} (last error: {last_err})",
                env.rank,
                env.master_addr,
                env.master_port
            )
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn remaining(deadline: Instant) -> Duration {
    deadline
        .saturating_duration_since(Instant::now())
        .max(Duration::from_millis(1))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn env(rank: usize, world: usize, port: u16) -> DistEnv {
        DistEnv {
            rank,
            world_size: world,
            local_rank: rank,
            master_addr: "127.0.0.1".into(),
            master_port: port,
        }
    }

    /// A port that was free a moment ago.
    fn free_port() -> u16 {
        TcpListener::bind(("127.0.0.1", 0))
            .unwrap()
            .local_addr()
            .unwrap()
            .port()
    }

    #[test]
    fn reads_torchrun_variables() {
        let vars: HashMap<&str, &str> = [
            ("RANK", "3"),
            ("WORLD_SIZE", "8"),
            ("LOCAL_RANK", "1"),
            ("MASTER_ADDR", "node0"),
            ("MASTER_PORT", "29500"),
        ]
        .into_iter()
        .collect();
        let e = DistEnv::from_vars(|k| vars.get(k).map(|v| v.to_string())).unwrap();
        assert_eq!(e.rank, 3);
        assert_eq!(e.world_size, 8);
        assert_eq!(e.local_rank, 1);
        assert_eq!(e.master_addr, "node0");
        assert_eq!(e.master_port, 29500);
    }

    #[test]
    fn names_the_missing_or_bad_variable() {
        let err = |vars: &[(&str, &str)]| {
            let m: HashMap<&str, &str> = vars.iter().copied().collect();
            DistEnv::from_vars(|k| m.get(k).map(|v| v.to_string()))
                .unwrap_err()
                .to_string()
        };
        let base = [
            ("RANK", "0"),
            ("WORLD_SIZE", "2"),
            ("MASTER_ADDR", "h"),
            ("MASTER_PORT", "1"),
        ];
        assert!(err(&base[1..]).contains("RANK is not set"));
        assert!(err(&[base[0], base[1], base[2]]).contains("MASTER_PORT is not set"));
        assert!(err(&[("RANK", "x"), base[1], base[2], base[3]]).contains("RANK=\"x\""));
        assert!(err(&[("RANK", "2"), base[1], base[2], base[3]]).contains("below WORLD_SIZE=2"));
        assert!(err(&[base[0], base[1], base[2], ("MASTER_PORT", "70000")]).contains("MASTER_PORT"));
    }

    #[test]
    fn every_rank_receives_rank_zeros_payload() {
        let port = free_port();
        let id: Vec<u8> = (0..128u32).map(|i| (i * 7 + 3) as u8).collect();
        let got: Vec<Vec<u8>> = std::thread::scope(|s| {
            let hs: Vec<_> = (0..4)
                .map(|r| {
                    let id = id.clone();
                    s.spawn(move || {
                        let p = (r == 0).then_some(id.as_slice());
                        share_bytes(&env(r, 4, port), p, Duration::from_secs(20)).unwrap()
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        for g in got {
            assert_eq!(g, id);
        }
    }

    #[test]
    fn a_missing_rank_times_out_with_its_number() {
        let port = free_port();
        let err = std::thread::scope(|s| {
            let root =
                s.spawn(|| share_bytes(&env(0, 3, port), Some(b"x"), Duration::from_millis(800)));
            let one = s.spawn(|| share_bytes(&env(1, 3, port), None, Duration::from_secs(5)));
            assert_eq!(one.join().unwrap().unwrap(), b"x");
            root.join().unwrap().unwrap_err().to_string()
        });
        assert!(err.contains("waiting for ranks [2]"), "{err}");
        let lonely = share_bytes(&env(1, 2, free_port()), None, Duration::from_millis(300));
        assert!(lonely.unwrap_err().to_string().contains("timed out"));
    }

    #[test]
    fn a_rank_of_another_job_is_refused() {
        let port = free_port();
        let err = std::thread::scope(|s| {
            let root =
                s.spawn(|| share_bytes(&env(0, 2, port), Some(b"id"), Duration::from_secs(5)));
            let stranger =
                s.spawn(|| share_bytes(&env(1, 3, port), None, Duration::from_millis(500)));
            let _ = stranger.join().unwrap();
            root.join().unwrap().unwrap_err().to_string()
        });
        assert!(err.contains("rank 1 of 3"), "{err}");
    }
}
