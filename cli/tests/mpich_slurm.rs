//! Programs started by MPICH's `mpiexec` and by Slurm's `srun` join their jobs through
//! `RankEnv::from_env`, with no ferrogloo variable set but MPICH's store. Slurm runs for the
//! test itself: a controller and a node daemon of this host, in the foreground, on a
//! configuration the test writes in a temporary directory, stopped when the test ends.
//!
//! Skipped, saying why, where MPICH or Slurm is not installed, or where Slurm's daemons cannot
//! run here (they need root). CI installs mpich and slurm-wlm.

use std::io::{Read, Write};
use std::net::{TcpListener, ToSocketAddrs};
use std::os::unix::fs::OpenOptionsExt;
use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::process::{Child, Command, Output, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

const BENCH: &str = env!("CARGO_BIN_EXE_ferrogloo-bench");

/// Removes every variable through which ferrogloo, or a launcher other than the one under
/// test, could tell a rank about a job: the ranks see only what their launcher sets.
fn scrub(cmd: &mut Command) -> &mut Command {
    const PREFIXES: [&str; 11] =
        ["FERROGLOO_", "SLURM_", "SALLOC_", "SBATCH_", "SRUN_", "PMI_", "PMIX_", "MPI_", "OMPI_", "HYDRA_", "HOROVOD_"];
    const NAMES: [&str; 7] = [
        "RANK",
        "WORLD_SIZE",
        "LOCAL_RANK",
        "LOCAL_WORLD_SIZE",
        "MASTER_ADDR",
        "MASTER_PORT",
        "TORCHELASTIC_RESTART_COUNT",
    ];
    for (name, _) in std::env::vars_os() {
        if let Some(n) = name.to_str()
            && (PREFIXES.iter().any(|p| n.starts_with(p)) || NAMES.contains(&n))
        {
            cmd.env_remove(n);
        }
    }
    cmd
}

/// MPICH's own `mpiexec` (Hydra), not whichever `mpiexec` the alternatives point at (Open
/// MPI's, where both are installed), or why this test cannot run here.
fn mpiexec() -> Option<&'static str> {
    for exe in ["mpiexec.mpich", "mpiexec.hydra"] {
        if let Ok(o) = Command::new(exe).arg("--version").output()
            && o.status.success()
            && String::from_utf8_lossy(&o.stdout).contains("HYDRA")
        {
            return Some(exe);
        }
    }
    assert!(!required("mpich"), "FERROGLOO_TEST_REQUIRE names mpich, but its mpiexec is not installed here");
    eprintln!(
        "SKIPPED: MPICH's mpiexec (mpiexec.mpich or mpiexec.hydra) is not installed here (apt-get install mpich)"
    );
    None
}

/// Whether `FERROGLOO_TEST_REQUIRE` (comma-separated; `.ci/run` sets it where it installed
/// them) makes `what` required: then a test that cannot run fails instead of skipping.
fn required(what: &str) -> bool {
    std::env::var("FERROGLOO_TEST_REQUIRE").is_ok_and(|v| v.split(',').any(|w| w.trim() == what))
}

#[test]
fn mpich_mpiexec_starts_four_ranks_that_meet_through_a_file_store() {
    let Some(mpiexec) = mpiexec() else { return };
    let _serial = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let t = Instant::now();
    let dir = tempfile::tempdir().expect("a store directory");
    let store = format!("file:{}", dir.path().display());
    let out = scrub(
        Command::new("timeout")
            .args(["120", mpiexec, "-launcher", "fork", "-n", "4", "-genv", "FERROGLOO_STORE", &store])
            .args([BENCH, "--op", "allreduce,broadcast", "--sizes", "4K,1M", "-n", "3", "--timeout", "60"]),
    )
    .env("RUST_LOG", "ferrogloo=info")
    .output()
    .expect("run mpiexec");
    let (_, stderr) = job_ran(&out, "mpiexec", "mpich", 4, "");
    // Hydra's rank and local rank variables, all read: one node, so each rank is its local rank.
    for r in 0..4 {
        let line = format!("rank {r} of 4 (from PMI_RANK and PMI_SIZE), local rank {r} of 4, store {store}");
        assert!(stderr.contains(&line), "no {line:?} in:\n{stderr}");
    }
    eprintln!("mpiexec job of 4 ranks: {:?}", t.elapsed());
}

/// A Slurm program: on the PATH, or where Debian puts the daemons.
fn slurm_tool(name: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .chain([PathBuf::from("/usr/sbin"), PathBuf::from("/usr/local/sbin")])
        .map(|d| d.join(name))
        .find(|p| p.is_file())
}

/// Clusters started by this process: each gets ports and job ids of its own.
static CLUSTERS: AtomicU32 = AtomicU32::new(0);
/// One job of these tests at a time: their ranks share this host's cores.
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// A one-node Slurm cluster of this host: `slurmctld` and `slurmd` in the foreground, on a
/// `slurm.conf` in a temporary directory. Dropping it cancels its jobs and stops both daemons.
struct Slurm {
    dir: tempfile::TempDir,
    conf: PathBuf,
    node: String,
    daemons: Vec<(&'static str, Child)>,
}

impl Slurm {
    /// Starts the daemons and waits for the node to be idle; `Err` says why Slurm cannot run here.
    fn start() -> Result<Slurm, String> {
        // SAFETY: geteuid has no preconditions and cannot fail.
        if unsafe { libc::geteuid() } != 0 {
            return Err("slurmd needs root to start tasks".into());
        }
        let mut found = Vec::new();
        for name in ["slurmctld", "slurmd", "srun", "salloc", "sinfo", "squeue", "scancel"] {
            found.push(slurm_tool(name).ok_or_else(|| format!("{name} is not installed (apt-get install slurm-wlm)"))?);
        }
        // (The client tools read slurm.conf first, even for their version: not written yet.)
        let version = Command::new(&found[0]).arg("-V").output().map_err(|e| format!("slurmctld -V: {e}"))?;
        let version = String::from_utf8_lossy(&version.stdout).trim().to_string();
        let (major, minor) = version
            .rsplit(' ')
            .next()
            .and_then(|v| {
                let mut p = v.split('.').map(|n| n.parse::<u32>().ok());
                Some((p.next()??, p.next()??))
            })
            .ok_or_else(|| format!("cannot read Slurm's version from {version:?}"))?;
        let node = nix::unistd::gethostname().map_err(|e| format!("gethostname: {e}"))?;
        let node = node.to_string_lossy().split('.').next().unwrap_or_default().to_string();
        // Rank 0 serves the store on the step's first node, by name: the ranks must reach it.
        if (node.as_str(), 0).to_socket_addrs().map(|mut a| a.next().is_none()).unwrap_or(true) {
            return Err(format!("this host's name {node:?} does not resolve: ranks could not reach rank 0's store"));
        }
        let cpus = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1).max(4);
        let n = CLUSTERS.fetch_add(1, Ordering::Relaxed);
        let seed = std::process::id().wrapping_add(n.wrapping_mul(37));
        let port = (0..500)
            .map(|i| 20000 + 2 * ((seed.wrapping_add(i) % 4500) as u16))
            .find(|&p| TcpListener::bind(("0.0.0.0", p)).is_ok() && TcpListener::bind(("0.0.0.0", p + 1)).is_ok())
            .ok_or("no two free ports in 20000-28999 for slurmctld and slurmd")?;
        // The store of job J's step 0 is at port 10000 + J mod 10000: clusters of this and
        // other processes number their jobs apart.
        let first_job = 10_000 + (std::process::id().wrapping_mul(3).wrapping_add(n.wrapping_mul(5011))) % 10_000;
        let dir = tempfile::tempdir().map_err(|e| format!("a temporary directory: {e}"))?;
        let d = dir.path();
        for sub in ["state", "spool"] {
            std::fs::create_dir(d.join(sub)).map_err(|e| format!("{}: {e}", d.join(sub).display()))?;
        }
        // auth/none until Slurm 23.11, which has auth/slurm instead (a key beside slurm.conf).
        let auth = if (major, minor) >= (23, 11) {
            let mut key = vec![0u8; 1024];
            std::fs::File::open("/dev/urandom")
                .and_then(|mut f| f.read_exact(&mut key))
                .map_err(|e| format!("/dev/urandom: {e}"))?;
            std::fs::OpenOptions::new()
                .write(true)
                .create_new(true)
                .mode(0o600)
                .open(d.join("slurm.key"))
                .and_then(|mut f| f.write_all(&key))
                .map_err(|e| format!("slurm.key: {e}"))?;
            "AuthType=auth/slurm\nCredType=cred/slurm\n"
        } else {
            "AuthType=auth/none\nCredType=cred/none\n"
        };
        let conf = d.join("slurm.conf");
        let text = format!(
            "ClusterName=fgtest\nSlurmctldHost={node}\nSlurmctldPort={port}\nSlurmdPort={sport}\n\
             SlurmUser=root\nSlurmdUser=root\n{auth}StateSaveLocation={state}\nSlurmdSpoolDir={spool}\n\
             SlurmctldPidFile={d}/slurmctld.pid\nSlurmdPidFile={d}/slurmd.pid\n\
             ProctrackType=proctrack/linuxproc\nTaskPlugin=task/none\nMpiDefault=none\nMailProg=/bin/true\n\
             SchedulerType=sched/backfill\nSelectType=select/cons_tres\nSelectTypeParameters=CR_CPU\n\
             SlurmdParameters=config_overrides\nReturnToService=2\nFirstJobId={first_job}\nKillWait=5\n\
             JobCompType=jobcomp/none\nJobAcctGatherType=jobacct_gather/none\n\
             AccountingStorageType=accounting_storage/none\n\
             NodeName={node} NodeAddr=127.0.0.1 CPUs={cpus} State=UNKNOWN\n\
             PartitionName=fgtest Nodes={node} Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE\n",
            sport = port + 1,
            state = d.join("state").display(),
            spool = d.join("spool").display(),
            d = d.display(),
        );
        std::fs::write(&conf, text).map_err(|e| format!("{}: {e}", conf.display()))?;
        let mut slurm = Slurm { dir, conf, node, daemons: Vec::new() };
        for (name, exe) in [("slurmctld", &found[0]), ("slurmd", &found[1])] {
            let log = std::fs::File::create(slurm.log(name)).map_err(|e| format!("{name}'s log: {e}"))?;
            let err = log.try_clone().map_err(|e| format!("{name}'s log: {e}"))?;
            // -D: in the foreground, logging to stderr; `timeout` ends it should this test die.
            let child = scrub(Command::new("timeout").arg("600").arg(exe).arg("-D"))
                .process_group(0)
                .env("SLURM_CONF", &slurm.conf)
                .stdin(Stdio::null())
                .stdout(log)
                .stderr(err)
                .spawn()
                .map_err(|e| format!("starting {name}: {e}"))?;
            slurm.daemons.push((name, child));
        }
        slurm.wait_idle(Duration::from_secs(60))?;
        Ok(slurm)
    }

    fn log(&self, daemon: &str) -> PathBuf {
        self.dir.path().join(format!("{daemon}.log"))
    }

    /// The daemons' error lines, for a reason to skip or fail.
    fn errors(&self) -> String {
        let mut out = String::new();
        for (name, _) in &self.daemons {
            let text = std::fs::read_to_string(self.log(name)).unwrap_or_default();
            for line in text.lines().filter(|l| l.contains("error") || l.contains("fatal")) {
                // (A fresh state directory has no state files to recover: not a problem.)
                if !line.contains("state file") && !line.contains("Trying backup state") {
                    out.push_str(&format!("\n  {line}"));
                }
            }
        }
        out
    }

    /// A Slurm command on this cluster, under `timeout secs`, without the caller's job variables.
    fn cmd(&self, tool: &str, secs: u32) -> Command {
        let mut c = Command::new("timeout");
        c.arg(secs.to_string()).arg(slurm_tool(tool).unwrap_or_else(|| PathBuf::from(tool)));
        scrub(&mut c).env("SLURM_CONF", &self.conf).stdin(Stdio::null());
        c
    }

    /// Waits until the controller reports the node idle, both daemons still running.
    fn wait_idle(&mut self, limit: Duration) -> Result<(), String> {
        let t = Instant::now();
        let mut state = String::new();
        loop {
            for (name, child) in &mut self.daemons {
                if let Ok(Some(status)) = child.try_wait() {
                    let log = std::fs::read_to_string(self.dir.path().join(format!("{name}.log"))).unwrap_or_default();
                    let tail: Vec<&str> = log.lines().rev().take(8).collect::<Vec<_>>().into_iter().rev().collect();
                    return Err(format!("{name} exited ({status}):\n  {}", tail.join("\n  ")));
                }
            }
            let out = self.cmd("sinfo", 10).args(["-h", "-N", "-n", &self.node, "-o", "%T"]).output();
            if let Ok(o) = out {
                state = String::from_utf8_lossy(&o.stdout).trim().to_string();
                if state == "idle" {
                    return Ok(());
                }
            }
            if t.elapsed() > limit {
                return Err(format!(
                    "node {} is not idle after {limit:?} (state {state:?}){}",
                    self.node,
                    self.errors()
                ));
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// `srun` of the benchmark, its ranks logging which launcher they found.
    fn srun(&self, args: &[&str], bench: &[&str]) -> Command {
        let mut c = self.cmd("srun", 120);
        c.args(args).arg(BENCH).args(bench).env("RUST_LOG", "ferrogloo=info");
        c
    }
}

impl Drop for Slurm {
    fn drop(&mut self) {
        // Jobs first (their steps' processes are not the daemons' children), then the daemons:
        // SIGTERM through `timeout`, which passes it on, and SIGKILL where that is not enough.
        let _ = self.cmd("scancel", 10).args(["--user", "root"]).output();
        // Each daemon runs in a process group of its own (`timeout` and the daemon): signals go
        // to the group, so a SIGKILL reaches the daemon too, not only `timeout`.
        let group = |child: &Child| i32::try_from(child.id()).ok().map(nix::unistd::Pid::from_raw);
        for (_, child) in &mut self.daemons {
            if let Some(pg) = group(child) {
                let _ = nix::sys::signal::killpg(pg, nix::sys::signal::Signal::SIGTERM);
            }
        }
        let t = Instant::now();
        for (_, child) in &mut self.daemons {
            while matches!(child.try_wait(), Ok(None)) && t.elapsed() < Duration::from_secs(15) {
                std::thread::sleep(Duration::from_millis(50));
            }
            if let Some(pg) = group(child) {
                let _ = nix::sys::signal::killpg(pg, nix::sys::signal::Signal::SIGKILL);
            }
            let _ = child.wait();
        }
    }
}

fn cluster() -> Option<(std::sync::MutexGuard<'static, ()>, Slurm)> {
    let guard = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let t = Instant::now();
    match Slurm::start() {
        Ok(s) => {
            eprintln!("slurm: node {} idle after {:?}", s.node, t.elapsed());
            Some((guard, s))
        }
        Err(why) => {
            assert!(!required("slurm"), "FERROGLOO_TEST_REQUIRE names slurm, but it cannot run here: {why}");
            eprintln!("SKIPPED: cannot run a one-node Slurm cluster here (needs root and slurm-wlm): {why}");
            None
        }
    }
}

/// The store URLs the ranks of one job logged, one per rank.
fn stores(stderr: &str) -> Vec<&str> {
    stderr
        .lines()
        .filter(|l| l.contains("launched by slurm"))
        .filter_map(|l| l.rsplit_once(", store ").map(|(_, s)| s.trim()))
        .collect()
}

fn texts(out: &Output) -> (String, String) {
    (String::from_utf8_lossy(&out.stdout).into_owned(), String::from_utf8_lossy(&out.stderr).into_owned())
}

/// Checks that `what` ran a benchmark job of `n` ranks: it succeeded, rank 0's table is for `n`
/// ranks with no wrong value, and every rank named `launcher` as its launcher (`more`: the
/// daemons' errors, for the failure message). Returns the job's stdout and stderr.
fn job_ran(out: &Output, what: &str, launcher: &str, n: usize, more: &str) -> (String, String) {
    let (stdout, stderr) = texts(out);
    assert!(out.status.success(), "{what} failed ({}):\n{stdout}\n{stderr}{more}", out.status);
    assert!(stdout.contains(&format!("allreduce: {n} ranks")), "{what}: not a job of {n} ranks:\n{stdout}");
    assert!(stdout.contains("Out of bounds values : 0 OK"), "{stdout}");
    let found = stderr.matches(&format!("launched by {launcher}")).count();
    assert_eq!(found, n, "{what}: every rank names {launcher} as its launcher:\n{stderr}");
    (stdout, stderr)
}

#[test]
fn srun_starts_four_ranks_that_meet_through_rank_0s_store() {
    let Some((_serial, slurm)) = cluster() else { return };
    let t = Instant::now();
    let out = slurm
        .srun(&["-n", "4"], &["--op", "allreduce,broadcast", "--sizes", "4K,1M", "-n", "3", "--timeout", "60"])
        .output()
        .expect("run srun");
    let (_, stderr) = job_ran(&out, "srun", "slurm", 4, &slurm.errors());
    for r in 0..4 {
        let line = format!("rank {r} of 4 (from SLURM_PROCID and SLURM_NTASKS), local rank {r} of 4, store http://");
        assert!(stderr.contains(&line), "no {line:?} in:\n{stderr}");
    }
    // Rank 0 served the store on this node, under the scope of step 0 of the job.
    let urls = stores(&stderr);
    // Its port is 10000 + the job id mod 10000 (below the ephemeral ports).
    let on_port = |u: &&str| {
        u.strip_prefix(&format!("http://{}:", slurm.node))
            .and_then(|rest| rest.split('/').next()?.parse::<u16>().ok())
            .is_some_and(|p| (10_000..20_000).contains(&p))
    };
    assert!(urls.len() == 4 && urls.iter().all(|u| on_port(u) && u.ends_with(".0")), "{urls:?}");
    eprintln!("srun job of 4 ranks: {:?}", t.elapsed());
}

#[test]
fn concurrent_srun_steps_of_one_allocation_do_not_meet() {
    let Some((_serial, slurm)) = cluster() else { return };
    let t = Instant::now();
    // An allocation of 4 tasks with no shell; its two steps of 2 start at once.
    let alloc = slurm.cmd("salloc", 60).args(["--no-shell", "-n", "4"]).output().expect("run salloc");
    let said = String::from_utf8_lossy(&alloc.stderr);
    assert!(alloc.status.success(), "salloc failed ({}): {said}{}", alloc.status, slurm.errors());
    let job = said
        .split("Granted job allocation ")
        .nth(1)
        .and_then(|r| r.split_whitespace().next())
        .expect("salloc names the job it granted")
        .to_string();
    let bench = ["--op", "allreduce", "--sizes", "4K,1M", "--seconds", "2", "--timeout", "60"];
    let steps: Vec<_> = (0..2)
        .map(|_| {
            let child = slurm
                .srun(&["--jobid", &job, "--overlap", "-n", "2"], &bench)
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .expect("start srun");
            std::thread::spawn(move || child.wait_with_output())
        })
        .collect();
    // Both steps must be seen running at once, or they could not have met anyway.
    let mut most = 0;
    while !steps.iter().all(|s| s.is_finished()) {
        if let Ok(o) = slurm.cmd("squeue", 10).args(["-h", "-s", "-j", &job, "-o", "%i"]).output() {
            let running = String::from_utf8_lossy(&o.stdout)
                .lines()
                .filter(|l| l.trim().strip_prefix(&format!("{job}.")).is_some_and(|s| s.parse::<u32>().is_ok()))
                .count();
            most = most.max(running);
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    let outs: Vec<Output> =
        steps.into_iter().map(|s| s.join().expect("a step's thread").expect("wait for srun")).collect();
    let mut urls = Vec::new();
    for out in &outs {
        // Each step is a job of its own 2 ranks.
        let (_, stderr) = job_ran(out, "a step", "slurm", 2, &slurm.errors());
        let mine = stores(&stderr);
        assert!(mine.len() == 2 && mine[0] == mine[1], "the step's ranks share one store: {mine:?}");
        assert!(mine[0].contains(&format!("/slurm-{job}.")), "{mine:?}");
        urls.push(mine[0].to_string());
    }
    assert_ne!(urls[0], urls[1], "the steps' stores differ in port and scope");
    assert_eq!(most, 2, "both steps ran at once (squeue saw at most {most} steps of job {job})");
    eprintln!("two concurrent srun steps of job {job}: {urls:?}, {:?}", t.elapsed());
}

#[test]
fn srun_with_slurms_own_pmi2_is_still_taken_for_slurm_not_mpich() {
    let Some((_serial, slurm)) = cluster() else { return };
    // Slurm's PMI-2 plugin sets PMI_RANK and PMI_SIZE, which MPICH's Hydra sets too.
    let list = slurm.cmd("srun", 30).arg("--mpi=list").output().expect("run srun --mpi=list");
    let plugins = format!("{}{}", String::from_utf8_lossy(&list.stdout), String::from_utf8_lossy(&list.stderr));
    if !plugins.contains("pmi2") {
        eprintln!("SKIPPED: this Slurm has no pmi2 plugin (srun --mpi=list: {plugins:?})");
        return;
    }
    let out = slurm
        .srun(&["--mpi=pmi2", "-n", "2"], &["--op", "allreduce", "--sizes", "4K", "-n", "3", "--timeout", "60"])
        .output()
        .expect("run srun");
    job_ran(&out, "srun --mpi=pmi2", "slurm", 2, &slurm.errors());
}
