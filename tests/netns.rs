//! Several hosts on one machine: each test builds its own network of Linux network namespaces
//! (three "hosts" plus a "switch" namespace holding a bridge, joined by veth pairs), runs two
//! rank processes per host, and removes the namespaces when it ends. Ranks pick their address
//! by interface name, and meet through a FileStore on the shared filesystem.
//!
//! Needs root and `ip`/`tc` (iproute2). Where namespaces cannot be made, each test prints why
//! it is skipped and passes.

mod common;

use ferrogloo::config::{FERROGLOO_RANK as RANK_ENV, FERROGLOO_SIZE as SIZE_ENV, FERROGLOO_STORE as STORE_ENV};
use ferrogloo::device::{Device, TcpAttr};
use ferrogloo::launch::RankEnv;
use ferrogloo::rendezvous::{PrefixStore, Store};
use ferrogloo::{Algorithm, CollectiveOptions, Context, Error, Reduction};
use std::io::{BufRead, BufReader, Write};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

const SCENARIO_ENV: &str = "FERROGLOO_TEST_SCENARIO";
const EXPECT_IP_ENV: &str = "FERROGLOO_TEST_IP";
/// The interface every host reaches the others through.
const IFACE: &str = "fgnet";
const HOSTS: usize = 3;
const RANKS_PER_HOST: usize = 2;
/// Deadline of the calls that must succeed (debug build, loaded 2-core machine, shaped link).
const TIMEOUT: Duration = Duration::from_secs(30);
/// Deadline of the calls running when the link goes down: every rank must fail within it + 1 s.
const LINK_TIMEOUT: Duration = Duration::from_secs(3);
/// Shaping of the slow host's link, both directions.
const SLOW_RATE: &str = "40mbit";

fn now_ns() -> u128 {
    SystemTime::now().duration_since(UNIX_EPOCH).unwrap_or_default().as_nanos()
}

/// One rank, started by a test below inside a host's namespace.
#[test]
#[ignore = "run as a child process by the other tests in this file"]
fn netns_rank_worker() {
    if !RankEnv::is_set() {
        return;
    }
    let env = RankEnv::from_env().expect("rank environment");
    let store = ferrogloo::rendezvous::open(&env.store).expect("open store");
    // Interface selection by name: each host also has a decoy interface whose address the
    // other hosts cannot reach, so picking the wrong one fails the job.
    let scenario = std::env::var(SCENARIO_ENV).unwrap_or_default();
    let dev = if scenario == "hier" {
        // Shared memory between the ranks of one namespace, TCP across.
        Device::auto(&TcpAttr::iface(IFACE)).expect("auto device on the named interface")
    } else {
        Device::tcp(&TcpAttr::iface(IFACE)).expect("device on the named interface")
    };
    let want = std::env::var(EXPECT_IP_ENV).expect("expected address");
    assert_eq!(
        dev.local_addr().expect("a TCP device").ip().to_string(),
        want,
        "rank {} bound the wrong interface",
        env.rank
    );
    match scenario.as_str() {
        "hier" => hierarchical(&env, &store, &dev),
        "shaped" => shaped(&env, &store, &dev),
        "link_down" => link_down(&env, &store, &dev),
        other => panic!("unknown scenario {other:?}"),
    }
    println!("DONE rank {}", env.rank);
}

/// Two namespaces of two ranks each on auto devices: the ranks of a namespace are one host
/// (shared memory), the namespaces two hosts (TCP); allreduce runs hierarchically, and every
/// other collective over the mixed pairs.
fn hierarchical(env: &RankEnv, store: &impl Store, dev: &Device) {
    let ctx = Context::builder(env.rank, env.size).timeout(TIMEOUT).connect(store, dev).expect("rendezvous");
    let (r, n) = (ctx.rank(), ctx.size());
    let host = r / RANKS_PER_HOST;
    let mates: Vec<usize> = (host * RANKS_PER_HOST..(host + 1) * RANKS_PER_HOST).collect();
    assert_eq!(ctx.local_ranks(), mates, "rank {r}: the ranks of its namespace are its host");
    assert_eq!(ctx.allreduce_algorithm(1 << 20, Algorithm::Auto).expect("algorithm"), Algorithm::SharedMemory);
    for len in [0usize, 1, 4096, (3 << 20) / 4 + 3] {
        let mut v: Vec<f64> = (0..len).map(|i| (r * 1000 + i % 977) as f64).collect();
        ctx.allreduce(&mut v, Reduction::Sum).expect("hierarchical allreduce");
        let base = (1000 * n * (n - 1) / 2) as f64;
        let bad = v.iter().enumerate().position(|(i, &x)| x != base + (n * (i % 977)) as f64);
        assert_eq!(bad, None, "rank {r}: hierarchical allreduce of {len} wrong");
    }
    check_collectives(&ctx, 10_000);
}

/// Checks a run of collectives (values on every rank) with every allreduce algorithm.
fn check_collectives(ctx: &Context, elems: usize) {
    let (r, n) = (ctx.rank(), ctx.size());
    for alg in [Algorithm::Ring, Algorithm::HalvingDoubling, Algorithm::RecursiveDoubling, Algorithm::Auto] {
        let mut v: Vec<f32> = (0..elems).map(|i| (r + i % 13) as f32).collect();
        ctx.allreduce_with(&mut v, Reduction::Sum, &CollectiveOptions::new().algorithm(alg)).expect("allreduce");
        let base = (n * (n - 1) / 2) as f32;
        let bad = v.iter().enumerate().position(|(i, &x)| x != base + (n * (i % 13)) as f32);
        assert_eq!(bad, None, "rank {r}: {alg:?} allreduce wrong");
    }
    let o = CollectiveOptions::default();
    // Broadcast from a rank on the slow host.
    let root = n - 1;
    let mut b: Vec<u32> = if r == root { (0..elems as u32).map(|i| i ^ 0x5a5a).collect() } else { vec![0; elems] };
    ctx.broadcast(&mut b, root, &o).expect("broadcast");
    assert!(b.iter().enumerate().all(|(i, &x)| x == i as u32 ^ 0x5a5a), "rank {r}: broadcast wrong");
    let per = elems / n + 1;
    let mine: Vec<u64> = (0..per).map(|i| (r * per + i) as u64).collect();
    let mut all = vec![0u64; per * n];
    ctx.allgather(&mine, &mut all, &o).expect("allgather");
    assert!(all.iter().enumerate().all(|(i, &x)| x == i as u64), "rank {r}: allgather wrong");
    ctx.barrier().expect("barrier");
}

/// Collectives across three hosts, one of them behind a slow shaped link.
fn shaped(env: &RankEnv, store: &impl Store, dev: &Device) {
    let ctx = Context::builder(env.rank, env.size).timeout(TIMEOUT).connect(store, dev).expect("rendezvous");
    check_collectives(&ctx, 64 * 1024 + 3);
}

/// Allreduces until the parent takes the last host's link down; every rank reports when its
/// call failed, waits for the parent's "UP", then joins generation 1 under a fresh prefix.
fn link_down(env: &RankEnv, store: &impl Store, dev: &Device) {
    let (r, n) = (env.rank, env.size);
    let gen0 = PrefixStore::new("gen0", store);
    let ctx = Context::builder(r, n).timeout(LINK_TIMEOUT).connect(&gen0, dev).expect("generation 0");
    let mut buf = vec![0f32; 1 << 18]; // 1 MiB
    let started = Instant::now();
    let mut laps = 0u64;
    let err = loop {
        buf.fill(1.0);
        match ctx.allreduce(&mut buf, Reduction::Sum) {
            Ok(()) => assert!(buf.iter().all(|&x| x == n as f32), "rank {r}: wrong allreduce before the fault"),
            Err(e) => break e,
        }
        laps += 1;
        if laps == 1 {
            println!("READY");
        }
        assert!(started.elapsed() < TIMEOUT * 2, "rank {r}: the link never went down");
    };
    println!("ERROR_AT {} {err}", now_ns());
    assert!(
        matches!(err, Error::Timeout { .. } | Error::PeerTimedOut { .. } | Error::PeerClosed { .. } | Error::Io { .. }),
        "rank {r}: unexpected kind of error {err:?}"
    );
    assert!(ctx.is_aborted(), "rank {r}: a failed collective leaves the context aborted");
    drop(ctx);

    let mut line = String::new();
    std::io::stdin().read_line(&mut line).expect("read the parent's go-ahead");
    assert_eq!(line.trim(), "UP", "rank {r}: unexpected word from the parent");
    let gen1 = PrefixStore::new("gen1", store);
    let ctx = Context::builder(r, n).timeout(TIMEOUT).connect(&gen1, dev).expect("generation 1");
    check_collectives(&ctx, 10_000);
}

/// A private network of namespaces: `<tag>sw` holds bridge `br0`; host `i` is `<tag>h<i>`, with
/// interface `fgnet` (10.77.<net>.<i+1>/24) on the bridge and a decoy `fgdecoy`
/// (10.88.<net>.<i+1>/24) on a veth pair of its own. Dropping it deletes every namespace.
struct Net {
    tag: String,
    net: u8,
    made: Vec<String>,
}

impl Net {
    /// Builds the network, or says why it cannot be built here.
    fn create(name: &str, net: u8) -> Result<Net, String> {
        let tag = format!("fg{}{name}", std::process::id());
        let mut me = Net { tag, net, made: Vec::new() };
        me.add_ns(&me.switch())?;
        me.ip(&["-n", &me.switch(), "link", "add", "br0", "type", "bridge"])?;
        me.ip(&["-n", &me.switch(), "link", "set", "br0", "up"])?;
        for h in 0..HOSTS {
            let (ns, port) = (me.host(h), format!("h{h}"));
            me.add_ns(&ns)?;
            me.ip(&["-n", &me.switch(), "link", "add", &port, "type", "veth", "peer", "name", IFACE, "netns", &ns])?;
            me.ip(&["-n", &me.switch(), "link", "set", &port, "master", "br0", "up"])?;
            me.ip(&["-n", &ns, "link", "add", "fgdecoy", "type", "veth", "peer", "name", "fgdecoy1"])?;
            me.ip(&["-n", &ns, "link", "set", "fgdecoy1", "up"])?;
            me.ip(&["-n", &ns, "addr", "add", &format!("10.88.{net}.{}/24", h + 1), "dev", "fgdecoy"])?;
            me.ip(&["-n", &ns, "link", "set", "fgdecoy", "up"])?;
            me.ip(&["-n", &ns, "addr", "add", &format!("{}/24", me.addr(h)), "dev", IFACE])?;
            me.ip(&["-n", &ns, "link", "set", IFACE, "up"])?;
            me.ip(&["-n", &ns, "link", "set", "lo", "up"])?;
        }
        Ok(me)
    }

    fn switch(&self) -> String {
        format!("{}sw", self.tag)
    }

    fn host(&self, h: usize) -> String {
        format!("{}h{h}", self.tag)
    }

    fn addr(&self, h: usize) -> String {
        format!("10.77.{}.{}", self.net, h + 1)
    }

    fn add_ns(&mut self, ns: &str) -> Result<(), String> {
        self.ip(&["netns", "add", ns])?;
        self.made.push(ns.to_string());
        Ok(())
    }

    fn ip(&self, args: &[&str]) -> Result<(), String> {
        run("ip", args)
    }

    /// Shapes host `h`'s link in both directions with a token bucket.
    fn shape(&self, h: usize, rate: &str) -> Result<(), String> {
        let tbf = ["root", "tbf", "rate", rate, "burst", "64kb", "latency", "400ms"];
        let port = format!("h{h}");
        run("tc", &[&["-n", &self.switch(), "qdisc", "add", "dev", &port][..], &tbf].concat())?;
        run("tc", &[&["-n", &self.host(h), "qdisc", "add", "dev", IFACE][..], &tbf].concat())
    }

    /// Bytes the shaping qdisc on host `h`'s switch port has sent (toward host `h`).
    fn shaped_bytes(&self, h: usize) -> u64 {
        let out = Command::new("tc")
            .args(["-n", &self.switch(), "-s", "qdisc", "show", "dev", &format!("h{h}")])
            .output()
            .expect("tc");
        let text = String::from_utf8_lossy(&out.stdout);
        text.split("Sent ").nth(1).and_then(|s| s.split(' ').next()).and_then(|b| b.parse().ok()).unwrap_or(0)
    }

    /// Sets host `h`'s switch port down or up: the cable pulled out or put back.
    fn link(&self, h: usize, up: bool) {
        let state = if up { "up" } else { "down" };
        self.ip(&["-n", &self.switch(), "link", "set", &format!("h{h}"), state]).expect("set link state");
    }

    /// Starts the six rank processes of `scenario`, two in each host's namespace.
    fn spawn(&self, scenario: &str, store_url: &str) -> Vec<Child> {
        self.spawn_on(HOSTS, scenario, store_url)
    }

    /// Starts two rank processes of `scenario` in each of the first `hosts` namespaces.
    fn spawn_on(&self, hosts: usize, scenario: &str, store_url: &str) -> Vec<Child> {
        let exe = std::env::current_exe().unwrap();
        let n = hosts * RANKS_PER_HOST;
        (0..n)
            .map(|rank| {
                let h = rank / RANKS_PER_HOST;
                Command::new("ip")
                    .args(["netns", "exec", &self.host(h)])
                    .arg(&exe)
                    .args(["--ignored", "--exact", "netns_rank_worker", "--nocapture", "--test-threads=1"])
                    .env(RANK_ENV, rank.to_string())
                    .env(SIZE_ENV, n.to_string())
                    .env(STORE_ENV, store_url)
                    .env(SCENARIO_ENV, scenario)
                    .env(EXPECT_IP_ENV, self.addr(h))
                    .stdin(Stdio::piped())
                    .stdout(Stdio::piped())
                    .spawn()
                    .unwrap()
            })
            .collect()
    }
}

impl Drop for Net {
    fn drop(&mut self) {
        // Deleting a namespace deletes the veth ends and the bridge in it.
        for ns in self.made.iter().rev() {
            let _ = run("ip", &["netns", "del", ns]);
        }
    }
}

fn run(cmd: &str, args: &[&str]) -> Result<(), String> {
    let out = Command::new(cmd).args(args).output().map_err(|e| format!("{cmd}: {e}"))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!("`{cmd} {}` failed: {}", args.join(" "), String::from_utf8_lossy(&out.stderr).trim()))
    }
}

/// Builds the network, or prints why the test is skipped here.
fn network(name: &str, net: u8) -> Option<Net> {
    match Net::create(name, net) {
        Ok(n) => Some(n),
        Err(why) => {
            eprintln!("SKIPPED: cannot build network namespaces here (needs root and iproute2): {why}");
            None
        }
    }
}

/// Every line a child prints, sent on a channel as it comes, with the child's rank.
fn lines_of(children: &mut [Child]) -> mpsc::Receiver<(usize, String)> {
    let (tx, rx) = mpsc::channel();
    for (rank, c) in children.iter_mut().enumerate() {
        let out = c.stdout.take().unwrap();
        let tx = tx.clone();
        std::thread::spawn(move || {
            for l in BufReader::new(out).lines().map_while(Result::ok) {
                if tx.send((rank, l)).is_err() {
                    break;
                }
            }
        });
    }
    rx
}

/// Collects lines until every rank has printed one containing `word`; gives up at `deadline`.
/// Returns each rank's first such line, and every line seen (for failure messages).
fn await_word(
    rx: &mpsc::Receiver<(usize, String)>,
    n: usize,
    word: &str,
    deadline: Instant,
    seen: &mut String,
) -> Vec<String> {
    let mut got: Vec<Option<String>> = vec![None; n];
    while got.iter().any(Option::is_none) {
        let left = deadline.saturating_duration_since(Instant::now());
        match rx.recv_timeout(left) {
            Ok((rank, l)) => {
                seen.push_str(&format!("[{rank}] {l}\n"));
                if l.contains(word) && got[rank].is_none() {
                    got[rank] = Some(l);
                }
            }
            Err(_) => panic!("not every rank printed {word:?} in time:\n{seen}"),
        }
    }
    got.into_iter().flatten().collect()
}

/// Waits for every child to exit successfully, killing the rest at `deadline`.
fn reap(children: Vec<Child>, deadline: Instant, seen: &str) {
    for (rank, mut c) in children.into_iter().enumerate() {
        let status = common::wait_or_kill(&mut c, deadline);
        assert!(status.is_some_and(|s| s.success()), "rank {rank} failed or overran ({status:?}):\n{seen}");
    }
}

#[test]
fn two_namespaces_of_two_ranks_run_the_hierarchical_allreduce() {
    let Some(net) = network("h", 3) else { return };
    let dir = tempfile::tempdir().unwrap();
    let mut children = net.spawn_on(2, "hier", &format!("file:{}", dir.path().display()));
    let rx = lines_of(&mut children);
    let n = children.len();
    let start = Instant::now();
    let mut seen = String::new();
    await_word(&rx, n, "DONE rank", start + TIMEOUT * 2, &mut seen);
    reap(children, start + TIMEOUT * 2, &seen);
    println!("2 namespaces of 2 ranks, hierarchical allreduce: {:?}\n{seen}", start.elapsed());
}

#[test]
fn three_hosts_with_a_slow_link_run_collectives_correctly() {
    let Some(net) = network("s", 1) else { return };
    net.shape(HOSTS - 1, SLOW_RATE).expect("tbf shaping");
    let dir = tempfile::tempdir().unwrap();
    let mut children = net.spawn("shaped", &format!("file:{}", dir.path().display()));
    let rx = lines_of(&mut children);
    let n = children.len();
    let start = Instant::now();
    let mut seen = String::new();
    await_word(&rx, n, "DONE rank", start + TIMEOUT * 4, &mut seen);
    reap(children, start + TIMEOUT * 4, &seen);
    // The traffic did cross the shaped link: the two ranks behind it received at least their
    // share of the broadcast and allgather through it.
    let through = net.shaped_bytes(HOSTS - 1);
    println!("6 ranks on 3 hosts, one link at {SLOW_RATE}: {:?}, {through} bytes into the slow host", start.elapsed());
    assert!(through > 2 * (64 * 1024) * 4, "only {through} bytes crossed the shaped link");
}

#[test]
fn a_link_taken_down_mid_allreduce_fails_every_rank_in_time_and_the_job_recovers() {
    let Some(net) = network("d", 2) else { return };
    let dir = tempfile::tempdir().unwrap();
    let mut children = net.spawn("link_down", &format!("file:{}", dir.path().display()));
    let rx = lines_of(&mut children);
    let n = children.len();
    let mut seen = String::new();
    await_word(&rx, n, "READY", Instant::now() + TIMEOUT * 2, &mut seen);

    // Every rank has finished an allreduce and is in the middle of the next ones.
    let down_at = now_ns();
    net.link(HOSTS - 1, false);
    let errors = await_word(&rx, n, "ERROR_AT", Instant::now() + LINK_TIMEOUT * 3, &mut seen);
    for (rank, l) in errors.iter().enumerate() {
        let at: u128 =
            l.split("ERROR_AT ").nth(1).and_then(|s| s.split(' ').next()).and_then(|t| t.parse().ok()).unwrap();
        let took = Duration::from_nanos(at.saturating_sub(down_at) as u64);
        println!("rank {rank} failed {took:?} after the link went down: {l}");
        assert!(took < LINK_TIMEOUT + Duration::from_secs(1), "rank {rank} took {took:?} to fail:\n{seen}");
    }

    // Cable back in: the same processes form generation 1 and run collectives correctly.
    net.link(HOSTS - 1, true);
    for c in &mut children {
        c.stdin.as_mut().unwrap().write_all(b"UP\n").unwrap();
    }
    let deadline = Instant::now() + TIMEOUT * 4;
    await_word(&rx, n, "DONE rank", deadline, &mut seen);
    reap(children, deadline, &seen);
}
