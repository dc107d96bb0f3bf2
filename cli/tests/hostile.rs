//! Hostile and broken clients, against the HTTP store server (`ferrogloo-store-server`, a real
//! process) and against a rank's listening socket during a live job (two `ferrogloo-bench`
//! processes). Each case: the server or the job keeps serving other clients, a live job ends
//! with correct results, and the attacked process's resident memory (from /proc) grows by less
//! than a stated bound. Every case prints a row: case, requests tried, crashes, memory growth,
//! time.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

const BENCH: &str = env!("CARGO_BIN_EXE_ferrogloo-bench");
const SERVER: &str = env!("CARGO_BIN_EXE_ferrogloo-store-server");

/// Kills the child when dropped (a failing test must not leave processes behind).
struct Guard(Child);

impl Drop for Guard {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

impl Guard {
    fn pid(&self) -> u32 {
        self.0.id()
    }

    /// Whether the process still runs.
    fn alive(&mut self) -> bool {
        matches!(self.0.try_wait(), Ok(None))
    }
}

/// Resident memory of process `pid`, in KiB.
fn rss_kib(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or(0)
}

/// Raises this process's open-file limit to its hard limit (children inherit it): a flood of
/// 2,000 connections needs that many descriptors on each side.
fn raise_fd_limit() -> u64 {
    let mut lim = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: getrlimit/setrlimit read and write a live rlimit struct.
    unsafe {
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) == 0 {
            lim.rlim_cur = lim.rlim_max;
            libc::setrlimit(libc::RLIMIT_NOFILE, &lim);
        }
    }
    lim.rlim_cur
}

/// A tiny deterministic generator (xorshift) for random bytes.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    fn bytes(&mut self, n: usize) -> Vec<u8> {
        (0..n).map(|_| self.next() as u8).collect()
    }
}

/// One row of the report.
fn report(case: &str, tried: usize, crashes: u32, grown_kib: i64, bound_kib: i64, took: Duration) {
    eprintln!(
        "| {case} | {tried} | {crashes} | {:+.1} MiB (bound {} MiB) | {:.1} s |",
        grown_kib as f64 / 1024.0,
        bound_kib / 1024,
        took.as_secs_f64()
    );
}

/// The store server with `args`, and the URL it printed.
fn server(args: &[&str]) -> (Guard, String) {
    let mut child = Command::new(SERVER)
        .args(args)
        .args(["--bind", "127.0.0.1:0", "--seconds", "120"])
        .env("RUST_LOG", "error")
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("start ferrogloo-store-server");
    let stdout = child.stdout.take().expect("piped stdout");
    let mut line = String::new();
    BufReader::new(stdout).read_line(&mut line).expect("the server prints its URL");
    (Guard(child), line.trim().to_string())
}

/// `host:port` of an `http://host:port/scope` URL.
fn authority(url: &str) -> SocketAddr {
    url.trim_start_matches("http://").split('/').next().and_then(|a| a.parse().ok()).expect("an address in the URL")
}

/// A well-behaved client: PUT then GET of a fresh key; the answer to the GET.
fn well_behaved(addr: SocketAddr, n: usize) -> bool {
    let Ok(mut s) = TcpStream::connect_timeout(&addr, Duration::from_secs(5)) else { return false };
    let _ = s.set_read_timeout(Some(Duration::from_secs(5)));
    let value = format!("value-{n}");
    let put = format!("PUT /ok/k{n} HTTP/1.1\r\nHost: x\r\nContent-Length: {}\r\n\r\n{value}", value.len());
    let get = format!("GET /ok/k{n} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
    if s.write_all(put.as_bytes()).and_then(|()| s.write_all(get.as_bytes())).is_err() {
        return false;
    }
    let mut answer = String::new();
    let _ = s.read_to_string(&mut answer);
    answer.starts_with("HTTP/1.1 200") && answer.ends_with(&value)
}

/// Sends a request on a fresh connection and reads the answer, until the server closes the
/// connection (answers here ask it to) or 5 s pass.
fn send_and_read(addr: SocketAddr, bytes: &[u8]) -> Vec<u8> {
    let Ok(mut s) = TcpStream::connect_timeout(&addr, Duration::from_secs(5)) else { return Vec::new() };
    let _ = s.set_read_timeout(Some(Duration::from_secs(5)));
    let _ = s.write_all(bytes);
    let mut got = Vec::new();
    let _ = s.take(1 << 16).read_to_end(&mut got);
    got
}

/// Sends `bytes` on a fresh connection and goes away (half-closes, reads what comes within a
/// second, closes): a broken client that expects nothing.
fn send_and_leave(addr: SocketAddr, bytes: &[u8]) {
    let Ok(mut s) = TcpStream::connect_timeout(&addr, Duration::from_secs(5)) else { return };
    let _ = s.set_read_timeout(Some(Duration::from_secs(1)));
    let _ = s.write_all(bytes);
    let _ = s.shutdown(std::net::Shutdown::Write);
    let _ = s.take(1 << 16).read_to_end(&mut Vec::new());
}

#[test]
fn the_store_server_keeps_serving_hostile_and_broken_clients() {
    let fds = raise_fd_limit();
    let flood = 2000usize.min(fds.saturating_sub(200) as usize / 2);
    // Short timeouts, so that the slow cases end within the test.
    let (mut srv, url) = server(&["--header-timeout", "1", "--body-timeout", "1", "--max-connections", "4096"]);
    let addr = authority(&url);
    assert!(well_behaved(addr, 0));
    let base = rss_kib(srv.pid()) as i64;
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    let bound = 64 << 10; // KiB
    eprintln!("| case | requests | crashes | memory growth | time |\n|---|---|---|---|---|");
    let mut served = 1;
    let mut check = |srv: &mut Guard, case: &str, tried: usize, t: Instant| {
        let took = t.elapsed();
        assert!(srv.alive(), "{case}: the server died");
        served += 1;
        assert!(well_behaved(addr, served), "{case}: a well-behaved client was not served afterwards");
        let grown = rss_kib(srv.pid()) as i64 - base;
        report(case, tried, 0, grown, bound, took);
        assert!(grown < bound, "{case}: the server grew by {grown} KiB");
    };

    // 1. Huge declared lengths: 413 at once, nothing read or allocated, connection closed.
    let t = Instant::now();
    for i in 0..200 {
        let req = format!("PUT /sc/k{i} HTTP/1.1\r\nHost: x\r\nContent-Length: {}\r\n\r\nabc", 1u64 << 40);
        let got = send_and_read(addr, req.as_bytes());
        assert!(got.starts_with(b"HTTP/1.1 413"), "huge length {i}: {:?}", String::from_utf8_lossy(&got));
    }
    check(&mut srv, "huge Content-Length (1 TiB), 3 bytes sent", 200, t);

    // 2. Missing length, bad paths, chunked bodies: clear statuses.
    let t = Instant::now();
    for (req, want) in [
        (&b"PUT /sc/k HTTP/1.1\r\nHost: x\r\n\r\n"[..], &b"HTTP/1.1 411"[..]),
        (b"GET /../../etc/passwd HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n", b"HTTP/1.1 400"),
        (
            b"PUT /sc/k HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n",
            b"HTTP/1.1 411",
        ),
    ] {
        let got = send_and_read(addr, req);
        assert!(got.starts_with(want), "{:?}: {:?}", String::from_utf8_lossy(req), String::from_utf8_lossy(&got));
    }
    check(&mut srv, "no length, bad path, chunked", 3, t);

    // 3. Truncated requests: cut anywhere, then closed.
    let t = Instant::now();
    let whole = b"PUT /sc/truncated HTTP/1.1\r\nHost: x\r\nContent-Length: 10\r\n\r\n0123456789";
    for i in 0..500 {
        let cut = (rng.next() as usize) % whole.len();
        send_and_leave(addr, &whole[..cut]);
        if i % 100 == 0 {
            assert!(well_behaved(addr, 10_000 + i));
        }
    }
    check(&mut srv, "truncated requests", 500, t);

    // 4. Random bytes, and valid requests with bytes flipped.
    let t = Instant::now();
    for i in 0..500 {
        let mut junk = if i % 2 == 0 {
            let n = 1 + (rng.next() as usize) % 2000;
            rng.bytes(n)
        } else {
            let mut v = whole.to_vec();
            for _ in 0..3 {
                let at = (rng.next() as usize) % v.len();
                v[at] ^= rng.next() as u8 | 1;
            }
            v
        };
        junk.truncate(4096);
        send_and_leave(addr, &junk);
    }
    check(&mut srv, "random and mutated bytes", 500, t);

    // 5. A flood of connections that never send, held open while others are served; the
    // server closes them at the header timeout.
    let t = Instant::now();
    let held: Vec<TcpStream> =
        (0..flood).filter_map(|_| TcpStream::connect_timeout(&addr, Duration::from_secs(5)).ok()).collect();
    assert!(held.len() * 10 >= flood * 9, "only {} of {flood} connections opened", held.len());
    assert!(well_behaved(addr, 20_000), "a client during a flood of {} idle connections", held.len());
    let peak = rss_kib(srv.pid()) as i64 - base;
    // They are closed by the server after the header timeout (1 s here): reads see EOF.
    let mut closed = 0;
    for mut s in held {
        let _ = s.set_read_timeout(Some(Duration::from_secs(5)));
        let mut b = [0u8; 1];
        if matches!(s.read(&mut b), Ok(0) | Err(_)) {
            closed += 1;
        }
    }
    assert_eq!(closed, flood, "the server closed every idle connection");
    assert!(peak < bound, "during the flood the server grew by {peak} KiB");
    check(&mut srv, &format!("flood of {flood} idle connections"), flood, t);

    // 6. Slow senders (one header byte every 100 ms) and a body that stops: closed, 408.
    let t = Instant::now();
    std::thread::scope(|s| {
        let slow: Vec<_> = (0..20)
            .map(|_| {
                s.spawn(move || {
                    let Ok(mut c) = TcpStream::connect(addr) else { return true };
                    let _ = c.set_read_timeout(Some(Duration::from_secs(5)));
                    for b in b"PUT /sc/slowly HTTP/1.1\r\nHost: x\r\n" {
                        if c.write_all(&[*b]).is_err() {
                            return true; // closed by the server: the point
                        }
                        std::thread::sleep(Duration::from_millis(100));
                    }
                    false
                })
            })
            .collect();
        assert!(well_behaved(addr, 30_000), "a client beside slow senders");
        let stopped = slow.into_iter().map(|h| h.join().unwrap_or(false)).filter(|&cut| cut).count();
        assert!(stopped >= 18, "only {stopped} of 20 slow senders were cut off at the header timeout");
    });
    let got = {
        let mut c = TcpStream::connect(addr).expect("connect");
        c.set_read_timeout(Some(Duration::from_secs(5))).expect("timeout");
        c.write_all(b"PUT /sc/stalled HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n0123456789").expect("write");
        let mut got = Vec::new();
        let _ = c.read_to_end(&mut got);
        got
    };
    assert!(got.starts_with(b"HTTP/1.1 408"), "a body that stops: {:?}", String::from_utf8_lossy(&got));
    check(&mut srv, "slow senders, stalled body", 21, t);
}

#[test]
fn the_store_server_s_limits_answer_with_their_status_and_it_goes_on() {
    let (mut srv, url) = server(&["--max-value", "1K", "--max-keys-per-scope", "3", "--max-connections", "8"]);
    let addr = authority(&url);
    let put = |k: &str, len: usize| {
        let req = format!(
            "PUT /lim/{k} HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Length: {len}\r\n\r\n{}",
            "v".repeat(len)
        );
        String::from_utf8_lossy(&send_and_read(addr, req.as_bytes())).into_owned()
    };
    assert!(put("a", 1024).starts_with("HTTP/1.1 200"));
    assert!(put("big", 1025).starts_with("HTTP/1.1 413"), "over --max-value");
    assert!(put("b", 1).starts_with("HTTP/1.1 200") && put("c", 1).starts_with("HTTP/1.1 200"));
    let full = put("d", 1);
    assert!(full.starts_with("HTTP/1.1 507") && full.contains("3 keys"), "over --max-keys-per-scope: {full}");
    assert!(put("a", 2).starts_with("HTTP/1.1 200"), "replacing a key in a full scope is fine");
    // Connections beyond the limit: 503 at once, the others unaffected.
    let held: Vec<TcpStream> = (0..8).filter_map(|_| TcpStream::connect(addr).ok()).collect();
    let extra = send_and_read(addr, b"GET /lim/a HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
    assert!(extra.starts_with(b"HTTP/1.1 503"), "over --max-connections: {:?}", String::from_utf8_lossy(&extra));
    drop(held);
    let t = Instant::now();
    while !well_behaved(addr, 1) {
        assert!(t.elapsed() < Duration::from_secs(5), "the server did not serve again once the connections closed");
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(srv.alive());
}

/// Resident memory of `pid` once it has settled (its buffers allocated): the first value that
/// five samples 100 ms apart stay within 512 KiB of, or the last sample after `limit`.
fn steady_rss_kib(pid: u32, limit: Duration) -> u64 {
    let t = Instant::now();
    let mut samples: Vec<u64> = Vec::new();
    loop {
        samples.push(rss_kib(pid));
        let recent = &samples[samples.len().saturating_sub(5)..];
        let (lo, hi) = (recent.iter().min().copied().unwrap_or(0), recent.iter().max().copied().unwrap_or(0));
        if (recent.len() == 5 && hi - lo <= 512) || t.elapsed() >= limit {
            return hi;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// The address a rank published in a file store (`ferrogloo.rank.R`), once it is there.
fn published_address(dir: &std::path::Path, rank: usize, limit: Duration) -> SocketAddr {
    let t = Instant::now();
    loop {
        if let Ok(entry) = std::fs::read_to_string(dir.join(format!("ferrogloo.rank.{rank}")))
            && let Some(addr) = entry.split(' ').nth(5).and_then(|a| a.parse().ok())
        {
            return addr;
        }
        assert!(t.elapsed() < limit, "rank {rank} published no entry");
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn a_rank_s_listener_under_attack_keeps_its_job_going() {
    let fds = raise_fd_limit();
    let flood = 2000usize.min(fds.saturating_sub(200) as usize / 2);
    let dir = tempfile::tempdir().expect("store directory");
    let store = format!("file:{}", dir.path().display());
    let rank = |r: usize| {
        Command::new(BENCH)
            .args(["--rank", &r.to_string(), "--size", "2", "--store", &store])
            // 200 cells of checked 1 MiB allreduces, a second each (minutes in all): the job
            // outlasts the attack however slow this machine is; the test ends it once a cell
            // finished after the attack.
            .args(["--op", "allreduce", "--sizes", &vec!["1M"; 200].join(","), "--seconds", "1"])
            .env("FERROGLOO_ADDR", "127.0.0.1")
            // The TCP listener is what is attacked.
            .env("FERROGLOO_TRANSPORT", "tcp")
            .env("RUST_LOG", "error")
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .map(Guard)
            .expect("start a rank")
    };
    let (mut r0, r1) = (rank(0), rank(1));
    // Rank 0's result rows (a row per finished cell), as they come.
    let rows = {
        let out = r0.0.stdout.take().expect("stdout");
        let (tx, rx) = std::sync::mpsc::channel::<String>();
        std::thread::spawn(move || {
            for line in std::io::BufRead::lines(std::io::BufReader::new(out)).map_while(Result::ok) {
                if line.trim_start().starts_with(|c: char| c.is_ascii_digit()) && tx.send(line).is_err() {
                    break;
                }
            }
        });
        rx
    };
    let addr = published_address(dir.path(), 0, Duration::from_secs(20));
    let base = steady_rss_kib(r0.pid(), Duration::from_secs(5)) as i64;
    let bound = 64 << 10; // KiB
    let mut rng = Rng(0x2545_f491_4f6c_dd1d);
    let t = Instant::now();
    // Random bytes, truncated and mutated handshakes (56-byte hellos of a TCP pair, see
    // src/transport/handshake/mod.rs).
    // Version 5 (src/transport/handshake/messages.rs).
    let mut hello = b"FGLO\x05\x00\x01\x00\x01\x00".to_vec();
    hello.resize(56, 0);
    for i in 0..600 {
        let bytes = match i % 3 {
            0 => {
                let n = 1 + (rng.next() as usize) % 200;
                rng.bytes(n)
            }
            1 => hello[..(rng.next() as usize) % 56].to_vec(),
            _ => {
                let mut h = hello.clone();
                let at = (rng.next() as usize) % h.len();
                h[at] ^= rng.next() as u8 | 1;
                h
            }
        };
        if let Ok(mut s) = TcpStream::connect_timeout(&addr, Duration::from_secs(2)) {
            let _ = s.write_all(&bytes);
        }
    }
    // A flood of connections that never send, held while the job runs.
    let held: Vec<TcpStream> =
        (0..flood).filter_map(|_| TcpStream::connect_timeout(&addr, Duration::from_secs(2)).ok()).collect();
    let peak = rss_kib(r0.pid()) as i64 - base;
    if !r0.alive() {
        let mut err = String::new();
        let _ = r0.0.stderr.take().expect("stderr").read_to_string(&mut err);
        panic!("the attacked rank died ({:?}): {err}", r0.0.try_wait());
    }
    // The job goes on: a cell that finishes after the attack (with the connections still
    // held) has every value right (its last column counts the wrong ones).
    for earlier in rows.try_iter() {
        assert_eq!(earlier.split_whitespace().last(), Some("0"), "wrong values during the attack: {earlier}");
    }
    let row = rows.recv_timeout(Duration::from_secs(60)).expect("a cell finished after the attack");
    assert_eq!(row.split_whitespace().last(), Some("0"), "wrong values after the attack: {row}");
    assert!(r0.alive(), "the attacked rank ended early");
    drop(held);
    drop((r0, r1));
    report(
        &format!("rank listener: 600 random/truncated/mutated handshakes, {flood} idle connections"),
        600 + flood,
        0,
        peak,
        bound,
        t.elapsed(),
    );
    assert!(peak < bound, "the attacked rank grew by {peak} KiB");
}
