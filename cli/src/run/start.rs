//! Starting one rank process, here or over ssh, with its variables, its output relays and
//! its lifeline; and what the launcher keeps of it.

use super::args::Args;
use super::hosts::machine_of;
use super::output::{Output, TAIL, relay};
use super::ssh::{Ssh, handover};
use ferrogloo::config::{
    FERROGLOO_ADDR, FERROGLOO_ELASTIC, FERROGLOO_ELASTIC_TIMEOUT, FERROGLOO_IFACE, FERROGLOO_LOCAL_RANK,
    FERROGLOO_LOCAL_SIZE, FERROGLOO_RANK, FERROGLOO_SECRET, FERROGLOO_SIZE, FERROGLOO_STORE, FERROGLOO_STORE_TOKEN,
    FERROGLOO_WORKER, HOROVOD_CROSS_RANK, HOROVOD_CROSS_SIZE, HOROVOD_LOCAL_RANK, HOROVOD_LOCAL_SIZE, HOROVOD_RANK,
    HOROVOD_SIZE,
};
use ferrogloo::credentials::JobCredentials;
use ferrogloo::launch::spawn_tied;
use ferrogloo::{Error, Result};
use std::collections::VecDeque;
use std::io::Write;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// A rank as the launcher knows it.
pub(super) struct Rank {
    pub(super) host: String,
    /// Its machine ([`machine_of`] its host): names of one machine count together.
    pub(super) machine: String,
    pub(super) local_rank: usize,
    pub(super) tail: Arc<Mutex<VecDeque<String>>>,
}

/// Where, and as which rank, a rank process starts.
pub(super) struct Slot {
    pub(super) host: String,
    pub(super) local: bool,
    pub(super) rank: usize,
    pub(super) size: usize,
    pub(super) local_rank: usize,
    pub(super) local_size: usize,
    pub(super) cross_rank: usize,
    pub(super) cross_size: usize,
}

/// Starts rank processes, and keeps what they leave for the end of the job: `ranks[i]`,
/// their output relays and their lifelines belong to the `i`-th process started.
pub(super) struct Starter<'a> {
    pub(super) args: &'a Args,
    /// The job's secret and store token, handed to every rank (never in its command line or
    /// environment).
    pub(super) credentials: &'a JobCredentials,
    pub(super) ssh: Ssh,
    pub(super) store: String,
    pub(super) out: Arc<Output>,
    pub(super) extra: Vec<(String, String)>,
    /// Every rank on this machine, the store on loopback.
    pub(super) loopback: bool,
    pub(super) grace: Duration,
    /// The input ends of the remote ranks' ssh channels (see `Ssh::command`), closed only
    /// when this process ends or the job is over.
    pub(super) lifelines: Vec<std::process::ChildStdin>,
    pub(super) ranks: Vec<Rank>,
    pub(super) relays: Vec<std::thread::JoinHandle<()>>,
}

impl Starter<'_> {
    /// Starts the process `index` (its worker id in an elastic job) at `slot`.
    pub(super) fn start(&mut self, slot: &Slot, index: usize) -> Result<Child> {
        let args = self.args;
        let mut vars: Vec<(String, String)> = vec![
            (FERROGLOO_RANK.into(), slot.rank.to_string()),
            (FERROGLOO_SIZE.into(), slot.size.to_string()),
            (FERROGLOO_LOCAL_RANK.into(), slot.local_rank.to_string()),
            (FERROGLOO_LOCAL_SIZE.into(), slot.local_size.to_string()),
            (FERROGLOO_STORE.into(), self.store.clone()),
            (HOROVOD_RANK.into(), slot.rank.to_string()),
            (HOROVOD_SIZE.into(), slot.size.to_string()),
            (HOROVOD_LOCAL_RANK.into(), slot.local_rank.to_string()),
            (HOROVOD_LOCAL_SIZE.into(), slot.local_size.to_string()),
            (HOROVOD_CROSS_RANK.into(), slot.cross_rank.to_string()),
            (HOROVOD_CROSS_SIZE.into(), slot.cross_size.to_string()),
        ];
        if args.min_np.is_some() {
            vars.push((FERROGLOO_ELASTIC.into(), "1".into()));
            vars.push((FERROGLOO_WORKER.into(), index.to_string()));
            vars.push((FERROGLOO_ELASTIC_TIMEOUT.into(), args.elastic_timeout.to_string()));
        }
        if let Some(iface) = &args.network_interface {
            vars.push((FERROGLOO_IFACE.into(), iface.clone()));
        } else if self.loopback {
            vars.push((FERROGLOO_ADDR.into(), "127.0.0.1".into()));
        }
        vars.extend(self.extra.iter().cloned());
        let host = &slot.host;
        // The job's secret and token: a local rank gets the paths of the launcher's private
        // files (the values stay out of its environment); a remote one reads them from its
        // channel's input, written below.
        let (mut cmd, handed) = if slot.local {
            let mut c = Command::new(&args.command[0]);
            c.args(&args.command[1..]).envs(vars.iter().map(|(k, v)| (k, v)));
            c.envs(self.credentials.rank_vars()).env_remove(FERROGLOO_SECRET).env_remove(FERROGLOO_STORE_TOKEN);
            (c, None)
        } else {
            (self.ssh.command(host, &vars, &args.command, self.grace), Some(handover(self.credentials)?))
        };
        // A remote rank's channel input carries the job's secret and token, then is its
        // lifeline: held open here, never written again.
        let stdin = if slot.local { Stdio::null() } else { Stdio::piped() };
        cmd.stdin(stdin).stdout(Stdio::piped()).stderr(Stdio::piped());
        let mut child = spawn_tied(&mut cmd)
            .map_err(|e| Error::io(format!("starting rank {} ({}) on {host}", slot.rank, args.command[0]), e))?;
        if let (Some(lines), Some(input)) = (handed, child.stdin.as_mut()) {
            // Two short lines into an empty pipe: the write does not block. When it fails, ssh
            // has already ended, and its exit (with its stderr) is reported as the rank's
            // failure.
            let _ = input.write_all(&lines);
        }
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
