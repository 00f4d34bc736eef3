//! A client of PyTorch's TCPStore (the c10d key-value store that `torchrun`'s agent serves to
//! its workers): enough of the wire protocol to rendezvous through it — connect with the
//! validation handshake, `set`, `get` (which waits for the key) and `add`.
//!
//! Supported servers: PyTorch 2.5 and later ([`OLDEST_PYTORCH`]), both back-ends; an older one
//! closes the connection at the handshake's PING, which this client reports by name.
//!
//! Wire format (PyTorch 2.5 and later, both of its server back-ends): every request starts with one byte,
//! the query type; byte strings are a u64 length and the bytes, integers i64, counts u64, all
//! little-endian. A connection opens with VALIDATE and the magic `0x3C85F7CE` (no answer), then
//! PING with a nonce the server echoes. SET has no answer; GET answers the value; WAIT answers
//! one byte (0, stop waiting) once every key exists; CANCEL_WAIT answers 1 (after a 0 that may
//! still be in flight); ADD answers the new value; CHECK (a count and the keys, as WAIT)
//! answers one byte at once, 0 when every key exists, 1 when one does not. PyTorch's own clients put `/` before every
//! key; so does this one.

use std::io::{Read, Write};
use std::net::{IpAddr, SocketAddr, TcpStream, ToSocketAddrs};
use std::time::{Duration, Instant};

use crate::{bail, Result};

pub(crate) const VALIDATE: u8 = 0;
pub(crate) const SET: u8 = 1;
pub(crate) const GET: u8 = 3;
pub(crate) const ADD: u8 = 4;
pub(crate) const CHECK: u8 = 5;
pub(crate) const WAIT: u8 = 6;
pub(crate) const CANCEL_WAIT: u8 = 12;
pub(crate) const PING: u8 = 13;
pub(crate) const MAGIC: u32 = 0x3C85_F7CE;
pub(crate) const STOP_WAITING: u8 = 0;
pub(crate) const WAIT_CANCELED: u8 = 1;
/// CHECK's answers.
pub(crate) const READY: u8 = 0;
pub(crate) const NOT_READY: u8 = 1;

/// The oldest PyTorch whose TCPStore servers (classic and libuv) this client speaks to: the
/// first with PING. Tested against 2.5.1 and 2.15.0, and refused by name against 2.4.1
/// (`scripts/test-torch-versions.sh`).
pub const OLDEST_PYTORCH: &str = "2.5";

/// The largest value this client accepts from a server: a rendezvous payload is small; a
/// length beyond this is garbage (or not a TCPStore), not something to allocate.
pub const MAX_VALUE_BYTES: u64 = 1 << 20;

/// One connection to a TCPStore server.
///
/// Requests go one at a time. After any failure (a timeout, a short read) a late answer may
/// still be on its way, so the client refuses further requests: connect again.
#[derive(Debug)]
pub struct TcpStoreClient {
    stream: TcpStream,
    peer: String,
    /// Set by the first failed exchange.
    poisoned: bool,
}

fn err(peer: &str, what: impl std::fmt::Display) -> crate::Error {
    crate::Error::Msg(format!("TCPStore at {peer}: {what}"))
}

/// Time a GET's answer may take once its WAIT has seen the key, past the caller's deadline.
const GET_GRACE: Duration = Duration::from_secs(5);

/// Time left until `deadline`, at least 1 ms (socket timeouts refuse zero).
pub(crate) fn remaining(deadline: Instant) -> Duration {
    deadline
        .saturating_duration_since(Instant::now())
        .max(Duration::from_millis(1))
}

/// The addresses `host:port` resolves to, by `deadline`: the system's resolver (`getaddrinfo`,
/// which has timeouts of its own, tens of seconds with an unreachable DNS server) runs on a
/// thread of its own, and a lookup still running at the deadline is left to finish there, its
/// answer unused. An address literal is parsed at once.
///
/// # Errors
/// The resolver's error, or `TimedOut` at the deadline.
pub(crate) fn resolve(
    host: &str,
    port: u16,
    deadline: Instant,
) -> std::io::Result<Vec<SocketAddr>> {
    if let Ok(ip) = host
        .trim_start_matches('[')
        .trim_end_matches(']')
        .parse::<IpAddr>()
    {
        return Ok(vec![SocketAddr::new(ip, port)]);
    }
    let host = host.to_string();
    resolve_with(
        move || {
            (host.as_str(), port)
                .to_socket_addrs()
                .map(Iterator::collect)
        },
        deadline,
    )
}

/// [`resolve`] with the lookup given: `lookup` runs on a thread of its own, awaited until
/// `deadline`.
pub(crate) fn resolve_with(
    lookup: impl FnOnce() -> std::io::Result<Vec<SocketAddr>> + Send + 'static,
    deadline: Instant,
) -> std::io::Result<Vec<SocketAddr>> {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::Builder::new()
        .name("resolve".into())
        .spawn(move || {
            let _ = tx.send(lookup());
        })?;
    match rx.recv_timeout(remaining(deadline)) {
        Ok(found) => found,
        Err(_) => Err(std::io::Error::new(
            std::io::ErrorKind::TimedOut,
            "name resolution did not finish by the deadline",
        )),
    }
}

/// Connects to `host:port`, trying every address it resolves to (IPv4 and IPv6), retrying
/// until `deadline` while nothing listens yet. Returns the connected stream and its address.
pub(crate) fn connect_any(host: &str, port: u16, deadline: Instant) -> Result<(TcpStream, String)> {
    let mut last = String::from("nothing tried");
    loop {
        match resolve(host, port, deadline) {
            Ok(addrs) => {
                for a in addrs {
                    match TcpStream::connect_timeout(
                        &a,
                        remaining(deadline).min(Duration::from_secs(5)),
                    ) {
                        Ok(s) => return Ok((s, a.to_string())),
                        Err(e) => last = format!("{a}: {e}"),
                    }
                }
            }
            Err(e) => last = format!("resolving {host}: {e}"),
        }
        if Instant::now() >= deadline {
            bail!("cannot connect to {host}:{port} (last error: {last})")
        }
        log::debug!("store: {host}:{port} not reachable yet ({last}); retrying");
        std::thread::sleep(Duration::from_millis(50));
    }
}

impl TcpStoreClient {
    /// Connects and validates (VALIDATE, then a PING whose nonce must come back), retrying the
    /// connection until `deadline`.
    ///
    /// # Errors
    ///
    /// When no address of `host:port` accepts a connection before `deadline`; when the socket
    /// options cannot be set; when sending the handshake or reading the PING answer fails or does
    /// not finish by `deadline`; or when the answer does not echo the nonce (the peer is not a
    /// TCPStore).
    pub fn connect(host: &str, port: u16, deadline: Instant) -> Result<Self> {
        let (stream, peer) = connect_any(host, port, deadline)?;
        Self::over(stream, peer, deadline)
    }

    /// The handshake (VALIDATE, then PING) on a connection already open to `peer`: a store
    /// session of the store rank 0 hosts, once it has admitted this rank.
    ///
    /// # Errors
    /// As [`TcpStoreClient::connect`], but for the connection itself.
    pub(crate) fn over(stream: TcpStream, peer: String, deadline: Instant) -> Result<Self> {
        stream.set_nodelay(true)?;
        let mut c = Self {
            stream,
            peer,
            poisoned: false,
        };
        c.deadline(deadline)?;
        let mut hello = vec![VALIDATE];
        hello.extend(MAGIC.to_le_bytes());
        let nonce = std::process::id() ^ 0x5A5A_0000;
        hello.push(PING);
        hello.extend(nonce.to_le_bytes());
        c.send(&hello)?;
        let mut echo = [0u8; 4];
        if let Err(e) = c.stream.read_exact(&mut echo) {
            c.poisoned = true;
            use std::io::ErrorKind::{ConnectionAborted, ConnectionReset, UnexpectedEof};
            let why = if matches!(
                e.kind(),
                UnexpectedEof | ConnectionReset | ConnectionAborted
            ) {
                format!(
                    "the server closed the connection at the handshake's PING ({e}): a TCPStore of PyTorch older than {OLDEST_PYTORCH}, which has no PING, is not supported (supported: PyTorch {OLDEST_PYTORCH} and later)"
                )
            } else {
                format!("reading the PING answer: {e}")
            };
            return Err(err(&c.peer, why));
        }
        if u32::from_le_bytes(echo) != nonce {
            return Err(err(
                &c.peer,
                "the PING answer does not echo the nonce: not a TCPStore",
            ));
        }
        Ok(c)
    }

    /// Sets the socket timeouts for a request, unless an earlier one failed.
    fn deadline(&mut self, deadline: Instant) -> Result<()> {
        if self.poisoned {
            return Err(err(
                &self.peer,
                "an earlier request on this connection failed; connect again",
            ));
        }
        self.stream.set_read_timeout(Some(remaining(deadline)))?;
        self.stream.set_write_timeout(Some(remaining(deadline)))?;
        Ok(())
    }

    fn send(&mut self, bytes: &[u8]) -> Result<()> {
        self.stream.write_all(bytes).map_err(|e| {
            self.poisoned = true;
            err(&self.peer, format!("sending: {e}"))
        })
    }

    fn recv(&mut self, buf: &mut [u8], what: &str) -> Result<()> {
        self.stream.read_exact(buf).map_err(|e| {
            self.poisoned = true;
            err(&self.peer, format!("reading {what}: {e}"))
        })
    }

    fn request(kind: u8, key: &str) -> Vec<u8> {
        let key = format!("/{key}");
        let mut m = vec![kind];
        m.extend((key.len() as u64).to_le_bytes());
        m.extend(key.as_bytes());
        m
    }

    fn push_bytes(m: &mut Vec<u8>, v: &[u8]) {
        m.extend((v.len() as u64).to_le_bytes());
        m.extend(v);
    }

    /// Stores `value` under `key` (the server answers nothing).
    ///
    /// # Errors
    ///
    /// When an earlier request on this connection failed, or when the request cannot be sent by
    /// `deadline` (the connection is then refused for later requests). The server does not answer a
    /// SET, so a value it did not store goes unnoticed.
    pub fn set(&mut self, key: &str, value: &[u8], deadline: Instant) -> Result<()> {
        self.deadline(deadline)?;
        let mut m = Self::request(SET, key);
        Self::push_bytes(&mut m, value);
        self.send(&m)
    }

    /// Adds `delta` to the integer under `key` (0 when absent) and returns the new value.
    ///
    /// # Errors
    ///
    /// When an earlier request on this connection failed, or when the request cannot be sent or its
    /// answer read by `deadline` (the connection is then refused for later requests).
    pub fn add(&mut self, key: &str, delta: i64, deadline: Instant) -> Result<i64> {
        self.deadline(deadline)?;
        let mut m = Self::request(ADD, key);
        m.extend(delta.to_le_bytes());
        self.send(&m)?;
        let mut v = [0u8; 8];
        self.recv(&mut v, "the ADD answer")?;
        Ok(i64::from_le_bytes(v))
    }

    /// Whether `key` exists now (no waiting).
    ///
    /// # Errors
    ///
    /// When an earlier request on this connection failed, when sending or reading does not
    /// finish by `deadline`, or when the server answers with another byte than CHECK's two.
    pub fn check(&mut self, key: &str, deadline: Instant) -> Result<bool> {
        self.deadline(deadline)?;
        let mut m = vec![CHECK];
        m.extend(1u64.to_le_bytes());
        Self::push_bytes(&mut m, format!("/{key}").as_bytes());
        self.send(&m)?;
        let mut b = [0u8; 1];
        self.recv(&mut b, "the CHECK answer")?;
        match b[0] {
            READY => Ok(true),
            NOT_READY => Ok(false),
            other => {
                self.poisoned = true;
                Err(err(&self.peer, format!("unexpected CHECK answer {other}")))
            }
        }
    }

    /// The value under `key`, waiting until some client has set it or `deadline` passes.
    ///
    /// # Errors
    ///
    /// When no client sets `key` before `deadline` (the wait is cancelled; the connection stays
    /// usable once the server confirms the cancellation, and refuses later requests when it does
    /// not within 5 s); when an earlier request on this connection failed; when the server
    /// answers the wait with an unexpected byte or announces a value longer than
    /// [`MAX_VALUE_BYTES`]; or when sending or reading fails or does not finish by `deadline`.
    pub fn get(&mut self, key: &str, deadline: Instant) -> Result<Vec<u8>> {
        self.wait(key, deadline)?;
        // The key exists now: its value is one round trip away, however little of the
        // caller's time is left (a key set just before the deadline is still read).
        self.deadline(deadline.max(Instant::now() + GET_GRACE))?;
        self.send(&Self::request(GET, key))?;
        let mut len = [0u8; 8];
        self.recv(&mut len, "the GET answer")?;
        let len = u64::from_le_bytes(len);
        if len > MAX_VALUE_BYTES {
            self.poisoned = true;
            return Err(err(
                &self.peer,
                format!("announces a value of {len} bytes for {key:?} (at most {MAX_VALUE_BYTES} accepted)"),
            ));
        }
        let mut v = vec![0u8; len as usize];
        self.recv(&mut v, "the GET value")?;
        Ok(v)
    }

    /// WAIT for `key`; past `deadline`, CANCEL_WAIT and an error naming the key.
    ///
    /// # Errors
    ///
    /// As [`TcpStoreClient::get`]'s wait.
    pub fn wait(&mut self, key: &str, deadline: Instant) -> Result<()> {
        self.deadline(deadline)?;
        let mut m = vec![WAIT];
        m.extend(1u64.to_le_bytes());
        let k = format!("/{key}");
        Self::push_bytes(&mut m, k.as_bytes());
        self.send(&m)?;
        let mut b = [0u8; 1];
        match self.stream.read_exact(&mut b) {
            Ok(()) if b[0] == STOP_WAITING => Ok(()),
            Ok(()) => {
                self.poisoned = true;
                Err(err(&self.peer, format!("unexpected WAIT answer {}", b[0])))
            }
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) =>
            {
                let in_step = self.cancel_wait();
                self.poisoned = !in_step;
                let closed = if in_step {
                    ""
                } else {
                    "; the server did not confirm the cancellation, so this connection takes no \
                     further requests"
                };
                Err(err(
                    &self.peer,
                    format!("timed out waiting for key {key:?}{closed}"),
                ))
            }
            Err(e) => {
                self.poisoned = true;
                Err(err(&self.peer, format!("waiting for key {key:?}: {e}")))
            }
        }
    }

    /// CANCEL_WAIT after a WAIT that timed out, then reads until the server confirms (a late
    /// STOP_WAITING may come first). True when it did: the connection is in step again.
    fn cancel_wait(&mut self) -> bool {
        let grace = Some(Duration::from_secs(5));
        if self.stream.set_read_timeout(grace).is_err()
            || self.stream.write_all(&[CANCEL_WAIT]).is_err()
        {
            return false;
        }
        let mut b = [0u8; 1];
        for _ in 0..2 {
            match self.stream.read_exact(&mut b) {
                Ok(()) if b[0] == WAIT_CANCELED => return true,
                Ok(()) if b[0] == STOP_WAITING => {}
                _ => return false,
            }
        }
        false
    }
}

/// A key-value store every rank of a job reaches: what a start-up needs of one, each request
/// bounded by a deadline. [`TcpStoreClient`] speaks to PyTorch's TCPStore (torchrun's agent
/// store); the exchange and the progress reports are written against this trait, not against
/// that client.
///
/// Keys are text, values bytes. A request that fails may leave the store's connection unusable
/// (the implementation says so in its error); the caller connects again.
pub trait Store: Send + std::fmt::Debug {
    /// Stores `value` under `key`, replacing any value there.
    ///
    /// # Errors
    /// When the request cannot be made by `deadline`.
    fn set(&mut self, key: &str, value: &[u8], deadline: Instant) -> Result<()>;

    /// The value under `key`, waiting until some rank has set it.
    ///
    /// # Errors
    /// When `key` is not set by `deadline`, or the request fails.
    fn get(&mut self, key: &str, deadline: Instant) -> Result<Vec<u8>>;

    /// Adds `delta` to the integer under `key` (0 when absent) and returns the new value.
    ///
    /// # Errors
    /// When the request cannot be made or answered by `deadline`.
    fn add(&mut self, key: &str, delta: i64, deadline: Instant) -> Result<i64>;

    /// Whether `key` is set now, without waiting for it.
    ///
    /// # Errors
    /// When the request cannot be made or answered by `deadline`.
    fn check(&mut self, key: &str, deadline: Instant) -> Result<bool>;

    /// Returns once `key` is set.
    ///
    /// # Errors
    /// When `key` is not set by `deadline`, or the request fails.
    fn wait(&mut self, key: &str, deadline: Instant) -> Result<()>;
}

impl Store for TcpStoreClient {
    fn set(&mut self, key: &str, value: &[u8], deadline: Instant) -> Result<()> {
        TcpStoreClient::set(self, key, value, deadline)
    }

    fn get(&mut self, key: &str, deadline: Instant) -> Result<Vec<u8>> {
        TcpStoreClient::get(self, key, deadline)
    }

    fn add(&mut self, key: &str, delta: i64, deadline: Instant) -> Result<i64> {
        TcpStoreClient::add(self, key, delta, deadline)
    }

    fn check(&mut self, key: &str, deadline: Instant) -> Result<bool> {
        TcpStoreClient::check(self, key, deadline)
    }

    fn wait(&mut self, key: &str, deadline: Instant) -> Result<()> {
        TcpStoreClient::wait(self, key, deadline)
    }
}

#[cfg(test)]
mod tests {
    use std::net::TcpListener;
    use std::thread::JoinHandle;

    use super::*;

    /// A server that completes the handshake, lets one WAIT time out, answers its CANCEL_WAIT
    /// with `answer`, then returns every byte the client sends until it hangs up.
    fn one_wait_server(answer: &'static [u8]) -> (u16, JoinHandle<Vec<u8>>) {
        let l = TcpListener::bind(("127.0.0.1", 0)).unwrap();
        let port = l.local_addr().unwrap().port();
        let h = std::thread::spawn(move || {
            let (mut s, _) = l.accept().unwrap();
            let mut hello = [0u8; 10];
            s.read_exact(&mut hello).unwrap();
            s.write_all(&hello[6..]).unwrap();
            // WAIT: the query byte, the key count (u64), then one key (u64 length, bytes).
            let mut head = [0u8; 17];
            s.read_exact(&mut head).unwrap();
            assert_eq!(head[0], WAIT);
            let len = u64::from_le_bytes(head[9..].try_into().unwrap());
            s.read_exact(&mut vec![0u8; len as usize]).unwrap();
            let mut cancel = [0u8; 1];
            s.read_exact(&mut cancel).unwrap();
            assert_eq!(cancel[0], CANCEL_WAIT);
            s.write_all(answer).unwrap();
            let mut rest = Vec::new();
            let _ = s.read_to_end(&mut rest);
            rest
        });
        (port, h)
    }

    fn soon(ms: u64) -> Instant {
        Instant::now() + Duration::from_millis(ms)
    }

    /// The key is set just before the caller's deadline and the GET's answer comes after it:
    /// the value is still read (it used to get a 1 ms read timeout and fail).
    #[test]
    fn a_key_set_at_the_deadline_is_read() {
        let l = TcpListener::bind(("127.0.0.1", 0)).unwrap();
        let port = l.local_addr().unwrap().port();
        let server = std::thread::spawn(move || {
            let (mut s, _) = l.accept().unwrap();
            let mut hello = [0u8; 10];
            s.read_exact(&mut hello).unwrap();
            s.write_all(&hello[6..]).unwrap();
            let mut head = [0u8; 17];
            s.read_exact(&mut head).unwrap();
            assert_eq!(head[0], WAIT);
            let len = u64::from_le_bytes(head[9..].try_into().unwrap());
            s.read_exact(&mut vec![0u8; len as usize]).unwrap();
            std::thread::sleep(Duration::from_millis(700));
            s.write_all(&[STOP_WAITING]).unwrap();
            let mut get = [0u8; 9];
            s.read_exact(&mut get).unwrap();
            assert_eq!(get[0], GET);
            let len = u64::from_le_bytes(get[1..].try_into().unwrap());
            s.read_exact(&mut vec![0u8; len as usize]).unwrap();
            // Answered after the client's deadline (1 s after its start).
            std::thread::sleep(Duration::from_millis(600));
            s.write_all(&1u64.to_le_bytes()).unwrap();
            s.write_all(b"v").unwrap();
        });
        let mut c = TcpStoreClient::connect("127.0.0.1", port, soon(5000)).unwrap();
        assert_eq!(c.get("k", soon(1000)).unwrap(), b"v");
        server.join().unwrap();
    }

    #[test]
    fn a_confirmed_cancellation_leaves_the_connection_usable() {
        let (port, server) = one_wait_server(&[STOP_WAITING, WAIT_CANCELED]);
        let mut c = TcpStoreClient::connect("127.0.0.1", port, soon(5000)).unwrap();
        let e = c.get("never", soon(200)).unwrap_err().to_string();
        assert!(e.ends_with("timed out waiting for key \"never\""), "{e}");
        c.set("k", b"v", soon(5000)).unwrap();
        drop(c);
        let rest = server.join().unwrap();
        assert_eq!(
            rest.first(),
            Some(&SET),
            "the SET reached the server: {rest:?}"
        );
    }

    #[test]
    fn an_unconfirmed_cancellation_closes_the_connection_to_requests() {
        let (port, server) = one_wait_server(&[9]);
        let mut c = TcpStoreClient::connect("127.0.0.1", port, soon(5000)).unwrap();
        let e = c.get("never", soon(200)).unwrap_err().to_string();
        assert!(e.contains("did not confirm the cancellation"), "{e}");
        let e = c.set("k", b"v", soon(5000)).unwrap_err().to_string();
        assert!(
            e.contains("an earlier request on this connection failed"),
            "{e}"
        );
        drop(c);
        assert_eq!(
            server.join().unwrap(),
            b"",
            "nothing sent after the failure"
        );
    }
}
