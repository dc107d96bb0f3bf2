//! Which launcher started this process, and what it says about the job: rank, size, local
//! rank and size, and where the ranks meet.
//!
//! Each launcher names these its own way. [`detect`] reads them through a lookup function (the
//! process environment in [`RankEnv::from_env`](super::RankEnv::from_env), a map in tests),
//! says which launcher it found and from which variables, and refuses variables that
//! contradict each other rather than waiting for ranks that will never come.
//!
//! | launcher | rank, size | local rank, size | store |
//! |---|---|---|---|
//! | `ferrogloo-run`, `--np` | `FERROGLOO_RANK`, `FERROGLOO_SIZE` | `FERROGLOO_LOCAL_RANK`, `FERROGLOO_LOCAL_SIZE` | `FERROGLOO_STORE` |
//! | horovodrun | `HOROVOD_RANK`, `HOROVOD_SIZE` | `HOROVOD_LOCAL_RANK`, `HOROVOD_LOCAL_SIZE` | its HTTP server, `HOROVOD_GLOO_RENDEZVOUS_ADDR`:`_PORT` |
//! | torchrun, `env://` | `RANK`, `WORLD_SIZE` | `LOCAL_RANK`, `LOCAL_WORLD_SIZE` | PyTorch's TCPStore at `MASTER_ADDR`:`MASTER_PORT` (keys under `worker/attempt_<TORCHELASTIC_RESTART_COUNT>` when torchrun's agent sets it) |
//! | Open MPI | `OMPI_COMM_WORLD_RANK`, `_SIZE` | `OMPI_COMM_WORLD_LOCAL_RANK`, `_LOCAL_SIZE` | `FERROGLOO_STORE` |
//! | MPICH, Hydra | `PMI_RANK`, `PMI_SIZE` | `MPI_LOCALRANKID`, `MPI_LOCALNRANKS` | `FERROGLOO_STORE` |
//! | Slurm, under `srun` | `SLURM_PROCID`, `SLURM_NTASKS` | `SLURM_LOCALID`, from `SLURM_TASKS_PER_NODE` | `FERROGLOO_STORE`, else rank 0 serves one at a port and scope from `SLURM_JOB_ID` and `SLURM_STEP_ID` |
//!
//! `FERROGLOO_STORE` overrides the store of every launcher. `FERROGLOO_LAUNCHER` picks one
//! (`ferrogloo`, `horovod`, `torchrun`, `openmpi`, `mpich`, `slurm`) or none (`none`: a job of
//! one, whatever the variables say). Without it the first launcher of the table whose
//! variables are set wins.
//!
//! Slurm sets `SLURM_PROCID` in a batch script too, where the script is not a task: a Slurm
//! rank must also have `SLURM_STEP_ID` (only `srun` sets it), so a batch shell is not mistaken
//! for rank 0 of a job that waits for ranks that never start. Without `FERROGLOO_STORE`, rank 0
//! serves an HTTP store on the first node of the step (`SLURM_STEP_NODELIST`, compressed lists
//! like `gnode[01-04,10]` or `rack[1-2]n[01-16]` expanded) at port 10000 + (job id + 7919 ×
//! step id) mod 10000, under the scope `slurm-<job id>.<step id>`: concurrent `srun` steps of
//! one allocation (step ids less than 10000 apart) get ports and scopes of their own, and step 0
//! keeps port 10000 + job id mod 10000. (Below Linux's ephemeral ports, 32768-60999 by default:
//! at 40000 + …, a port an outgoing connection of the node held made rank 0's bind fail.)

use super::RankEnv;
use crate::config::{
    FERROGLOO_LAUNCHER, FERROGLOO_LOCAL_RANK, FERROGLOO_LOCAL_SIZE, FERROGLOO_RANK, FERROGLOO_SIZE, FERROGLOO_STORE,
    HOROVOD_GLOO_IFACE, HOROVOD_GLOO_RENDEZVOUS_ADDR, HOROVOD_GLOO_RENDEZVOUS_PORT, HOROVOD_LOCAL_RANK,
    HOROVOD_LOCAL_SIZE, HOROVOD_RANK, HOROVOD_SIZE, Vars,
};
use crate::error::{Error, Result};
/// The first port of the stores rank 0 serves for Slurm jobs without `FERROGLOO_STORE`: ports
/// run from here to `SLURM_PORT_BASE + 9999` (see [`slurm_store`]), below Linux's ephemeral
/// ports (32768-60999 by default), which the node's outgoing connections take.
pub(crate) const SLURM_PORT_BASE: u16 = 10000;
/// How far apart (mod 10000) the ports of consecutive steps of one Slurm job are: a prime, so
/// steps less than 10000 apart never share a port, and step 1 of one job does not take the
/// port of step 0 of the next job id.
pub(crate) const SLURM_STEP_PORT_STRIDE: u64 = 7919;
/// The most hosts [`expand_nodelist`] expands a list to; a longer list is refused.
pub(crate) const MAX_NODELIST_HOSTS: usize = 1 << 20;
/// The longest host name [`expand_nodelist`] makes, in bytes.
const MAX_NODE_NAME: usize = 255;

/// The launchers whose variables [`detect`] understands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Launcher {
    /// `ferrogloo-run`, or a program's own `--np N`.
    Ferrogloo,
    /// Horovod's `horovodrun`.
    Horovod,
    /// PyTorch's `torchrun` (or any `env://` launch).
    Torchrun,
    /// Open MPI's `mpirun`.
    OpenMpi,
    /// MPICH's (Hydra's) `mpiexec`.
    Mpich,
    /// Slurm's `srun`.
    Slurm,
}

impl Launcher {
    /// Every launcher, in the order [`detect`] tries them.
    pub const ALL: [Launcher; 6] = [
        Launcher::Ferrogloo,
        Launcher::Horovod,
        Launcher::Torchrun,
        Launcher::OpenMpi,
        Launcher::Mpich,
        Launcher::Slurm,
    ];

    /// The name `FERROGLOO_LAUNCHER` takes: `ferrogloo`, `horovod`, `torchrun`, `openmpi`,
    /// `mpich` or `slurm`.
    pub fn name(self) -> &'static str {
        match self {
            Launcher::Ferrogloo => "ferrogloo",
            Launcher::Horovod => "horovod",
            Launcher::Torchrun => "torchrun",
            Launcher::OpenMpi => "openmpi",
            Launcher::Mpich => "mpich",
            Launcher::Slurm => "slurm",
        }
    }

    /// The variable whose presence says this launcher started the process.
    fn marker(self) -> &'static str {
        match self {
            Launcher::Ferrogloo => FERROGLOO_RANK,
            Launcher::Horovod => HOROVOD_RANK,
            Launcher::Torchrun => "RANK",
            Launcher::OpenMpi => "OMPI_COMM_WORLD_RANK",
            Launcher::Mpich => "PMI_RANK",
            Launcher::Slurm => "SLURM_PROCID",
        }
    }

    /// Rank, size, local rank and local size variables.
    fn vars(self) -> [&'static str; 4] {
        match self {
            Launcher::Ferrogloo => [FERROGLOO_RANK, FERROGLOO_SIZE, FERROGLOO_LOCAL_RANK, FERROGLOO_LOCAL_SIZE],
            Launcher::Horovod => [HOROVOD_RANK, HOROVOD_SIZE, HOROVOD_LOCAL_RANK, HOROVOD_LOCAL_SIZE],
            Launcher::Torchrun => ["RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"],
            Launcher::OpenMpi => [
                "OMPI_COMM_WORLD_RANK",
                "OMPI_COMM_WORLD_SIZE",
                "OMPI_COMM_WORLD_LOCAL_RANK",
                "OMPI_COMM_WORLD_LOCAL_SIZE",
            ],
            Launcher::Mpich => ["PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"],
            Launcher::Slurm => ["SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", ""],
        }
    }
}

impl std::fmt::Display for Launcher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for Launcher {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self> {
        let s = s.trim().to_ascii_lowercase();
        Launcher::ALL.into_iter().find(|l| l.name() == s).ok_or_else(|| {
            let names: Vec<&str> = Launcher::ALL.iter().map(|l| l.name()).collect();
            Error::invalid(format!("unknown launcher {s:?} (one of {}, or none)", names.join(", ")))
        })
    }
}

/// The launcher `var` (an environment lookup) describes, if any, and what it says. `Ok(None)`
/// when no launcher started this process (or `FERROGLOO_LAUNCHER=none`); an error when the
/// variables are incomplete or contradict each other, naming them.
pub fn detect(var: &dyn Fn(&str) -> Option<String>) -> Result<Option<RankEnv>> {
    detect_in(&Vars::lookup(var), true)
}

/// [`detect`] as `vars` give the variables, logging what it finds when `log`.
pub(crate) fn detect_in(vars: &Vars<'_>, log: bool) -> Result<Option<RankEnv>> {
    let get = |name: &str| vars.text(name);
    if get(FERROGLOO_LAUNCHER).as_deref() == Some("none") {
        tracing::debug!("{FERROGLOO_LAUNCHER}=none: not a rank of a launched job");
        return Ok(None);
    }
    let launcher = match vars.parse_own::<Launcher>(FERROGLOO_LAUNCHER)? {
        Some(l) => {
            // Named explicitly, MPICH needs only its rank (Slurm's PMI-2 sets it too; the
            // user said whose it is).
            let there = match l {
                Launcher::Mpich => get("PMI_RANK").is_some(),
                l => present(l, &get),
            };
            if !there {
                let missing = match l {
                    Launcher::Torchrun => {
                        let gone: Vec<&str> = ["RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"]
                            .into_iter()
                            .filter(|v| get(v).is_none())
                            .collect();
                        format!("{} {} not set", gone.join(", "), if gone.len() == 1 { "is" } else { "are" })
                    }
                    Launcher::Slurm if get("SLURM_PROCID").is_some() => {
                        "SLURM_STEP_ID is not set (a batch shell, not a task srun started)".to_string()
                    }
                    l => format!("{} is not set", l.marker()),
                };
                return Err(Error::invalid(format!(
                    "{FERROGLOO_LAUNCHER}={l}, but {missing}: this process was not started by {l}"
                )));
            }
            l
        }
        None => match Launcher::ALL.into_iter().find(|l| present(*l, &get)) {
            Some(l) => l,
            None => {
                if get("SLURM_PROCID").is_some() {
                    tracing::info!(
                        "SLURM_PROCID is set without SLURM_STEP_ID: a Slurm batch shell, not a task started by \
                         srun; running as a job of one"
                    );
                }
                return Ok(None);
            }
        },
    };
    read(launcher, &get, log).map(Some)
}

/// Whether `l`'s variables are there (for torchrun, all four of `env://`; for Slurm, a step).
fn present(l: Launcher, get: &dyn Fn(&str) -> Option<String>) -> bool {
    match l {
        Launcher::Torchrun => ["RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"].iter().all(|v| get(v).is_some()),
        Launcher::Slurm => get("SLURM_PROCID").is_some() && get("SLURM_STEP_ID").is_some(),
        // Slurm's own PMI (`srun --mpi=pmi2`, or `MpiDefault=pmi2`) sets PMI_RANK and PMI_SIZE
        // too, for the tasks srun started: those are Slurm's. MPICH's Hydra also sets
        // MPI_LOCALRANKID, also when it runs inside an allocation.
        Launcher::Mpich => {
            get("PMI_RANK").is_some() && (get("MPI_LOCALRANKID").is_some() || get("SLURM_STEP_ID").is_none())
        }
        l => get(l.marker()).is_some(),
    }
}

fn read(l: Launcher, get: &dyn Fn(&str) -> Option<String>, log: bool) -> Result<RankEnv> {
    let need = |name: &str| {
        get(name).ok_or_else(|| Error::invalid(format!("started by {l} ({} is set), but {name} is not", l.marker())))
    };
    let num = |name: &str, v: String| {
        v.parse::<usize>().map_err(|_| Error::invalid(format!("{name}={v:?} is not a number (launcher {l})")))
    };
    let [rank_v, size_v, local_rank_v, local_size_v] = l.vars();
    let rank = num(rank_v, need(rank_v)?)?;
    let size = num(size_v, need(size_v)?)?;
    if size == 0 || rank >= size {
        return Err(Error::invalid(format!("{rank_v}={rank} is out of range for {size_v}={size} (launcher {l})")));
    }
    let local_rank = get(local_rank_v).map(|v| num(local_rank_v, v)).transpose()?;
    let local_size = match l {
        Launcher::Slurm => slurm_local_size(get)?,
        _ => get(local_size_v).map(|v| num(local_size_v, v)).transpose()?,
    };
    if let (Some(r), Some(s)) = (local_rank, local_size)
        && (r >= s || s > size)
    {
        return Err(Error::invalid(format!(
            "local rank {r} of {s} does not fit a job of {size} (launcher {l}: {local_rank_v}, {})",
            if local_size_v.is_empty() { "SLURM_TASKS_PER_NODE" } else { local_size_v }
        )));
    }
    let mut env = RankEnv::new(rank, size, String::new());
    env.local_rank = local_rank;
    env.local_size = local_size;
    env.launcher = Some(l);
    let store = get(FERROGLOO_STORE);
    env.store = match (l, store) {
        (_, Some(s)) => s,
        (Launcher::Ferrogloo, None) => return Err(need(FERROGLOO_STORE).unwrap_err()),
        (Launcher::Horovod, None) => {
            let (addr, port) = (need(HOROVOD_GLOO_RENDEZVOUS_ADDR)?, need(HOROVOD_GLOO_RENDEZVOUS_PORT)?);
            format!("http://{}:{}/ferrogloo", bracket(&addr), port)
        }
        (Launcher::Torchrun, None) => {
            let (addr, port) = (need("MASTER_ADDR")?, need("MASTER_PORT")?);
            // Under torchrun's agent each restart of the workers is a new attempt: its keys
            // go under the attempt's prefix (as torch's own ranks do), so a restarted job never
            // reads the addresses its failed attempt left in the store.
            match get("TORCHELASTIC_RESTART_COUNT") {
                Some(n) => {
                    let n: u64 = n.trim().parse().map_err(|_| {
                        Error::invalid(format!("TORCHELASTIC_RESTART_COUNT={n:?} is not a restart count"))
                    })?;
                    format!("tcpstore://{}:{}/worker/attempt_{n}", bracket(&addr), port)
                }
                None => format!("tcpstore://{}:{}", bracket(&addr), port),
            }
        }
        (Launcher::Slurm, None) => {
            let (list_v, nodes) = ["SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST"]
                .into_iter()
                .find_map(|v| get(v).map(|n| (v, n)))
                .ok_or_else(|| {
                    Error::invalid(format!(
                        "started by srun without {FERROGLOO_STORE}, and neither SLURM_STEP_NODELIST nor \
                         SLURM_JOB_NODELIST names the node that would serve the store",
                    ))
                })?;
            let first = expand_labelled(&nodes, &format!("{list_v}={nodes:?}"))?
                .into_iter()
                .next()
                .ok_or_else(|| Error::invalid(format!("{list_v}={nodes:?} names no node")))?;
            let job = need("SLURM_JOB_ID")?;
            let job: u64 = job
                .parse()
                .map_err(|_| Error::invalid(format!("SLURM_JOB_ID={job:?} is not a number (launcher {l})")))?;
            let step = need("SLURM_STEP_ID")?;
            let step: u64 = step
                .parse()
                .map_err(|_| Error::invalid(format!("SLURM_STEP_ID={step:?} is not a number (launcher {l})")))?;
            let (port, scope) = slurm_store(job, step);
            env.serve_store = true;
            format!("http://{}:{port}/{scope}", bracket(&first))
        }
        (Launcher::OpenMpi | Launcher::Mpich, None) => {
            return Err(Error::invalid(format!(
                "started by {l} (rank {rank} of {size}), but {} is not set: give every rank the same store \
                 (a shared directory, file:DIR, or a store server's URL)",
                FERROGLOO_STORE
            )));
        }
    };
    if l == Launcher::Horovod
        && let Some(iface) = get(HOROVOD_GLOO_IFACE)
    {
        env.iface = Some(iface);
    }
    if !log {
        return Ok(env);
    }
    tracing::info!(
        "launched by {l}: rank {rank} of {size} (from {rank_v} and {size_v}){}, store {}",
        match (local_rank, local_size) {
            (Some(r), Some(s)) => format!(", local rank {r} of {s}"),
            _ => String::new(),
        },
        env.store
    );
    Ok(env)
}

/// An IPv6 address in brackets, for a URL.
fn bracket(addr: &str) -> String {
    if addr.contains(':') && !addr.starts_with('[') { format!("[{addr}]") } else { addr.to_string() }
}

/// The port and scope of the store rank 0 serves for step `step` of Slurm job `job` without
/// `FERROGLOO_STORE`: port [`SLURM_PORT_BASE`] + (`job` + [`SLURM_STEP_PORT_STRIDE`] × `step`)
/// mod 10000 and scope `slurm-<job>.<step>`, so two steps of one allocation running at once
/// (whose ids are less than 10000 apart) neither bind the same port nor read each other's keys.
pub(crate) fn slurm_store(job: u64, step: u64) -> (u16, String) {
    // Each term is reduced first: no product or sum can overflow.
    let offset = (job % 10_000 + (step % 10_000) * SLURM_STEP_PORT_STRIDE % 10_000) % 10_000;
    // offset < 10000, so the sum stays below 50000.
    (SLURM_PORT_BASE + offset as u16, format!("slurm-{job}.{step}"))
}

/// Ranks on this node under Slurm: this node's entry of `SLURM_TASKS_PER_NODE` (`2(x3),1`:
/// two on each of the first three nodes, one on the fourth), found by `SLURM_NODEID`. The whole
/// list is checked, its repeat counts included (their sum must fit a `usize`).
fn slurm_local_size(get: &dyn Fn(&str) -> Option<String>) -> Result<Option<usize>> {
    let (Some(spec), Some(node)) = (get("SLURM_TASKS_PER_NODE"), get("SLURM_NODEID")) else {
        return Ok(None);
    };
    let node: usize = node.parse().map_err(|_| Error::invalid(format!("SLURM_NODEID={node:?} is not a number")))?;
    let bad = || Error::invalid(format!("SLURM_TASKS_PER_NODE={spec:?} is not a list like 2(x3),1"));
    let mut at = 0usize;
    let mut here = None;
    for part in spec.split(',') {
        let (count, times) = match part.split_once("(x") {
            Some((c, t)) => (c, t.strip_suffix(')').ok_or_else(bad)?),
            None => (part, "1"),
        };
        let (count, times): (usize, usize) = (count.parse().map_err(|_| bad())?, times.parse().map_err(|_| bad())?);
        let end = at.checked_add(times).ok_or_else(|| {
            Error::invalid(format!("SLURM_TASKS_PER_NODE={spec:?}: its repeat counts add up to more nodes than can be"))
        })?;
        if here.is_none() && node < end {
            here = Some(count);
        }
        at = end;
    }
    here.map(Some).ok_or_else(|| Error::invalid(format!("SLURM_NODEID={node} is beyond SLURM_TASKS_PER_NODE={spec:?}")))
}

/// Expands a Slurm node list: `gnode[01-04,10],login1` is `gnode01`, `gnode02`, `gnode03`,
/// `gnode04`, `gnode10`, `login1` (ranges keep the zero padding of their first bound). A name
/// with several bracket groups expands to every combination, the last group varying fastest,
/// as Slurm does: `a[1-2]b[3-4]` is `a1b3`, `a1b4`, `a2b3`, `a2b4`.
///
/// Malformed lists are errors naming the list: unbalanced or nested brackets, empty names or
/// sets, members that are not numbers, ranges that run backwards, names longer than 255 bytes,
/// and lists of more than [`MAX_NODELIST_HOSTS`] hosts.
#[cfg(test)]
pub(crate) fn expand_nodelist(list: &str) -> Result<Vec<String>> {
    expand_labelled(list, &format!("node list {list:?}"))
}

/// Expands a compressed node list, its errors naming the list as `label` (`SLURM_STEP_NODELIST="..."`).
fn expand_labelled(list: &str, label: &str) -> Result<Vec<String>> {
    let bad = |why: &str| Error::invalid(format!("{label}: {why}"));
    let too_many = || bad(&format!("more than {MAX_NODELIST_HOSTS} hosts"));
    let mut out: Vec<String> = Vec::new();
    let mut rest = list.trim();
    while !rest.is_empty() {
        // One entry: up to the next comma outside brackets.
        let mut depth = 0u8;
        let mut end = rest.len();
        for (i, c) in rest.char_indices() {
            match c {
                '[' if depth == 0 => depth = 1,
                '[' => return Err(bad("nested brackets")),
                ']' if depth == 1 => depth = 0,
                ']' => return Err(bad("a ']' without its '['")),
                ',' if depth == 0 => {
                    end = i;
                    break;
                }
                _ => {}
            }
        }
        if depth != 0 {
            return Err(bad("an unclosed bracket"));
        }
        let entry = &rest[..end];
        rest = rest[end..].strip_prefix(',').unwrap_or(&rest[end..]).trim_start();
        if entry.trim().is_empty() {
            return Err(bad("an empty name"));
        }
        // The entry's names, grown group by group: the literal text before each bracket
        // group, then each member of the group (so the last group varies fastest). `longest`
        // is checked before anything grows, so no absurd entry is built to be refused.
        let budget = MAX_NODELIST_HOSTS - out.len();
        let long = || bad(&format!("a name longer than {MAX_NODE_NAME} bytes"));
        let mut names = vec![String::new()];
        let mut longest = 0usize;
        let mut text = entry;
        loop {
            let (literal, set, after) = match text.split_once('[') {
                Some((literal, tail)) => {
                    // Brackets are balanced and never nested here: the scan above checked.
                    let (set, after) = tail.split_once(']').ok_or_else(|| bad("an unclosed bracket"))?;
                    (literal, Some(set), after)
                }
                None => (text, None, ""),
            };
            longest += literal.len();
            if longest > MAX_NODE_NAME {
                return Err(long());
            }
            for n in &mut names {
                n.push_str(literal);
            }
            let Some(set) = set else { break };
            let members = expand_set(set, budget).map_err(|why| if why.is_empty() { too_many() } else { bad(why) })?;
            if names.len().checked_mul(members.len()).is_none_or(|n| n > budget) {
                return Err(too_many());
            }
            longest += members.iter().map(String::len).max().unwrap_or(0);
            if longest > MAX_NODE_NAME {
                return Err(long());
            }
            names = names.iter().flat_map(|n| members.iter().map(move |m| format!("{n}{m}"))).collect();
            text = after;
        }
        if names.len() > budget {
            return Err(too_many());
        }
        out.extend(names);
    }
    Ok(out)
}

/// The members of one bracket group of a node list (`01-04,10`), at most `budget` of them:
/// the reason in words when the group is malformed, an empty reason when it is too large.
fn expand_set(set: &str, budget: usize) -> std::result::Result<Vec<String>, &'static str> {
    let mut members = Vec::new();
    for item in set.split(',') {
        let digits = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit());
        match item.split_once('-') {
            Some((a, b)) if digits(a) && digits(b) => {
                let width = a.len();
                let number = |s: &str| s.parse::<u64>().map_err(|_| "a range bound too large");
                let (lo, hi) = (number(a)?, number(b)?);
                if hi < lo {
                    return Err("a range that runs backwards");
                }
                // hi - lo + 1 members, without overflow when the range is everything.
                if hi - lo >= (budget - members.len()) as u64 {
                    return Err("");
                }
                members.extend((lo..=hi).map(|i| format!("{i:0width$}")));
            }
            Some(_) => return Err("a range bound that is not a number"),
            None if !digits(item) => return Err("a set member that is not a number"),
            None => {
                if members.len() >= budget {
                    return Err("");
                }
                members.push(item.to_string());
            }
        }
    }
    Ok(members)
}

#[cfg(test)]
mod tests;
