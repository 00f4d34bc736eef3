//! Start-up of multi-process groups from the environment that `torchrun` and similar launchers
//! set, and the exchange with which rank 0 hands a small secret (NCCL's 128-byte unique id) to
//! every other rank. Pure Rust, no GPU: the NCCL backend builds on it.
//!
//! Two ways, chosen by the environment:
//! - **Under torchrun** (`TORCHELASTIC_USE_AGENT_STORE=True`): torchrun's agent already serves a
//!   TCPStore at `MASTER_ADDR:MASTER_PORT`; rank 0 `set`s the payload there and the others `get`
//!   it, through [`super::store::TcpStoreClient`], under the key
//!   `candle-distributed/<TORCHELASTIC_RUN_ID>/<restart>/<n>`, where `n` counts this process's
//!   rendezvous (every rank creates its communicators in the same order).
//! - **Standalone** (any other launcher, or none): rank 0 listens on `MASTER_ADDR:MASTER_PORT`
//!   (every address the name resolves to, IPv4 and IPv6) and serves clients concurrently, each
//!   with a short deadline of its own. A client sends `MAGIC`, the job identity, the number of
//!   the rendezvous, its rank and the world size; rank 0 answers `MAGIC`, a status byte and a
//!   length-prefixed payload (or, for a client of another job or an impossible rank, the reason
//!   it is refused; for a client already at the next rendezvous, "retry"), and the client
//!   acknowledges with one byte. Rank 0 returns once every rank has acknowledged; a
//!   rank that retries is answered again, an idle, garbled or foreign connection is dropped
//!   without failing the job, and every length read is bounded.

use std::collections::HashSet;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use candle_core::{bail, Result};

use super::store::{remaining, TcpStoreClient};

/// Bytes that open every message of the standalone exchange (protocol name and version).
const MAGIC: &[u8; 8] = b"CDBOOT02";
/// Longest payload either side accepts: rendezvous payloads are tiny (NCCL's id is 128 bytes).
pub const MAX_PAYLOAD: usize = 1 << 16;
/// Time one client connection may take on rank 0 before it is dropped: an idle or slow
/// connection costs this much of one serving thread, never the job.
const CLIENT_DEADLINE: Duration = Duration::from_secs(5);
/// Answer status: the payload follows.
const OK: u8 = 0;
/// Answer status: refused, the reason follows.
const REFUSED: u8 = 1;
/// Answer status: this rank 0 serves another rendezvous of the job (the client is one ahead,
/// the previous server has not closed yet): try again.
const RETRY: u8 = 2;

/// Where a process sits in a multi-process job, as launchers describe it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DistEnv {
    /// `RANK`: this process's rank in `0..world_size`.
    pub rank: usize,
    /// `WORLD_SIZE`: number of processes.
    pub world_size: usize,
    /// `LOCAL_RANK`: this process's index on its machine (its GPU), 0 when unset.
    pub local_rank: usize,
    /// `MASTER_ADDR`: host name or address of rank 0 (or of torchrun's agent store).
    pub master_addr: String,
    /// `MASTER_PORT`: port rank 0 listens on (or torchrun's agent store).
    pub master_port: u16,
    /// The job's identity: `TORCHELASTIC_RUN_ID`, else `CANDLE_DISTRIBUTED_JOB_ID`, else `""`.
    /// Rank 0 refuses a rank of another job (a leftover of an earlier run that reaches the
    /// port); two jobs cannot share one port at once, since only one rank 0 can listen there.
    pub job_id: String,
    /// `TORCHELASTIC_RESTART_COUNT` (0 when unset): torchrun's restart of the job.
    pub restart: u64,
    /// `TORCHELASTIC_USE_AGENT_STORE=True`: torchrun's agent serves a TCPStore at
    /// `MASTER_ADDR:MASTER_PORT`, and rank 0 must not listen there itself.
    pub agent_store: bool,
}

impl DistEnv {
    /// Reads `RANK`, `WORLD_SIZE`, `LOCAL_RANK` (optional), `MASTER_ADDR`, `MASTER_PORT` and
    /// torchrun's `TORCHELASTIC_*` variables from the process environment.
    ///
    /// # Errors
    /// When a required variable is missing or not a number, or `RANK ≥ WORLD_SIZE`.
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
        let restart = match get("TORCHELASTIC_RESTART_COUNT") {
            Some(v) => parse("TORCHELASTIC_RESTART_COUNT", Some(v))?,
            None => 0,
        };
        let job_id = get("TORCHELASTIC_RUN_ID")
            .or_else(|| get("CANDLE_DISTRIBUTED_JOB_ID"))
            .unwrap_or_default();
        let agent_store = get("TORCHELASTIC_USE_AGENT_STORE")
            .is_some_and(|v| v.trim().eq_ignore_ascii_case("true") || v.trim() == "1");
        Ok(Self {
            rank,
            world_size,
            local_rank,
            master_addr,
            master_port,
            job_id,
            restart,
            agent_store,
        })
    }
}

/// Rendezvous of this process so far: numbers the store keys (see the module documentation).
static RENDEZVOUS: AtomicU64 = AtomicU64::new(0);

/// Hands rank 0's `payload` to every rank of `env`'s job and returns it on every rank: through
/// torchrun's agent store when `env.agent_store`, else over the standalone TCP exchange.
///
/// Rank 0 passes `Some(payload)` (at most [`MAX_PAYLOAD`] bytes), the others `None` (what they
/// pass is ignored). Collective: every rank calls it the same number of times, in the same
/// order.
///
/// # Errors
/// On every rank that does not complete within `timeout`, naming what it waited for; on rank 0
/// when it cannot listen (standalone) or reach the store; on a rank refused by rank 0 (another
/// job, an impossible rank), with the reason.
pub fn share_bytes(env: &DistEnv, payload: Option<&[u8]>, timeout: Duration) -> Result<Vec<u8>> {
    share_bytes_round(
        env,
        RENDEZVOUS.fetch_add(1, Ordering::SeqCst),
        payload,
        timeout,
    )
}

/// [`share_bytes`] as rendezvous number `seq` of the job, for callers that number their
/// rendezvous themselves (several ranks simulated in one process, where the process-wide count
/// of [`share_bytes`] would differ between them). Every rank passes the same `seq`.
///
/// # Errors
/// As [`share_bytes`].
pub fn share_bytes_round(
    env: &DistEnv,
    seq: u64,
    payload: Option<&[u8]>,
    timeout: Duration,
) -> Result<Vec<u8>> {
    let deadline = Instant::now() + timeout;
    if env.rank == 0 {
        let payload = match payload {
            Some(p) if p.len() <= MAX_PAYLOAD => p,
            Some(p) => bail!(
                "bootstrap: the payload has {} bytes, at most {MAX_PAYLOAD} are allowed",
                p.len()
            ),
            None => bail!("bootstrap: rank 0 must provide the payload"),
        };
        if env.agent_store {
            let mut store = TcpStoreClient::connect(&env.master_addr, env.master_port, deadline)?;
            store.set(&store_key(env, seq), payload, deadline)?;
        } else {
            serve(env, seq, payload, deadline, timeout)?;
        }
        Ok(payload.to_vec())
    } else if env.agent_store {
        let mut store = TcpStoreClient::connect(&env.master_addr, env.master_port, deadline)
            .map_err(|e| {
                candle_core::Error::Msg(format!(
                    "bootstrap: rank {} cannot reach torchrun's store: {e}",
                    env.rank
                ))
            })?;
        store.get(&store_key(env, seq), deadline).map_err(|e| {
            candle_core::Error::Msg(format!(
                "bootstrap: rank {} waited {timeout:?} for rank 0's payload: {e}",
                env.rank
            ))
        })
    } else {
        fetch(env, seq, deadline, timeout)
    }
}

/// The store key of rendezvous `seq` of this job and restart.
fn store_key(env: &DistEnv, seq: u64) -> String {
    format!("candle-distributed/{}/{}/{seq}", env.job_id, env.restart)
}

/// The job identity as it travels: a 64-bit FNV-1a of the identity, the world size and the
/// port, so that ranks of another job, or of the same job with another world size, differ.
fn identity(env: &DistEnv) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    let text = format!("{}|{}|{}", env.job_id, env.world_size, env.master_port);
    for b in text.bytes() {
        h = (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}

/// Every address `MASTER_ADDR` resolves to, bound on `MASTER_PORT`. An address that is not
/// this machine's (a NAT or service address, `EADDRNOTAVAIL`) is replaced by the wildcard of its
/// family; an address in use is an error (another rank 0 holds the port).
fn listeners(env: &DistEnv) -> Result<Vec<TcpListener>> {
    let addrs: Vec<SocketAddr> = (env.master_addr.as_str(), env.master_port)
        .to_socket_addrs()
        .map_err(|e| {
            candle_core::Error::Msg(format!(
                "bootstrap: rank 0 cannot resolve MASTER_ADDR={}: {e}",
                env.master_addr
            ))
        })?
        .collect();
    let mut out: Vec<TcpListener> = Vec::new();
    let mut bound: Vec<SocketAddr> = Vec::new();
    let mut errors = Vec::new();
    for a in addrs {
        let err = bind(a, &mut out, &mut bound)?;
        let err = match err {
            Some(e) if e.kind() == std::io::ErrorKind::AddrNotAvailable => {
                let any: SocketAddr = match a {
                    SocketAddr::V4(_) => (std::net::Ipv4Addr::UNSPECIFIED, a.port()).into(),
                    SocketAddr::V6(_) => (std::net::Ipv6Addr::UNSPECIFIED, a.port()).into(),
                };
                if bound.contains(&any) {
                    None
                } else {
                    bind(any, &mut out, &mut bound)?
                }
            }
            e => e,
        };
        match err {
            Some(e) if e.kind() == std::io::ErrorKind::AddrInUse => bail!(
                "bootstrap: rank 0 cannot listen on {a}: {e}{}",
                if env.agent_store {
                    String::new()
                } else {
                    " (another process holds the port; under torchrun, whose agent serves a store there, TORCHELASTIC_USE_AGENT_STORE=True must be set, as torchrun does)".to_string()
                }
            ),
            Some(e) => errors.push(format!("{a}: {e}")),
            None => {}
        }
    }
    if out.is_empty() {
        bail!(
            "bootstrap: rank 0 cannot listen on MASTER_ADDR={}:{} ({})",
            env.master_addr,
            env.master_port,
            errors.join("; ")
        )
    }
    Ok(out)
}

/// Binds `a` (non-blocking) into `out`/`bound`; the bind error, if any.
fn bind(
    a: SocketAddr,
    out: &mut Vec<TcpListener>,
    bound: &mut Vec<SocketAddr>,
) -> Result<Option<std::io::Error>> {
    let l = match TcpListener::bind(a) {
        Ok(l) => l,
        Err(e) => return Ok(Some(e)),
    };
    l.set_nonblocking(true)?;
    bound.push(a);
    out.push(l);
    Ok(None)
}

/// What one client connection turned out to be.
enum Client {
    /// Rank `r` received the payload and acknowledged it.
    Served(usize),
    /// Dropped: not one of ours, another job, idle, or gone before acknowledging.
    Dropped(String),
}

fn serve(
    env: &DistEnv,
    seq: u64,
    payload: &[u8],
    deadline: Instant,
    timeout: Duration,
) -> Result<()> {
    if env.world_size == 1 {
        return Ok(());
    }
    let listeners = listeners(env)?;
    let (tx, rx) = mpsc::channel::<Client>();
    let mut served: HashSet<usize> = HashSet::new();
    let mut dropped: Vec<String> = Vec::new();
    // A handle on every connection, shut down on the way out so that no answering thread
    // (an idle or slow client) keeps rank 0 waiting once the exchange is over.
    let mut open: Vec<TcpStream> = Vec::new();
    let id = identity(env);
    std::thread::scope(|s| -> Result<()> {
        let result = (|| -> Result<()> {
            while served.len() + 1 < env.world_size {
                let mut idle = true;
                for l in &listeners {
                    match l.accept() {
                        Ok((stream, peer)) => {
                            idle = false;
                            if let Ok(c) = stream.try_clone() {
                                open.push(c);
                            }
                            let tx = tx.clone();
                            let client_deadline = (Instant::now() + CLIENT_DEADLINE).min(deadline);
                            s.spawn(move || {
                                let outcome =
                                    answer(stream, env, (id, seq), payload, client_deadline)
                                        .unwrap_or_else(|e| {
                                            Client::Dropped(format!("{peer}: {e}"))
                                        });
                                let _ = tx.send(outcome);
                            });
                        }
                        Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
                        Err(e) => {
                            log::warn!("bootstrap: rank 0: accept failed: {e}");
                            dropped.push(format!("accept: {e}"))
                        }
                    }
                }
                while let Ok(c) = rx.try_recv() {
                    match c {
                        Client::Served(r) => {
                            served.insert(r);
                        }
                        Client::Dropped(why) => dropped.push(why),
                    }
                }
                if served.len() + 1 >= env.world_size {
                    break;
                }
                if Instant::now() >= deadline {
                    let mut missing: Vec<usize> = (1..env.world_size)
                        .filter(|r| !served.contains(r))
                        .collect();
                    missing.truncate(16);
                    dropped.truncate(4);
                    bail!(
                        "bootstrap: rank 0 timed out after {timeout:?} waiting for ranks {missing:?} to connect to {}:{}{}",
                        env.master_addr,
                        env.master_port,
                        if dropped.is_empty() {
                            String::new()
                        } else {
                            format!(" (dropped connections: {})", dropped.join("; "))
                        }
                    )
                }
                if idle {
                    std::thread::sleep(Duration::from_millis(2));
                }
            }
            Ok(())
        })();
        for c in &open {
            let _ = c.shutdown(std::net::Shutdown::Both);
        }
        result
    })
}

/// Bytes of a client's hello: magic, identity, rendezvous number, rank, world size.
const HELLO: usize = 32;

/// `read_exact` that fails once `deadline` has passed, however slowly the peer trickles.
fn read_by(stream: &mut TcpStream, mut buf: &mut [u8], deadline: Instant) -> std::io::Result<()> {
    while !buf.is_empty() {
        if Instant::now() >= deadline {
            return Err(std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                "deadline passed",
            ));
        }
        stream.set_read_timeout(Some(remaining(deadline)))?;
        match stream.read(buf)? {
            0 => return Err(std::io::ErrorKind::UnexpectedEof.into()),
            n => buf = &mut buf[n..],
        }
    }
    Ok(())
}

/// `write_all` that fails once `deadline` has passed.
fn write_by(stream: &mut TcpStream, mut buf: &[u8], deadline: Instant) -> std::io::Result<()> {
    while !buf.is_empty() {
        if Instant::now() >= deadline {
            return Err(std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                "deadline passed",
            ));
        }
        stream.set_write_timeout(Some(remaining(deadline)))?;
        match stream.write(buf)? {
            0 => return Err(std::io::ErrorKind::WriteZero.into()),
            n => buf = &buf[n..],
        }
    }
    Ok(())
}

/// The answer frame: `MAGIC`, a status, a u32 length and the body.
fn frame(status: u8, body: &[u8]) -> Vec<u8> {
    let mut reply = MAGIC.to_vec();
    reply.push(status);
    reply.extend_from_slice(&(body.len() as u32).to_le_bytes());
    reply.extend_from_slice(body);
    reply
}

/// Answers one client on rank 0; `(id, seq)`: the job identity and this rendezvous' number.
fn answer(
    mut stream: TcpStream,
    env: &DistEnv,
    (id, seq): (u64, u64),
    payload: &[u8],
    deadline: Instant,
) -> std::io::Result<Client> {
    stream.set_nonblocking(false)?;
    let mut hello = [0u8; HELLO];
    read_by(&mut stream, &mut hello, deadline)?;
    if &hello[..8] != MAGIC {
        return Ok(Client::Dropped(
            "not a candle-distributed bootstrap client".into(),
        ));
    }
    let word = |at: usize| u64::from_le_bytes(hello[at..at + 8].try_into().expect("8 bytes"));
    let (their_id, their_seq) = (word(8), word(16));
    let rank = u32::from_le_bytes(hello[24..28].try_into().expect("4 bytes")) as usize;
    let world = u32::from_le_bytes(hello[28..32].try_into().expect("4 bytes")) as usize;
    if their_id == id && their_seq > seq {
        // One rendezvous ahead: the next server answers it.
        let msg = format!("rank 0 serves rendezvous {seq}, not {their_seq}");
        write_by(&mut stream, &frame(RETRY, msg.as_bytes()), deadline)?;
        return Ok(Client::Dropped(msg));
    }
    let refusal = if their_id != id || world != env.world_size {
        Some(format!(
            "rank 0 runs job {:?} of {} ranks on port {}; this rank is of another job (identity or world size {world} differs)",
            env.job_id, env.world_size, env.master_port
        ))
    } else if their_seq < seq {
        Some(format!(
            "rank 0 is at rendezvous {seq} of this process's communicators, this rank at {their_seq}: the ranks created different numbers of communicators"
        ))
    } else if rank == 0 || rank >= world {
        Some(format!(
            "rank {rank} is not a client rank of a job of {world}"
        ))
    } else {
        None
    };
    let (status, body) = match &refusal {
        Some(why) => (REFUSED, why.as_bytes()),
        None => (OK, payload),
    };
    write_by(&mut stream, &frame(status, body), deadline)?;
    if let Some(why) = refusal {
        return Ok(Client::Dropped(why));
    }
    let mut ack = [0u8; 1];
    read_by(&mut stream, &mut ack, deadline)?;
    Ok(Client::Served(rank))
}

/// One attempt of a client rank at `addr`: the payload, or why the exchange cannot succeed
/// (rank 0's refusal, a length beyond [`MAX_PAYLOAD`]); an I/O error is worth a retry.
fn fetch_from(
    addr: SocketAddr,
    hello: &[u8],
    deadline: Instant,
) -> std::io::Result<std::result::Result<Vec<u8>, String>> {
    let mut stream = TcpStream::connect_timeout(&addr, remaining(deadline).min(CLIENT_DEADLINE))?;
    write_by(&mut stream, hello, deadline)?;
    let mut head = [0u8; 13];
    read_by(&mut stream, &mut head, deadline)?;
    if &head[..8] != MAGIC {
        return Err(std::io::Error::other(
            "the answer is not from a candle-distributed rank 0",
        ));
    }
    let len = u32::from_le_bytes(head[9..13].try_into().expect("4 bytes")) as usize;
    if len > MAX_PAYLOAD {
        return Ok(Err(format!(
            "{addr} announces {len} bytes (at most {MAX_PAYLOAD} accepted): not a rank 0 of ours"
        )));
    }
    let mut body = vec![0u8; len];
    read_by(&mut stream, &mut body, deadline)?;
    match head[8] {
        OK => {
            write_by(&mut stream, &[1], deadline)?;
            Ok(Ok(body))
        }
        RETRY => Err(std::io::Error::other(
            String::from_utf8_lossy(&body).into_owned(),
        )),
        _ => Ok(Err(format!(
            "refused by rank 0: {}",
            String::from_utf8_lossy(&body)
        ))),
    }
}

fn fetch(env: &DistEnv, seq: u64, deadline: Instant, timeout: Duration) -> Result<Vec<u8>> {
    let mut hello = MAGIC.to_vec();
    hello.extend_from_slice(&identity(env).to_le_bytes());
    hello.extend_from_slice(&seq.to_le_bytes());
    hello.extend_from_slice(&(env.rank as u32).to_le_bytes());
    hello.extend_from_slice(&(env.world_size as u32).to_le_bytes());
    // Every address the name resolves to, in turn: one that refuses, answers garbage or is not
    // rank 0 does not keep a rank from the others.
    let mut attempt = 0usize;
    loop {
        let last_err = match (env.master_addr.as_str(), env.master_port).to_socket_addrs() {
            Ok(addrs) => {
                let addrs: Vec<SocketAddr> = addrs.collect();
                if addrs.is_empty() {
                    "the address resolves to nothing".to_string()
                } else {
                    let a = addrs[attempt % addrs.len()];
                    match fetch_from(a, &hello, deadline) {
                        Ok(Ok(p)) => return Ok(p),
                        Ok(Err(why)) => bail!("bootstrap: rank {}: {why}", env.rank),
                        Err(e) => format!("{a}: {e}"),
                    }
                }
            }
            Err(e) => format!("resolving {}: {e}", env.master_addr),
        };
        attempt += 1;
        if Instant::now() >= deadline {
            bail!(
                "bootstrap: rank {} timed out after {timeout:?} reaching rank 0 at {}:{} (last error: {last_err})",
                env.rank,
                env.master_addr,
                env.master_port
            )
        }
        log::debug!(
            "bootstrap: rank {}: rank 0 not reached yet ({last_err}); retrying",
            env.rank
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::collective::store::connect_any;
    use std::collections::HashMap;

    fn env_at(rank: usize, world: usize, addr: &str, port: u16, job: &str) -> DistEnv {
        DistEnv {
            rank,
            world_size: world,
            local_rank: rank,
            master_addr: addr.into(),
            master_port: port,
            job_id: job.into(),
            restart: 0,
            agent_store: false,
        }
    }

    fn env(rank: usize, world: usize, port: u16) -> DistEnv {
        env_at(rank, world, "127.0.0.1", port, "")
    }

    /// A port that was free a moment ago.
    fn free_port() -> u16 {
        TcpListener::bind(("127.0.0.1", 0))
            .unwrap()
            .local_addr()
            .unwrap()
            .port()
    }

    const LONG: Duration = Duration::from_secs(20);

    /// Runs `world` ranks of `share_bytes` on `addr:port`, rank 0 sharing `id`, while `meddle`
    /// does something to rank 0 on the side; returns every rank's result and the time taken.
    fn job(
        world: usize,
        addr: &str,
        port: u16,
        meddle: impl FnOnce() + Send,
    ) -> (Vec<Result<Vec<u8>>>, Duration) {
        let id: Vec<u8> = (0..128u32).map(|i| (i * 7 + 3) as u8).collect();
        let t = Instant::now();
        let got = std::thread::scope(|s| {
            let hs: Vec<_> = (0..world)
                .map(|r| {
                    let id = id.clone();
                    s.spawn(move || {
                        let p = (r == 0).then_some(id.as_slice());
                        share_bytes_round(&env_at(r, world, addr, port, "job"), 0, p, LONG)
                    })
                })
                .collect();
            s.spawn(meddle);
            hs.into_iter()
                .map(|h| h.join().unwrap())
                .collect::<Vec<_>>()
        });
        for (r, g) in got.iter().enumerate() {
            assert_eq!(g.as_ref().unwrap(), &id, "rank {r}");
        }
        (got, t.elapsed())
    }

    #[test]
    fn reads_torchrun_variables() {
        let vars: HashMap<&str, &str> = [
            ("RANK", "3"),
            ("WORLD_SIZE", "8"),
            ("LOCAL_RANK", "1"),
            ("MASTER_ADDR", "node0"),
            ("MASTER_PORT", "29500"),
            ("TORCHELASTIC_RUN_ID", "abc"),
            ("TORCHELASTIC_RESTART_COUNT", "2"),
            ("TORCHELASTIC_USE_AGENT_STORE", "True"),
        ]
        .into_iter()
        .collect();
        let e = DistEnv::from_vars(|k| vars.get(k).map(|v| v.to_string())).unwrap();
        assert_eq!(e.rank, 3);
        assert_eq!(e.world_size, 8);
        assert_eq!(e.local_rank, 1);
        assert_eq!(e.master_addr, "node0");
        assert_eq!(e.master_port, 29500);
        assert_eq!(
            (e.job_id.as_str(), e.restart, e.agent_store),
            ("abc", 2, true)
        );
        assert_eq!(store_key(&e, 4), "candle-distributed/abc/2/4");
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
        job(4, "127.0.0.1", free_port(), || {});
    }

    #[test]
    fn a_missing_rank_times_out_with_its_number() {
        let port = free_port();
        let err = std::thread::scope(|s| {
            let root = s.spawn(|| {
                share_bytes_round(&env(0, 3, port), 0, Some(b"x"), Duration::from_millis(800))
            });
            let one =
                s.spawn(|| share_bytes_round(&env(1, 3, port), 0, None, Duration::from_secs(5)));
            assert_eq!(one.join().unwrap().unwrap(), b"x");
            root.join().unwrap().unwrap_err().to_string()
        });
        assert!(err.contains("waiting for ranks [2]"), "{err}");
        let lonely =
            share_bytes_round(&env(1, 2, free_port()), 0, None, Duration::from_millis(300));
        assert!(lonely.unwrap_err().to_string().contains("timed out"));
    }

    /// A rank of another job (another identity) is refused with the reason, at once; the job
    /// on the port completes.
    #[test]
    fn a_stray_from_another_job_is_refused_and_the_job_completes() {
        let port = free_port();
        std::thread::scope(|s| {
            let root = s.spawn(|| share_bytes_round(&env(0, 2, port), 0, Some(b"id"), LONG));
            let stray = env_at(1, 2, "127.0.0.1", port, "an earlier run");
            let t = Instant::now();
            let e = share_bytes_round(&stray, 0, None, LONG)
                .unwrap_err()
                .to_string();
            assert!(t.elapsed() < Duration::from_secs(5), "refused promptly");
            assert!(
                e.contains("refused by rank 0") && e.contains("another job"),
                "{e}"
            );
            assert!(!root.is_finished(), "rank 0 still waits for its own rank 1");
            assert_eq!(
                share_bytes_round(&env(1, 2, port), 0, None, LONG).unwrap(),
                b"id"
            );
            root.join().unwrap().unwrap();
        });
    }

    /// A connection that says nothing holds one serving thread for at most CLIENT_DEADLINE;
    /// the ranks behind it are served at once.
    #[test]
    fn an_idle_connection_does_not_stall_the_job() {
        let port = free_port();
        let (_, took) = job(3, "127.0.0.1", port, || {
            let (idle, _) =
                connect_any("127.0.0.1", port, Instant::now() + Duration::from_secs(5)).unwrap();
            std::thread::sleep(Duration::from_secs(3));
            drop(idle);
        });
        assert!(
            took < CLIENT_DEADLINE + Duration::from_secs(3),
            "took {took:?}"
        );
    }

    /// Garbage and a truncated hello are dropped without failing the job.
    #[test]
    fn garbage_is_dropped() {
        let port = free_port();
        job(3, "127.0.0.1", port, || {
            let deadline = Instant::now() + Duration::from_secs(5);
            let (mut g, _) = connect_any("127.0.0.1", port, deadline).unwrap();
            let _ = g.write_all(&[0xAB; 100]);
            let (mut t, _) = connect_any("127.0.0.1", port, deadline).unwrap();
            let _ = t.write_all(&MAGIC[..5]);
        });
    }

    /// A rank that connects twice (a retry after a lost answer) is answered twice, and counted
    /// once: rank 0 still waits for the rank that has not come yet.
    #[test]
    fn a_duplicate_rank_is_answered_again() {
        let port = free_port();
        std::thread::scope(|s| {
            let root = s.spawn(|| share_bytes_round(&env(0, 3, port), 0, Some(b"id"), LONG));
            for _ in 0..2 {
                assert_eq!(
                    share_bytes_round(&env(1, 3, port), 0, None, LONG).unwrap(),
                    b"id"
                );
            }
            assert!(!root.is_finished(), "rank 2 has not connected yet");
            assert_eq!(
                share_bytes_round(&env(2, 3, port), 0, None, LONG).unwrap(),
                b"id"
            );
            root.join().unwrap().unwrap();
        });
    }

    /// A client already at the next rendezvous while rank 0 still serves this one is told to
    /// retry, and gets the next payload from the next server (not this one's).
    #[test]
    fn a_client_one_rendezvous_ahead_waits_for_it() {
        let port = free_port();
        std::thread::scope(|s| {
            let ahead = s.spawn(|| share_bytes_round(&env(1, 2, port), 1, None, LONG));
            let root = s.spawn(|| {
                share_bytes_round(&env(0, 2, port), 0, Some(b"first"), LONG)?;
                share_bytes_round(&env(0, 2, port), 1, Some(b"second"), LONG)
            });
            std::thread::sleep(Duration::from_millis(300));
            assert_eq!(
                share_bytes_round(&env(1, 2, port), 0, None, LONG).unwrap(),
                b"first"
            );
            assert_eq!(ahead.join().unwrap().unwrap(), b"second");
            root.join().unwrap().unwrap();
        });
    }

    /// A server that announces a huge payload is refused by the client before any allocation.
    #[test]
    fn an_oversized_length_is_refused() {
        let l = TcpListener::bind(("127.0.0.1", 0)).unwrap();
        let port = l.local_addr().unwrap().port();
        // Detached: it answers every connection of the retrying client until the test ends.
        std::thread::spawn(move || {
            for c in l.incoming() {
                let Ok(mut c) = c else { return };
                let mut hello = [0u8; HELLO];
                let _ = c.read_exact(&mut hello);
                let mut reply = MAGIC.to_vec();
                reply.push(OK);
                reply.extend(u32::MAX.to_le_bytes());
                let _ = c.write_all(&reply);
            }
        });
        let err = share_bytes_round(&env(1, 2, port), 0, None, Duration::from_millis(400))
            .unwrap_err()
            .to_string();
        assert!(err.contains("announces 4294967295 bytes"), "{err}");
    }

    /// `localhost` (IPv4 and IPv6 addresses) and the IPv6 loopback work as MASTER_ADDR, where
    /// this machine has IPv6.
    #[test]
    fn ipv6_and_localhost() {
        job(2, "localhost", free_port(), || {});
        if TcpListener::bind(("::1", 0)).is_ok() {
            let port = TcpListener::bind(("::1", 0))
                .unwrap()
                .local_addr()
                .unwrap()
                .port();
            job(3, "::1", port, || {});
        } else {
            eprintln!("no IPv6 loopback on this machine: the ::1 case did not run");
        }
    }

    #[test]
    fn rank_zero_checks_its_payload() {
        let big = vec![0u8; MAX_PAYLOAD + 1];
        let e = share_bytes_round(&env(0, 2, free_port()), 0, Some(&big), LONG).unwrap_err();
        assert!(e.to_string().contains("at most"), "{e}");
    }
}
