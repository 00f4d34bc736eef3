//! A client rank's way into the store rank 0 hosts: the hello, every address tried in turn,
//! the admission read and checked; then the exchange over the admitted session.

use std::net::{SocketAddr, TcpStream};
use std::time::{Duration, Instant};

use crate::store::{remaining, resolve, TcpStoreClient};
use crate::wire::{read_by, write_by};
use crate::{
    bail, secret, DistEnv, Result, CHALLENGE, CLIENT_DEADLINE, MAGIC, MAX_PAYLOAD, OK, SECRET_VAR,
};

/// The run identity as it travels: a 64-bit FNV-1a of the run id, the restart count, the world
/// size and the port, so that ranks of another run or restart, or with another world size,
/// differ. Not a secret: the shared secret, when set, authenticates.
pub(crate) fn identity(env: &DistEnv) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    let text = format!(
        "{}:{}|{}|{}|{}",
        env.run_id.len(),
        env.run_id,
        env.restart,
        env.world_size,
        env.master_port
    );
    for b in text.bytes() {
        h = (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}

/// The hello of one attempt (with a fresh nonce): see the module documentation.
pub(crate) fn hello(env: &DistEnv, seq: u64) -> Result<Vec<u8>> {
    let mut hello = MAGIC.to_vec();
    hello.extend_from_slice(&identity(env).to_le_bytes());
    hello.extend_from_slice(&seq.to_le_bytes());
    hello.extend_from_slice(&(env.rank as u32).to_le_bytes());
    hello.extend_from_slice(&(env.world_size as u32).to_le_bytes());
    hello.push(u8::from(env.secret.is_some()));
    hello.extend_from_slice(&secret::nonce()?);
    debug_assert_eq!(hello.len(), crate::wire::HELLO);
    Ok(hello)
}

/// One answer frame from `addr`: its status and body, or why the exchange cannot succeed (a
/// length beyond what rank 0 sends); an I/O error or a stranger's bytes are worth a retry.
pub(crate) fn read_answer(
    stream: &mut TcpStream,
    addr: SocketAddr,
    deadline: Instant,
) -> std::io::Result<std::result::Result<(u8, Vec<u8>), String>> {
    let mut head = [0u8; 13];
    read_by(stream, &mut head, deadline)?;
    if &head[..8] != MAGIC {
        return Err(std::io::Error::other(
            "the answer is not from a candle-distributed rank 0",
        ));
    }
    let len = u32::from_le_bytes(head[9..13].try_into().expect("4 bytes")) as usize;
    let most = MAX_PAYLOAD + secret::SEAL_OVERHEAD;
    if len > most {
        return Ok(Err(format!(
            "{addr} announces {len} bytes (at most {most} accepted): not a rank 0 of ours"
        )));
    }
    let mut body = vec![0u8; len];
    read_by(stream, &mut body, deadline)?;
    Ok(Ok((head[8], body)))
}

/// One attempt of a client rank at `addr`: the admitted connection, or why admission cannot
/// succeed (rank 0's refusal, a length beyond what rank 0 sends, a disagreement on the shared
/// secret's use); an I/O error, or an answer that does not prove the secret, is worth a retry.
/// The admission, connect and hello together, takes at most [`CLIENT_DEADLINE`] (as rank 0
/// grants each client): an address that accepts and then says nothing costs one attempt, not
/// the whole timeout.
pub(crate) fn admit_at(
    addr: SocketAddr,
    env: &DistEnv,
    seq: u64,
    deadline: Instant,
) -> std::io::Result<std::result::Result<TcpStream, String>> {
    let hello = hello(env, seq).map_err(std::io::Error::other)?;
    let deadline = deadline.min(Instant::now() + CLIENT_DEADLINE);
    let mut stream = TcpStream::connect_timeout(&addr, remaining(deadline))?;
    write_by(&mut stream, &hello, deadline)?;
    // With a secret, nothing unproven ends the attempt for good: an oversized frame is retried.
    let unproven = |why: String| match env.secret {
        Some(_) => Err(std::io::Error::other(why)),
        None => Ok(Err(why)),
    };
    let (mut status, mut body) = match read_answer(&mut stream, addr, deadline)? {
        Ok(answer) => answer,
        Err(why) => return unproven(why),
    };
    match (&env.secret, status) {
        (None, CHALLENGE) => {
            return Ok(Err(format!(
                "rank 0 at {addr} requires the job's shared secret and this rank has none: set {SECRET_VAR} on every rank"
            )))
        }
        (Some(k), CHALLENGE) => {
            if body.len() != secret::NONCE + secret::TAG {
                return Err(std::io::Error::other("a malformed challenge"));
            }
            let (ns, proof) = body.split_at(secret::NONCE);
            if !k.check(&[b"rank 0", &hello, ns], proof) {
                return Err(std::io::Error::other(format!(
                    "{addr} does not prove the job's shared secret (not our rank 0, or its {SECRET_VAR} differs)"
                )));
            }
            write_by(&mut stream, &k.prove(&[b"rank", &hello, ns]), deadline)?;
            (status, body) = match read_answer(&mut stream, addr, deadline)? {
                Ok(answer) => answer,
                Err(why) => return unproven(why),
            };
        }
        (Some(_), OK) => {
            return Err(std::io::Error::other(format!(
                "rank 0 at {addr} answered without the shared secret's challenge: set {SECRET_VAR} on every rank, or on none"
            )))
        }
        _ => {}
    }
    match status {
        OK if body.is_empty() => Ok(Ok(stream)),
        OK => unproven(format!(
            "{addr} admits with a body of {} bytes: not a rank 0 of this version",
            body.len()
        )),
        // With a secret, a refusal carries no proof (anyone on the way could send it): retried
        // until the timeout, whose message quotes it. Without one, it ends this rank at once.
        _ if env.secret.is_some() => Err(std::io::Error::other(format!(
            "an unproven refusal (anyone on the way could have sent it): {}",
            peer_text(&body)
        ))),
        _ => Ok(Err(format!("refused by rank 0: {}", peer_text(&body)))),
    }
}

/// Text a peer sent, as an error may quote it: its first 200 bytes in quotes, control
/// characters and quotes escaped (no terminal escape sequence or line break reaches the
/// user's log), and the full length when longer.
pub(crate) fn peer_text(body: &[u8]) -> String {
    const MOST: usize = 200;
    let shown = String::from_utf8_lossy(&body[..body.len().min(MOST)]);
    let more = match body.len() > MOST {
        true => format!(" … ({} bytes in all)", body.len()),
        false => String::new(),
    };
    let escaped: String = shown
        .chars()
        .map(|c| match c.is_control() || c == '"' || c == '\\' {
            true => c.escape_default().collect(),
            false => c.to_string(),
        })
        .collect();
    format!("\"{escaped}\"{more}")
}

/// A session of the store rank 0 hosts, admitted as rank `env.rank` at rendezvous `seq`
/// ([`SESSION`](crate::SESSION) for one that serves no rendezvous): every address `MASTER_ADDR`
/// resolves to is tried in turn, backing off, until `deadline` (`timeout` is named in the error).
///
/// # Errors
/// Rank 0's refusal (without a shared secret), a disagreement on the secret's use, or the
/// deadline passing, with the last attempt's error.
pub(crate) fn session(
    env: &DistEnv,
    seq: u64,
    deadline: Instant,
    timeout: Duration,
) -> Result<TcpStoreClient> {
    // Every address the name resolves to, in turn: one that refuses, answers garbage, stays
    // silent or is not rank 0 does not keep a rank from the others.
    let mut attempt = 0usize;
    // The last attempt's error, unless the deadline cut that attempt short: then the one
    // before, which says more (a refused connection, an answer that does not prove the secret).
    let mut last_err = String::new();
    loop {
        let this_err = match resolve(&env.master_addr, env.master_port, deadline) {
            Ok(addrs) => {
                if addrs.is_empty() {
                    "the address resolves to nothing".to_string()
                } else {
                    let a = addrs[attempt % addrs.len()];
                    match admit_at(a, env, seq, deadline) {
                        Ok(Ok(stream)) => {
                            match TcpStoreClient::over(stream, a.to_string(), deadline) {
                                Ok(store) => return Ok(store),
                                Err(e) => format!("{a}: {e}"),
                            }
                        }
                        Ok(Err(why)) => bail!("bootstrap: rank {}: {why}", env.rank),
                        Err(e) => format!("{a}: {e}"),
                    }
                }
            }
            Err(e) => format!("resolving {}: {e}", env.master_addr),
        };
        attempt += 1;
        let cut_short = Instant::now() >= deadline;
        if !cut_short || last_err.is_empty() {
            last_err = this_err;
        }
        if cut_short {
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
        // Backing off, 50 ms doubling up to 1 s: a rank early by minutes (or many of them)
        // does not hammer rank 0.
        let pause = Duration::from_millis(50) * 2u32.saturating_pow(attempt.min(5) as u32);
        std::thread::sleep(pause.min(Duration::from_secs(1)).min(remaining(deadline)));
    }
}
