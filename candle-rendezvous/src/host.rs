//! The store rank 0 hosts when no launcher serves one (any launch but torchrun's): it speaks
//! PyTorch TCPStore's requests, behind this crate's admission (the hello with the run identity,
//! and with a shared key, its proof). It lives while rank 0 holds a [`crate::JobStore`] of it
//! (a communicator's progress board holds one), and one process hosts one per port.

use std::collections::HashMap;
use std::net::TcpListener;
use std::sync::atomic::{AtomicBool, AtomicU8, Ordering};
use std::sync::{mpsc, Arc, Mutex, Weak};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::client::identity;
use crate::server::{
    admission, admit, listeners, max_handlers, max_sessions, Client, Open, Throttle,
};
use crate::server::{HELLO_DEADLINE, SILENT};
use crate::store::Store;
use crate::table::Table;
use crate::{bail, session, DistEnv, Result, CLIENT_DEADLINE};

/// Dropped connections remembered for rank 0's error, at most.
const REMEMBERED: usize = 64;

/// What the sessions and rank 0 share.
#[derive(Debug, Default)]
pub(crate) struct Shared {
    pub table: Table,
    stop: AtomicBool,
    /// The newest rendezvous rank 0 has begun: a client behind it is refused.
    latest: Mutex<Option<u64>>,
    /// Why connections were dropped (the first [`REMEMBERED`]), for rank 0's error.
    dropped: Mutex<Vec<String>>,
}

impl Shared {
    fn note_dropped(&self, why: String) {
        let mut d = self.dropped.lock().unwrap_or_else(|e| e.into_inner());
        if d.len() < REMEMBERED {
            d.push(why);
        }
    }
}

/// The store rank 0 hosts on `MASTER_ADDR:MASTER_PORT`; stops when dropped.
#[derive(Debug)]
pub(crate) struct Host {
    pub shared: Arc<Shared>,
    port: u16,
    accept: Option<JoinHandle<()>>,
}

/// The hosts of this process, by port: a second [`crate::JobStore`] on a port shares the first's.
static HOSTS: Mutex<Vec<(u16, u64, Weak<Host>)>> = Mutex::new(Vec::new());

impl Host {
    /// This process's host for `env`'s job, started (listening) if none runs.
    ///
    /// # Errors
    /// `MASTER_ADDR` does not resolve by `deadline`, the port cannot be bound (another process
    /// holds it), or the accepting thread cannot be started.
    pub fn get_or_start(env: &DistEnv, deadline: Instant) -> Result<Arc<Host>> {
        let id = identity(env);
        loop {
            let mut hosts = HOSTS.lock().unwrap_or_else(|e| e.into_inner());
            let mine = hosts.iter().find(|(p, _, _)| *p == env.master_port);
            match mine.map(|(_, i, w)| (*i, w.upgrade())) {
                Some((i, Some(h))) if i == id => return Ok(h),
                Some((_, Some(_))) => bail!(
                    "bootstrap: rank 0: this process already hosts the store of another run or restart on port {}",
                    env.master_port
                ),
                // Stopping: its listeners close before its entry goes.
                Some((_, None)) if Instant::now() < deadline => {
                    drop(hosts);
                    std::thread::sleep(Duration::from_millis(5));
                    continue;
                }
                Some((_, None)) => bail!(
                    "bootstrap: rank 0: the previous store on port {} did not stop in time",
                    env.master_port
                ),
                None => {}
            }
            let host = Arc::new(Self::start(env, deadline)?);
            hosts.push((env.master_port, id, Arc::downgrade(&host)));
            return Ok(host);
        }
    }

    fn start(env: &DistEnv, deadline: Instant) -> Result<Host> {
        let listeners = listeners(env, deadline)?;
        let shared = Arc::new(Shared::default());
        let (env2, shared2) = (env.clone(), shared.clone());
        let accept = std::thread::Builder::new()
            .name("store-host".into())
            .spawn(move || accept_loop(&listeners, &env2, &shared2))?;
        Ok(Host {
            shared,
            port: env.master_port,
            accept: Some(accept),
        })
    }

    /// Rank 0 begins rendezvous `seq`: clients still at an earlier one are refused from now.
    pub fn begin(&self, seq: u64) {
        let mut l = self.shared.latest.lock().unwrap_or_else(|e| e.into_inner());
        *l = Some(l.map_or(seq, |l| l.max(seq)));
    }

    /// The first connections dropped so far, and why.
    pub fn dropped(&self) -> Vec<String> {
        self.shared
            .dropped
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }
}

impl Drop for Host {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.accept.take() {
            let _ = t.join();
        }
        let mut hosts = HOSTS.lock().unwrap_or_else(|e| e.into_inner());
        hosts.retain(|(p, _, w)| !(*p == self.port && w.strong_count() == 0));
    }
}

/// Accepts and admits connections, each on a thread of its own, until the host stops; then
/// closes every connection and waits for their threads.
fn accept_loop(listeners: &[TcpListener], env: &DistEnv, shared: &Arc<Shared>) {
    let (tx, rx) = mpsc::channel::<u64>();
    let mut open: HashMap<u64, Open> = HashMap::new();
    let mut threads: HashMap<u64, JoinHandle<()>> = HashMap::new();
    let mut next_conn = 0u64;
    let mut accept_warnings = Throttle::default();
    let (id, cap, most) = (
        identity(env),
        max_handlers(env.world_size),
        max_sessions(env.world_size),
    );
    let mut idle_passes = 0u32;
    while !shared.stop.load(Ordering::Relaxed) {
        let mut idle = true;
        for l in listeners {
            match l.accept() {
                Ok((stream, _)) if !admit(&mut open, cap, most) => {
                    // Over the bounds, every connection proven: closed now, the client retries.
                    idle = false;
                    drop(stream);
                    shared.note_dropped(format!(
                        "over {cap} connections awaiting admission or {most} in all: closed"
                    ));
                }
                Ok((stream, peer)) => {
                    idle = false;
                    let Ok(handle) = stream.try_clone() else {
                        continue; // no descriptor for the handle: closed, retried
                    };
                    let conn = next_conn;
                    next_conn += 1;
                    let now = Instant::now();
                    let deadlines = (now + HELLO_DEADLINE, now + CLIENT_DEADLINE);
                    let stage = Arc::new(AtomicU8::new(SILENT));
                    let latest = *shared.latest.lock().unwrap_or_else(|e| e.into_inner());
                    let (mark, env, mine, tx) =
                        (stage.clone(), env.clone(), shared.clone(), tx.clone());
                    let spawned = std::thread::Builder::new()
                        .name("store-session".into())
                        .spawn(move || {
                            let mut stream = stream;
                            let why =
                                match admission(&mut stream, &env, id, latest, deadlines, &mark) {
                                    Ok(Client::Admitted(rank)) => {
                                        match session::serve(&mut stream, &mine.table, &mine.stop) {
                                            Ok(_) => None,
                                            Err(e) => Some(format!("{peer} (rank {rank}): {e}")),
                                        }
                                    }
                                    Ok(Client::Dropped(why)) => Some(format!("{peer}: {why}")),
                                    Err(e) => Some(format!("{peer}: {e}")),
                                };
                            if let Some(why) = why {
                                log::debug!("store: rank 0 dropped {why}");
                                mine.note_dropped(why);
                            }
                            let _ = tx.send(conn);
                        });
                    match spawned {
                        Ok(t) => {
                            threads.insert(conn, t);
                            open.insert(
                                conn,
                                Open {
                                    handle,
                                    since: now,
                                    stage,
                                },
                            );
                        }
                        Err(e) => {
                            // No thread to be had: the connection is closed (with the closure
                            // that owned it) and the client retries.
                            log::warn!("bootstrap: rank 0: cannot start a thread for {peer}: {e}");
                            shared.note_dropped(format!("{peer}: no thread: {e}"));
                        }
                    }
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
                Err(e) => {
                    // Out of descriptors (EMFILE) or the like: the connection stays in the
                    // backlog until one is free.
                    match accept_warnings.admit(Instant::now()) {
                        Some(0) => log::warn!("bootstrap: rank 0: accept failed: {e}"),
                        Some(n) => log::warn!(
                            "bootstrap: rank 0: accept failed: {e} ({n} more since the last warning)"
                        ),
                        None => {}
                    }
                    shared.note_dropped(format!("accept: {e}"));
                }
            }
        }
        while let Ok(conn) = rx.try_recv() {
            open.remove(&conn);
            if let Some(t) = threads.remove(&conn) {
                let _ = t.join();
            }
        }
        // Quick while connections come, slower once idle (the host lives as long as rank 0's
        // communicator): 2 ms doubling to 32 ms.
        idle_passes = if idle {
            idle_passes.saturating_add(1)
        } else {
            0
        };
        if idle {
            std::thread::sleep(Duration::from_millis(1 << idle_passes.min(5)));
        }
    }
    for c in open.values() {
        let _ = c.handle.shutdown(std::net::Shutdown::Both);
    }
    for (_, t) in threads {
        let _ = t.join();
    }
}

/// Rank 0's own access to the store it hosts, without a connection.
#[derive(Debug, Clone)]
pub(crate) struct LocalStore(pub Arc<Host>);

/// Keys as PyTorch's clients (and [`crate::TcpStoreClient`]) send them: behind a `/`.
fn wire_key(key: &str) -> String {
    format!("/{key}")
}

impl Store for LocalStore {
    fn set(&mut self, key: &str, value: &[u8], _deadline: Instant) -> Result<()> {
        self.0.shared.table.set(&wire_key(key), value)
    }

    fn get(&mut self, key: &str, deadline: Instant) -> Result<Vec<u8>> {
        self.wait(key, deadline)?;
        Ok(self
            .0
            .shared
            .table
            .value(&wire_key(key))
            .expect("a set key stays set"))
    }

    fn add(&mut self, key: &str, delta: i64, _deadline: Instant) -> Result<i64> {
        self.0.shared.table.add(&wire_key(key), delta)
    }

    fn check(&mut self, key: &str, _deadline: Instant) -> Result<bool> {
        Ok(self.0.shared.table.all_set(&[wire_key(key)]))
    }

    fn wait(&mut self, key: &str, deadline: Instant) -> Result<()> {
        if self.0.shared.table.wait_until(&[wire_key(key)], deadline) {
            Ok(())
        } else {
            bail!("rank 0's store: timed out waiting for key {key:?}")
        }
    }
}
