//! The launcher's policy for elastic jobs (`--min-np`): when ranks fail, grow or stall, which
//! workers the next generation has, which hosts get new ranks; the host discovery script. The
//! store protocol itself is `ferrogloo::launch::elastic::Coordinator`.

use super::args::{Args, seconds};
use super::hosts::{Host, is_local, machine_of, merge_same, parse_hosts};
use super::ssh::run_bounded;
use super::start::{Rank, Slot, Starter};
use ferrogloo::launch::elastic;
use ferrogloo::rendezvous::Store;
use ferrogloo::{Error, Result};
use std::collections::HashMap;
use std::path::PathBuf;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

/// How long failures are gathered before an elastic job's next generation is published, so
/// that ranks dying together (a host going down) make one generation, not one each.
const ELASTIC_SETTLE: Duration = Duration::from_millis(500);

/// The launcher's side of an elastic job: which workers each generation has, where ranks may
/// be added, and the hosts that recently lost one.
pub(super) struct Elastic<'a> {
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
    pub(super) starter: Option<Starter<'a>>,
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

/// How long, after the failures settled, the launcher waits for the survivors' record of a
/// shrink in place before it publishes a generation of them itself. Survivors inside a call
/// learn of the loss at once and shrink within milliseconds; survivors busy elsewhere rebuild
/// in the launcher's generation instead.
const SHRINK_WAIT: Duration = Duration::from_secs(1);

/// The host discovery script, run in the background.
struct Discovery {
    script: PathBuf,
    interval: Duration,
    next: Instant,
    answer: Option<std::sync::mpsc::Receiver<Result<Vec<Host>>>>,
}

impl<'a> Elastic<'a> {
    /// Publishes generation 0: workers `0..np`.
    pub(super) fn start(args: &Args, store: Box<dyn Store>, min: usize, hosts: &[Host]) -> Result<Self> {
        let discovery = args.host_discovery_script.as_ref().map(|script| {
            Ok::<_, Error>(Discovery {
                script: script.clone(),
                interval: seconds(args.discovery_interval, "discovery-interval")?.max(Duration::from_millis(100)),
                next: Instant::now(),
                answer: None,
            })
        });
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

    /// The current generation's workers when none of `failed` is among them (its survivors
    /// shrank it in place, [`elastic::Coordinator::follow_shrinks`]), waiting for their record
    /// at most [`SHRINK_WAIT`]; `None` when a new generation is needed.
    fn shrunk_without(&mut self, failed: &[usize]) -> Option<Vec<usize>> {
        let deadline = Instant::now() + SHRINK_WAIT;
        loop {
            if let Err(e) = self.coordinator.follow_shrinks() {
                eprintln!("ferrogloo-run: the elastic job's store: {e}");
                return None;
            }
            let members = self.coordinator.members();
            if failed.iter().all(|w| !members.contains(w)) {
                return Some(members.to_vec());
            }
            if Instant::now() >= deadline {
                return None;
            }
            std::thread::sleep(Duration::from_millis(10));
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
        // Survivors that shrank in place may have finished already (with success).
        let left = statuses.iter().filter(|s| s.is_none_or(|s| s.success())).count();
        if left < self.min || self.resets_left == 0 {
            eprintln!(
                "ferrogloo-run: {r} failed and the elastic job cannot go on ({left} left of at least {}, {} resets left)",
                self.min, self.resets_left
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
        // The survivors shrink their context in place when they notice the loss inside a call:
        // then they go on without a new generation.
        if let Some(members) = self.shrunk_without(failed) {
            let g = self.coordinator.generation();
            if members.len() < self.min {
                eprintln!(
                    "ferrogloo-run: {r} failed; the survivors shrank generation {g} in place to {} ranks, fewer than \
                     --min-np {}: the elastic job ends",
                    members.len(),
                    self.min
                );
                return false;
            }
            eprintln!(
                "ferrogloo-run: {r} failed; the survivors shrank generation {g} in place to {} ranks (workers \
                 {members:?})",
                members.len()
            );
            return true;
        }
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
