//! `ferrogloo-run` across hosts: two network namespaces, each running a real `sshd` (Debian's
//! openssh-server) with keys made by the test, joined to this namespace by a bridge. The
//! launcher starts ranks in both over ssh; an unreachable host is named within the start
//! timeout; SIGKILL of the launcher ends the remote ranks too; remote ranks get the job's
//! secret over their channel, never in a command line or environment, and lose it with the job.
//!
//! Needs root, iproute2 and openssh-server; where they are missing the tests print why and
//! pass (CI installs them).

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

const RUN: &str = env!("CARGO_BIN_EXE_ferrogloo-run");
const BENCH: &str = env!("CARGO_BIN_EXE_ferrogloo-bench");
const SSHD: &str = "/usr/sbin/sshd";
/// The bridge in this namespace, and the interface in each host: ranks and launcher both use it.
const IFACE: &str = "fgssh";
const HOSTS: usize = 2;

fn run(cmd: &str, args: &[&str]) -> Result<(), String> {
    let out = Command::new(cmd).args(args).output().map_err(|e| format!("{cmd}: {e}"))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!("`{cmd} {}` failed: {}", args.join(" "), String::from_utf8_lossy(&out.stderr).trim()))
    }
}

/// Two "hosts" with sshd, and the keys to reach them.
struct Net {
    /// Namespaces made (deleted on drop), and the sshd processes (killed on drop).
    ns: Vec<String>,
    sshd: Vec<Child>,
    bridge: bool,
    dir: tempfile::TempDir,
}

impl Net {
    fn host(i: usize) -> String {
        format!("fgssh-h{i}")
    }

    fn addr(i: usize) -> String {
        format!("10.77.0.{}", 10 + i)
    }

    fn create() -> Result<Net, String> {
        if !Path::new(SSHD).exists() {
            return Err(format!("{SSHD} is not installed (apt-get install openssh-server)"));
        }
        let dir = tempfile::tempdir().map_err(|e| e.to_string())?;
        let mut net = Net { ns: Vec::new(), sshd: Vec::new(), bridge: false, dir };
        // Leftovers of an earlier run that was killed.
        let _ = run("ip", &["link", "del", IFACE]);
        for i in 0..HOSTS {
            let _ = run("ip", &["netns", "del", &Self::host(i)]);
            // (A veth outlives its deleted namespace while a process there still runs.)
            let _ = run("ip", &["link", "del", &format!("fgsshp{i}")]);
        }
        run("ip", &["link", "add", IFACE, "type", "bridge"])?;
        net.bridge = true;
        run("ip", &["addr", "add", "10.77.0.1/24", "dev", IFACE])?;
        run("ip", &["link", "set", IFACE, "up"])?;
        let d = net.dir.path().to_path_buf();
        let keygen =
            |path: &Path| run("ssh-keygen", &["-q", "-t", "ed25519", "-N", "", "-f", &path.display().to_string()]);
        keygen(&d.join("user_key"))?;
        std::fs::copy(d.join("user_key.pub"), d.join("authorized_keys")).map_err(|e| e.to_string())?;
        for i in 0..HOSTS {
            let ns = Self::host(i);
            run("ip", &["netns", "add", &ns])?;
            net.ns.push(ns.clone());
            let port = format!("fgsshp{i}");
            run("ip", &["link", "add", &port, "type", "veth", "peer", "name", IFACE, "netns", &ns])?;
            run("ip", &["link", "set", &port, "master", IFACE, "up"])?;
            run("ip", &["-n", &ns, "addr", "add", &format!("{}/24", Self::addr(i)), "dev", IFACE])?;
            run("ip", &["-n", &ns, "link", "set", IFACE, "up"])?;
            run("ip", &["-n", &ns, "link", "set", "lo", "up"])?;
            let key = d.join(format!("host_key_{i}"));
            keygen(&key)?;
            let config = d.join(format!("sshd_config_{i}"));
            std::fs::write(
                &config,
                format!(
                    "ListenAddress {}\nPort 22\nHostKey {}\nAuthorizedKeysFile {}\nPermitRootLogin prohibit-password\n\
                     PasswordAuthentication no\nKbdInteractiveAuthentication no\nUsePAM no\nStrictModes no\n\
                     PidFile {}\nAcceptEnv none\n",
                    Self::addr(i),
                    key.display(),
                    d.join("authorized_keys").display(),
                    d.join(format!("sshd_{i}.pid")).display()
                ),
            )
            .map_err(|e| e.to_string())?;
            // sshd refuses to run from a relative path, and needs its privilege-separation dir.
            let _ = std::fs::create_dir_all("/run/sshd");
            let child = Command::new("ip")
                .args(["netns", "exec", &ns, SSHD, "-D", "-e", "-f"])
                .arg(&config)
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .map_err(|e| format!("starting sshd: {e}"))?;
            net.sshd.push(child);
        }
        net.wait_for_sshd(Duration::from_secs(10))?;
        Ok(net)
    }

    /// Waits until every host's port 22 accepts connections.
    fn wait_for_sshd(&self, limit: Duration) -> Result<(), String> {
        let t = Instant::now();
        for i in 0..HOSTS {
            let addr: std::net::SocketAddr = format!("{}:22", Self::addr(i)).parse().map_err(|e| format!("{e}"))?;
            while std::net::TcpStream::connect_timeout(&addr, Duration::from_millis(200)).is_err() {
                if t.elapsed() > limit {
                    return Err(format!("sshd on {addr} did not come up in {limit:?}"));
                }
                std::thread::sleep(Duration::from_millis(50));
            }
        }
        Ok(())
    }

    /// `ferrogloo-run` with this network's ssh settings.
    fn launcher(&self) -> Command {
        let d = self.dir.path();
        let mut c = Command::new(RUN);
        c.arg("--ssh-identity")
            .arg(d.join("user_key"))
            .args(["--ssh-option", &format!("UserKnownHostsFile={}", d.join("known_hosts").display())])
            .args(["--network-interface", IFACE]);
        c
    }

    fn hosts(&self, slots: usize) -> String {
        (0..HOSTS).map(|i| format!("{}:{slots}", Self::addr(i))).collect::<Vec<_>>().join(",")
    }

    fn dir(&self) -> PathBuf {
        self.dir.path().to_path_buf()
    }
}

impl Drop for Net {
    fn drop(&mut self) {
        for c in &mut self.sshd {
            let _ = c.kill();
            let _ = c.wait();
        }
        for ns in self.ns.iter().rev() {
            let _ = run("ip", &["netns", "del", ns]);
        }
        if self.bridge {
            let _ = run("ip", &["link", "del", IFACE]);
        }
    }
}

/// One network at a time: the tests share the bridge's name.
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn network() -> Option<(std::sync::MutexGuard<'static, ()>, Net)> {
    let guard = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    match Net::create() {
        Ok(n) => Some((guard, n)),
        Err(why) => {
            eprintln!("SKIPPED: cannot build namespaces with sshd here (needs root, iproute2, openssh-server): {why}");
            None
        }
    }
}

#[test]
fn an_allreduce_across_two_ssh_hosts() {
    let Some((_serial, net)) = network() else { return };
    let out = net
        .launcher()
        .args(["-np", "4", "-H", &net.hosts(2), "--start-timeout", "20", "--timeout", "120"])
        .args([BENCH, "--op", "allreduce,allgather", "--sizes", "4K,1M", "-n", "3"])
        .stdin(Stdio::null())
        .output()
        .expect("run ferrogloo-run");
    let (stdout, stderr) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "{stdout}\n{stderr}");
    assert!(stdout.contains("[0]<stdout>:# allreduce: 4 ranks"), "{stdout}");
    assert!(stdout.contains("Out of bounds values : 0 OK"), "{stdout}");
    // Two ranks per namespace: shared memory within, TCP across (the hierarchical allreduce).
    assert!(stdout.contains("auto:shm"), "{stdout}");
}

#[test]
fn an_unreachable_host_is_named_within_the_start_timeout() {
    let Some((_serial, net)) = network() else { return };
    let t = Instant::now();
    let out = net
        .launcher()
        .args(["-np", "2", "-H", &format!("{}:1,10.77.0.99:1", Net::addr(0)), "--start-timeout", "4"])
        .args(["true"])
        .stdin(Stdio::null())
        .output()
        .expect("run ferrogloo-run");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("did not answer over ssh") && stderr.contains("10.77.0.99"), "{stderr}");
    assert!(!stderr.contains(&format!("{} (", Net::addr(0))), "the reachable host is not named: {stderr}");
    assert!(t.elapsed() < Duration::from_secs(15), "took {:?}", t.elapsed());
}

#[test]
fn sigkill_to_the_launcher_ends_the_remote_ranks() {
    let Some((_serial, net)) = network() else { return };
    let mut child = net
        .launcher()
        .args(["-np", "2", "-H", &net.hosts(1), "--start-timeout", "20"])
        .args(["sh", "-c", "echo PID $$; exec sleep 120"])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("start ferrogloo-run");
    let out = child.stdout.take().expect("stdout");
    let mut pids: Vec<u32> = Vec::new();
    for line in BufReader::new(out).lines().map_while(Result::ok) {
        if let Some(p) = line.split("PID ").nth(1).and_then(|p| p.trim().parse().ok()) {
            pids.push(p);
            if pids.len() == 2 {
                break;
            }
        }
    }
    assert_eq!(pids.len(), 2, "both remote ranks printed their pids");
    child.kill().expect("SIGKILL the launcher");
    let _ = child.wait();
    // Namespaces share this machine's process table: the remote ranks are visible by pid.
    let t = Instant::now();
    let alive = |p: &u32| std::fs::metadata(format!("/proc/{p}")).is_ok();
    while pids.iter().any(alive) && t.elapsed() < Duration::from_secs(10) {
        std::thread::sleep(Duration::from_millis(50));
    }
    let left: Vec<&u32> = pids.iter().filter(|p| alive(p)).collect();
    assert!(left.is_empty(), "remote ranks outlived the launcher: {left:?} ({})", net.dir().display());
}

#[test]
fn a_remote_rank_s_failure_is_the_headline_with_its_own_stderr() {
    let Some((_serial, net)) = network() else { return };
    let t = Instant::now();
    // Rank 1 (on the second host) writes to stderr and to stdout, and exits 3; rank 0 would
    // sleep a minute.
    let script = r#"if [ "$FERROGLOO_RANK" = 1 ]; then echo "to stdout"; echo "bad input on rank 1" >&2; exit 3; fi; exec sleep 60"#;
    let out = net
        .launcher()
        .args(["-np", "2", "-H", &net.hosts(1), "--start-timeout", "20", "--grace", "2"])
        .args(["sh", "-c", script])
        .stdin(Stdio::null())
        .output()
        .expect("run ferrogloo-run");
    let (stdout, stderr) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert_eq!(out.status.code(), Some(3), "{stdout}\n{stderr}");
    let host = Net::addr(1);
    assert!(stderr.contains(&format!("rank 1 (host {host}) exited with code 3")), "{stderr}");
    // Its stderr apart from its stdout (no pseudo-terminal merging them).
    assert!(stderr.contains("[1]<stderr>:bad input on rank 1"), "{stderr}");
    assert!(stderr.contains("    bad input on rank 1"), "the headline quotes its stderr:\n{stderr}");
    assert!(stdout.contains("[1]<stdout>:to stdout") && !stdout.contains("bad input"), "{stdout}");
    assert!(t.elapsed() < Duration::from_secs(30), "took {:?}", t.elapsed());
}

/// The variables of process `pid`.
fn environ(pid: u32) -> std::collections::HashMap<String, String> {
    let raw = std::fs::read(format!("/proc/{pid}/environ")).unwrap_or_default();
    raw.split(|&b| b == 0)
        .filter_map(|kv| std::str::from_utf8(kv).ok()?.split_once('=').map(|(k, v)| (k.to_string(), v.to_string())))
        .collect()
}

/// Every process of this machine (namespaces share its process table) whose command line or
/// environment holds `needle`.
fn processes_showing(needle: &[u8]) -> Vec<String> {
    let mut found = Vec::new();
    for entry in std::fs::read_dir("/proc").expect("/proc").flatten() {
        let Some(pid) = entry.file_name().to_str().and_then(|p| p.parse::<u32>().ok()) else { continue };
        for what in ["cmdline", "environ"] {
            let bytes = std::fs::read(format!("/proc/{pid}/{what}")).unwrap_or_default();
            if bytes.windows(needle.len()).any(|w| w == needle) {
                found.push(format!("{pid} ({what})"));
            }
        }
    }
    found
}

#[test]
fn remote_ranks_get_the_secret_over_their_channel_and_no_process_shows_it() {
    let Some((_serial, net)) = network() else { return };
    let mut child = net
        .launcher()
        .args(["-np", "2", "-H", &net.hosts(1), "--start-timeout", "20", "--grace", "2"])
        .args(["sh", "-c", "echo PID $$; exec sleep 120"])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("start ferrogloo-run");
    let out = child.stdout.take().expect("stdout");
    let mut pids: Vec<u32> = Vec::new();
    for line in BufReader::new(out).lines().map_while(Result::ok) {
        if let Some(p) = line.split("PID ").nth(1).and_then(|p| p.trim().parse().ok()) {
            pids.push(p);
            if pids.len() == 2 {
                break;
            }
        }
    }
    assert_eq!(pids.len(), 2, "both remote ranks printed their pids");
    // Each remote rank has the job's secret and token in files of its own, readable by their
    // owner only; the same values on both hosts; in no process's command line or environment
    // (the ssh commands' included).
    let mut files = Vec::new();
    let mut values = Vec::new();
    for &p in &pids {
        use std::os::unix::fs::PermissionsExt;
        let env = environ(p);
        assert!(!env.contains_key("FERROGLOO_SECRET") && !env.contains_key("FERROGLOO_STORE_TOKEN"));
        let pair: Vec<PathBuf> = ["FERROGLOO_SECRET_FILE", "FERROGLOO_STORE_TOKEN_FILE"]
            .iter()
            .map(|v| PathBuf::from(env.get(*v).unwrap_or_else(|| panic!("rank {p} has {v}"))))
            .collect();
        for f in &pair {
            let mode = std::fs::metadata(f).expect("the file, while the rank runs").permissions().mode() & 0o777;
            assert_eq!(mode, 0o600, "{}", f.display());
        }
        values.push(pair.iter().map(|f| std::fs::read(f).expect("read")).collect::<Vec<_>>());
        files.extend(pair);
    }
    assert_ne!(files[0], files[2], "each remote rank has a directory of its own");
    assert_eq!(values[0], values[1], "one secret and token per job, on every host");
    for v in &values[0] {
        let v = v.strip_suffix(b"\n").unwrap_or(v);
        assert!(v.len() >= 32, "a fresh value");
        assert_eq!(processes_showing(v), Vec::<String>::new(), "processes showing the job's secret or token");
    }
    // When the job ends (here: interrupted), the remote files go with it.
    // SAFETY: kill takes plain integers; the launcher is our child, still running.
    unsafe { libc::kill(child.id() as i32, libc::SIGINT) };
    let _ = child.wait();
    let t = Instant::now();
    while files.iter().any(|f| f.exists()) && t.elapsed() < Duration::from_secs(10) {
        std::thread::sleep(Duration::from_millis(50));
    }
    let left: Vec<&PathBuf> = files.iter().filter(|f| f.exists() || f.parent().is_some_and(|d| d.exists())).collect();
    assert!(left.is_empty(), "the remote ranks' secret files outlived the job: {left:?}");
}
