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
//! | Slurm, under `srun` | `SLURM_PROCID`, `SLURM_NTASKS` | `SLURM_LOCALID`, from `SLURM_TASKS_PER_NODE` | `FERROGLOO_STORE`, else rank 0 serves one |
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
//! like `gnode[01-04,10]` expanded) at port [`SLURM_PORT_BASE`] + job id mod 10000.

use super::RankEnv;
use crate::error::{Error, Result};

/// The environment variable that picks the launcher ([`Launcher::name`], or `none`).
pub const LAUNCHER_ENV: &str = "FERROGLOO_LAUNCHER";
/// This rank's index among the ranks of its host (ferrogloo-run and `--np` set it).
pub const LOCAL_RANK_ENV: &str = "FERROGLOO_LOCAL_RANK";
/// The number of ranks on this rank's host.
pub const LOCAL_SIZE_ENV: &str = "FERROGLOO_LOCAL_SIZE";
/// The first port of the stores rank 0 serves for Slurm jobs without `FERROGLOO_STORE`.
pub const SLURM_PORT_BASE: u16 = 40000;

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
            Launcher::Ferrogloo => "FERROGLOO_RANK",
            Launcher::Horovod => "HOROVOD_RANK",
            Launcher::Torchrun => "RANK",
            Launcher::OpenMpi => "OMPI_COMM_WORLD_RANK",
            Launcher::Mpich => "PMI_RANK",
            Launcher::Slurm => "SLURM_PROCID",
        }
    }

    /// Rank, size, local rank and local size variables.
    fn vars(self) -> [&'static str; 4] {
        match self {
            Launcher::Ferrogloo => ["FERROGLOO_RANK", "FERROGLOO_SIZE", LOCAL_RANK_ENV, LOCAL_SIZE_ENV],
            Launcher::Horovod => ["HOROVOD_RANK", "HOROVOD_SIZE", "HOROVOD_LOCAL_RANK", "HOROVOD_LOCAL_SIZE"],
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
    detect_with(var, true)
}

/// [`detect`], logging what it finds when `log`.
pub(crate) fn detect_with(var: &dyn Fn(&str) -> Option<String>, log: bool) -> Result<Option<RankEnv>> {
    let get = |name: &str| var(name).map(|v| v.trim().to_string()).filter(|v| !v.is_empty());
    let launcher = match get(LAUNCHER_ENV).as_deref() {
        Some("none") => {
            tracing::debug!("{LAUNCHER_ENV}=none: not a rank of a launched job");
            return Ok(None);
        }
        Some(name) => {
            let l: Launcher = name.parse().map_err(|e: Error| Error::invalid(format!("{LAUNCHER_ENV}: {e}")))?;
            if !present(l, &get) {
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
                    "{LAUNCHER_ENV}={name}, but {missing}: this process was not started by {l}"
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
    let store = get(crate::rendezvous::STORE_ENV);
    env.store = match (l, store) {
        (_, Some(s)) => s,
        (Launcher::Ferrogloo, None) => return Err(need(crate::rendezvous::STORE_ENV).unwrap_err()),
        (Launcher::Horovod, None) => {
            let (addr, port) = (need("HOROVOD_GLOO_RENDEZVOUS_ADDR")?, need("HOROVOD_GLOO_RENDEZVOUS_PORT")?);
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
            let nodes = get("SLURM_STEP_NODELIST").or_else(|| get("SLURM_JOB_NODELIST")).ok_or_else(|| {
                Error::invalid(
                    "started by srun without FERROGLOO_STORE, and neither SLURM_STEP_NODELIST nor SLURM_JOB_NODELIST \
                     names the node that would serve the store",
                )
            })?;
            let first = expand_nodelist(&nodes)?
                .into_iter()
                .next()
                .ok_or_else(|| Error::invalid(format!("SLURM_STEP_NODELIST={nodes:?} names no node")))?;
            let job = num("SLURM_JOB_ID", need("SLURM_JOB_ID")?)?;
            let port = SLURM_PORT_BASE + (job % 10_000) as u16;
            env.serve_store = true;
            format!("http://{first}:{port}/slurm-{job}")
        }
        (Launcher::OpenMpi | Launcher::Mpich, None) => {
            return Err(Error::invalid(format!(
                "started by {l} (rank {rank} of {size}), but {} is not set: give every rank the same store \
                 (a shared directory, file:DIR, or a store server's URL)",
                crate::rendezvous::STORE_ENV
            )));
        }
    };
    if l == Launcher::Horovod
        && let Some(iface) = get("HOROVOD_GLOO_IFACE")
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

/// Ranks on this node under Slurm: this node's entry of `SLURM_TASKS_PER_NODE` (`2(x3),1`:
/// two on each of the first three nodes, one on the fourth), found by `SLURM_NODEID`.
fn slurm_local_size(get: &dyn Fn(&str) -> Option<String>) -> Result<Option<usize>> {
    let (Some(spec), Some(node)) = (get("SLURM_TASKS_PER_NODE"), get("SLURM_NODEID")) else {
        return Ok(None);
    };
    let node: usize = node.parse().map_err(|_| Error::invalid(format!("SLURM_NODEID={node:?} is not a number")))?;
    let mut at = 0usize;
    for part in spec.split(',') {
        let bad = || Error::invalid(format!("SLURM_TASKS_PER_NODE={spec:?} is not a list like 2(x3),1"));
        let (count, times) = match part.split_once("(x") {
            Some((c, t)) => (c, t.strip_suffix(')').ok_or_else(bad)?),
            None => (part, "1"),
        };
        let (count, times): (usize, usize) = (count.parse().map_err(|_| bad())?, times.parse().map_err(|_| bad())?);
        if node < at + times {
            return Ok(Some(count));
        }
        at += times;
    }
    Err(Error::invalid(format!("SLURM_NODEID={node} is beyond SLURM_TASKS_PER_NODE={spec:?}")))
}

/// Expands a Slurm node list: `gnode[01-04,10],login1` is `gnode01`, `gnode02`, `gnode03`,
/// `gnode04`, `gnode10`, `login1` (ranges keep their zero padding).
pub fn expand_nodelist(list: &str) -> Result<Vec<String>> {
    let bad = |why: &str| Error::invalid(format!("node list {list:?}: {why}"));
    let mut out = Vec::new();
    let mut rest = list.trim();
    while !rest.is_empty() {
        // One entry: a prefix, maybe a bracketed set, up to the next comma outside brackets.
        let end = {
            let mut depth = 0i32;
            let mut end = rest.len();
            for (i, c) in rest.char_indices() {
                match c {
                    '[' => depth += 1,
                    ']' => depth -= 1,
                    ',' if depth == 0 => {
                        end = i;
                        break;
                    }
                    _ => {}
                }
                if !(0..=1).contains(&depth) {
                    return Err(bad("unbalanced or nested brackets"));
                }
            }
            if depth != 0 {
                return Err(bad("an unclosed bracket"));
            }
            end
        };
        let entry = &rest[..end];
        rest = rest[end..].strip_prefix(',').unwrap_or(&rest[end..]).trim_start();
        let Some(open) = entry.find('[') else {
            if entry.is_empty() {
                return Err(bad("an empty name"));
            }
            out.push(entry.to_string());
            continue;
        };
        let (prefix, set) = (&entry[..open], &entry[open + 1..]);
        let (set, suffix) = set.split_once(']').ok_or_else(|| bad("an unclosed bracket"))?;
        for item in set.split(',') {
            match item.split_once('-') {
                Some((a, b)) => {
                    let width = a.len();
                    let (lo, hi): (u64, u64) = (
                        a.parse().map_err(|_| bad("a range bound that is not a number"))?,
                        b.parse().map_err(|_| bad("a range bound that is not a number"))?,
                    );
                    if hi < lo || hi - lo >= 100_000 {
                        return Err(bad("a range that runs backwards or is too long"));
                    }
                    out.extend((lo..=hi).map(|i| format!("{prefix}{i:0width$}{suffix}")));
                }
                None if item.is_empty() || !item.bytes().all(|b| b.is_ascii_digit()) => {
                    return Err(bad("a set member that is not a number"));
                }
                None => out.push(format!("{prefix}{item}{suffix}")),
            }
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn env(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let m: HashMap<String, String> = pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        move |k| m.get(k).cloned()
    }

    #[test]
    fn every_launcher_is_read_from_its_own_variables() {
        type Case<'a> = (Vec<(&'a str, &'a str)>, Launcher, usize, usize, Option<(usize, usize)>, &'a str);
        let cases: Vec<Case<'_>> = vec![
            (
                vec![
                    ("FERROGLOO_RANK", "1"),
                    ("FERROGLOO_SIZE", "4"),
                    ("FERROGLOO_STORE", "file:/s"),
                    ("FERROGLOO_LOCAL_RANK", "1"),
                    ("FERROGLOO_LOCAL_SIZE", "2"),
                ],
                Launcher::Ferrogloo,
                1,
                4,
                Some((1, 2)),
                "file:/s",
            ),
            (
                vec![
                    ("HOROVOD_RANK", "3"),
                    ("HOROVOD_SIZE", "4"),
                    ("HOROVOD_LOCAL_RANK", "1"),
                    ("HOROVOD_LOCAL_SIZE", "2"),
                    ("HOROVOD_GLOO_RENDEZVOUS_ADDR", "10.0.0.1"),
                    ("HOROVOD_GLOO_RENDEZVOUS_PORT", "5555"),
                ],
                Launcher::Horovod,
                3,
                4,
                Some((1, 2)),
                "http://10.0.0.1:5555/ferrogloo",
            ),
            (
                vec![
                    ("RANK", "2"),
                    ("WORLD_SIZE", "8"),
                    ("LOCAL_RANK", "2"),
                    ("LOCAL_WORLD_SIZE", "4"),
                    ("MASTER_ADDR", "node1"),
                    ("MASTER_PORT", "29500"),
                ],
                Launcher::Torchrun,
                2,
                8,
                Some((2, 4)),
                "tcpstore://node1:29500",
            ),
            (
                vec![
                    ("RANK", "0"),
                    ("WORLD_SIZE", "2"),
                    ("MASTER_ADDR", "node1"),
                    ("MASTER_PORT", "29500"),
                    ("TORCHELASTIC_RESTART_COUNT", "2"),
                ],
                Launcher::Torchrun,
                0,
                2,
                None,
                "tcpstore://node1:29500/worker/attempt_2",
            ),
            (
                vec![
                    ("OMPI_COMM_WORLD_RANK", "0"),
                    ("OMPI_COMM_WORLD_SIZE", "2"),
                    ("OMPI_COMM_WORLD_LOCAL_RANK", "0"),
                    ("OMPI_COMM_WORLD_LOCAL_SIZE", "2"),
                    ("FERROGLOO_STORE", "file:/shared"),
                ],
                Launcher::OpenMpi,
                0,
                2,
                Some((0, 2)),
                "file:/shared",
            ),
            (
                vec![("PMI_RANK", "5"), ("PMI_SIZE", "6"), ("FERROGLOO_STORE", "http://h:1/x")],
                Launcher::Mpich,
                5,
                6,
                None,
                "http://h:1/x",
            ),
            (
                vec![
                    ("SLURM_PROCID", "5"),
                    ("SLURM_NTASKS", "7"),
                    ("SLURM_LOCALID", "1"),
                    ("SLURM_STEP_ID", "0"),
                    ("SLURM_NODEID", "2"),
                    ("SLURM_TASKS_PER_NODE", "2(x3),1"),
                    ("SLURM_JOB_ID", "123456"),
                    ("SLURM_STEP_NODELIST", "gnode[07-09,11]"),
                ],
                Launcher::Slurm,
                5,
                7,
                Some((1, 2)),
                "http://gnode07:43456/slurm-123456",
            ),
        ];
        for (vars, l, rank, size, local, store) in cases {
            let got = detect(&env(&vars)).unwrap_or_else(|e| panic!("{l}: {e}")).expect("a launcher");
            assert_eq!(got.launcher, Some(l));
            assert_eq!((got.rank, got.size), (rank, size), "{l}");
            assert_eq!(got.local_rank.zip(got.local_size), local, "{l}");
            assert_eq!(got.store, store, "{l}");
            assert_eq!(got.serve_store, l == Launcher::Slurm, "{l}");
        }
    }

    #[test]
    fn a_slurm_batch_shell_is_not_a_rank() {
        // sbatch sets SLURM_PROCID for the batch script; only srun's tasks have a step.
        let batch = env(&[("SLURM_PROCID", "0"), ("SLURM_NTASKS", "4"), ("SLURM_JOB_ID", "9")]);
        assert_eq!(detect(&batch).unwrap(), None);
        // Asked for by name, it is an error in words rather than a wait for 3 ranks.
        let named = env(&[("SLURM_PROCID", "0"), ("SLURM_NTASKS", "4"), ("FERROGLOO_LAUNCHER", "slurm")]);
        let e = detect(&named).expect_err("no step");
        assert!(e.to_string().contains("SLURM_STEP_ID"), "{e}");
    }

    #[test]
    fn contradictions_and_gaps_are_errors_naming_the_variables() {
        for (vars, words) in [
            (
                vec![("FERROGLOO_RANK", "4"), ("FERROGLOO_SIZE", "4"), ("FERROGLOO_STORE", "file:/s")],
                "FERROGLOO_RANK=4 is out of range",
            ),
            (
                vec![("FERROGLOO_RANK", "0"), ("FERROGLOO_SIZE", "two"), ("FERROGLOO_STORE", "file:/s")],
                "FERROGLOO_SIZE=\"two\" is not a number",
            ),
            (vec![("FERROGLOO_RANK", "0"), ("FERROGLOO_SIZE", "2")], "FERROGLOO_STORE is not"),
            (vec![("OMPI_COMM_WORLD_RANK", "0"), ("OMPI_COMM_WORLD_SIZE", "2")], "FERROGLOO_STORE is not set"),
            (vec![("HOROVOD_RANK", "0"), ("HOROVOD_SIZE", "2")], "HOROVOD_GLOO_RENDEZVOUS_ADDR is not"),
            (
                vec![
                    ("RANK", "1"),
                    ("WORLD_SIZE", "2"),
                    ("MASTER_ADDR", "h"),
                    ("MASTER_PORT", "1"),
                    ("LOCAL_RANK", "3"),
                    ("LOCAL_WORLD_SIZE", "2"),
                ],
                "local rank 3 of 2",
            ),
            (
                vec![("FERROGLOO_LAUNCHER", "torchrun"), ("RANK", "0"), ("WORLD_SIZE", "2")],
                "MASTER_ADDR, MASTER_PORT are not set",
            ),
            (vec![("FERROGLOO_LAUNCHER", "pbs"), ("RANK", "0")], "unknown launcher"),
            (
                vec![("SLURM_PROCID", "0"), ("SLURM_NTASKS", "2"), ("SLURM_STEP_ID", "0"), ("SLURM_JOB_ID", "1")],
                "SLURM_STEP_NODELIST",
            ),
        ] {
            let e = detect(&env(&vars)).expect_err(words);
            assert!(e.to_string().contains(words), "{e} (wanted {words:?})");
        }
    }

    #[test]
    fn the_first_launcher_wins_and_none_opts_out() {
        // mpirun started a program that also carries torchrun-like leftovers: FERROGLOO_* first.
        let both = env(&[
            ("FERROGLOO_RANK", "1"),
            ("FERROGLOO_SIZE", "2"),
            ("FERROGLOO_STORE", "file:/a"),
            ("OMPI_COMM_WORLD_RANK", "0"),
            ("OMPI_COMM_WORLD_SIZE", "2"),
        ]);
        assert_eq!(detect(&both).unwrap().unwrap().launcher, Some(Launcher::Ferrogloo));
        // torchrun needs all four env:// variables; RANK alone is somebody else's.
        assert_eq!(detect(&env(&[("RANK", "3")])).unwrap(), None);
        let opt_out = env(&[("LAUNCHER", "x"), ("FERROGLOO_LAUNCHER", "none"), ("PMI_RANK", "0"), ("PMI_SIZE", "2")]);
        assert_eq!(detect(&opt_out).unwrap(), None);
        let chosen = env(&[
            ("FERROGLOO_LAUNCHER", "mpich"),
            ("PMI_RANK", "1"),
            ("PMI_SIZE", "2"),
            ("FERROGLOO_STORE", "file:/b"),
            ("OMPI_COMM_WORLD_RANK", "0"),
            ("OMPI_COMM_WORLD_SIZE", "2"),
        ]);
        assert_eq!(detect(&chosen).unwrap().unwrap().rank, 1);
    }

    #[test]
    fn slurm_node_lists_expand() {
        let cases: [(&str, &[&str]); 5] = [
            ("gnode[01-04,10]", &["gnode01", "gnode02", "gnode03", "gnode04", "gnode10"]),
            ("a1,b[7-9]", &["a1", "b7", "b8", "b9"]),
            ("n[098-101]", &["n098", "n099", "n100", "n101"]),
            ("x[1,3]-ib,login", &["x1-ib", "x3-ib", "login"]),
            ("solo", &["solo"]),
        ];
        for (list, want) in cases {
            assert_eq!(expand_nodelist(list).unwrap(), want, "{list}");
        }
        for bad in ["n[1-", "n[a-b]", "n[5-2]", "n[[1]]", "n[1]]", ",", "n[]"] {
            assert!(expand_nodelist(bad).is_err(), "{bad}");
        }
    }
}
