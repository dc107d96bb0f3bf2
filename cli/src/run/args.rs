//! `ferrogloo-run`'s command line: its options (clap), Open MPI's `-np` spelling, durations,
//! `-x` variables, and the address remote hosts reach the launcher at.

use clap::Parser;
use ferrogloo::{Error, Result};
use std::path::PathBuf;
use std::time::Duration;

/// Start a ferrogloo job: N ranks on this machine or on ssh hosts.
#[derive(Parser, Debug)]
#[command(version, trailing_var_arg = true)]
pub(super) struct Args {
    /// Number of ranks (also `-np N`).
    #[arg(short = 'n', long = "np")]
    pub(super) np: usize,
    /// Hosts and their slots: host1:4,host2:4 (default: this machine, N slots).
    #[arg(short = 'H', long = "hosts")]
    pub(super) hosts: Option<String>,
    /// A file of hosts, one per line: `name slots=N`.
    #[arg(long)]
    pub(super) hostfile: Option<PathBuf>,
    /// Port of the hosts' ssh servers.
    #[arg(long)]
    pub(super) ssh_port: Option<u16>,
    /// Private key for ssh.
    #[arg(long)]
    pub(super) ssh_identity: Option<PathBuf>,
    /// An ssh option (`-o`), as KEY=VALUE; repeatable.
    #[arg(long)]
    pub(super) ssh_option: Vec<String>,
    /// Seconds every remote host gets to answer over ssh before the job starts.
    #[arg(long, default_value_t = 30.0)]
    pub(super) start_timeout: f64,
    /// The network interface ranks listen on and the store is reached through.
    #[arg(long)]
    pub(super) network_interface: Option<String>,
    /// Write each rank's output to DIR/1/rank.N/{stdout,stderr} (Open MPI's layout).
    #[arg(long)]
    pub(super) output_filename: Option<PathBuf>,
    /// Prefix every line with `[rank]<stdout>:` or `[rank]<stderr>:` (default: on for N > 1).
    #[arg(long, overrides_with = "no_tag_output")]
    pub(super) tag_output: bool,
    /// Do not prefix lines.
    #[arg(long)]
    pub(super) no_tag_output: bool,
    /// Prefix every line with the time it was read.
    #[arg(long)]
    pub(super) timestamp_output: bool,
    /// Pass an environment variable to every rank: NAME (its value here) or NAME=VALUE.
    #[arg(short = 'x', long = "env")]
    pub(super) env: Vec<String>,
    /// Seconds ranks get to stop after a forwarded signal or another rank's failure.
    #[arg(long, default_value_t = 5.0)]
    pub(super) grace: f64,
    /// The whole job's deadline in seconds (default: none).
    #[arg(long)]
    pub(super) timeout: Option<f64>,
    /// Elastic: keep the job going while at least this many ranks are left. When a rank
    /// fails, the survivors rebuild their context at the smaller size (a new generation; see
    /// `ferrogloo::launch::elastic`).
    #[arg(long)]
    pub(super) min_np: Option<usize>,
    /// Elastic: the most ranks the job grows to where hosts have room (default: -np).
    #[arg(long)]
    pub(super) max_np: Option<usize>,
    /// Elastic: a program printing the hosts available now, one `host[:slots]` per line; run
    /// every --discovery-interval seconds (at most 10 s each). The job grows onto hosts with
    /// free slots (up to --max-np). Without it, the hosts of -H/--hostfile are the hosts.
    #[arg(long)]
    pub(super) host_discovery_script: Option<PathBuf>,
    /// Elastic: seconds between runs of the host discovery script.
    #[arg(long, default_value_t = 2.0)]
    pub(super) discovery_interval: f64,
    /// Elastic: seconds a host where a rank failed gets no new ranks.
    #[arg(long, default_value_t = 60.0)]
    pub(super) blacklist_cooldown: f64,
    /// Elastic: how many times the job may lose ranks and go on.
    #[arg(long, default_value_t = 3)]
    pub(super) reset_limit: usize,
    /// Elastic: seconds a surviving rank waits for the next generation.
    #[arg(long, default_value_t = 60.0)]
    pub(super) elastic_timeout: f64,
    /// The program and its arguments.
    #[arg(required = true)]
    pub(super) command: Vec<String>,
}

/// The longest duration an option takes (about 31 years): deadlines computed from it never
/// overflow.
const MAX_SECONDS: f64 = 1e9;

pub(super) fn seconds(v: f64, what: &str) -> Result<Duration> {
    if !(0.0..=MAX_SECONDS).contains(&v) {
        return Err(Error::invalid(format!("--{what} {v} is not a duration from 0 to {MAX_SECONDS} seconds")));
    }
    Duration::try_from_secs_f64(v).map_err(|_| Error::invalid(format!("--{what} {v} is not a duration")))
}

/// `argv` with Open MPI's and Horovod's spelling `-np N` as `--np N`, among the launcher's own
/// options only: the program's arguments (from the first word that is not an option or an
/// option's value, or after `--`) are left as they are.
pub(super) fn launcher_argv(argv: Vec<String>) -> Vec<String> {
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

/// `-x NAME` or `-x NAME=VALUE` as pairs (NAME alone takes this process's value).
/// The job's secret and store token are refused: every rank gets them without `-x` (remote ones
/// over ssh's input), and `-x` would put them in ssh's command line, which `ps` shows.
pub(super) fn pass_env(specs: &[String]) -> Result<Vec<(String, String)>> {
    use ferrogloo::config::{FERROGLOO_SECRET, FERROGLOO_STORE_TOKEN};
    specs
        .iter()
        .map(|s| {
            let name = s.split_once('=').map_or(s.as_str(), |(k, _)| k);
            if [FERROGLOO_SECRET, FERROGLOO_STORE_TOKEN].contains(&name) {
                return Err(Error::invalid(format!(
                    "-x {name}: every rank gets the job's secret and store token without -x (remote ranks \
                     over ssh's input); passed with -x they would show in ssh's command line"
                )));
            }
            match s.split_once('=') {
                Some((k, v)) if !k.is_empty() => Ok((k.to_string(), v.to_string())),
                Some(_) => Err(Error::invalid(format!("-x {s:?}: no variable name"))),
                None => std::env::var(s)
                    .map(|v| (s.clone(), v))
                    .map_err(|_| Error::invalid(format!("-x {s}: {s} is not set here"))),
            }
        })
        .collect()
}

/// The address of `--network-interface` (or of this host's default route), for remote hosts
/// to reach the store at.
pub(super) fn reachable_address(args: &Args) -> Result<String> {
    let attr = match &args.network_interface {
        Some(i) => ferrogloo::device::TcpAttr::iface(i.clone()),
        None => ferrogloo::device::TcpAttr::default(),
    };
    Ok(attr.resolve()?.to_string())
}

#[cfg(test)]
mod tests {
    use super::pass_env;

    #[test]
    fn the_job_s_secret_and_token_are_not_passed_with_x() {
        for spec in ["FERROGLOO_SECRET", "FERROGLOO_SECRET=hunter2", "FERROGLOO_STORE_TOKEN=t0ken"] {
            let e = pass_env(&[spec.to_string()]).unwrap_err().to_string();
            assert!(e.contains("ssh's command line") && !e.contains("hunter2") && !e.contains("t0ken"), "{e}");
        }
        assert_eq!(pass_env(&["A=1".to_string()]).unwrap(), vec![("A".to_string(), "1".to_string())]);
    }
}
