//! The exchange against real sockets: retries, foreign and garbled clients, deadlines.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::Barrier;
use std::time::{Duration, Instant};

use super::client::{hello, read_answer};
use super::store::connect_any;
use super::stored::{open_per_rank, per_rank_context, per_rank_key, unseal_stored};
use super::wire::write_by;
use super::wire::HELLO;
use super::*;
use std::collections::HashMap;

fn env_at(rank: usize, world: usize, addr: &str, port: u16, job: &str) -> DistEnv {
    DistEnv {
        rank,
        world_size: world,
        local_rank: rank,
        local_world_size: None,
        master_addr: addr.into(),
        master_port: port,
        run_id: job.into(),
        restart: 0,
        agent_store: false,
        secret: None,
    }
}

fn env(rank: usize, world: usize, port: u16) -> DistEnv {
    env_at(rank, world, "127.0.0.1", port, "run")
}

/// `env(rank, world, port)` holding the secret `secret` (`None`: no secret).
fn env_secret(rank: usize, world: usize, port: u16, secret: Option<&str>) -> DistEnv {
    DistEnv {
        secret: secret.map(test_key),
        ..env(rank, world, port)
    }
}

/// A key made from a test's name for it: the text's bytes with the top bit set (a
/// `Secret` refuses bytes that are all printable text).
fn test_key(name: &str) -> Secret {
    Secret::new(name.bytes().map(|b| b | 0x80).collect::<Vec<u8>>()).unwrap()
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

/// Holds the ranks after 0 of [`job`] until its meddler calls [`Go::now`] or returns (or
/// panics): rank 0 serves until the others have their id, so a meddler scheduled late would
/// otherwise find the job over and nobody listening.
struct Go<'a> {
    start: &'a Barrier,
    done: std::cell::Cell<bool>,
}

impl Go<'_> {
    /// Lets the other ranks start (once; later calls do nothing).
    fn now(&self) {
        if !self.done.replace(true) {
            self.start.wait();
        }
    }
}

impl Drop for Go<'_> {
    fn drop(&mut self) {
        self.now();
    }
}

/// Runs `world` ranks of `share_bytes` on `addr:port`, rank 0 sharing `id`, while `meddle`
/// does something to rank 0 on the side (the other ranks start when it says so, see [`Go`]);
/// returns every rank's result and the time taken.
fn job(
    world: usize,
    addr: &str,
    port: u16,
    meddle: impl FnOnce(&Go) + Send,
) -> (Vec<Result<Vec<u8>>>, Duration) {
    let id: Vec<u8> = (0..128u32).map(|i| (i * 7 + 3) as u8).collect();
    let start = Barrier::new(world);
    let t = Instant::now();
    let got = std::thread::scope(|s| {
        let hs: Vec<_> = (0..world)
            .map(|r| {
                let id = id.clone();
                let start = &start;
                s.spawn(move || {
                    if r > 0 {
                        start.wait();
                    }
                    let p = (r == 0).then_some(id.as_slice());
                    share_bytes_round(&env_at(r, world, addr, port, "job"), 0, p, LONG)
                })
            })
            .collect();
        let start = &start;
        s.spawn(move || {
            let go = Go {
                start,
                done: std::cell::Cell::new(false),
            };
            meddle(&go);
        });
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
        (
            "CANDLE_DISTRIBUTED_SECRET",
            "000102030405060708090a0b0c0d0e0f",
        ),
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
        (e.run_id.as_str(), e.restart, e.agent_store),
        ("abc", 2, true)
    );
    assert_eq!(store_key(&e, 4), "candle-distributed/abc/2/4");
    assert_eq!(
        e.secret,
        Some(Secret::new((0..16u8).collect::<Vec<_>>()).unwrap())
    );
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
    job(4, "127.0.0.1", free_port(), |_| {});
}

#[test]
fn a_missing_rank_times_out_with_its_number() {
    let port = free_port();
    let err = std::thread::scope(|s| {
        let root = s.spawn(|| {
            share_bytes_round(&env(0, 3, port), 0, Some(b"x"), Duration::from_millis(800))
        });
        let one = s.spawn(|| share_bytes_round(&env(1, 3, port), 0, None, Duration::from_secs(5)));
        assert_eq!(one.join().unwrap().unwrap(), b"x");
        root.join().unwrap().unwrap_err().to_string()
    });
    assert!(err.contains("waiting for ranks [2]"), "{err}");
    let lonely = share_bytes_round(&env(1, 2, free_port()), 0, None, Duration::from_millis(300));
    assert!(lonely.unwrap_err().to_string().contains("timed out"));
}

/// A rank of another run (another identity: a client left over from an earlier launch) is
/// refused with the reason, at once; the run on the port completes.
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
            e.contains("refused by rank 0") && e.contains("another run"),
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
    let (_, took) = job(3, "127.0.0.1", port, |go| {
        let (idle, _) =
            connect_any("127.0.0.1", port, Instant::now() + Duration::from_secs(5)).unwrap();
        go.now();
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
    job(3, "127.0.0.1", port, |_| {
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

/// A client already at the next rendezvous while rank 0 still serves this one waits for it
/// (through a new session once rank 0's store of this one stops), and gets the next payload,
/// not this one's.
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
    let port = fake_rank_0(oversized_answer());
    let err = share_bytes_round(&env(1, 2, port), 0, None, Duration::from_millis(400))
        .unwrap_err()
        .to_string();
    assert!(err.contains("announces 4294967295 bytes"), "{err}");
}

/// `localhost` (IPv4 and IPv6 addresses) and the IPv6 loopback work as MASTER_ADDR, where
/// this machine has IPv6.
#[test]
fn ipv6_and_localhost() {
    job(2, "localhost", free_port(), |_| {});
    if TcpListener::bind(("::1", 0)).is_ok() {
        let port = TcpListener::bind(("::1", 0))
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        job(3, "::1", port, |_| {});
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

/// A listener that accepts and never answers holds the port first (a foreign service, an
/// un-accepted backlog), then gives it up to the real rank 0: the client's attempt on the
/// silent connection ends after the per-attempt deadline and the next one reaches rank 0,
/// long before the overall timeout.
#[test]
fn a_silent_listener_costs_one_attempt() {
    let port = free_port();
    let silent = TcpListener::bind(("127.0.0.1", port)).unwrap();
    let timeout = Duration::from_secs(60);
    let t0 = Instant::now();
    let got = std::thread::scope(|s| {
        let client = s.spawn(|| share_bytes_round(&env(1, 2, port), 0, None, timeout));
        // Accepts the client's first connection, keeps it open and says nothing, then closes
        // the listener (not the connection) and lets rank 0 bind the port.
        let (held, _) = silent.accept().unwrap();
        drop(silent);
        let server = s.spawn(|| share_bytes_round(&env(0, 2, port), 0, Some(b"id"), timeout));
        let got = client.join().unwrap();
        server.join().unwrap().unwrap();
        drop(held);
        got
    });
    assert_eq!(got.unwrap(), b"id");
    let took = t0.elapsed();
    assert!(
        took < CLIENT_DEADLINE * 3,
        "the client took {took:?}: it waited on the silent connection beyond its attempt"
    );
}

/// Rank 0 of `flood_rank_zero`'s test, run in a child process whose descriptor limit is
/// lowered (the parent sets `FLOOD_PORT`).
#[test]
#[ignore = "rank 0 of a_connection_flood_under_a_low_descriptor_limit, in a child process"]
fn flood_rank_zero() {
    if let Ok(port) = std::env::var("FLOOD_PORT") {
        let port = port.parse().unwrap();
        share_bytes_round(&env(0, 4, port), 0, Some(b"payload"), LONG).unwrap();
    }
}

/// Rank 0 in a process limited to 64 descriptors meets 300 connections that are opened and
/// held silent, then the real ranks 1 to 3: they get the payload, and rank 0 neither crashes
/// nor fails (each held connection used to keep two descriptors until the end, so `accept`
/// ran out and the real ranks waited in the backlog until the timeout).
#[test]
fn a_connection_flood_under_a_low_descriptor_limit() {
    use std::process::{Command, Stdio};
    let port = free_port();
    let exe = std::env::current_exe().unwrap();
    let mut rank0 = Command::new("sh")
        .arg("-c")
        .arg(
            "ulimit -n 64 && exec \"$0\" tests::flood_rank_zero --exact --ignored --test-threads 1",
        )
        .arg(&exe)
        .env("FLOOD_PORT", port.to_string())
        .stdout(Stdio::null())
        .spawn()
        .unwrap();
    let t0 = Instant::now();
    // Rank 0 listens once this connects; the connection is the flood's first.
    let mut flood = vec![loop {
        if let Ok(s) = std::net::TcpStream::connect(("127.0.0.1", port)) {
            break s;
        }
        assert!(t0.elapsed() < LONG, "rank 0 never listened");
        std::thread::sleep(Duration::from_millis(20));
    }];
    for _ in 0..300 {
        if let Ok(s) = std::net::TcpStream::connect_timeout(
            &SocketAddr::from(([127, 0, 0, 1], port)),
            Duration::from_secs(1),
        ) {
            flood.push(s);
        }
    }
    let got: Vec<Result<Vec<u8>>> = std::thread::scope(|s| {
        let hs: Vec<_> = (1..4)
            .map(|r| s.spawn(move || share_bytes_round(&env(r, 4, port), 0, None, LONG)))
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let status = rank0.wait().unwrap();
    drop(flood);
    for (r, g) in got.iter().enumerate() {
        assert_eq!(g.as_ref().unwrap(), b"payload", "rank {}", r + 1);
    }
    assert!(status.success(), "rank 0 failed under the flood: {status}");
}

/// A launch without torchrun and without a run id is refused, naming the variable to set: two
/// launches would otherwise share one identity, and a leftover client of the first would be
/// served the second's payload. Under torchrun's store the run id is torchrun's own.
#[test]
fn a_standalone_launch_needs_a_run_id() {
    let vars = |extra: &[(&'static str, &'static str)]| -> HashMap<&'static str, &'static str> {
        [
            ("RANK", "1"),
            ("WORLD_SIZE", "2"),
            ("MASTER_ADDR", "127.0.0.1"),
            ("MASTER_PORT", "29500"),
        ]
        .into_iter()
        .chain(extra.iter().copied())
        .collect()
    };
    let read = |m: HashMap<&str, &str>| DistEnv::from_vars(|k| m.get(k).map(|v| v.to_string()));
    let e = read(vars(&[])).unwrap_err().to_string();
    assert!(
        e.contains("needs a run id") && e.contains(RUN_ID_VAR),
        "{e}"
    );
    assert!(read(vars(&[(RUN_ID_VAR, "  ")])).is_err(), "blank is no id");
    assert_eq!(read(vars(&[(RUN_ID_VAR, "r7")])).unwrap().run_id, "r7");
    assert!(read(vars(&[("TORCHELASTIC_USE_AGENT_STORE", "True")])).is_ok());
    let e = read(vars(&[(RUN_ID_VAR, "r7"), (SECRET_VAR, "short")]))
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("not a generated key") && e.contains(SECRET_VAR),
        "{e}"
    );
    // Built by hand: refused by the exchange itself.
    let e = share_bytes_round(&env_at(1, 2, "127.0.0.1", free_port(), ""), 0, None, LONG)
        .unwrap_err()
        .to_string();
    assert!(e.contains("needs a run id"), "{e}");
    // One rank alone meets nobody: no run id needed.
    let one = [
        ("RANK", "0"),
        ("WORLD_SIZE", "1"),
        ("MASTER_ADDR", "127.0.0.1"),
        ("MASTER_PORT", "29500"),
    ];
    let alone = read(one.into_iter().collect()).unwrap();
    assert_eq!(
        share_bytes_round(&alone, 0, Some(b"x"), LONG).unwrap(),
        b"x"
    );
}

/// A client of another protocol version (an older, shorter hello) is dropped as soon as its
/// magic is read, not after the client deadline.
#[test]
fn a_client_of_another_version_is_dropped_at_once() {
    let port = free_port();
    std::thread::scope(|s| {
        let root = s.spawn(|| share_bytes_round(&env(0, 2, port), 0, Some(b"id"), LONG));
        let (mut old, _) =
            connect_any("127.0.0.1", port, Instant::now() + Duration::from_secs(5)).unwrap();
        old.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        let mut hello = b"CDBOOT02".to_vec();
        hello.extend_from_slice(&[0u8; 24]);
        old.write_all(&hello).unwrap();
        let t = Instant::now();
        let mut rest = Vec::new();
        let _ = old.read_to_end(&mut rest);
        let took = t.elapsed();
        assert!(took < CLIENT_DEADLINE / 2, "closed after {took:?}");
        assert!(!root.is_finished(), "rank 0 still waits for its rank 1");
        assert_eq!(
            share_bytes_round(&env(1, 2, port), 0, None, LONG).unwrap(),
            b"id"
        );
        root.join().unwrap().unwrap();
    });
}

/// A client of the same run id but another restart (torchrun's restart count) is refused too.
#[test]
fn a_client_of_an_earlier_restart_is_refused() {
    let port = free_port();
    std::thread::scope(|s| {
        let mut now = env(0, 2, port);
        now.restart = 1;
        let root = s.spawn(move || share_bytes_round(&now, 0, Some(b"id"), LONG));
        let e = share_bytes_round(&env(1, 2, port), 0, None, LONG)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("restart 1") && e.contains("another run or restart"),
            "{e}"
        );
        let mut real = env(1, 2, port);
        real.restart = 1;
        assert_eq!(share_bytes_round(&real, 0, None, LONG).unwrap(), b"id");
        root.join().unwrap().unwrap();
    });
}

const SECRET: &str = "correct horse battery staple";

/// With a shared secret, a stranger without it and one with another secret both fail to join
/// (neither is counted as a rank, neither gets the payload), while the real ranks start; the
/// payload never travels in the clear.
#[test]
fn strangers_without_the_secret_cannot_join() {
    let port = free_port();
    let id: Vec<u8> = (0..128u32).map(|i| (i * 13 + 1) as u8).collect();
    std::thread::scope(|s| {
        let root = s
            .spawn(|| share_bytes_round(&env_secret(0, 3, port, Some(SECRET)), 0, Some(&id), LONG));
        // Both strangers claim rank 1 and 2 before the real ranks arrive.
        let none = share_bytes_round(&env_secret(1, 3, port, None), 0, None, LONG)
            .unwrap_err()
            .to_string();
        assert!(none.contains("requires the job's shared secret"), "{none}");
        let t = Instant::now();
        let wrong = share_bytes_round(
            &env_secret(2, 3, port, Some("a different secret, long enough")),
            0,
            None,
            Duration::from_millis(1500),
        )
        .unwrap_err()
        .to_string();
        assert!(t.elapsed() < Duration::from_secs(5));
        assert!(
            wrong.contains("does not prove the job's shared secret"),
            "{wrong}"
        );
        assert!(!root.is_finished(), "rank 0 counted no stranger as a rank");
        // A raw stranger that sees the challenge learns neither the secret nor the payload.
        let (mut raw, _) =
            connect_any("127.0.0.1", port, Instant::now() + Duration::from_secs(5)).unwrap();
        raw.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        let mut hello = env_secret(1, 3, port, Some(SECRET));
        hello.secret = Some(test_key("yet another secret of length"));
        raw.write_all(&super::client::hello(&hello, 0).unwrap())
            .unwrap();
        let mut seen = Vec::new();
        raw.write_all(&[0u8; 32]).unwrap();
        let _ = raw.read_to_end(&mut seen);
        assert!(!seen.windows(SECRET.len()).any(|w| w == SECRET.as_bytes()));
        assert!(
            !seen.windows(16).any(|w| w == &id[..16]),
            "no payload bytes"
        );
        assert!(String::from_utf8_lossy(&seen).contains("proof of the shared secret is wrong"));
        let real: Vec<_> = (1..3)
            .map(|r| {
                s.spawn(move || {
                    share_bytes_round(&env_secret(r, 3, port, Some(SECRET)), 0, None, LONG)
                })
            })
            .collect();
        for h in real {
            assert_eq!(h.join().unwrap().unwrap(), id);
        }
        root.join().unwrap().unwrap();
    });
}

/// A rank with the secret does not take a payload from a rank 0 that cannot prove it, nor a
/// verdict without a proof: a rank 0 without a secret (whose refusal carries no proof), one with
/// another secret, and a stranger that answers with a bare refusal are each retried until the
/// timeout, then named.
#[test]
fn a_rank_trusts_only_a_rank_0_that_proves_the_secret() {
    for (root_secret, expect) in [
        (None, "rank 0 has no shared secret and this rank has one"),
        (
            Some("an impostor's secret, long enough"),
            "does not prove the job's shared secret",
        ),
    ] {
        let port = free_port();
        std::thread::scope(|s| {
            let root = s.spawn(|| {
                share_bytes_round(
                    &env_secret(0, 2, port, root_secret),
                    0,
                    Some(b"forged"),
                    Duration::from_secs(3),
                )
            });
            let e = share_bytes_round(
                &env_secret(1, 2, port, Some(SECRET)),
                0,
                None,
                Duration::from_millis(1500),
            )
            .unwrap_err()
            .to_string();
            assert!(e.contains(expect) && e.contains("timed out"), "{e}");
            assert!(root.join().unwrap().is_err(), "rank 0 served nobody");
        });
    }
    let port = fake_rank_0(wire::frame(REFUSED, b"forged verdict"));
    let t = Instant::now();
    let e = share_bytes_round(
        &env_secret(1, 2, port, Some(SECRET)),
        0,
        None,
        Duration::from_millis(1500),
    )
    .unwrap_err()
    .to_string();
    assert!(
        t.elapsed() >= Duration::from_millis(1500),
        "retried until the timeout"
    );
    assert!(
        e.contains("timed out") && e.contains("unproven refusal") && e.contains("forged verdict"),
        "{e}"
    );
}

/// A stranger listening on a free local port that reads each client's hello and sends
/// `answer`; detached: it answers every connection of a retrying client until the test ends.
/// Its port.
fn fake_rank_0(answer: Vec<u8>) -> u16 {
    let l = TcpListener::bind(("127.0.0.1", 0)).unwrap();
    let port = l.local_addr().unwrap().port();
    std::thread::spawn(move || {
        for c in l.incoming() {
            let Ok(mut c) = c else { return };
            let mut hello = [0u8; HELLO];
            let _ = c.read_exact(&mut hello);
            let _ = c.write_all(&answer);
        }
    });
    port
}

/// An answer that announces a payload of `u32::MAX` bytes.
fn oversized_answer() -> Vec<u8> {
    let mut reply = MAGIC.to_vec();
    reply.push(OK);
    reply.extend(u32::MAX.to_le_bytes());
    reply
}

/// A stranger on rank 0's address answering with terminal escapes, line breaks and kilobytes
/// of text: the error quotes at most 200 bytes of it, escaped. With a secret, not even an
/// oversized frame ends the start-up before the timeout; without one (a trusted network) the
/// refusal is final at once.
#[test]
fn peer_text_is_escaped_and_bounded_and_never_final_with_a_secret() {
    let mut text = b"\x1b]0;owned\x07\nset CANDLE_DISTRIBUTED_SECRET=x ".to_vec();
    text.extend(std::iter::repeat_n(b'A', 5000));
    let port = fake_rank_0(wire::frame(REFUSED, &text));
    let t = Instant::now();
    let e = share_bytes_round(&env(1, 2, port), 0, None, LONG)
        .unwrap_err()
        .to_string();
    assert!(
        t.elapsed() < Duration::from_secs(5),
        "final at once without a secret"
    );
    assert!(
        !e.contains('\x1b') && !e.contains('\x07') && !e.contains("\nset"),
        "{e:?}"
    );
    assert!(
        e.contains("\\u{1b}") && e.contains("(5043 bytes in all)"),
        "{e}"
    );
    let message = e.lines().next().unwrap();
    assert!(message.len() < 400, "{} bytes: {message}", message.len());
    let port = fake_rank_0(oversized_answer());
    let t = Instant::now();
    let e = share_bytes_round(
        &env_secret(1, 2, port, Some(SECRET)),
        0,
        None,
        Duration::from_millis(1500),
    )
    .unwrap_err()
    .to_string();
    assert!(t.elapsed() >= Duration::from_millis(1500), "retried: {e}");
    assert!(e.contains("timed out") && e.contains("announces"), "{e}");
}

/// Under `srun` (or Open MPI's `mpirun`) the launcher's variables place the process, and its
/// job and step ids name the launch, so that no run id needs exporting; an explicit one wins.
#[test]
fn srun_places_and_names_the_launch() {
    let mut vars: HashMap<&str, &str> = [
        ("SLURM_PROCID", "3"),
        ("SLURM_STEP_NUM_TASKS", "4"),
        ("SLURM_LOCALID", "1"),
        ("SLURM_NODEID", "1"),
        ("SLURM_STEP_TASKS_PER_NODE", "2(x2)"),
        ("SLURM_JOB_ID", "77"),
        ("SLURM_STEP_ID", "0"),
        ("MASTER_ADDR", "node0"),
        ("MASTER_PORT", "29500"),
    ]
    .into_iter()
    .collect();
    let e = DistEnv::from_vars(|k| vars.get(k).map(|v| v.to_string())).unwrap();
    assert_eq!(
        (e.rank, e.world_size, e.local_rank, e.local_world_size),
        (3, 4, 1, Some(2))
    );
    assert_eq!(e.run_id, "slurm-77.0");
    vars.insert(RUN_ID_VAR, "mine");
    let e = DistEnv::from_vars(|k| vars.get(k).map(|v| v.to_string())).unwrap();
    assert_eq!(e.run_id, "mine");
}

#[test]
fn local_world_size_needs_only_the_launchers_variables() {
    let get = |vars: &'static [(&'static str, &'static str)]| {
        move |k: &str| {
            vars.iter()
                .find(|(n, _)| *n == k)
                .map(|(_, v)| v.to_string())
        }
    };
    let torchrun = &[
        ("RANK", "1"),
        ("WORLD_SIZE", "8"),
        ("LOCAL_WORLD_SIZE", "4"),
    ];
    assert_eq!(super::local_world_size_from(get(torchrun)), Some(4));
    let ompi = &[
        ("OMPI_COMM_WORLD_RANK", "0"),
        ("OMPI_COMM_WORLD_SIZE", "6"),
        ("OMPI_COMM_WORLD_LOCAL_SIZE", "3"),
    ];
    assert_eq!(super::local_world_size_from(get(ompi)), Some(3));
    assert_eq!(
        super::local_world_size_from(get(&[("RANK", "0"), ("WORLD_SIZE", "2")])),
        None
    );
    assert_eq!(super::local_world_size_from(get(&[])), None);
}

/// The variables of a standalone launch of rank 1 of 2, with `extra`.
fn launch_vars(extra: &[(&'static str, String)]) -> HashMap<&'static str, String> {
    [
        ("RANK", "1".to_string()),
        ("WORLD_SIZE", "2".into()),
        ("MASTER_ADDR", "127.0.0.1".into()),
        ("MASTER_PORT", "29500".into()),
        (RUN_ID_VAR, "r1".into()),
    ]
    .into_iter()
    .chain(extra.iter().cloned())
    .collect()
}

fn read_env(vars: &HashMap<&str, String>) -> Result<DistEnv> {
    DistEnv::from_vars(|k| vars.get(k).cloned())
}

/// A passphrase in the variable is refused with the command that makes a key; a key file is
/// read (its key never in the environment); both at once, or an unreadable file, are errors
/// naming them.
#[test]
fn a_passphrase_is_refused_and_a_key_file_is_read() {
    let e = read_env(&launch_vars(&[(
        SECRET_VAR,
        "correct horse battery staple".into(),
    )]))
    .unwrap_err()
    .to_string();
    assert!(
        e.contains(SECRET_VAR) && e.contains("openssl rand -hex 32") && !e.contains("horse"),
        "{e}"
    );
    let hex = "8f1e2d3c4b5a69788796a5b4c3d2e1f00f1e2d3c4b5a69788796a5b4c3d2e1f0";
    let dir = std::env::temp_dir().join(format!("cd-key-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("key");
    std::fs::write(&file, format!("{hex}\n")).unwrap();
    let path = file.to_string_lossy().to_string();
    let from_file = read_env(&launch_vars(&[(SECRET_FILE_VAR, path.clone())])).unwrap();
    let from_var = read_env(&launch_vars(&[(SECRET_VAR, hex.into())])).unwrap();
    assert!(from_file.secret.is_some());
    assert_eq!(from_file.secret, from_var.secret);
    let both = read_env(&launch_vars(&[
        (SECRET_VAR, hex.into()),
        (SECRET_FILE_VAR, path.clone()),
    ]))
    .unwrap_err()
    .to_string();
    assert!(both.contains("set one"), "{both}");
    // CamelCase passphrases are valid base64 of enough bytes: refused in the variable.
    for camel in [
        "CorrectHorseBatteryStapleCorrect",
        "MyVerySecretTrainingPassword",
    ] {
        let e = read_env(&launch_vars(&[(SECRET_VAR, camel.into())]))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("not a generated key") && !e.contains(camel),
            "{e}"
        );
    }
    // A base64 key (openssl rand -base64 32) is read from the file.
    std::fs::write(&file, "qL0zqk7d8bNQ2x+3mY1w9Vf4aRk5pT6cJe/8hUoIs2E=\n").unwrap();
    assert!(read_env(&launch_vars(&[(SECRET_FILE_VAR, path.clone())])).is_ok());
    std::fs::write(&file, "my favourite passphrase").unwrap();
    let weak = read_env(&launch_vars(&[(SECRET_FILE_VAR, path.clone())]))
        .unwrap_err()
        .to_string();
    assert!(
        weak.contains(&path) && weak.contains("not a generated key"),
        "{weak}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
    let gone = read_env(&launch_vars(&[(SECRET_FILE_VAR, path.clone())]))
        .unwrap_err()
        .to_string();
    assert!(
        gone.contains(&path) && gone.contains("cannot be read"),
        "{gone}"
    );
}

/// Under torchrun a shared secret works with any run id, torchrun's default `none` and a
/// constant one (`--rdzv-id=100`) included: each rank's copy is sealed for a nonce of its own,
/// so nothing recorded in an earlier launch opens.
#[test]
fn a_secret_under_torchrun_takes_any_run_id() {
    let key = (
        "CANDLE_DISTRIBUTED_SECRET",
        "00112233445566778899aabbccddeeff".to_string(),
    );
    let store = ("TORCHELASTIC_USE_AGENT_STORE", "True".to_string());
    for id in ["none", "100"] {
        let mut vars = launch_vars(&[key.clone(), store.clone()]);
        vars.remove(RUN_ID_VAR);
        vars.insert("TORCHELASTIC_RUN_ID", id.into());
        assert!(read_env(&vars).is_ok(), "{id:?}");
    }
}

/// A copy rank 0 sealed into torchrun's store for one launch's rank does not open in another
/// launch, even under the same store key (a constant run id): each copy is sealed for the
/// receiving rank's fresh nonce. It opens for the nonce it was sealed for; a marker or a value
/// sealed the older way is refused by name.
#[test]
fn a_store_value_from_another_launch_is_refused() {
    let env = DistEnv {
        run_id: "100".into(),
        agent_store: true,
        ..env_secret(1, 2, 29500, Some(SECRET))
    };
    let key = per_rank_key(&store_key(&env, 0), 1);
    let payload = b"nccl unique id bytes".to_vec();
    let (then, now) = (secret::nonce().unwrap(), secret::nonce().unwrap());
    let k = env.secret.as_ref().unwrap();
    let recorded = k.seal(&per_rank_context(&key, &then), &payload).unwrap();
    assert_eq!(
        open_per_rank(&env, &key, &then, &recorded).unwrap(),
        payload
    );
    let e = open_per_rank(&env, &key, &now, &recorded)
        .unwrap_err()
        .to_string();
    assert!(e.contains("fails authentication"), "{e}");
    let older = k.seal(store_key(&env, 0).as_bytes(), &payload).unwrap();
    let e = unseal_stored(&env, &store_key(&env, 0), older)
        .unwrap_err()
        .to_string();
    assert!(e.contains("sealed but not for this rank"), "{e}");
    let plain = DistEnv {
        secret: None,
        ..env.clone()
    };
    let e = unseal_stored(&plain, "k", secret::per_rank_marker())
        .unwrap_err()
        .to_string();
    assert!(e.contains("this rank has none"), "{e}");
}

/// A client of an earlier protocol version is refused with the reason, in its own framing,
/// so that it fails at once instead of at its timeout; the job goes on.
#[test]
fn a_client_of_another_protocol_version_gets_the_reason() {
    let port = free_port();
    job(2, "127.0.0.1", port, |_| {
        let (mut old, _) =
            connect_any("127.0.0.1", port, Instant::now() + Duration::from_secs(5)).unwrap();
        old.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        let mut hello = super::client::hello(&env(1, 2, port), 0).unwrap();
        hello[..8].copy_from_slice(b"CDBOOT03");
        old.write_all(&hello).unwrap();
        let mut reply = Vec::new();
        let _ = old.read_to_end(&mut reply);
        assert!(reply.starts_with(b"CDBOOT03"), "{reply:?}");
        assert_eq!(reply[8], REFUSED);
        let why = String::from_utf8_lossy(&reply[13..]);
        assert!(why.contains("protocol 05 and this rank 03"), "{why}");
    });
}

/// A `MASTER_ADDR` that resolves to addresses of both families that are not this machine's
/// (a NAT name with AAAA and A records; documentation ranges here), in either order, or to a
/// local IPv4 and a foreign IPv6 address: rank 0 listens (Linux's dual-stack IPv6 wildcard holds
/// the port for both families) and a client reaches it over IPv4; a port another process
/// holds is still an error naming it.
#[test]
fn rank_0_listens_when_master_addr_is_dual_stack() {
    if TcpListener::bind("[::]:0").is_err() {
        eprintln!("no IPv6 on this machine: the dual-stack cases cannot run here");
        return;
    }
    let v6: std::net::Ipv6Addr = "2001:db8::1".parse().unwrap();
    let v4 = std::net::Ipv4Addr::new(192, 0, 2, 1);
    let local = std::net::Ipv4Addr::LOCALHOST;
    for order in 0..3 {
        let port = free_port();
        let (a6, a4, l4) = (
            SocketAddr::from((v6, port)),
            SocketAddr::from((v4, port)),
            SocketAddr::from((local, port)),
        );
        let addrs = match order {
            0 => vec![a6, a4],
            1 => vec![a4, a6],
            _ => vec![l4, a6],
        };
        let ls = server::listen_on(&addrs, false).unwrap_or_else(|e| panic!("{addrs:?}: {e}"));
        let reached = TcpStream::connect_timeout(&l4, Duration::from_secs(2));
        assert!(reached.is_ok(), "{addrs:?}: no listener for IPv4 clients");
        drop(ls);
    }
    // A port another process holds for IPv4: the dual-stack wildcard conflicts with it (where
    // IPv6 sockets are not IPv6-only by default, as on Linux unless `bindv6only` is set).
    let v6_only =
        std::fs::read_to_string("/proc/sys/net/ipv6/bindv6only").is_ok_and(|v| v.trim() == "1");
    if v6_only {
        eprintln!("net.ipv6.bindv6only = 1: IPv6 wildcards do not hold IPv4 ports here");
        return;
    }
    let other = TcpListener::bind(("0.0.0.0", 0)).unwrap();
    let port = other.local_addr().unwrap().port();
    let e = server::listen_on(&[SocketAddr::from((v6, port))], false)
        .unwrap_err()
        .to_string();
    assert!(e.contains("another process holds the port"), "{e}");
}

/// A sustained flood: a stranger keeps rank 0's whole connection table full of silent
/// connections and opens a new one the moment any is closed, for the whole start-up, with and
/// without a secret. The real ranks 1 to 3 are still served within seconds (silent connections
/// lose their slot after the hello's 500 ms, and the oldest unproven one makes room for a
/// newcomer), and rank 0 returns.
#[test]
fn a_sustained_flood_does_not_keep_the_ranks_out() {
    use std::sync::atomic::AtomicBool;
    for key in [None, Some(SECRET)] {
        let port = free_port();
        let world = 4;
        let cap = server::max_handlers(world);
        let stop = AtomicBool::new(false);
        let t = Instant::now();
        let got: Vec<Result<Vec<u8>>> = std::thread::scope(|s| {
            let root = s.spawn(|| {
                share_bytes_round(&env_secret(0, world, port, key), 0, Some(b"payload"), LONG)
            });
            let addr = SocketAddr::from(([127, 0, 0, 1], port));
            let stop = &stop;
            s.spawn(move || {
                let mut held: Vec<TcpStream> = Vec::new();
                let mut opened = 0usize;
                while !stop.load(Ordering::Relaxed) {
                    // Reconnect at once for every connection rank 0 closed.
                    held.retain(|c| {
                        let mut b = [0u8; 1];
                        match (&*c).read(&mut b) {
                            Ok(0) => false,
                            Ok(_) => true,
                            Err(e) => e.kind() == std::io::ErrorKind::WouldBlock,
                        }
                    });
                    while held.len() < 2 * cap && !stop.load(Ordering::Relaxed) {
                        match TcpStream::connect_timeout(&addr, Duration::from_millis(200)) {
                            Ok(c) => {
                                c.set_nonblocking(true).unwrap();
                                held.push(c);
                                opened += 1;
                            }
                            Err(_) => break,
                        }
                    }
                    std::thread::sleep(Duration::from_millis(1));
                }
                eprintln!("flooder opened {opened} connections");
            });
            // The flood first, then the real ranks.
            std::thread::sleep(Duration::from_millis(300));
            let ranks: Vec<_> = (1..world)
                .map(|r| {
                    s.spawn(move || {
                        share_bytes_round(&env_secret(r, world, port, key), 0, None, LONG)
                    })
                })
                .collect();
            let got = ranks.into_iter().map(|h| h.join().unwrap()).collect();
            let root = root.join().unwrap();
            stop.store(true, Ordering::Relaxed);
            assert!(root.is_ok(), "rank 0: {root:?}");
            got
        });
        let took = t.elapsed();
        for (r, g) in got.iter().enumerate() {
            assert_eq!(
                g.as_ref().unwrap(),
                b"payload",
                "rank {} (key {key:?})",
                r + 1
            );
        }
        assert!(took < Duration::from_secs(8), "took {took:?} (key {key:?})");
    }
}

/// A client whose acknowledgement reaches rank 0 long after its admission (more than the
/// time a connection has for its hello and its proof; a loaded machine): rank 0 still counts
/// it and completes, instead of waiting for a rank that has moved on until the timeout.
#[test]
fn a_late_acknowledgement_is_still_counted() {
    let port = free_port();
    let e = env(1, 2, port);
    std::thread::scope(|s| {
        let root = s.spawn(|| {
            let t = Instant::now();
            share_bytes_round(&env(0, 2, port), 0, Some(b"id"), LONG).map(|p| (p, t.elapsed()))
        });
        let (mut stream, addr) = connect_any("127.0.0.1", port, Instant::now() + LONG).unwrap();
        let deadline = Instant::now() + LONG;
        write_by(&mut stream, &hello(&e, 0).unwrap(), deadline).unwrap();
        let at: SocketAddr = addr.parse().unwrap();
        let (status, body) = read_answer(&mut stream, at, deadline).unwrap().unwrap();
        assert_eq!((status, body.len()), (OK, 0), "admitted");
        let mut store = TcpStoreClient::over(stream, addr, deadline).unwrap();
        let key = store_key(&e, 0);
        assert_eq!(store.get(&key, deadline).unwrap(), b"id");
        std::thread::sleep(CLIENT_DEADLINE + Duration::from_millis(500));
        assert!(!root.is_finished(), "rank 0 waits for the acknowledgement");
        store
            .set(&stored::ack_key(&key, 1), b"1", deadline)
            .unwrap();
        let (payload, took) = root.join().unwrap().unwrap();
        assert_eq!(payload, b"id");
        assert!(took < LONG / 2, "rank 0 took {took:?}");
    });
}

/// A resolver that does not answer (an unreachable DNS server) costs the caller its deadline,
/// not the resolver's own timeouts; an address literal needs no lookup.
#[test]
fn a_slow_resolver_costs_only_the_deadline() {
    let t = Instant::now();
    let e = store::resolve_with(
        || {
            std::thread::sleep(Duration::from_secs(30));
            Ok(Vec::new())
        },
        Instant::now() + Duration::from_millis(200),
    )
    .unwrap_err();
    assert_eq!(e.kind(), std::io::ErrorKind::TimedOut);
    assert!(t.elapsed() < Duration::from_secs(3), "{:?}", t.elapsed());
    let past = Instant::now() - Duration::from_secs(1);
    assert_eq!(
        store::resolve("::1", 7, past).unwrap(),
        vec!["[::1]:7".parse::<SocketAddr>().unwrap()]
    );
    assert_eq!(
        store::resolve("[::1]", 7, past).unwrap(),
        vec!["[::1]:7".parse::<SocketAddr>().unwrap()]
    );
}

/// A failure repeated on every pass of the accept loop (descriptors exhausted) is logged once
/// per second, with the number left out since.
#[test]
fn a_repeated_accept_failure_is_logged_once_a_second() {
    let mut w = server::Throttle::default();
    let t0 = Instant::now();
    let at = |ms: u64| t0 + Duration::from_millis(ms);
    assert_eq!(w.admit(at(0)), Some(0));
    let held: Vec<_> = (1..500).step_by(2).map(|ms| w.admit(at(ms))).collect();
    assert!(held.iter().all(Option::is_none), "{held:?}");
    assert_eq!(w.admit(at(999)), None);
    assert_eq!(w.admit(at(1000)), Some(251));
    assert_eq!(w.admit(at(2500)), Some(0));
}

/// A store held in this process, shared by the ranks' threads: what any other [`Store`] must
/// offer the exchange (`get` and `wait` block until the key is set or the deadline passes).
#[derive(Debug, Clone, Default)]
struct MemoryStore(std::sync::Arc<(std::sync::Mutex<Entries>, std::sync::Condvar)>);

type Entries = HashMap<String, Vec<u8>>;

impl Store for MemoryStore {
    fn set(&mut self, key: &str, value: &[u8], _deadline: Instant) -> Result<()> {
        let (map, cv) = &*self.0;
        map.lock().unwrap().insert(key.into(), value.into());
        cv.notify_all();
        Ok(())
    }

    fn get(&mut self, key: &str, deadline: Instant) -> Result<Vec<u8>> {
        self.wait(key, deadline)?;
        Ok(self.0 .0.lock().unwrap()[key].clone())
    }

    fn add(&mut self, key: &str, delta: i64, _deadline: Instant) -> Result<i64> {
        let mut map = self.0 .0.lock().unwrap();
        let v = map
            .get(key)
            .map_or(0, |b| i64::from_le_bytes(b[..].try_into().unwrap()))
            + delta;
        map.insert(key.into(), v.to_le_bytes().to_vec());
        Ok(v)
    }

    fn check(&mut self, key: &str, _deadline: Instant) -> Result<bool> {
        Ok(self.0 .0.lock().unwrap().contains_key(key))
    }

    fn wait(&mut self, key: &str, deadline: Instant) -> Result<()> {
        let (map, cv) = &*self.0;
        let mut m = map.lock().unwrap();
        while !m.contains_key(key) {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                bail!("memory store: timed out waiting for key {key:?}");
            }
            m = cv.wait_timeout(m, left).unwrap().0;
        }
        Ok(())
    }
}

/// The exchange through a store is written against [`Store`], not against torchrun's client:
/// over a store held in memory, 4 ranks get rank 0's payload, with and without a shared key
/// (with one, every rank's copy is sealed for its own nonce, and the value under the
/// rendezvous key is the marker, not the payload); a rank with another key is refused.
#[test]
fn the_store_exchange_runs_over_any_store() {
    let id: Vec<u8> = (0..128u32).map(|i| (i * 11 + 5) as u8).collect();
    for secret in [None, Some("memory-store-key-of-this-test")] {
        let store = MemoryStore::default();
        let env = |r| DistEnv {
            agent_store: true,
            ..env_secret(r, 4, 1, secret)
        };
        let got: Vec<Vec<u8>> = std::thread::scope(|s| {
            let hs: Vec<_> = (0..4)
                .map(|r| {
                    let (mut store, id, env) = (store.clone(), &id, env(r));
                    s.spawn(move || {
                        let deadline = Instant::now() + LONG;
                        match r {
                            0 => stored::set_payload(&env, &mut store, 3, id, deadline)
                                .map(|()| id.clone()),
                            _ => {
                                let nonce = secret::nonce().unwrap();
                                stored::get_payload(&env, &mut store, (3, &nonce), deadline, LONG)
                            }
                        }
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap().unwrap()).collect()
        });
        assert!(got.iter().all(|g| *g == id), "{secret:?}");
        let mut s = store.clone();
        let at_key = s.get(&store_key(&env(0), 3), Instant::now()).unwrap();
        assert_eq!(at_key == id, secret.is_none(), "{secret:?}");
    }
    // A rank holding another key than rank 0's.
    let store = MemoryStore::default();
    let env = |r, key| DistEnv {
        agent_store: true,
        ..env_secret(r, 2, 1, Some(key))
    };
    let e = std::thread::scope(|s| {
        let mut rank0 = store.clone();
        s.spawn(move || {
            let deadline = Instant::now() + LONG;
            stored::set_payload(&env(0, "the key of rank 0"), &mut rank0, 0, b"id", deadline)
        });
        let mut rank1 = store.clone();
        let deadline = Instant::now() + LONG;
        stored::get_payload(
            &env(1, "another key, rank 1"),
            &mut rank1,
            (0, &secret::nonce().unwrap()),
            deadline,
            LONG,
        )
    })
    .unwrap_err()
    .to_string();
    assert!(e.contains("fails authentication"), "{e}");
}

/// The store rank 0 hosts answers PyTorch TCPStore's requests over an admitted session as
/// rank 0 sees them in process: a SET read back by a GET that waited for it, ADD's running
/// total (stored as decimal text), CHECK of a key set and one not, a WAIT that times out and
/// is cancelled with the session still usable; a request over the bounds (a value of 1 MiB)
/// ends only its own session. The store stops with the last `JobStore` of it: the port is
/// free again.
#[test]
fn the_hosted_store_serves_tcpstore_requests() {
    let port = free_port();
    let soon = || Instant::now() + Duration::from_secs(5);
    let root = JobStore::open(&env(0, 2, port), LONG).unwrap();
    let mut local = root.connect(soon()).unwrap();
    let one = JobStore::open(&env(1, 2, port), LONG).unwrap();
    let mut s = one.connect(soon()).unwrap();
    std::thread::scope(|t| {
        let later = t.spawn(|| {
            std::thread::sleep(Duration::from_millis(300));
            root.connect(soon())
                .unwrap()
                .set("late", b"from rank 0", soon())
                .unwrap();
        });
        assert_eq!(s.get("late", soon()).unwrap(), b"from rank 0", "waited");
        later.join().unwrap();
    });
    s.set("k", b"value 1", soon()).unwrap();
    assert_eq!(local.get("k", soon()).unwrap(), b"value 1");
    assert_eq!(s.add("n", 5, soon()).unwrap(), 5);
    assert_eq!(local.add("n", -7, soon()).unwrap(), -2);
    assert_eq!(s.get("n", soon()).unwrap(), b"-2", "decimal text");
    assert!(s.check("k", soon()).unwrap());
    assert!(!s.check("absent", soon()).unwrap());
    let t0 = Instant::now();
    let e = s
        .get("absent", Instant::now() + Duration::from_millis(300))
        .unwrap_err()
        .to_string();
    assert!(e.contains("timed out waiting for key"), "{e}");
    assert!(t0.elapsed() < Duration::from_secs(3), "{:?}", t0.elapsed());
    s.set("after", b"the cancellation", soon()).unwrap();
    assert_eq!(local.get("after", soon()).unwrap(), b"the cancellation");
    let mut big = one.connect(soon()).unwrap();
    let _ = big.set("big", &vec![7u8; 1 << 20], soon());
    let e = big.get("k", soon()).unwrap_err().to_string();
    assert!(
        e.contains("127.0.0.1"),
        "the oversized session is closed: {e}"
    );
    assert!(!local.check("big", soon()).unwrap(), "not stored");
    assert_eq!(s.get("k", soon()).unwrap(), b"value 1", "the others go on");
    drop((s, big, local, root));
    let t0 = Instant::now();
    while TcpListener::bind(("127.0.0.1", port)).is_err() {
        assert!(
            t0.elapsed() < Duration::from_secs(5),
            "the store still listens"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Progress reports through the store rank 0 hosts, in a launch without torchrun: ranks 1 and
/// 2 publish, rank 3 does not; rank 0 and rank 3 each name the ranks behind call #4 (rank 2
/// with its line, rank 3 as having published none), with and without a shared key (with one,
/// a rank with another key is not admitted). The boards keep the store: rank 0's exchange
/// returned long before.
#[test]
fn progress_reports_through_the_store_rank_0_hosts() {
    use crate::progress::ProgressBoard;
    let soon = || Instant::now() + Duration::from_secs(5);
    for key in [None, Some(SECRET)] {
        let port = free_port();
        let world = 4;
        let jobs: Vec<JobStore> = std::thread::scope(|s| {
            let hs: Vec<_> = (0..world)
                .map(|r| {
                    s.spawn(move || {
                        let job = JobStore::open(&env_secret(r, world, port, key), LONG).unwrap();
                        let p = (r == 0).then_some(&b"id"[..]);
                        assert_eq!(job.share(9, p, LONG).unwrap(), b"id");
                        job
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        let boards: Vec<ProgressBoard> = jobs
            .iter()
            .map(|j| ProgressBoard::new(j, 9).unwrap())
            .collect();
        drop(jobs);
        boards[1]
            .publish(Some(4), "all_reduce #4 F32×6, enqueued", soon())
            .unwrap();
        boards[2]
            .publish(Some(3), "all_reduce #3 F32×6, completed", soon())
            .unwrap();
        // A SET has no answer: a round trip on each publisher's connection makes sure it landed.
        for r in [1, 2] {
            boards[r].read(r, soon()).unwrap();
        }
        for reader in [0, 3] {
            let r = boards[reader].read(1, soon()).unwrap();
            assert_eq!(r.call, Some(4), "{key:?}");
            let r = boards[reader].read(2, soon()).unwrap();
            assert_eq!(
                (r.call, r.line.as_str()),
                (Some(3), "\"all_reduce #3 F32×6, completed\"")
            );
            let e = boards[reader].read(3, soon()).unwrap_err().to_string();
            assert!(e.contains("published none"), "{e}");
        }
        if key.is_some() {
            let stranger = JobStore::open(
                &env_secret(1, world, port, Some("another secret, long enough")),
                LONG,
            )
            .unwrap();
            let e = ProgressBoard::new(&stranger, 9)
                .unwrap()
                .read(2, Instant::now() + Duration::from_millis(1500))
                .unwrap_err()
                .to_string();
            assert!(e.contains("does not prove the job's shared secret"), "{e}");
        }
    }
}

/// A rank still at an earlier rendezvous than rank 0's newest (the ranks created different
/// numbers of communicators) is refused with both numbers, at once; the rank at rank 0's
/// rendezvous is served.
#[test]
fn a_client_at_an_earlier_rendezvous_is_refused() {
    let port = free_port();
    std::thread::scope(|s| {
        let root = s.spawn(|| share_bytes_round(&env(0, 2, port), 3, Some(b"third"), LONG));
        std::thread::sleep(Duration::from_millis(200));
        let t = Instant::now();
        let e = share_bytes_round(&env(1, 2, port), 2, None, LONG)
            .unwrap_err()
            .to_string();
        assert!(t.elapsed() < Duration::from_secs(5), "refused promptly");
        assert!(
            e.contains("rank 0 is at rendezvous 3") && e.contains("this rank at 2"),
            "{e}"
        );
        assert_eq!(
            share_bytes_round(&env(1, 2, port), 3, None, LONG).unwrap(),
            b"third"
        );
        root.join().unwrap().unwrap();
    });
}

/// Every rank of a job of 300 keeps a session of the store rank 0 hosts at once (as each
/// rank's progress board does), beyond the bound on connections awaiting admission (256):
/// admitted sessions do not count against it. Each answers a request afterwards.
#[test]
fn every_rank_of_a_large_job_keeps_a_session() {
    let port = free_port();
    let world = 300;
    let soon = || Instant::now() + Duration::from_secs(20);
    let root = JobStore::open(&env(0, world, port), LONG).unwrap();
    root.connect(soon())
        .unwrap()
        .set("k", b"v", soon())
        .unwrap();
    let mut sessions: Vec<Box<dyn Store>> = (1..world)
        .map(|r| {
            JobStore::open(&env(r, world, port), LONG)
                .unwrap()
                .connect(soon())
                .unwrap_or_else(|e| panic!("rank {r}: {e}"))
        })
        .collect();
    assert!(world - 1 > server::max_handlers(world));
    for (r, s) in sessions.iter_mut().enumerate() {
        assert!(s.check("k", soon()).unwrap(), "rank {}", r + 1);
    }
}
