//! Rank 0's door to the store it hosts: listening on every address of `MASTER_ADDR`, the
//! admission of a client (its hello, the proof of the shared secret, the run identity), and the
//! bound on connections answered at once.

use std::collections::HashMap;
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::AtomicU8;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::{bail, Result};

use super::wire::{frame, frame_as, read_by, write_by, HELLO};
use super::*;

/// Every address `MASTER_ADDR` resolves to (by `deadline`), bound on `MASTER_PORT`
/// ([`listen_on`]).
pub(super) fn listeners(env: &DistEnv, deadline: Instant) -> Result<Vec<TcpListener>> {
    let addrs =
        super::store::resolve(&env.master_addr, env.master_port, deadline).map_err(|e| {
            crate::Error::Msg(format!(
                "bootstrap: rank 0 cannot resolve MASTER_ADDR={}: {e}",
                env.master_addr
            ))
        })?;
    listen_on(&addrs, env.agent_store).map_err(|e| {
        crate::Error::Msg(format!(
            "{e} (MASTER_ADDR={}:{})",
            env.master_addr, env.master_port
        ))
    })
}

/// Listeners on `addrs`. An address that is not this machine's (a NAT or service address,
/// `EADDRNOTAVAIL`) is replaced by the wildcard of its family. Linux's IPv6 wildcard is dual-stack
/// by default (`net.ipv6.bindv6only = 0`) and then holds the port for IPv4 too: an IPv4 address
/// in use while that listener of ours is bound is covered by it, and an IPv6 wildcard in use
/// while only IPv4 listeners of ours hold the port replaces them (it takes their clients too).
/// Any other address in use is an error: another process holds the port.
pub(super) fn listen_on(addrs: &[SocketAddr], agent_store: bool) -> Result<Vec<TcpListener>> {
    let port = addrs.first().map_or(0, SocketAddr::port);
    let v6_any = SocketAddr::from((std::net::Ipv6Addr::UNSPECIFIED, port));
    let mut out: Vec<TcpListener> = Vec::new();
    let mut bound: Vec<SocketAddr> = Vec::new();
    let mut errors = Vec::new();
    for &a in addrs {
        let mut target = a;
        let mut err = bind(a, &mut out, &mut bound)?;
        if matches!(&err, Some(e) if e.kind() == std::io::ErrorKind::AddrNotAvailable) {
            target = match a {
                SocketAddr::V4(_) => (std::net::Ipv4Addr::UNSPECIFIED, port).into(),
                SocketAddr::V6(_) => v6_any,
            };
            err = match bound.contains(&target) {
                true => None,
                false => bind(target, &mut out, &mut bound)?,
            };
        }
        if matches!(&err, Some(e) if e.kind() == std::io::ErrorKind::AddrInUse) {
            if target.is_ipv4() && bound.contains(&v6_any) {
                err = None;
            } else if target == v6_any && !bound.is_empty() && bound.iter().all(|b| b.is_ipv4()) {
                let (held_out, held) = (std::mem::take(&mut out), std::mem::take(&mut bound));
                drop(held_out);
                err = bind(v6_any, &mut out, &mut bound)?;
                if err.is_some() {
                    // Not dual-stack after all: keep what was bound, report the conflict.
                    out.clear();
                    bound.clear();
                    for b in held {
                        bind(b, &mut out, &mut bound)?;
                    }
                }
            }
        }
        match err {
            Some(e) if e.kind() == std::io::ErrorKind::AddrInUse => bail!(
                "bootstrap: rank 0 cannot listen on {target}: {e}{}",
                if agent_store {
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
        bail!("bootstrap: rank 0 cannot listen ({})", errors.join("; "))
    }
    Ok(out)
}

/// Binds `a` (non-blocking) into `out`/`bound`; the bind error, if any.
pub(super) fn bind(
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

/// Connections not yet admitted (no hello of this job, or with a secret no proof yet) answered
/// at once, at most: each holds a thread and two descriptors for at most [`CLIENT_DEADLINE`].
/// One beyond is closed at once (or closes the oldest silent one), and its client retries: a
/// flood of connections cannot exhaust rank 0's threads or descriptors.
pub(super) fn max_handlers(world: usize) -> usize {
    (4 * world).clamp(16, 256)
}

/// Connections open at once, admitted sessions included, at most: a rank keeps one session per
/// communicator for its progress reports, and opens one more for each start-up.
pub(super) fn max_sessions(world: usize) -> usize {
    16 * world + 64
}

/// Time a client has from its connection to the end of its hello (49 bytes): a connection that
/// says nothing frees its slot within this, not [`CLIENT_DEADLINE`].
pub(super) const HELLO_DEADLINE: Duration = Duration::from_millis(500);

/// A warning repeated on every pass of a loop (an `accept` failing while descriptors are
/// exhausted) is logged at most once per [`WARN_EVERY`], with the number left out since.
#[derive(Debug, Default)]
pub(super) struct Throttle {
    last: Option<Instant>,
    held: u64,
}

/// See [`Throttle`].
pub(super) const WARN_EVERY: Duration = Duration::from_secs(1);

impl Throttle {
    /// Whether a warning at `now` is logged: `Some(n)` with the `n` warnings left out since the
    /// last one logged, or `None` when this one is left out.
    pub fn admit(&mut self, now: Instant) -> Option<u64> {
        match self.last {
            Some(t) if now.saturating_duration_since(t) < WARN_EVERY => {
                self.held += 1;
                None
            }
            _ => {
                self.last = Some(now);
                Some(std::mem::take(&mut self.held))
            }
        }
    }
}

/// A connection being answered.
pub(super) struct Open {
    /// A handle to shut it down.
    pub handle: TcpStream,
    /// When it was accepted.
    pub since: Instant,
    /// How far it got, set by its thread: [`SILENT`], [`HELLOED`], [`PROVEN`].
    pub stage: Arc<AtomicU8>,
}

/// A connection that has not sent a hello of this job yet.
pub(super) const SILENT: u8 = 0;
/// A hello of this job's run identity came in time; with a secret, its proof has not yet.
const HELLOED: u8 = 1;
/// A hello in time, and with a secret, its proof (then admitted or refused): never evicted.
const PROVEN: u8 = 2;

/// Whether a new connection gets a slot now: when fewer than `cap` connections await their
/// admission and fewer than `most` are open, or room can be made by closing a connection that
/// has not proven itself: the oldest silent one (no hello of this job yet), else the oldest
/// whose hello came but whose proof of the secret has not. A flood of silent connections that
/// reconnect the moment they are closed keeps evicting itself, a real rank between its hello
/// and its proof is evicted only after every silent connection, and after older connections in
/// its own stage, and admitted sessions (the ranks' progress boards) take no slot of `cap`.
pub(super) fn admit(open: &mut HashMap<u64, Open>, cap: usize, most: usize) -> bool {
    let waiting = open
        .values()
        .filter(|c| c.stage.load(Ordering::Relaxed) < PROVEN)
        .count();
    if waiting < cap && open.len() < most {
        return true;
    }
    let victim = open
        .iter()
        .map(|(&conn, c)| (c.stage.load(Ordering::Relaxed), c.since, conn))
        .filter(|&(stage, _, _)| stage < PROVEN)
        .min()
        .map(|(_, _, conn)| conn);
    match victim.and_then(|conn| open.remove(&conn)) {
        Some(c) => {
            let _ = c.handle.shutdown(std::net::Shutdown::Both);
            true
        }
        None => false,
    }
}

/// What one client connection turned out to be.
pub(super) enum Client {
    /// Rank `r` of this job, admitted to the store.
    Admitted(usize),
    /// Dropped: not one of ours, another job, idle, or refused.
    Dropped(String),
}

/// Admits one client to the store rank 0 hosts, or refuses it with the reason; `id`: the run
/// identity, `latest`: the newest rendezvous rank 0 has begun (a client behind it is refused).
pub(super) fn admission(
    stream: &mut TcpStream,
    env: &DistEnv,
    id: u64,
    latest: Option<u64>,
    (hello_deadline, deadline): (Instant, Instant),
    stage: &AtomicU8,
) -> std::io::Result<Client> {
    stream.set_nonblocking(false)?;
    // The magic first: a client of another protocol version (a shorter hello) is dropped at
    // once instead of holding this thread until the deadline.
    let mut hello = [0u8; HELLO];
    read_by(stream, &mut hello[..MAGIC.len()], hello_deadline)?;
    if &hello[..MAGIC.len()] != MAGIC {
        // Another version of this protocol: refused in its own framing (its magic, the
        // refusal status, a length and the reason), which every version reads, so that it
        // fails with the reason instead of a timeout.
        if hello.starts_with(&MAGIC[..6]) {
            let why = format!(
                "rank 0 speaks bootstrap protocol {} and this rank {}: run the same candle-distributed on every rank",
                String::from_utf8_lossy(&MAGIC[6..]),
                String::from_utf8_lossy(&hello[6..8]).escape_default()
            );
            let reply = frame_as(&hello[..MAGIC.len()], REFUSED, why.as_bytes());
            write_by(stream, &reply, deadline)?;
            return Ok(Client::Dropped(why));
        }
        return Ok(Client::Dropped(
            "not a candle-distributed bootstrap client of this version".into(),
        ));
    }
    read_by(stream, &mut hello[MAGIC.len()..], hello_deadline)?;
    if hello[8..16] == id.to_le_bytes() {
        // This job's hello: evicted only after the silent connections.
        stage.store(HELLOED, Ordering::Relaxed);
    }
    // With a shared secret, the client proves it holds it before anything else is said.
    let mut context = hello.to_vec();
    if let Some(why) = authenticate(stream, env, &hello, &mut context, deadline)? {
        write_by(stream, &frame(REFUSED, why.as_bytes()), deadline)?;
        return Ok(Client::Dropped(why));
    }
    // A hello of ours in time (and with a secret, its proof): no longer a candidate for
    // eviction when the connection table is full.
    stage.store(PROVEN, Ordering::Relaxed);
    let word = |at: usize| u64::from_le_bytes(hello[at..at + 8].try_into().expect("8 bytes"));
    let (their_id, their_seq) = (word(8), word(16));
    let rank = u32::from_le_bytes(hello[24..28].try_into().expect("4 bytes")) as usize;
    let world = u32::from_le_bytes(hello[28..32].try_into().expect("4 bytes")) as usize;
    let refusal = if their_id != id || world != env.world_size {
        Some(format!(
            "rank 0 runs run {:?}, restart {}, of {} ranks on port {}; this rank is of another run or restart (identity or world size {world} differs)",
            env.run_id, env.restart, env.world_size, env.master_port
        ))
    } else if let Some(seq) = latest.filter(|&l| their_seq != SESSION && their_seq < l) {
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
    if let Some(why) = refusal {
        write_by(stream, &frame(REFUSED, why.as_bytes()), deadline)?;
        return Ok(Client::Dropped(why));
    }
    write_by(stream, &frame(OK, &[]), deadline)?;
    Ok(Client::Admitted(rank))
}

/// The challenge–response when either side has a shared secret: `None` when the client may go
/// on (`context` then holds the hello and rank 0's nonce, for sealing), else why it is refused.
fn authenticate(
    stream: &mut TcpStream,
    env: &DistEnv,
    hello: &[u8; HELLO],
    context: &mut Vec<u8>,
    deadline: Instant,
) -> std::io::Result<Option<String>> {
    let client_has_secret = hello[32] == 1;
    let Some(k) = &env.secret else {
        return Ok(client_has_secret.then(|| {
            format!("rank 0 has no shared secret and this rank has one: set {SECRET_VAR} on every rank, or on none")
        }));
    };
    if !client_has_secret {
        return Ok(Some(format!(
            "rank 0 requires the job's shared secret ({SECRET_VAR}) and this rank has none"
        )));
    }
    let ns = secret::nonce().map_err(std::io::Error::other)?;
    let mut challenge = ns.to_vec();
    challenge.extend_from_slice(&k.prove(&[b"rank 0", hello, &ns]));
    write_by(stream, &frame(CHALLENGE, &challenge), deadline)?;
    let mut proof = [0u8; secret::TAG];
    read_by(stream, &mut proof, deadline)?;
    if !k.check(&[b"rank", hello, &ns], &proof) {
        return Ok(Some("the proof of the shared secret is wrong".into()));
    }
    context.extend_from_slice(&ns);
    Ok(None)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::TcpListener;

    /// A full table (too many connections awaiting admission, or too many in all) makes room
    /// by closing the oldest silent connection, then the oldest whose hello came but not its
    /// proof (a real rank between the two); a proven one never, and admitted sessions do not
    /// count against the bound on connections awaiting admission.
    #[test]
    fn admission_evicts_silent_connections_before_helloed_ones() {
        let l = TcpListener::bind(("127.0.0.1", 0)).unwrap();
        let now = Instant::now();
        let mut open: HashMap<u64, Open> = HashMap::new();
        let add = |open: &mut HashMap<u64, Open>, id: u64, stage: u8, age_ms: u64| {
            let handle = TcpStream::connect(l.local_addr().unwrap()).unwrap();
            let since = now - Duration::from_millis(age_ms);
            let stage = Arc::new(AtomicU8::new(stage));
            open.insert(
                id,
                Open {
                    handle,
                    since,
                    stage,
                },
            );
        };
        let (cap, most) = (3, 6);
        add(&mut open, 0, HELLOED, 900);
        add(&mut open, 1, SILENT, 10);
        assert!(admit(&mut open, cap, most) && open.len() == 2, "room");
        add(&mut open, 2, SILENT, 300);
        assert!(
            admit(&mut open, cap, most) && !open.contains_key(&2),
            "three await admission: the oldest silent one goes"
        );
        for (id, age) in [(3, 2000), (4, 1), (5, 1)] {
            add(&mut open, id, PROVEN, age);
        }
        assert!(
            admit(&mut open, cap, most) && open.len() == 5,
            "admitted sessions take no slot of the cap"
        );
        add(&mut open, 6, HELLOED, 5);
        assert!(
            admit(&mut open, cap, most) && !open.contains_key(&1),
            "six in all: the silent one goes"
        );
        add(&mut open, 7, PROVEN, 1);
        assert!(
            admit(&mut open, cap, most) && !open.contains_key(&0),
            "then the oldest helloed one"
        );
        add(&mut open, 8, PROVEN, 1);
        assert!(admit(&mut open, cap, most) && !open.contains_key(&6));
        add(&mut open, 9, PROVEN, 1);
        assert!(!admit(&mut open, cap, most), "every connection proven");
        assert_eq!(open.len(), 6);
    }
}
