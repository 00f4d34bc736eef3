//! Against the real thing: our TCPStore client against PyTorch's TCPStore server (both of its
//! back-ends), and `examples/rendezvous` launched by `torchrun --no-python` on 2 processes.
//!
//! Needs PyTorch: these tests are `#[ignore]`d in a plain `cargo test` and run by
//! `scripts/test-torch.sh` (which CI calls), with `TORCH_PYTHON` naming a Python that has torch
//! and `examples/rendezvous` built. Run without `TORCH_PYTHON` they fail, saying so.

use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use candle_distributed::collective::hang_report::ranks_behind;
use candle_rendezvous::progress::ProgressBoard;
use candle_rendezvous::store::TcpStoreClient;
use candle_rendezvous::{share_bytes_round, DistEnv, JobStore, Secret};

fn python() -> String {
    std::env::var("TORCH_PYTHON")
        .expect("TORCH_PYTHON must name a Python with torch (scripts/test-torch.sh sets it)")
}

/// A PyTorch TCPStore server in a child process; it echoes the key `from-rust`, reversed, under
/// `from-python`, and lives until its stdin closes.
struct Server {
    child: std::process::Child,
    port: u16,
}

const SERVER: &str = r#"
import sys, datetime
import torch.distributed as d
s = d.TCPStore("127.0.0.1", 0, None, True, timeout=datetime.timedelta(seconds=60),
               wait_for_workers=False, use_libuv=(sys.argv[1] == "libuv"))
print(s.port, "libuv" if s.libuvBackend else "classic", flush=True)
v = s.get("candle-test/from-rust")
s.set("candle-test/from-python", v[::-1])
sys.stdin.read()
"#;

impl Server {
    fn start(backend: &str) -> Self {
        let mut child = Command::new(python())
            .args(["-c", SERVER, backend])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .expect("starting python");
        let mut line = String::new();
        BufReader::new(child.stdout.as_mut().unwrap())
            .read_line(&mut line)
            .unwrap();
        let mut words = line.split_whitespace();
        let port = words
            .next()
            .expect("the server prints its port")
            .parse()
            .unwrap();
        assert_eq!(
            words.next(),
            Some(backend),
            "the server runs the asked back-end"
        );
        Self { child, port }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        drop(self.child.stdin.take());
        let _ = self.child.wait();
    }
}

/// set, get (waiting for a key the Python side writes), add, a get that times out and leaves
/// the connection usable, on both server back-ends.
#[test]
#[ignore = "needs PyTorch: scripts/test-torch.sh"]
fn our_client_speaks_pytorchs_tcpstore() {
    for backend in ["classic", "libuv"] {
        let server = Server::start(backend);
        let deadline = || Instant::now() + Duration::from_secs(30);
        let mut c = TcpStoreClient::connect("127.0.0.1", server.port, deadline()).unwrap();
        let value: Vec<u8> = (0..=255u8).collect();
        c.set("candle-test/own", &value, deadline()).unwrap();
        assert_eq!(
            c.get("candle-test/own", deadline()).unwrap(),
            value,
            "{backend}"
        );
        c.set("candle-test/from-rust", b"abc\0xyz", deadline())
            .unwrap();
        assert_eq!(
            c.get("candle-test/from-python", deadline()).unwrap(),
            b"zyx\0cba",
            "{backend}: the value the Python side derived from ours"
        );
        assert_eq!(c.add("candle-test/n", 5, deadline()).unwrap(), 5);
        assert_eq!(c.add("candle-test/n", -2, deadline()).unwrap(), 3);
        let t = Instant::now();
        let e = c
            .get(
                "candle-test/never",
                Instant::now() + Duration::from_millis(300),
            )
            .unwrap_err()
            .to_string();
        assert!(e.contains("timed out waiting for key"), "{backend}: {e}");
        assert!(t.elapsed() < Duration::from_secs(10));
        assert_eq!(
            c.get("candle-test/own", deadline()).unwrap(),
            value,
            "{backend}: usable after a timeout"
        );
    }
}

/// Rank `rank` of `world` as torchrun's agent launches it, with the store at `port` on this
/// machine, run id `run` and an optional shared secret.
fn store_env(port: u16, world: usize, rank: usize, run: &str, secret: Option<&str>) -> DistEnv {
    DistEnv {
        rank,
        world_size: world,
        local_rank: rank,
        local_world_size: None,
        master_addr: "127.0.0.1".into(),
        master_port: port,
        run_id: run.into(),
        restart: 0,
        agent_store: true,
        secret: secret
            .map(|s| Secret::new(s.bytes().map(|b| b | 0x80).collect::<Vec<u8>>()).unwrap()),
    }
}

/// Two ranks rendezvous through a PyTorch TCPStore as they would under torchrun's agent: in the
/// clear, then with a shared secret, where the value in the store is sealed (its bytes do not
/// show the payload) and a rank without the secret is refused with the reason.
#[test]
#[ignore = "needs PyTorch: scripts/test-torch.sh"]
fn share_bytes_through_a_pytorch_store() {
    let server = Server::start("libuv");
    let env = |rank, run: &str, secret: Option<&str>| store_env(server.port, 2, rank, run, secret);
    let payload = b"nccl-id: 0123456789abcdef";
    for (run, secret) in [
        ("test-run", None),
        ("sealed-run", Some("a shared secret of 32 bytes.....")),
    ] {
        let got: Vec<Vec<u8>> = std::thread::scope(|s| {
            let hs: Vec<_> = (0..2)
                .map(|r| {
                    let env = env(r, run, secret);
                    s.spawn(move || {
                        let p = (r == 0).then_some(&payload[..]);
                        share_bytes_round(&env, 0, p, Duration::from_secs(30)).unwrap()
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        assert_eq!(got, vec![payload.to_vec(); 2], "{run}");
    }
    let stored = TcpStoreClient::connect(
        "127.0.0.1",
        server.port,
        Instant::now() + Duration::from_secs(5),
    )
    .unwrap()
    .get(
        "candle-distributed/sealed-run/0/0",
        Instant::now() + Duration::from_secs(5),
    )
    .unwrap();
    assert!(!stored.windows(8).any(|w| w == &payload[..8]), "sealed");
    let e = share_bytes_round(&env(1, "sealed-run", None), 0, None, Duration::from_secs(5))
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("sealed") && e.contains("CANDLE_DISTRIBUTED_SECRET"),
        "{e}"
    );
    let e = share_bytes_round(
        &env(1, "sealed-run", Some("another secret, also long enough")),
        0,
        None,
        Duration::from_secs(5),
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("fails authentication"), "{e}");
    // Unblock the server script (it waits for `from-rust`).
    let mut c = TcpStoreClient::connect(
        "127.0.0.1",
        server.port,
        Instant::now() + Duration::from_secs(5),
    )
    .unwrap();
    c.set(
        "candle-test/from-rust",
        b"done",
        Instant::now() + Duration::from_secs(5),
    )
    .unwrap();
}

/// The job's store of `env`: under torchrun, a client of the agent's store.
fn job(env: DistEnv) -> JobStore {
    JobStore::open(&env, Duration::from_secs(5)).unwrap()
}

/// Progress reports through a PyTorch TCPStore, as the NCCL ranks of a torchrun job publish
/// them: rank 1 publishes its newest collective (#4), rank 2 one still before the call in
/// question (#3), rank 3 nothing at all; rank 0, whose call #4 timed out, names rank 2 with
/// its line and rank 3 as having published none (at once: no wait for it), not rank 1. With a shared secret the reports are sealed: a
/// rank with another key cannot read them, and a report planted in the clear is refused.
#[test]
#[ignore = "needs PyTorch: scripts/test-torch.sh"]
fn progress_reports_through_a_pytorch_store() {
    let server = Server::start("libuv");
    let env = |rank, run: &str, secret: Option<&str>| store_env(server.port, 4, rank, run, secret);
    let soon = || Instant::now() + Duration::from_secs(5);
    for (run, secret) in [
        ("progress-run", None),
        (
            "sealed-progress-run",
            Some("a shared secret of 32 bytes....."),
        ),
    ] {
        let board = |rank| ProgressBoard::new(&job(env(rank, run, secret)), 7).unwrap();
        board(1)
            .publish(Some(3), "all_reduce #3 F32×6, completed", soon())
            .unwrap();
        board(1)
            .publish(Some(4), "all_reduce #4 F32×6, enqueued", soon())
            .unwrap();
        board(2)
            .publish(Some(3), "all_reduce #3 F32×6, completed\u{1b}[2J", soon())
            .unwrap();
        let t = Instant::now();
        let behind = ranks_behind(
            &board(0),
            "all_reduce",
            4,
            Instant::now() + Duration::from_secs(1),
        );
        assert_eq!(behind.len(), 2, "{run}: {behind:?}");
        assert!(
            behind[0].starts_with(
                "rank 2 never reached all_reduce #4; its last collective: \"all_reduce #3 F32×6, completed\\u{1b}[2J\" (reported "
            ),
            "{run}: the newest report, its text escaped: {behind:?}"
        );
        assert!(
            behind[1].starts_with("rank 3: no progress report read (")
                && behind[1].contains("published none"),
            "{run}: {behind:?}"
        );
        // Nothing waits for a report that is not there.
        assert!(t.elapsed() < Duration::from_secs(1), "{:?}", t.elapsed());
        let r = board(3).read(1, soon()).unwrap();
        assert_eq!(r.call, Some(4));
        assert!(r.age < Duration::from_secs(60), "{r:?}");
    }
    let key = "candle-distributed/sealed-progress-run/0/7/progress/1";
    let mut c = TcpStoreClient::connect("127.0.0.1", server.port, soon()).unwrap();
    assert!(
        !String::from_utf8_lossy(&c.get(key, soon()).unwrap()).contains("all_reduce"),
        "sealed"
    );
    let other = ProgressBoard::new(
        &job(env(
            0,
            "sealed-progress-run",
            Some("another secret, also long enough"),
        )),
        7,
    )
    .unwrap();
    let e = other.read(1, soon()).unwrap_err().to_string();
    assert!(e.contains("does not open with this rank's key"), "{e}");
    c.set(key, b"9\n0\nforged", soon()).unwrap();
    let keyed = ProgressBoard::new(
        &job(env(
            0,
            "sealed-progress-run",
            Some("a shared secret of 32 bytes....."),
        )),
        7,
    )
    .unwrap();
    assert!(
        keyed.read(1, soon()).is_err(),
        "a report in the clear is refused"
    );
    // Unblock the server script (it waits for `from-rust`).
    c.set("candle-test/from-rust", b"done", soon()).unwrap();
}

/// Against a PyTorch older than the oldest supported (`scripts/test-torch-versions.sh` runs it
/// with 2.4.1): the connection fails at once, on both back-ends, with an error that names the
/// supported range.
#[test]
#[ignore = "needs an unsupported PyTorch: scripts/test-torch-versions.sh"]
fn an_unsupported_pytorch_is_named() {
    for backend in ["classic", "libuv"] {
        let server = Server::start(backend);
        let t = Instant::now();
        let e = TcpStoreClient::connect(
            "127.0.0.1",
            server.port,
            Instant::now() + Duration::from_secs(30),
        )
        .unwrap_err()
        .to_string();
        assert!(t.elapsed() < Duration::from_secs(10), "{backend}: prompt");
        assert!(
            e.contains("PyTorch older than 2.5") && e.contains("not supported"),
            "{backend}: {e}"
        );
        // The server script waits for a key this client cannot set: ended here.
        let mut server = server;
        let _ = server.child.kill();
    }
}

/// `torchrun --nproc_per_node 2 --no-python target/<profile>/examples/rendezvous`: both
/// processes receive rank 0's bytes through torchrun's own store, twice.
#[test]
#[ignore = "needs PyTorch: scripts/test-torch.sh"]
fn torchrun_launches_our_binary() {
    // This test binary is target/<profile>/deps/torch_interop-…; the example sits beside deps.
    let exe = std::env::current_exe().unwrap();
    let example: PathBuf = exe
        .parent()
        .unwrap()
        .parent()
        .unwrap()
        .join("examples/rendezvous");
    assert!(
        example.exists(),
        "build it first: cargo build --example rendezvous ({example:?})"
    );
    let out = Command::new(python())
        .args([
            "-m",
            "torch.distributed.run",
            "--nproc_per_node",
            "2",
            "--no-python",
        ])
        .arg(&example)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "torchrun failed: {stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let mut lines: Vec<&str> = stdout.lines().filter(|l| l.starts_with("rank ")).collect();
    lines.sort();
    assert_eq!(lines.len(), 2, "{stdout}");
    // "rank R of 2: <round 1> <round 2> via store"
    let payload = |l: &str| {
        let words: Vec<&str> = l.split(": ").nth(1).unwrap().split_whitespace().collect();
        words[..2].join(" ")
    };
    assert_eq!(
        payload(lines[0]),
        payload(lines[1]),
        "both ranks got rank 0's bytes"
    );
    assert!(lines.iter().all(|l| l.ends_with("via store")), "{stdout}");
    let p = payload(lines[0]);
    let rounds: Vec<&str> = p.split_whitespace().collect();
    assert!(
        rounds.len() == 2 && rounds[0].ends_with("00") && rounds[1].ends_with("01"),
        "two rendezvous, in order: {p}"
    );
}
