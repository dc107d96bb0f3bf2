//! `ferrogloo-run`: starts a job's ranks on this machine and on other hosts over ssh, serves
//! their rendezvous store, tags and saves their output, and ends the job as a whole.
//!
//! ```text
//! ferrogloo-run -np 4 ./my_program --its-args
//! ferrogloo-run -np 8 -H node1:4,node2:4 --network-interface eth0 ./my_program
//! ```
//!
//! Every rank gets `FERROGLOO_RANK`, `FERROGLOO_SIZE`, `FERROGLOO_LOCAL_RANK`,
//! `FERROGLOO_LOCAL_SIZE` and `FERROGLOO_STORE` (the launcher's own HTTP store), and the
//! `HOROVOD_*` equivalents, so Horovod-style programs run under it too. No rank outlives the
//! launcher: local ranks run in process groups of their own with a parent-death signal and a
//! lifeline pipe; a remote one runs under a small shell wrapper in a session of its own, and
//! the wrapper watches its ssh channel (the launcher holds the channel's input open and never
//! writes to it): when the channel ends, however the launcher ended, the wrapper stops the
//! rank's session (SIGTERM, the grace period, SIGKILL). SIGINT and SIGTERM are forwarded,
//! and ranks still running after the grace period are killed. The first rank to fail is the
//! headline: its rank, host, exit code or signal and the last lines of its stderr; the
//! launcher exits with its code (128 + the signal when a signal ended it).

use clap::Parser;
use ferrogloo::launch::{JobEnd, Supervision, elastic, spawn_tied, supervise, supervise_with};
use ferrogloo::rendezvous::HttpStoreServer;
use ferrogloo::{Error, Result};
use ferrogloo_cli::run::{Host, is_local, machine_of, merge_same, parse_hostfile, parse_hosts, place};
use std::collections::{HashMap, VecDeque};
use std::io::{BufRead, BufReader, Write};
use std::path::PathBuf;
use std::process::ExitStatus;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use std::time::Instant;

/// Lines of each rank's stderr kept for the failure report.
const TAIL: usize = 20;

/// Start a ferrogloo job: N ranks on this machine or on ssh hosts.
#[derive(Parser, Debug)]
#[command(version, trailing_var_arg = true)]
struct Args {
    /// Number of ranks (also `-np N`).
    #[arg(short = 'n', long = "np")]
    np: usize,
    /// Hosts and their slots: host1:4,host2:4 (default: this machine, N slots).
    #[arg(short = 'H', long = "hosts")]
    hosts: Option<String>,
    /// A file of hosts, one per line: `name slots=N`.
    #[arg(long)]
    hostfile: Option<PathBuf>,
    /// Port of the hosts' ssh servers.
    #[arg(long)]
    ssh_port: Option<u16>,
    /// Private key for ssh.
    #[arg(long)]
    ssh_identity: Option<PathBuf>,
    /// An ssh option (`-o`), as KEY=VALUE; repeatable.
    #[arg(long)]
    ssh_option: Vec<String>,
    /// Seconds every remote host gets to answer over ssh before the job starts.
    #[arg(long, default_value_t = 30.0)]
    start_timeout: f64,
    /// The network interface ranks listen on and the store is reached through.
    #[arg(long)]
    network_interface: Option<String>,
    /// Write each rank's output to DIR/1/rank.N/{stdout,stderr} (Open MPI's layout).
    #[arg(long)]
    output_filename: Option<PathBuf>,
    /// Prefix every line with `[rank]<stdout>:` or `[rank]<stderr>:` (default: on for N > 1).
    #[arg(long, overrides_with = "no_tag_output")]
    tag_output: bool,
    /// Do not prefix lines.
    #[arg(long)]
    no_tag_output: bool,
    /// Prefix every line with the time it was read.
    #[arg(long)]
    timestamp_output: bool,
    /// Pass an environment variable to every rank: NAME (its value here) or NAME=VALUE.
    #[arg(short = 'x', long = "env")]
    env: Vec<String>,
    /// Seconds ranks get to stop after a forwarded signal or another rank's failure.
    #[arg(long, default_value_t = 5.0)]
    grace: f64,
    /// The whole job's deadline in seconds (default: none).
    #[arg(long)]
    timeout: Option<f64>,
    /// Elastic: keep the job going while at least this many ranks are left. When a rank
    /// fails, the survivors rebuild their context at the smaller size (a new generation; see
    /// `ferrogloo::launch::elastic`).
    #[arg(long)]
    min_np: Option<usize>,
    /// Elastic: the most ranks the job grows to where hosts have room (default: -np).
    #[arg(long)]
    max_np: Option<usize>,
    /// Elastic: a program printing the hosts available now, one `host[:slots]` per line; run
    /// every --discovery-interval seconds (at most 10 s each). The job grows onto hosts with
    /// free slots (up to --max-np). Without it, the hosts of -H/--hostfile are the hosts.
    #[arg(long)]
    host_discovery_script: Option<PathBuf>,
    /// Elastic: seconds between runs of the host discovery script.
    #[arg(long, default_value_t = 2.0)]
    discovery_interval: f64,
    /// Elastic: seconds a host where a rank failed gets no new ranks.
    #[arg(long, default_value_t = 60.0)]
    blacklist_cooldown: f64,
    /// Elastic: how many times the job may lose ranks and go on.
    #[arg(long, default_value_t = 3)]
    reset_limit: usize,
    /// Elastic: seconds a surviving rank waits for the next generation.
    #[arg(long, default_value_t = 60.0)]
    elastic_timeout: f64,
    /// The program and its arguments.
    #[arg(required = true)]
    command: Vec<String>,
}

/// Where rank output goes.
struct Output {
    tag: bool,
    timestamps: bool,
    dir: Option<PathBuf>,
    /// One lock for this process's stdout and stderr, so tagged lines do not interleave.
    console: Mutex<()>,
}

/// A rank as the launcher knows it.
struct Rank {
    host: String,
    /// Its machine ([`machine_of`] its host): names of one machine count together.
    machine: String,
    local_rank: usize,
    tail: Arc<Mutex<VecDeque<String>>>,
}

/// The longest duration an option takes (about 31 years): deadlines computed from it never
/// overflow.
const MAX_SECONDS: f64 = 1e9;

fn seconds(v: f64, what: &str) -> Result<Duration> {
    if !(0.0..=MAX_SECONDS).contains(&v) {
        return Err(Error::invalid(format!("--{what} {v} is not a duration from 0 to {MAX_SECONDS} seconds")));
    }
    Duration::try_from_secs_f64(v).map_err(|_| Error::invalid(format!("--{what} {v} is not a duration")))
}

fn main() {
    ferrogloo_cli::init_logging();
    let args = Args::parse_from(launcher_argv(std::env::args().collect()));
    match run(&args) {
        Ok(code) => std::process::exit(code),
        Err(e) => {
            eprintln!("ferrogloo-run: {e}");
            std::process::exit(1);
        }
    }
}

/// `argv` with Open MPI's and Horovod's spelling `-np N` as `--np N`, among the launcher's own
/// options only: the program's arguments (from the first word that is not an option or an
/// option's value, or after `--`) are left as they are.
fn launcher_argv(argv: Vec<String>) -> Vec<String> {
    use clap::CommandFactory;
    let cmd = Args::command();
    let takes_value = |opt: &str| {
        cmd.get_arguments().any(|a| {
            a.get_action().takes_values()
                && match opt.strip_prefix("--") {
                    Some(long) => a.get_long() == Some(long),
                    None => opt.len() == 2 && opt.chars().nth(1) == a.get_short(),
                }
        })
    };
    let mut out = Vec::with_capacity(argv.len());
    let mut rest = argv.into_iter();
    out.extend(rest.next());
    let mut value_next = false;
    while let Some(a) = rest.next() {
        if value_next {
            value_next = false;
            out.push(a);
            continue;
        }
        if a == "--" || !a.starts_with('-') || a == "-" {
            out.push(a);
            out.extend(rest);
            break;
        }
        let a = if a == "-np" { "--np".to_string() } else { a };
        value_next = !a.contains('=') && takes_value(&a);
        out.push(a);
    }
    out
}

/// Kills and reaps ranks already started, when the job cannot start after all.
fn kill_started(children: &mut Vec<Child>) {
    for c in children.iter_mut() {
        let _ = c.kill();
        let _ = c.wait();
    }
    children.clear();
}

fn run(args: &Args) -> Result<i32> {
    if args.np == 0 {
        return Err(Error::invalid("-np must be at least 1"));
    }
    let hosts: Vec<Host> = match (&args.hosts, &args.hostfile) {
        (Some(_), Some(_)) => return Err(Error::invalid("give -H or --hostfile, not both")),
        (Some(spec), None) => parse_hosts(spec)?,
        (None, Some(path)) => parse_hostfile(
            &std::fs::read_to_string(path).map_err(|e| Error::io(format!("reading {}", path.display()), e))?,
        )?,
        (None, None) => vec![Host { name: "localhost".into(), slots: args.np }],
    };
    let hosts = merge_same(hosts);
    let placement = place(args.np, &hosts)?;
    let local: Vec<bool> = hosts.iter().map(|h| is_local(&h.name)).collect();
    // Ranks only ever on this machine: the store and the ranks listen on loopback. (An elastic
    // job may add ranks on any host it was given, or on hosts its discovery script names.)
    let all_local = match args.min_np {
        Some(_) => local.iter().all(|&l| l) && args.host_discovery_script.is_none(),
        None => placement.iter().all(|p| local[p.host]),
    };
    let ssh = Ssh { port: args.ssh_port, identity: args.ssh_identity.clone(), options: args.ssh_option.clone() };
    if !all_local {
        let remote: Vec<&str> = hosts.iter().zip(&local).filter(|(_, l)| !**l).map(|(h, _)| h.name.as_str()).collect();
        ssh.check(&remote, seconds(args.start_timeout, "start-timeout")?)?;
    }

    // The job's store: on loopback when every rank is here, else where the hosts reach us.
    let bind_ip = if all_local { "127.0.0.1".to_string() } else { reachable_address(args)? };
    let server = HttpStoreServer::start(format!("{bind_ip}:0"))?;
    let scope = format!("job-{}", std::process::id());
    let store = server.store_url(&scope);

    let out = Arc::new(Output {
        tag: !args.no_tag_output && (args.tag_output || args.np > 1 || args.max_np.is_some_and(|m| m > 1)),
        timestamps: args.timestamp_output,
        dir: args.output_filename.clone(),
        console: Mutex::new(()),
    });
    let how = Supervision {
        timeout: args.timeout.map(|t| seconds(t, "timeout")).transpose()?,
        grace: seconds(args.grace, "grace")?,
        terminate_on_failure: true,
    };
    let mut starter = Starter {
        args,
        ssh,
        store: store.clone(),
        out,
        extra: pass_env(&args.env)?,
        loopback: all_local,
        grace: how.grace,
        lifelines: Vec::new(),
        ranks: Vec::with_capacity(args.np),
        relays: Vec::with_capacity(2 * args.np),
    };
    // An elastic job starts at generation 0, every worker in it.
    let elastic_job = match args.min_np {
        Some(m) if m == 0 || m > args.np => {
            return Err(Error::invalid(format!("--min-np {m} must be from 1 to -np {}", args.np)));
        }
        Some(_) if args.max_np.is_some_and(|x| x < args.np) => {
            return Err(Error::invalid(format!("--max-np must be at least -np {}", args.np)));
        }
        Some(m) => Some(Elastic::start(args, &store, m, &hosts)?),
        None if args.max_np.is_some() || args.host_discovery_script.is_some() => {
            return Err(Error::invalid("--max-np and --host-discovery-script are for elastic jobs: give --min-np"));
        }
        None => None,
    };
    let mut children: Vec<Child> = Vec::with_capacity(args.np);
    let cross_size = placement.last().map_or(1, |p| p.cross_rank + 1);
    for (rank, p) in placement.iter().enumerate() {
        let slot = Slot {
            host: hosts[p.host].name.clone(),
            local: local[p.host],
            rank,
            size: args.np,
            local_rank: p.local_rank,
            local_size: p.local_size,
            cross_rank: p.cross_rank,
            cross_size,
        };
        match starter.start(&slot, rank) {
            Ok(c) => children.push(c),
            Err(e) => {
                kill_started(&mut children);
                return Err(e);
            }
        }
    }
    let (end, starter) = match elastic_job {
        Some(mut e) => {
            e.starter = Some(starter);
            let end = supervise_with(&mut children, &how, &mut e);
            (end, e.starter.take())
        }
        None => (supervise(&mut children, &how), Some(starter)),
    };
    let Some(Starter { lifelines, ranks, relays, .. }) = starter else {
        return Err(Error::invalid("the elastic job lost its rank starter"));
    };
    drop(lifelines);
    // The relays end with their pipes, once the ranks (and anything they started) are gone:
    // what they still hold is printed before the report, waiting at most a moment for a pipe
    // that a rank's own child keeps open.
    let until = std::time::Instant::now() + Duration::from_secs(2);
    while relays.iter().any(|r| !r.is_finished()) && std::time::Instant::now() < until {
        std::thread::sleep(Duration::from_millis(5));
    }
    for &r in &end.absorbed {
        eprintln!("ferrogloo-run: rank {r} (host {}) failed; the elastic job went on without it", ranks[r].host);
    }
    report(&end, &ranks, &how);
    drop(server);
    Ok(end.exit_code())
}

/// Where, and as which rank, a rank process starts.
struct Slot {
    host: String,
    local: bool,
    rank: usize,
    size: usize,
    local_rank: usize,
    local_size: usize,
    cross_rank: usize,
    cross_size: usize,
}

/// Starts rank processes, and keeps what they leave for the end of the job: `ranks[i]`,
/// their output relays and their lifelines belong to the `i`-th process started.
struct Starter<'a> {
    args: &'a Args,
    ssh: Ssh,
    store: String,
    out: Arc<Output>,
    extra: Vec<(String, String)>,
    /// Every rank on this machine, the store on loopback.
    loopback: bool,
    grace: Duration,
    /// The input ends of the remote ranks' ssh channels (see `Ssh::command`), closed only
    /// when this process ends or the job is over.
    lifelines: Vec<std::process::ChildStdin>,
    ranks: Vec<Rank>,
    relays: Vec<std::thread::JoinHandle<()>>,
}

impl Starter<'_> {
    /// Starts the process `index` (its worker id in an elastic job) at `slot`.
    fn start(&mut self, slot: &Slot, index: usize) -> Result<Child> {
        let args = self.args;
        let mut vars: Vec<(String, String)> = vec![
            ("FERROGLOO_RANK".into(), slot.rank.to_string()),
            ("FERROGLOO_SIZE".into(), slot.size.to_string()),
            ("FERROGLOO_LOCAL_RANK".into(), slot.local_rank.to_string()),
            ("FERROGLOO_LOCAL_SIZE".into(), slot.local_size.to_string()),
            ("FERROGLOO_STORE".into(), self.store.clone()),
            ("HOROVOD_RANK".into(), slot.rank.to_string()),
            ("HOROVOD_SIZE".into(), slot.size.to_string()),
            ("HOROVOD_LOCAL_RANK".into(), slot.local_rank.to_string()),
            ("HOROVOD_LOCAL_SIZE".into(), slot.local_size.to_string()),
            ("HOROVOD_CROSS_RANK".into(), slot.cross_rank.to_string()),
            ("HOROVOD_CROSS_SIZE".into(), slot.cross_size.to_string()),
        ];
        if args.min_np.is_some() {
            vars.push((elastic::ELASTIC_ENV.into(), "1".into()));
            vars.push((elastic::WORKER_ENV.into(), index.to_string()));
            vars.push((elastic::ELASTIC_TIMEOUT_ENV.into(), args.elastic_timeout.to_string()));
        }
        if let Some(iface) = &args.network_interface {
            vars.push(("FERROGLOO_IFACE".into(), iface.clone()));
        } else if self.loopback {
            vars.push(("FERROGLOO_ADDR".into(), "127.0.0.1".into()));
        }
        vars.extend(self.extra.iter().cloned());
        let host = &slot.host;
        let mut cmd = if slot.local {
            let mut c = Command::new(&args.command[0]);
            c.args(&args.command[1..]).envs(vars.iter().map(|(k, v)| (k, v)));
            c
        } else {
            self.ssh.command(host, &vars, &args.command, self.grace)
        };
        // A remote rank's channel input is its lifeline: held open here, never written.
        let stdin = if slot.local { Stdio::null() } else { Stdio::piped() };
        cmd.stdin(stdin).stdout(Stdio::piped()).stderr(Stdio::piped());
        let mut child = spawn_tied(&mut cmd)
            .map_err(|e| Error::io(format!("starting rank {} ({}) on {host}", slot.rank, args.command[0]), e))?;
        let tail = Arc::new(Mutex::new(VecDeque::with_capacity(TAIL)));
        let (stdout, stderr) = (child.stdout.take(), child.stderr.take());
        let relayed = || -> Result<()> {
            if let Some(o) = stdout {
                self.relays.push(relay(index, "stdout", o, self.out.clone(), None)?);
            }
            if let Some(e) = stderr {
                self.relays.push(relay(index, "stderr", e, self.out.clone(), Some(tail.clone()))?);
            }
            Ok(())
        };
        if let Err(e) = relayed() {
            let _ = child.kill();
            let _ = child.wait();
            return Err(e);
        }
        self.lifelines.extend(child.stdin.take());
        let machine = if slot.local { machine_of("localhost") } else { machine_of(host) };
        self.ranks.push(Rank { host: host.clone(), machine, local_rank: slot.local_rank, tail });
        Ok(child)
    }
}

/// Says how the job ended when it did not end well: the first failure first.
fn report(end: &JobEnd, ranks: &[Rank], how: &Supervision) {
    use std::os::unix::process::ExitStatusExt;
    let describe = |r: usize| match end.statuses[r] {
        Some(st) => match (st.code(), st.signal()) {
            (Some(c), _) => format!("exited with code {c}"),
            (None, Some(s)) => format!("was killed by signal {s} ({})", signal_name(s)),
            _ => format!("ended: {st}"),
        },
        None => format!("was killed at the job's {} s deadline", how.timeout.map_or(0.0, |t| t.as_secs_f64())),
    };
    let mut err = std::io::stderr().lock();
    if let Some(r) = end.first_failure {
        let _ =
            writeln!(err, "ferrogloo-run: rank {r} (host {}) {} — the first rank to fail", ranks[r].host, describe(r));
        let tail = ranks[r].tail.lock().map(|t| t.iter().cloned().collect::<Vec<_>>()).unwrap_or_default();
        if tail.is_empty() {
            let _ = writeln!(err, "ferrogloo-run: rank {r} wrote nothing to stderr");
        } else {
            let _ = writeln!(err, "ferrogloo-run: the last lines rank {r} wrote to stderr:");
            for l in tail {
                let _ = writeln!(err, "    {l}");
            }
        }
        let others: Vec<usize> =
            (0..ranks.len()).filter(|&o| o != r && !end.statuses[o].is_some_and(|s| s.success())).collect();
        if !others.is_empty() {
            let _ = writeln!(
                err,
                "ferrogloo-run: then stopped {} other rank(s): {}",
                others.len(),
                others.iter().map(|o| format!("rank {o} {}", describe(*o))).collect::<Vec<_>>().join(", ")
            );
        }
    } else if let Some(sig) = end.signal {
        let _ =
            writeln!(err, "ferrogloo-run: interrupted by signal {sig} ({}), forwarded to every rank", signal_name(sig));
    } else if end.statuses.iter().any(Option::is_none) {
        let _ = writeln!(err, "ferrogloo-run: the job ran past its deadline; its ranks were killed");
    }
}

fn signal_name(sig: i32) -> &'static str {
    nix::sys::signal::Signal::try_from(sig).map_or("unknown", |s| s.as_str())
}

/// Copies a rank's stream to this process's, tagged, and to its file; keeps the last lines of
/// stderr in `tail`.
fn relay(
    rank: usize,
    stream: &'static str,
    pipe: impl std::io::Read + Send + 'static,
    out: Arc<Output>,
    tail: Option<Arc<Mutex<VecDeque<String>>>>,
) -> Result<std::thread::JoinHandle<()>> {
    let mut file = match &out.dir {
        Some(dir) => {
            let d = dir.join("1").join(format!("rank.{rank}"));
            std::fs::create_dir_all(&d).map_err(|e| Error::io(format!("creating {}", d.display()), e))?;
            let p = d.join(stream);
            Some(std::fs::File::create(&p).map_err(|e| Error::io(format!("creating {}", p.display()), e))?)
        }
        None => None,
    };
    std::thread::Builder::new()
        .name(format!("rank{rank}-{stream}"))
        .spawn(move || {
            let mut reader = BufReader::new(pipe);
            let mut line = Vec::new();
            loop {
                line.clear();
                match reader.read_until(b'\n', &mut line) {
                    Ok(0) | Err(_) => break,
                    Ok(_) => {}
                }
                let text = String::from_utf8_lossy(&line);
                let text = text.trim_end_matches(['\n', '\r']);
                if let Some(f) = &mut file {
                    let _ = writeln!(f, "{text}");
                }
                if let Some(t) = &tail
                    && let Ok(mut t) = t.lock()
                {
                    if t.len() == TAIL {
                        t.pop_front();
                    }
                    t.push_back(text.to_string());
                }
                let mut prefix = String::new();
                if out.timestamps {
                    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
                    prefix.push_str(&format!("{}.{:06} ", now.as_secs(), now.subsec_micros()));
                }
                if out.tag {
                    prefix.push_str(&format!("[{rank}]<{stream}>:"));
                }
                let _guard = out.console.lock();
                if stream == "stdout" {
                    let _ = writeln!(std::io::stdout().lock(), "{prefix}{text}");
                } else {
                    let _ = writeln!(std::io::stderr().lock(), "{prefix}{text}");
                }
            }
        })
        .map_err(|e| Error::io("starting an output relay thread", e))
}

/// How long failures are gathered before an elastic job's next generation is published, so
/// that ranks dying together (a host going down) make one generation, not one each.
const ELASTIC_SETTLE: Duration = Duration::from_millis(500);

/// The launcher's side of an elastic job: which workers each generation has, where ranks may
/// be added, and the hosts that recently lost one.
struct Elastic<'a> {
    /// The store's side of the protocol: the generations published, what workers report.
    coordinator: elastic::Coordinator,
    min: usize,
    max: usize,
    resets_left: usize,
    /// The hosts ranks may run on (those given, or the discovery script's latest answer),
    /// each with its machine ([`machine_of`]).
    hosts: Vec<(Host, String)>,
    discovery: Option<Discovery>,
    /// Hosts where a rank failed, and until when they get no new ranks.
    blacklist: HashMap<String, Instant>,
    cooldown: Duration,
    /// Set once the first ranks are started: starts the ranks that join.
    starter: Option<Starter<'a>>,
    /// When the store was last asked whether all of them have joined.
    ready_asked: Instant,
    /// Since when the current generation's workers have asked to regroup.
    regroup_since: Option<Instant>,
    /// A generation whose request to regroup was refused (no resets left).
    regroup_refused: Option<u64>,
    /// When the store was last asked whether they have.
    regroup_asked: Instant,
}

/// How long a request to regroup waits for a process's end to explain it (a death makes a new
/// generation on its own) before the launcher publishes the same workers again.
const REGROUP_DELAY: Duration = Duration::from_secs(1);

/// The host discovery script, run in the background.
struct Discovery {
    script: PathBuf,
    interval: Duration,
    next: Instant,
    answer: Option<std::sync::mpsc::Receiver<Result<Vec<Host>>>>,
}

impl<'a> Elastic<'a> {
    /// Publishes generation 0: workers `0..np`.
    fn start(args: &Args, url: &str, min: usize, hosts: &[Host]) -> Result<Self> {
        let discovery = args.host_discovery_script.as_ref().map(|script| {
            Ok::<_, Error>(Discovery {
                script: script.clone(),
                interval: seconds(args.discovery_interval, "discovery-interval")?.max(Duration::from_millis(100)),
                next: Instant::now(),
                answer: None,
            })
        });
        let store = ferrogloo::rendezvous::open(url)?;
        Ok(Elastic {
            coordinator: elastic::Coordinator::start(store, &(0..args.np).collect::<Vec<_>>())?,
            min,
            max: args.max_np.unwrap_or(args.np),
            resets_left: args.reset_limit,
            hosts: hosts.iter().map(|h| (h.clone(), machine_of(&h.name))).collect(),
            discovery: discovery.transpose()?,
            blacklist: HashMap::new(),
            cooldown: seconds(args.blacklist_cooldown, "blacklist-cooldown")?,
            starter: None,
            ready_asked: Instant::now(),
            regroup_since: None,
            regroup_refused: None,
            regroup_asked: Instant::now(),
        })
    }

    /// Publishes the next generation, of `members`: its number.
    fn publish(&mut self, members: &[usize]) -> Result<u64> {
        let g = self.coordinator.publish_next(members)?;
        self.regroup_since = None;
        Ok(g)
    }

    /// Publishes the same workers again when the current generation's workers asked to
    /// regroup (a membership error with no process gone: a peer stalled past the deadline)
    /// and no death explained it within [`REGROUP_DELAY`]. Uses a reset.
    fn regroup(&mut self, alive: &[usize]) {
        match self.regroup_since {
            Some(since) if since.elapsed() >= REGROUP_DELAY => {
                if self.resets_left == 0 {
                    eprintln!(
                        "ferrogloo-run: ranks asked to regroup, but no resets are left: they end after --elastic-timeout"
                    );
                    self.regroup_since = None;
                    self.regroup_refused = Some(self.coordinator.generation());
                    return;
                }
                self.resets_left -= 1;
                match self.publish(alive) {
                    Ok(g) => eprintln!(
                        "ferrogloo-run: ranks asked to regroup (a peer stalled); generation {g} goes on with {} ranks (workers {alive:?})",
                        alive.len()
                    ),
                    Err(e) => eprintln!("ferrogloo-run: could not publish the next generation: {e}"),
                }
            }
            Some(_) => {}
            None if self.regroup_refused == Some(self.coordinator.generation()) => {}
            None => {
                if self.coordinator.regroup_count().is_ok_and(|n| n > 0) {
                    self.regroup_since = Some(Instant::now());
                }
            }
        }
    }

    /// Whether every worker of the current generation has built its context (asked of the
    /// store at most every 100 ms).
    fn all_joined(&mut self) -> bool {
        if self.ready_asked.elapsed() < Duration::from_millis(100) {
            return false;
        }
        self.ready_asked = Instant::now();
        match self.coordinator.all_joined() {
            Ok(joined) => joined,
            Err(e) => {
                eprintln!("ferrogloo-run: the elastic job's store: {e}");
                false
            }
        }
    }

    /// What the launcher knows of worker `w`.
    fn rank_of(&self, w: usize) -> Option<&Rank> {
        self.starter.as_ref().and_then(|s| s.ranks.get(w))
    }

    /// Takes the discovery script's answer when there is one, and runs it again when due.
    fn discover(&mut self) {
        let Some(d) = &mut self.discovery else { return };
        if let Some(rx) = &d.answer {
            match rx.try_recv() {
                Ok(Ok(hosts)) => {
                    self.hosts = merge_same(hosts)
                        .into_iter()
                        .map(|h| {
                            let m = machine_of(&h.name);
                            (h, m)
                        })
                        .collect();
                    d.answer = None;
                }
                Ok(Err(e)) => {
                    eprintln!("ferrogloo-run: the host discovery script failed: {e}");
                    d.answer = None;
                }
                Err(std::sync::mpsc::TryRecvError::Empty) => return,
                Err(std::sync::mpsc::TryRecvError::Disconnected) => d.answer = None,
            }
        }
        if d.answer.is_none() && Instant::now() >= d.next {
            d.next = Instant::now() + d.interval;
            let (tx, rx) = std::sync::mpsc::channel();
            let script = d.script.clone();
            let spawned = std::thread::Builder::new().name("ferrogloo-discovery".into()).spawn(move || {
                let _ = tx.send(run_discovery(&script, Duration::from_secs(10)));
            });
            if spawned.is_ok() {
                d.answer = Some(rx);
            }
        }
    }
}

impl ferrogloo::launch::Elasticity for Elastic<'_> {
    /// Workers `failed` failed: a new generation of the workers still running, if there are
    /// enough of them and resets left and no worker reported a failure of its own work (true),
    /// or the end of the job (false). Their hosts get no new ranks for the cooldown.
    fn absorb(&mut self, failed: &[usize], statuses: &[Option<ExitStatus>]) -> bool {
        let r = match failed {
            [one] => format!("rank {one}"),
            many => format!("ranks {many:?}"),
        };
        match self.coordinator.fatal() {
            Ok(Some(why)) => {
                eprintln!("ferrogloo-run: {r} failed, and the elastic job ends: {why}");
                return false;
            }
            Ok(None) => {}
            Err(e) => {
                eprintln!("ferrogloo-run: {r} failed; the elastic job ends (its store: {e})");
                return false;
            }
        }
        let alive: Vec<usize> = (0..statuses.len()).filter(|&w| statuses[w].is_none()).collect();
        if alive.len() < self.min || self.resets_left == 0 {
            eprintln!(
                "ferrogloo-run: {r} failed and the elastic job cannot go on ({} left of at least {}, {} resets left)",
                alive.len(),
                self.min,
                self.resets_left
            );
            return false;
        }
        let until = Instant::now() + self.cooldown;
        let bad: Vec<(String, String)> =
            failed.iter().filter_map(|&w| self.rank_of(w).map(|r| (r.host.clone(), r.machine.clone()))).collect();
        for (h, machine) in bad {
            eprintln!("ferrogloo-run: host {h} gets no new ranks for {:.0} s", self.cooldown.as_secs_f64());
            self.blacklist.insert(machine, until);
        }
        self.resets_left -= 1;
        match self.publish(&alive) {
            Ok(g) => {
                eprintln!(
                    "ferrogloo-run: {r} failed; generation {g} goes on with {} ranks (workers {alive:?})",
                    alive.len()
                );
                true
            }
            Err(e) => {
                eprintln!("ferrogloo-run: could not publish the next generation: {e}");
                false
            }
        }
    }

    fn settle(&self) -> Duration {
        ELASTIC_SETTLE
    }

    /// Adds ranks where hosts (given or discovered, not in their cooldown) have free slots, up
    /// to --max-np, and publishes the generation with them.
    fn tick(&mut self, children: &mut Vec<Child>, statuses: &[Option<ExitStatus>]) {
        // A job some of whose ranks finished is ending: it neither grows nor regroups (a
        // finished rank would look like a free slot, or a stalled peer).
        if statuses.iter().any(|s| s.is_some_and(|s| s.success())) {
            return;
        }
        self.discover();
        let alive: Vec<usize> = (0..statuses.len()).filter(|&w| statuses[w].is_none()).collect();
        if self.regroup_since.is_some() || self.regroup_asked.elapsed() >= Duration::from_millis(100) {
            if self.regroup_since.is_none() {
                self.regroup_asked = Instant::now();
            }
            self.regroup(&alive);
        }
        if alive.len() >= self.max {
            return;
        }
        let now = Instant::now();
        self.blacklist.retain(|_, until| *until > now);
        // Free slots, host by host in the hosts' order, each with the lowest local rank that
        // no running rank of that machine holds.
        let mut plan: Vec<(Host, usize)> = Vec::new();
        let mut room = self.max - alive.len();
        for (h, machine) in &self.hosts {
            if room == 0 {
                break;
            }
            if self.blacklist.contains_key(machine) {
                continue;
            }
            let taken: Vec<usize> = alive
                .iter()
                .filter_map(|&w| self.rank_of(w))
                .filter(|r| r.machine == *machine)
                .map(|r| r.local_rank)
                .collect();
            for local_rank in (0..h.slots).filter(|l| !taken.contains(l)) {
                if room == 0 {
                    break;
                }
                plan.push((h.clone(), local_rank));
                room -= 1;
            }
        }
        // Ranks join a generation that every member has joined: a member still forming an
        // older one would wait out its deadline there for members that moved on.
        if plan.is_empty() || !self.all_joined() {
            return;
        }
        let Some(starter) = self.starter.as_mut() else { return };
        let size = self.max - room;
        let mut members = alive.clone();
        let mut started: Vec<String> = Vec::new();
        for (h, local_rank) in plan {
            let slot = Slot {
                host: h.name.clone(),
                local: is_local(&h.name),
                rank: members.len(),
                size,
                local_rank,
                local_size: h.slots,
                cross_rank: 0,
                cross_size: 1,
            };
            let worker = children.len();
            match starter.start(&slot, worker) {
                Ok(c) => {
                    children.push(c);
                    members.push(worker);
                    started.push(format!("{worker} on {}", h.name));
                }
                Err(e) => {
                    eprintln!("ferrogloo-run: could not add a rank on {}: {e}", h.name);
                    self.blacklist.insert(machine_of(&h.name), now + self.cooldown);
                    break;
                }
            }
        }
        if started.is_empty() {
            return;
        }
        match self.publish(&members) {
            Ok(g) => eprintln!(
                "ferrogloo-run: generation {g} grows to {} ranks (workers {members:?}; started {})",
                members.len(),
                started.join(", ")
            ),
            Err(e) => eprintln!("ferrogloo-run: could not publish the next generation: {e}"),
        }
    }
}

/// Runs the host discovery script (at most `limit`): its hosts, one `host[:slots]` per line.
fn run_discovery(script: &std::path::Path, limit: Duration) -> Result<Vec<Host>> {
    let mut c = Command::new(script);
    c.stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::inherit());
    let what = script.display().to_string();
    let Some((st, text)) = run_bounded(c, limit, &what)? else {
        return Err(Error::invalid(format!("{what} gave no answer within {:.0} s", limit.as_secs_f64())));
    };
    if !st.success() {
        return Err(Error::invalid(format!("{what} exited with {st}")));
    }
    let spec: Vec<&str> = text.lines().map(str::trim).filter(|l| !l.is_empty() && !l.starts_with('#')).collect();
    if spec.is_empty() {
        return Ok(Vec::new());
    }
    parse_hosts(&spec.join(","))
}

/// `-x NAME` or `-x NAME=VALUE` as pairs (NAME alone takes this process's value).
fn pass_env(specs: &[String]) -> Result<Vec<(String, String)>> {
    specs
        .iter()
        .map(|s| match s.split_once('=') {
            Some((k, v)) if !k.is_empty() => Ok((k.to_string(), v.to_string())),
            Some(_) => Err(Error::invalid(format!("-x {s:?}: no variable name"))),
            None => std::env::var(s)
                .map(|v| (s.clone(), v))
                .map_err(|_| Error::invalid(format!("-x {s}: {s} is not set here"))),
        })
        .collect()
}

/// The address of `--network-interface` (or of this host's default route), for remote hosts
/// to reach the store at.
fn reachable_address(args: &Args) -> Result<String> {
    let attr = match &args.network_interface {
        Some(i) => ferrogloo::device::TcpAttr::iface(i.clone()),
        None => ferrogloo::device::TcpAttr::default(),
    };
    Ok(attr.resolve()?.to_string())
}

/// What runs a remote rank (`sh -c WRAPPER ferrogloo-rank PROGRAM ARGS...`): the program in a
/// session of its own (`setsid`, where there is one), its input from /dev/null, and beside it a
/// watcher reading the ssh channel's input, which the launcher never writes to. When the
/// channel ends (the launcher ended, or its ssh was killed), the watcher sends SIGTERM to the
/// rank's session, waits up to the grace period and sends SIGKILL. The wrapper exits with the
/// program's status (128 + the signal when one ended it). Without a pseudo-terminal, the
/// rank's stdout and stderr stay apart.
const REMOTE_WRAPPER: &str = r#"exec 3<&0 </dev/null
if command -v setsid >/dev/null 2>&1; then setsid "$@" 3<&- & else "$@" 3<&- & fi
p=$!
{ while read -r _; do :; done
  kill -TERM -"$p" 2>/dev/null || kill -TERM "$p" 2>/dev/null
  i=0; while [ "$i" -lt "$FERROGLOO_RUN_GRACE_TENTHS" ] && kill -0 "$p" 2>/dev/null; do sleep 0.1; i=$((i+1)); done
  kill -KILL -"$p" 2>/dev/null || kill -KILL "$p" 2>/dev/null
} <&3 3<&- &
w=$!
exec 3<&-
wait "$p"; rc=$?
kill "$w" 2>/dev/null
exit "$rc""#;

/// How to reach remote hosts.
struct Ssh {
    port: Option<u16>,
    identity: Option<PathBuf>,
    options: Vec<String>,
}

impl Ssh {
    /// The ssh command for `host`, without the remote command.
    fn base(&self, host: &str, batch: bool) -> Command {
        let mut c = Command::new("ssh");
        // Host keys are learned once and checked afterwards; never switched off.
        c.args(["-o", "StrictHostKeyChecking=accept-new", "-o", "BatchMode=yes", "-o", "ConnectTimeout=10"]);
        if !batch {
            c.args(["-o", "LogLevel=ERROR"]);
        }
        if let Some(p) = self.port {
            c.args(["-p", &p.to_string()]);
        }
        if let Some(i) = &self.identity {
            c.arg("-i").arg(i);
        }
        for o in &self.options {
            c.args(["-o", o]);
        }
        c.arg(host);
        c
    }

    /// The command that runs `command` on `host` with `vars` set, under [`REMOTE_WRAPPER`]
    /// (which gives a rank that outlives its channel `grace` to stop before killing it).
    fn command(&self, host: &str, vars: &[(String, String)], command: &[String], grace: Duration) -> Command {
        let mut c = self.base(host, false);
        let cwd = std::env::current_dir().map(|d| d.display().to_string()).unwrap_or_else(|_| ".".into());
        let mut line = format!("cd {} && exec env", quote(&cwd));
        for (k, v) in vars {
            line.push_str(&format!(" {k}={}", quote(v)));
        }
        let tenths = (grace.as_millis() / 100).max(1);
        line.push_str(&format!(" FERROGLOO_RUN_GRACE_TENTHS={tenths} sh -c {} ferrogloo-rank", quote(REMOTE_WRAPPER)));
        for a in command {
            line.push(' ');
            line.push_str(&quote(a));
        }
        c.arg(line);
        c
    }

    /// Checks that every host answers within `limit` (each tried up to three times, all hosts
    /// at once, 64 at a time); names those that do not.
    fn check(&self, hosts: &[&str], limit: Duration) -> Result<()> {
        let deadline = std::time::Instant::now() + limit;
        let mut silent = Vec::new();
        for batch in hosts.chunks(64) {
            std::thread::scope(|s| {
                let checks: Vec<_> = batch.iter().map(|&h| (h, s.spawn(move || self.answers(h, deadline)))).collect();
                for (h, c) in checks {
                    match c.join() {
                        Ok(None) => {}
                        Ok(Some(why)) => silent.push(format!("{h} ({why})")),
                        Err(_) => silent.push(format!("{h} (its check failed)")),
                    }
                }
            });
        }
        if silent.is_empty() {
            Ok(())
        } else {
            Err(Error::invalid(format!(
                "these hosts did not answer over ssh within {:.0} s: {}",
                limit.as_secs_f64(),
                silent.join("; ")
            )))
        }
    }

    /// Whether `host` answers over ssh before `deadline` (up to three tries, a short pause
    /// between them): `None` when it does, else why not.
    fn answers(&self, host: &str, deadline: std::time::Instant) -> Option<String> {
        let mut why = String::new();
        for attempt in 0..3u32 {
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            if left.is_zero() {
                break;
            }
            let mut c = self.base(host, true);
            c.arg("true").stdin(Stdio::null()).stdout(Stdio::null()).stderr(Stdio::piped());
            match run_bounded(c, left, "ssh") {
                Ok(Some((st, _))) if st.success() => return None,
                Ok(Some((_, err))) => why = err,
                Ok(None) => why = "timed out".into(),
                Err(e) => why = e.to_string(),
            }
            let pause = Duration::from_millis(250 << attempt);
            if std::time::Instant::now() + pause >= deadline {
                break;
            }
            std::thread::sleep(pause);
        }
        Some(if why.trim().is_empty() { "no answer".to_string() } else { why.trim().to_string() })
    }
}

/// Runs `c` (`what`, for errors) for at most `limit`, its output read from whichever of its
/// stdout and stderr is piped: its status and that output, or `None` when it did not end, and
/// close that output, in time (then it is killed).
fn run_bounded(mut c: Command, limit: Duration, what: &str) -> Result<Option<(ExitStatus, String)>> {
    let mut child = c.spawn().map_err(|e| Error::io(format!("running {what}"), e))?;
    let out: Option<Box<dyn std::io::Read + Send>> = match (child.stdout.take(), child.stderr.take()) {
        (Some(o), _) => Some(Box::new(o)),
        (None, Some(e)) => Some(Box::new(e)),
        (None, None) => None,
    };
    // Read on a thread of its own, and waited for with a deadline: a child of the program may
    // keep the pipe open after the program ended.
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(out.map(std::io::read_to_string).and_then(|r| r.ok()).unwrap_or_default());
    });
    let until = Instant::now() + limit;
    loop {
        if let Some(st) = child.try_wait().map_err(|e| Error::io(format!("waiting for {what}"), e))? {
            let left = until.saturating_duration_since(Instant::now()).max(Duration::from_millis(100));
            return Ok(rx.recv_timeout(left).ok().map(|text| (st, text)));
        }
        if Instant::now() >= until {
            let _ = child.kill();
            let _ = child.wait();
            return Ok(None);
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// `s` quoted for a POSIX shell.
fn quote(s: &str) -> String {
    if !s.is_empty() && s.bytes().all(|b| b.is_ascii_alphanumeric() || b"-_./:=@,+".contains(&b)) {
        s.to_string()
    } else {
        format!("'{}'", s.replace('\'', r"'\''"))
    }
}
