//! One admitted connection to the store rank 0 hosts: PyTorch TCPStore's requests (the wire
//! format [`crate::store`] describes) answered from the [`Table`], until the client hangs up,
//! breaks the protocol or the store stops.
//!
//! The requests served: VALIDATE, PING, SET, GET, ADD, CHECK, WAIT and CANCEL_WAIT. Any other
//! query type, a VALIDATE with another magic, a GET of a key that is not set (PyTorch's clients
//! WAIT first), a key or value over the table's bounds, or a request that does not arrive
//! whole within [`crate::CLIENT_DEADLINE`] of its first byte ends the session.

use std::io::{ErrorKind, Read};
use std::net::TcpStream;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use crate::store::{
    ADD, CANCEL_WAIT, CHECK, GET, MAGIC, NOT_READY, PING, READY, SET, STOP_WAITING, VALIDATE, WAIT,
    WAIT_CANCELED,
};
use crate::table::{Table, MAX_KEY, MAX_KEYS_PER_REQUEST, MAX_VALUE};
use crate::wire::{read_by, write_by};
use crate::CLIENT_DEADLINE;

/// How often an idle session looks whether the store is stopping.
const POLL: Duration = Duration::from_millis(100);
/// How often a WAIT looks for the client's CANCEL_WAIT (a set key wakes it at once).
const WAIT_POLL: Duration = Duration::from_millis(10);

/// Serves `stream`'s requests from `table` until the client hangs up (`Ok` with why the session
/// ended) or `stop` is set; an I/O failure or a broken protocol is the error.
pub(crate) fn serve(
    stream: &mut TcpStream,
    table: &Table,
    stop: &AtomicBool,
) -> std::io::Result<String> {
    loop {
        let Some(query) = next_query(stream, stop)? else {
            return Ok("closed by the client".into());
        };
        let by = Instant::now() + CLIENT_DEADLINE;
        match query {
            VALIDATE => {
                if u32::from_le_bytes(read_n(stream, by)?) != MAGIC {
                    return Err(broken("VALIDATE with another magic"));
                }
            }
            PING => {
                let nonce: [u8; 4] = read_n(stream, by)?;
                write_by(stream, &nonce, by)?;
            }
            SET => {
                let key = read_key(stream, by)?;
                let value = read_bytes(stream, MAX_VALUE, by)?;
                table.set(&key, &value).map_err(std::io::Error::other)?;
            }
            GET => {
                let key = read_key(stream, by)?;
                let Some(v) = table.value(&key) else {
                    return Err(broken(&format!("GET of {key:?}, which is not set")));
                };
                let mut answer = (v.len() as u64).to_le_bytes().to_vec();
                answer.extend_from_slice(&v);
                write_by(stream, &answer, by)?;
            }
            ADD => {
                let key = read_key(stream, by)?;
                let delta = i64::from_le_bytes(read_n(stream, by)?);
                let now = table.add(&key, delta).map_err(std::io::Error::other)?;
                write_by(stream, &now.to_le_bytes(), by)?;
            }
            CHECK => {
                let keys = read_keys(stream, by)?;
                let ready = if table.all_set(&keys) {
                    READY
                } else {
                    NOT_READY
                };
                write_by(stream, &[ready], by)?;
            }
            WAIT => {
                let keys = read_keys(stream, by)?;
                if !wait(stream, table, &keys, stop)? {
                    return Ok("the store stopped during a WAIT".into());
                }
            }
            // A cancellation that crossed its WAIT's answer: confirmed all the same, as the
            // client reads until it sees the confirmation.
            CANCEL_WAIT => write_by(stream, &[WAIT_CANCELED], by)?,
            other => {
                return Err(broken(&format!(
                    "query type {other}, which this store does not serve"
                )))
            }
        }
    }
}

/// A WAIT for `keys`: STOP_WAITING once all are set, or WAIT_CANCELED when the client sends
/// CANCEL_WAIT first. False when the store stops meanwhile.
fn wait(
    stream: &mut TcpStream,
    table: &Table,
    keys: &[String],
    stop: &AtomicBool,
) -> std::io::Result<bool> {
    loop {
        if table.wait_until(keys, Instant::now() + WAIT_POLL) {
            write_by(stream, &[STOP_WAITING], Instant::now() + CLIENT_DEADLINE)?;
            return Ok(true);
        }
        if stop.load(Ordering::Relaxed) {
            return Ok(false);
        }
        stream.set_nonblocking(true)?;
        let mut b = [0u8; 1];
        let got = stream.read(&mut b);
        stream.set_nonblocking(false)?;
        match got {
            Ok(0) => return Err(ErrorKind::UnexpectedEof.into()),
            Ok(_) if b[0] == CANCEL_WAIT => {
                write_by(stream, &[WAIT_CANCELED], Instant::now() + CLIENT_DEADLINE)?;
                return Ok(true);
            }
            Ok(_) => return Err(broken(&format!("query type {} during a WAIT", b[0]))),
            Err(e) if e.kind() == ErrorKind::WouldBlock => {}
            Err(e) => return Err(e),
        }
    }
}

/// The next request's query byte, waiting as long as the client likes (a progress board's
/// connection idles between reports); `None` once the client hangs up or the store stops.
fn next_query(stream: &mut TcpStream, stop: &AtomicBool) -> std::io::Result<Option<u8>> {
    stream.set_read_timeout(Some(POLL))?;
    let mut b = [0u8; 1];
    loop {
        if stop.load(Ordering::Relaxed) {
            return Ok(None);
        }
        match stream.read(&mut b) {
            Ok(0) => return Ok(None),
            Ok(_) => return Ok(Some(b[0])),
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {}
            Err(e) if e.kind() == ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
}

fn broken(what: &str) -> std::io::Error {
    std::io::Error::new(ErrorKind::InvalidData, format!("store protocol: {what}"))
}

fn read_n<const N: usize>(stream: &mut TcpStream, by: Instant) -> std::io::Result<[u8; N]> {
    let mut b = [0u8; N];
    read_by(stream, &mut b, by)?;
    Ok(b)
}

/// A u64 length and that many bytes, refused beyond `most`.
fn read_bytes(stream: &mut TcpStream, most: usize, by: Instant) -> std::io::Result<Vec<u8>> {
    let len = u64::from_le_bytes(read_n(stream, by)?);
    if len > most as u64 {
        return Err(broken(&format!("a length of {len} (at most {most})")));
    }
    let mut v = vec![0u8; len as usize];
    read_by(stream, &mut v, by)?;
    Ok(v)
}

fn read_key(stream: &mut TcpStream, by: Instant) -> std::io::Result<String> {
    String::from_utf8(read_bytes(stream, MAX_KEY, by)?).map_err(|_| broken("a key not in UTF-8"))
}

/// A u64 count and that many keys.
fn read_keys(stream: &mut TcpStream, by: Instant) -> std::io::Result<Vec<String>> {
    let n = u64::from_le_bytes(read_n(stream, by)?);
    if n > MAX_KEYS_PER_REQUEST as u64 {
        return Err(broken(&format!(
            "{n} keys in one request (at most {MAX_KEYS_PER_REQUEST})"
        )));
    }
    (0..n).map(|_| read_key(stream, by)).collect()
}
