//! Reaching remote hosts: the ssh command of a rank, the shell wrapper that runs it there
//! (receives the job's secret over the channel, stops the rank when the channel ends), the
//! check that hosts answer.

use ferrogloo::credentials::JobCredentials;
use ferrogloo::{Error, Result};
use std::path::PathBuf;
use std::process::{Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

/// What runs a remote rank (`sh -c WRAPPER ferrogloo-rank PROGRAM ARGS...`). It first reads
/// two lines from the ssh channel's input, the job's secret and store token ([`handover`]),
/// into files readable by their owner only in a private temporary directory (removed when the
/// wrapper ends, also when a signal ends it: its channel gone, writing to it raises SIGPIPE),
/// named by `FERROGLOO_SECRET_FILE` and `FERROGLOO_STORE_TOKEN_FILE`: so
/// neither value is ever in a command line or an environment. Then it runs the program in a
/// session of its own (`setsid`, where there is one, with the umask it was given), its input
/// from /dev/null, and beside it a watcher reading the rest of the channel's input, which the
/// launcher never writes to. When the channel ends (the launcher ended, or its ssh was
/// killed), the watcher sends SIGTERM to the rank's session, waits up to the grace period and
/// sends SIGKILL. The wrapper exits with the program's status (128 + the signal when one ended
/// it; 125 when it got no secret). Without a pseudo-terminal, the rank's stdout and stderr
/// stay apart.
const REMOTE_WRAPPER: &str = r#"m=$(umask); umask 077
d=$(mktemp -d "${TMPDIR:-/tmp}/ferrogloo-rank.XXXXXX") || exit 125
trap 'rm -rf "$d"' EXIT
trap 'exit 129' HUP; trap 'exit 130' INT; trap 'exit 141' PIPE; trap 'exit 143' TERM
if IFS= read -r s && IFS= read -r t; then :; else echo "ferrogloo-rank: the launcher sent no job secret" >&2; exit 125; fi
printf '%s\n' "$s" >"$d/secret" && printf '%s\n' "$t" >"$d/store-token" || exit 125
s=; t=; umask "$m"
export FERROGLOO_SECRET_FILE="$d/secret" FERROGLOO_STORE_TOKEN_FILE="$d/store-token"
exec 3<&0 </dev/null
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

/// What the launcher writes into a remote rank's channel for [`REMOTE_WRAPPER`]: the job's
/// secret and store token, a line each. A secret that is not one line (a line break or a NUL
/// in it) cannot go this way: an error says so.
pub(super) fn handover(credentials: &JobCredentials) -> Result<Vec<u8>> {
    const MAX_HANDOVER: usize = 16 << 10;
    let secret = credentials.secret();
    if secret.iter().any(|b| matches!(b, b'\n' | b'\r' | 0)) {
        return Err(Error::invalid(format!(
            "the job's secret ({}) holds a line break or a NUL byte, so it cannot be handed to the ranks \
             of other hosts: use a secret of one line",
            credentials.secret_file().display()
        )));
    }
    // The lines go into the channel's empty pipe in one write, which must not block the
    // launcher: a pipe holds 64 KiB.
    let size = secret.len() + credentials.store_token().len() + 2;
    if size > MAX_HANDOVER {
        return Err(Error::invalid(format!(
            "the job's secret ({}) and store token take {size} bytes: at most {} KiB can be handed to the \
             ranks of other hosts",
            credentials.secret_file().display(),
            MAX_HANDOVER >> 10
        )));
    }
    let mut lines = Vec::with_capacity(size);
    lines.extend_from_slice(secret);
    lines.push(b'\n');
    lines.extend_from_slice(credentials.store_token().as_bytes());
    lines.push(b'\n');
    Ok(lines)
}

/// How to reach remote hosts.
pub(super) struct Ssh {
    pub(super) port: Option<u16>,
    pub(super) identity: Option<PathBuf>,
    pub(super) options: Vec<String>,
}

impl Ssh {
    /// The ssh command for `host`, without the remote command.
    pub(super) fn base(&self, host: &str, batch: bool) -> Command {
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
    pub(super) fn command(
        &self,
        host: &str,
        vars: &[(String, String)],
        command: &[String],
        grace: Duration,
    ) -> Command {
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
    pub(super) fn check(&self, hosts: &[&str], limit: Duration) -> Result<()> {
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
    pub(super) fn answers(&self, host: &str, deadline: std::time::Instant) -> Option<String> {
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
pub(super) fn run_bounded(mut c: Command, limit: Duration, what: &str) -> Result<Option<(ExitStatus, String)>> {
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
