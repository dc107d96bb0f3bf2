//! Where ranks' output goes (tagged, timestamped, saved per rank), and the report of how a
//! job ended: the first rank to fail, with the last lines of its stderr.

use super::start::Rank;
use ferrogloo::launch::{JobEnd, Supervision};
use ferrogloo::{Error, Result};
use std::collections::VecDeque;
use std::io::{BufRead, BufReader, Write};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

/// Lines of each rank's stderr kept for the failure report.
pub(super) const TAIL: usize = 20;

/// Where rank output goes.
pub(super) struct Output {
    pub(super) tag: bool,
    pub(super) timestamps: bool,
    pub(super) dir: Option<PathBuf>,
    /// One lock for this process's stdout and stderr, so tagged lines do not interleave.
    pub(super) console: Mutex<()>,
}

/// Says how the job ended when it did not end well: the first failure first.
pub(super) fn report(end: &JobEnd, ranks: &[Rank], how: &Supervision) {
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
pub(super) fn relay(
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
