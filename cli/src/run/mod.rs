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
//! the wrapper watches its ssh channel (the launcher holds the channel's input open and, past
//! the job's secret, never writes to it): when the channel ends, however the launcher ended, the wrapper stops the
//! rank's session (SIGTERM, the grace period, SIGKILL). SIGINT and SIGTERM are forwarded,
//! and ranks still running after the grace period are killed. The first rank to fail is the
//! headline: its rank, host, exit code or signal and the last lines of its stderr; the
//! launcher exits with its code (128 + the signal when a signal ended it).
//!
//! Every job is authenticated. The launcher makes a fresh random secret and store token for
//! it (or takes those of its own environment: a `FERROGLOO_SECRET_FILE` or
//! `FERROGLOO_STORE_TOKEN_FILE` given is handed to local ranks unchanged), and its store
//! answers only requests with the token. A local rank gets both as files readable by their
//! owner only, in a private temporary directory removed when the job ends, named by
//! `FERROGLOO_SECRET_FILE` and `FERROGLOO_STORE_TOKEN_FILE`; a remote rank reads them from
//! its ssh channel's input into a directory of its own there (removed when it ends). Neither
//! value is ever in a command line or an environment, where `ps` would show it. Every rank's
//! context proves the secret in its handshakes (see `ferrogloo::credentials`), so a process
//! that reads the store but lacks the secret cannot take a rank's place.
//!
//! The binary `ferrogloo-run` is [`main`]. Its parts: [`hosts`] (the hosts and which rank goes
//! where), `args` (the command line), `start` (starting a rank), `ssh` (remote hosts),
//! `output` (relaying output, the report) and `elastic` (`--min-np` jobs).

mod args;
mod elastic;
pub mod hosts;
mod output;
mod ssh;
mod start;

pub use hosts::{Host, Placement, is_local, machine_of, merge_same, parse_hostfile, parse_hosts, place};

use args::{Args, launcher_argv, pass_env, reachable_address, seconds};
use clap::Parser;
use elastic::Elastic;
use ferrogloo::credentials::JobCredentials;
use ferrogloo::launch::{Supervision, supervise, supervise_with};
use ferrogloo::rendezvous::{HttpStore, HttpStoreServer, ServerLimits};
use ferrogloo::{Error, Result};
use output::{Output, report};
use ssh::Ssh;
use start::{Slot, Starter};
use std::process::Child;
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// `ferrogloo-run`: parses its command line, runs the job and exits with the job's code (1
/// when it could not start it).
pub fn main() {
    crate::init_logging();
    let args = Args::parse_from(launcher_argv(std::env::args().collect()));
    match run(&args) {
        Ok(code) => std::process::exit(code),
        Err(e) => {
            eprintln!("ferrogloo-run: {e}");
            std::process::exit(1);
        }
    }
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

    // The job's secret and store token (removed, with their files, when the job ends).
    let credentials = JobCredentials::for_job()?;
    // The job's store: on loopback when every rank is here, else where the hosts reach us;
    // only for clients with the job's token.
    let bind_ip = if all_local { "127.0.0.1".to_string() } else { reachable_address(args)? };
    let server = HttpStoreServer::start_authenticated(
        format!("{bind_ip}:0"),
        ServerLimits::default(),
        None,
        Some(credentials.store_token()),
    )?;
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
        credentials: &credentials,
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
        Some(m) => {
            let own = HttpStore::new(&server.base_url(), &scope, Duration::from_secs(30))?
                .with_token(credentials.store_token())?;
            Some(Elastic::start(args, Box::new(own), m, &hosts)?)
        }
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
