//! The secrets a job's ranks share, read from the environment: the secret that authenticates
//! their connections to each other, and the bearer token of their HTTP store; and the private
//! files in which a launcher hands both to the ranks it starts.
//!
//! | variable | holds |
//! |---|---|
//! | `FERROGLOO_SECRET_FILE` | the path of a file holding the job's secret, readable by its owner only |
//! | `FERROGLOO_SECRET` | the secret itself (weaker: see below) |
//! | `FERROGLOO_STORE_TOKEN_FILE` | the path of a file holding the HTTP store's bearer token, readable by its owner only |
//! | `FERROGLOO_STORE_TOKEN` | the token itself |
//!
//! A file's content is the value, without its trailing line break. A file that its group or
//! other users can read or change is refused (naming the file and its mode), and so is an
//! empty one. A file wins over the variable that holds the value itself, which is the weaker
//! way: the environment of a process can be read in `/proc/PID/environ` by its user (and by
//! root), and is inherited by every program it starts.
//!
//! [`Credentials::from_env`] is the one place these variables are read (through
//! [`config`](crate::config), which names them).
//! [`ContextBuilder::connect`](crate::ContextBuilder::connect) takes the secret from it when it
//! was given none, and [`open`](crate::rendezvous::open) hands the token to an HTTP store: so
//! every rank of a launched job is authenticated without a line of code. `ferrogloo-run` and a
//! program's own `--np` ([`spawn_local`](crate::launch::spawn_local)) make fresh ones for every
//! job ([`JobCredentials`]).

use crate::config::{FERROGLOO_SECRET, FERROGLOO_SECRET_FILE, FERROGLOO_STORE_TOKEN, FERROGLOO_STORE_TOKEN_FILE, Vars};
use crate::error::{Error, Result};
use std::fs::File;
use std::io::Read;
use std::path::{Path, PathBuf};

/// The longest secret or token file read.
const MAX_FILE_BYTES: u64 = 64 << 10;
/// The longest store token (it travels in every request's header).
const MAX_TOKEN_BYTES: usize = 4096;
/// Random bytes of a fresh secret or token (written as twice as many hex digits).
const FRESH_BYTES: usize = 32;

/// A job's shared secrets, as this process's environment gives them.
#[derive(Clone, Default, PartialEq, Eq)]
pub struct Credentials {
    /// The secret every rank proves in its connection handshakes.
    pub secret: Option<Vec<u8>>,
    /// The bearer token the job's HTTP store wants.
    pub store_token: Option<String>,
}

impl std::fmt::Debug for Credentials {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never the values: debug output ends up in logs.
        f.debug_struct("Credentials")
            .field("secret", &self.secret.as_ref().map(|s| format!("<{} bytes>", s.len())))
            .field("store_token", &self.store_token.as_ref().map(|t| format!("<{} bytes>", t.len())))
            .finish()
    }
}

impl Credentials {
    /// The secret and store token of this process's environment (see the [module](self)):
    /// `None` for either when its variables are not set (or empty). An error names the variable
    /// and file that cannot be used: unreadable, readable by others (with its mode), empty, or a
    /// token that cannot go in an HTTP header.
    pub fn from_env() -> Result<Self> {
        Self::read(&Vars::process())
    }

    /// The secret of this process's environment alone (what a context proves; a bad store
    /// token does not keep a context from forming).
    pub fn secret_from_env() -> Result<Option<Vec<u8>>> {
        Self::read_secret(&Vars::process())
    }

    /// The store token of this process's environment alone (what an HTTP store sends; a bad
    /// secret file does not keep a store from opening).
    pub fn store_token_from_env() -> Result<Option<String>> {
        Self::read_store_token(&Vars::process())
    }

    /// [`Credentials::from_env`], with the variables looked up through `var`.
    #[cfg(test)]
    pub(crate) fn from_vars(var: &dyn Fn(&str) -> Option<String>) -> Result<Self> {
        Self::read(&Vars::lookup(var))
    }

    /// [`Credentials::from_env`] as `vars` give it.
    fn read(vars: &Vars<'_>) -> Result<Self> {
        Ok(Credentials { secret: Self::read_secret(vars)?, store_token: Self::read_store_token(vars)? })
    }

    /// The secret as `vars` give it.
    fn read_secret(vars: &Vars<'_>) -> Result<Option<Vec<u8>>> {
        Ok(match (vars.raw(FERROGLOO_SECRET_FILE), vars.raw(FERROGLOO_SECRET)) {
            (Some(path), _) => Some(read_private_file(Path::new(&path), FERROGLOO_SECRET_FILE)?),
            (None, Some(s)) => Some(without_line_break(s.into_bytes())).filter(|s| !s.is_empty()),
            (None, None) => None,
        })
    }

    /// The store token as `vars` give it.
    fn read_store_token(vars: &Vars<'_>) -> Result<Option<String>> {
        let get = |name: &str| vars.raw(name);
        Ok(match (get(FERROGLOO_STORE_TOKEN_FILE), get(FERROGLOO_STORE_TOKEN)) {
            (Some(path), _) => {
                let raw = read_private_file(Path::new(&path), FERROGLOO_STORE_TOKEN_FILE)?;
                let text = String::from_utf8(raw).map_err(|_| {
                    Error::invalid(format!("{FERROGLOO_STORE_TOKEN_FILE}={path}: the token is not text"))
                })?;
                Some(check_token(&text, &format!("{FERROGLOO_STORE_TOKEN_FILE}={path}"))?)
            }
            (None, Some(t)) => Some(check_token(&t, FERROGLOO_STORE_TOKEN)?),
            (None, None) => None,
        })
    }
}

/// `bytes` without the line break that ends it, if one does (`\n` or `\r\n`).
fn without_line_break(mut bytes: Vec<u8>) -> Vec<u8> {
    if bytes.last() == Some(&b'\n') {
        bytes.pop();
        if bytes.last() == Some(&b'\r') {
            bytes.pop();
        }
    }
    bytes
}

/// `token` (without its line break) when it can be a bearer token: printable ASCII without
/// spaces, at most 4 KiB. `what` names where it came from, for the error.
pub fn check_token(token: &str, what: &str) -> Result<String> {
    let t = String::from_utf8(without_line_break(token.as_bytes().to_vec())).unwrap_or_default();
    if t.is_empty() {
        return Err(Error::invalid(format!("{what}: the store token is empty")));
    }
    if t.len() > MAX_TOKEN_BYTES || !t.bytes().all(|b| b.is_ascii_graphic()) {
        return Err(Error::invalid(format!(
            "{what}: a store token is printable ASCII without spaces, at most {MAX_TOKEN_BYTES} bytes (this one has {} bytes)",
            t.len()
        )));
    }
    Ok(t)
}

/// The content of the secret or token file `path` (without its trailing line break), once it
/// is known to be a regular file of this process's user that neither its group nor other users
/// can read or write.
/// `var` names the variable that named the file, for errors; they name the path and its mode.
pub fn read_private_file(path: &Path, var: &str) -> Result<Vec<u8>> {
    use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
    let shown = format!("{var}={}", path.display());
    // Non-blocking, so that a FIFO put there does not hang the open; checked on the open file,
    // so the file checked is the file read.
    let file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK)
        .open(path)
        .map_err(|e| Error::io(format!("{shown}: opening the file"), e))?;
    let meta = file.metadata().map_err(|e| Error::io(format!("{shown}: reading its mode"), e))?;
    if !meta.is_file() {
        return Err(Error::invalid(format!("{shown}: not a regular file")));
    }
    // SAFETY: geteuid has no preconditions and cannot fail.
    let me = unsafe { libc::geteuid() };
    if meta.uid() != me {
        return Err(Error::invalid(format!(
            "{shown}: the file belongs to user {}, not to this process's user {me}; its owner could read or \
             change the secret",
            meta.uid()
        )));
    }
    let mode = meta.mode() & 0o7777;
    if mode & 0o077 != 0 {
        return Err(Error::invalid(format!(
            "{shown}: its mode is {mode:04o}, so its group or other users can read or change it; it must be \
             readable by its owner only (chmod 600 {})",
            path.display()
        )));
    }
    let mut bytes = Vec::new();
    file.take(MAX_FILE_BYTES + 1)
        .read_to_end(&mut bytes)
        .map_err(|e| Error::io(format!("{shown}: reading the file"), e))?;
    if bytes.len() as u64 > MAX_FILE_BYTES {
        return Err(Error::invalid(format!("{shown}: the file is larger than {} KiB", MAX_FILE_BYTES >> 10)));
    }
    let bytes = without_line_break(bytes);
    if bytes.is_empty() {
        return Err(Error::invalid(format!("{shown}: the file is empty")));
    }
    Ok(bytes)
}

/// `n` fresh random bytes from the operating system, as hex digits.
fn fresh_hex(n: usize) -> Result<String> {
    let mut b = vec![0u8; n];
    getrandom::fill(&mut b).map_err(|e| Error::io("drawing a random secret", std::io::Error::other(e.to_string())))?;
    Ok(b.iter().map(|x| format!("{x:02x}")).collect())
}

/// What a launcher hands the ranks of one job: the job's secret and its store token, each in a
/// file readable by its owner only, in a private temporary directory (mode 0700) that is
/// removed when this value is dropped (when the job ends). Should this process die without
/// dropping it (killed by SIGKILL), a small watcher it started (`sh`, in a process group of
/// its own, reading a pipe only this process writes to) removes the directory instead.
///
/// A rank finds them through [`FERROGLOO_SECRET_FILE`] and [`FERROGLOO_STORE_TOKEN_FILE`] set to
/// [`JobCredentials::rank_vars`]: paths only, so neither value ever appears in a command line
/// or an environment that `ps` shows.
pub struct JobCredentials {
    /// Removes `dir` when this process dies first (see [`reaper`]).
    reaper: Option<(std::process::Child, std::process::ChildStdin)>,
    dir: tempfile::TempDir,
    secret: Vec<u8>,
    secret_file: PathBuf,
    store_token: String,
    store_token_file: PathBuf,
}

impl std::fmt::Debug for JobCredentials {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("JobCredentials")
            .field("secret_file", &self.secret_file)
            .field("store_token_file", &self.store_token_file)
            .finish()
    }
}

impl JobCredentials {
    /// The credentials of a job this process launches: those its own environment gives (a
    /// `FERROGLOO_SECRET_FILE` or `FERROGLOO_STORE_TOKEN_FILE` set here is handed to the ranks
    /// unchanged), else fresh random ones (32 bytes from the operating system each, as 64 hex
    /// digits).
    pub fn for_job() -> Result<Self> {
        Self::for_job_in(&Vars::process())
    }

    /// [`JobCredentials::for_job`], with the variables looked up through `var`.
    #[cfg(test)]
    pub(crate) fn for_job_with(var: &dyn Fn(&str) -> Option<String>) -> Result<Self> {
        Self::for_job_in(&Vars::lookup(var))
    }

    /// [`JobCredentials::for_job`] as `vars` give it.
    fn for_job_in(vars: &Vars<'_>) -> Result<Self> {
        let given = Credentials::read(vars)?;
        let dir = tempfile::Builder::new()
            .prefix("ferrogloo-job-")
            .permissions(std::os::unix::fs::PermissionsExt::from_mode(0o700))
            .tempdir()
            .map_err(|e| Error::io("creating the job's private directory", e))?;
        let given_file = |name: &str| vars.path(name);
        let (secret, secret_file) = match (given.secret, given_file(FERROGLOO_SECRET_FILE)) {
            (Some(s), Some(path)) => (s, path),
            (s, _) => {
                let s = match s {
                    Some(s) => s,
                    None => fresh_hex(FRESH_BYTES)?.into_bytes(),
                };
                let path = dir.path().join("secret");
                write_private_file(&path, &s)?;
                (s, path)
            }
        };
        let (store_token, store_token_file) = match (given.store_token, given_file(FERROGLOO_STORE_TOKEN_FILE)) {
            (Some(t), Some(path)) => (t, path),
            (t, _) => {
                let t = match t {
                    Some(t) => t,
                    None => fresh_hex(FRESH_BYTES)?,
                };
                let path = dir.path().join("store-token");
                write_private_file(&path, t.as_bytes())?;
                (t, path)
            }
        };
        let reaper = reaper(dir.path());
        Ok(JobCredentials { reaper, dir, secret, secret_file, store_token, store_token_file })
    }

    /// The job's secret.
    pub fn secret(&self) -> &[u8] {
        &self.secret
    }

    /// The job's store token.
    pub fn store_token(&self) -> &str {
        &self.store_token
    }

    /// The file holding the secret.
    pub fn secret_file(&self) -> &Path {
        &self.secret_file
    }

    /// The file holding the store token.
    pub fn store_token_file(&self) -> &Path {
        &self.store_token_file
    }

    /// The private directory removed with this value.
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// The variables that give a local rank both: [`FERROGLOO_SECRET_FILE`] and
    /// [`FERROGLOO_STORE_TOKEN_FILE`], with the files' paths.
    pub fn rank_vars(&self) -> [(&'static str, &Path); 2] {
        [(FERROGLOO_SECRET_FILE, &self.secret_file), (FERROGLOO_STORE_TOKEN_FILE, &self.store_token_file)]
    }
}

impl Drop for JobCredentials {
    fn drop(&mut self) {
        // The watcher wakes when its pipe closes, finds the directory (or not: the TempDir's
        // own drop may come first) and ends; it is reaped here, so it never lingers.
        if let Some((mut child, input)) = self.reaper.take() {
            drop(input);
            let _ = child.wait();
        }
    }
}

/// Starts the process that removes `dir` when this one ends without doing it itself: `sh`
/// reading its input, a pipe whose write end only this process holds, in a process group of
/// its own (a terminal's Ctrl-C to the launcher does not reach it). `None` (logged) when it
/// cannot start: the directory is then removed only by this process.
fn reaper(dir: &Path) -> Option<(std::process::Child, std::process::ChildStdin)> {
    use std::os::unix::process::CommandExt;
    use std::process::{Command, Stdio};
    let started = Command::new("sh")
        .args(["-c", r#"read _; rm -rf -- "$1""#, "ferrogloo-reaper"])
        .arg(dir)
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .process_group(0)
        .spawn();
    match started {
        Ok(mut child) => match child.stdin.take() {
            Some(input) => Some((child, input)),
            None => {
                let _ = child.kill();
                let _ = child.wait();
                None
            }
        },
        Err(e) => {
            tracing::debug!(error = %e, dir = %dir.display(), "no watcher for the job's private directory");
            None
        }
    }
}

/// Writes `value` to a new file at `path`, readable and writable by its owner only.
fn write_private_file(path: &Path, value: &[u8]) -> Result<()> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let mut f: File = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(path)
        .map_err(|e| Error::io(format!("creating {}", path.display()), e))?;
    f.write_all(value).map_err(|e| Error::io(format!("writing {}", path.display()), e))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;
    use std::os::unix::fs::PermissionsExt;

    fn vars(pairs: &[(&str, String)]) -> impl Fn(&str) -> Option<String> {
        let m: HashMap<String, String> = pairs.iter().map(|(k, v)| (k.to_string(), v.clone())).collect();
        move |k| m.get(k).cloned()
    }

    fn file(dir: &Path, name: &str, content: &[u8], mode: u32) -> PathBuf {
        let p = dir.join(name);
        std::fs::write(&p, content).unwrap();
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(mode)).unwrap();
        p
    }

    #[test]
    fn a_file_others_can_read_or_change_is_refused_naming_it_and_its_mode() {
        let dir = tempfile::tempdir().unwrap();
        for mode in [0o644, 0o640, 0o604, 0o620, 0o602, 0o660, 0o666, 0o610] {
            let p = file(dir.path(), &format!("s{mode:o}"), b"hunter2\n", mode);
            let e = read_private_file(&p, FERROGLOO_SECRET_FILE).expect_err("a file others can reach");
            let text = e.to_string();
            assert!(text.contains(&p.display().to_string()), "{text}");
            assert!(text.contains(&format!("{mode:04o}")), "mode {mode:o}: {text}");
            // Through the environment too.
            let e = Credentials::from_vars(&vars(&[(FERROGLOO_SECRET_FILE, p.display().to_string())])).unwrap_err();
            assert!(e.to_string().contains(&format!("FERROGLOO_SECRET_FILE={}", p.display())), "{e}");
        }
        for mode in [0o600, 0o400, 0o700] {
            let p = file(dir.path(), &format!("ok{mode:o}"), b"hunter2\n", mode);
            assert_eq!(read_private_file(&p, FERROGLOO_SECRET_FILE).unwrap(), b"hunter2", "mode {mode:o}");
        }
    }

    #[test]
    fn a_private_file_of_another_user_is_refused_naming_its_owner() {
        use std::os::unix::fs::MetadataExt;
        let dir = tempfile::tempdir().unwrap();
        let p = file(dir.path(), "theirs", b"chosen by them\n", 0o600);
        // Only root can give a file away; elsewhere the check cannot be staged.
        if std::os::unix::fs::chown(&p, Some(65534), None).is_err() {
            eprintln!("skipped: giving a file to another user needs root");
            return;
        }
        assert_eq!(std::fs::metadata(&p).unwrap().uid(), 65534);
        let e = read_private_file(&p, FERROGLOO_SECRET_FILE).expect_err("another user's file").to_string();
        assert!(e.contains("belongs to user 65534") && e.contains(&p.display().to_string()), "{e}");
    }

    #[test]
    fn an_empty_missing_or_odd_file_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        for (content, what) in [(&b""[..], "empty"), (b"\n", "empty"), (b"\r\n", "empty")] {
            let p = file(dir.path(), "e", content, 0o600);
            let e = read_private_file(&p, FERROGLOO_SECRET_FILE).unwrap_err();
            assert!(e.to_string().contains(what), "{e}");
            std::fs::remove_file(&p).unwrap();
        }
        let e = read_private_file(&dir.path().join("nothing"), FERROGLOO_SECRET_FILE).unwrap_err();
        assert!(matches!(e, Error::Io { .. }) && e.to_string().contains("nothing"), "{e}");
        let e = read_private_file(dir.path(), FERROGLOO_SECRET_FILE).unwrap_err();
        assert!(e.to_string().contains("not a regular file"), "{e}");
        let big = file(dir.path(), "big", &vec![b'x'; (MAX_FILE_BYTES + 1) as usize], 0o600);
        assert!(read_private_file(&big, FERROGLOO_SECRET_FILE).unwrap_err().to_string().contains("larger"));
        // Only the last line break goes: the rest is the secret.
        let p = file(dir.path(), "two", b"a\nb\n\n", 0o600);
        assert_eq!(read_private_file(&p, FERROGLOO_SECRET_FILE).unwrap(), b"a\nb\n");
    }

    #[test]
    fn the_file_wins_over_the_value_and_nothing_set_is_none() {
        let dir = tempfile::tempdir().unwrap();
        let s = file(dir.path(), "s", b"from-file\n", 0o600);
        let t = file(dir.path(), "t", b"tok-file\n", 0o600);
        let both = Credentials::from_vars(&vars(&[
            (FERROGLOO_SECRET_FILE, s.display().to_string()),
            (FERROGLOO_SECRET, "from-env".into()),
            (FERROGLOO_STORE_TOKEN_FILE, t.display().to_string()),
            (FERROGLOO_STORE_TOKEN, "tok-env".into()),
        ]))
        .unwrap();
        assert_eq!(both.secret.as_deref(), Some(&b"from-file"[..]));
        assert_eq!(both.store_token.as_deref(), Some("tok-file"));
        let values = Credentials::from_vars(&vars(&[
            (FERROGLOO_SECRET, "from-env".into()),
            (FERROGLOO_STORE_TOKEN, "tok-env".into()),
        ]))
        .unwrap();
        assert_eq!(values.secret.as_deref(), Some(&b"from-env"[..]));
        assert_eq!(values.store_token.as_deref(), Some("tok-env"));
        let none =
            Credentials::from_vars(&vars(&[(FERROGLOO_SECRET, String::new()), (FERROGLOO_SECRET_FILE, String::new())]));
        assert_eq!(none.unwrap(), Credentials::default());
        // The values never show in debug output.
        let shown = format!("{both:?}");
        assert!(!shown.contains("from-file") && !shown.contains("tok-file"), "{shown}");
    }

    #[test]
    fn a_token_that_cannot_be_a_header_is_refused() {
        for bad in ["two words", "tab\there", "é", &"x".repeat(MAX_TOKEN_BYTES + 1)] {
            let e = Credentials::from_vars(&vars(&[(FERROGLOO_STORE_TOKEN, bad.to_string())])).unwrap_err();
            assert!(e.to_string().contains("FERROGLOO_STORE_TOKEN"), "{e}");
        }
        assert_eq!(check_token("abc.DEF-_~+/=\n", "t").unwrap(), "abc.DEF-_~+/=");
    }

    #[test]
    fn a_job_gets_fresh_private_files_removed_when_it_ends() {
        let a = JobCredentials::for_job_with(&|_| None).unwrap();
        let b = JobCredentials::for_job_with(&|_| None).unwrap();
        assert_eq!(a.secret().len(), 2 * FRESH_BYTES);
        assert_ne!(a.secret(), b.secret(), "every job its own secret");
        assert_ne!(a.secret(), a.store_token().as_bytes(), "the token (sent in clear) is not the secret");
        let dir_mode = std::fs::metadata(a.dir()).unwrap().permissions().mode() & 0o777;
        assert_eq!(dir_mode, 0o700);
        for (var, path) in a.rank_vars() {
            assert!(path.starts_with(a.dir()), "{var}");
            assert_eq!(std::fs::metadata(path).unwrap().permissions().mode() & 0o777, 0o600, "{var}");
        }
        // A rank reads back what the launcher made.
        let lookup: HashMap<&str, String> = a.rank_vars().iter().map(|(k, p)| (*k, p.display().to_string())).collect();
        let read = Credentials::from_vars(&|k| lookup.get(k).cloned()).unwrap();
        assert_eq!(read.secret.as_deref(), Some(a.secret()));
        assert_eq!(read.store_token.as_deref(), Some(a.store_token()));
        let dir = a.dir().to_path_buf();
        drop(a);
        assert!(!dir.exists(), "the job's directory outlived it");
    }

    #[test]
    fn the_job_s_directory_goes_when_its_launcher_dies_without_removing_it() {
        let job = JobCredentials::for_job_with(&|_| None).unwrap();
        let dir = job.dir().to_path_buf();
        // As if this process were killed: its drop never runs, the watcher's pipe closes.
        let mut job = std::mem::ManuallyDrop::new(job);
        let (mut child, input) = job.reaper.take().expect("a watcher");
        drop(input);
        assert!(child.wait().unwrap().success());
        assert!(!dir.exists(), "{} outlived its launcher", dir.display());
    }

    #[test]
    fn a_job_takes_the_secret_and_token_its_launcher_was_given() {
        let dir = tempfile::tempdir().unwrap();
        let s = file(dir.path(), "mine", b"given secret\n", 0o600);
        // A file is handed on unchanged; a value goes into a private file.
        let job = JobCredentials::for_job_with(&vars(&[
            (FERROGLOO_SECRET_FILE, s.display().to_string()),
            (FERROGLOO_STORE_TOKEN, "given-token".into()),
        ]))
        .unwrap();
        assert_eq!(job.secret(), b"given secret");
        assert_eq!(job.secret_file(), s);
        assert_eq!(job.store_token(), "given-token");
        assert!(job.store_token_file().starts_with(job.dir()));
        assert_eq!(std::fs::read(job.store_token_file()).unwrap(), b"given-token");
        // A given file that others can read stops the launcher before it starts anything.
        let open = file(dir.path(), "open", b"x", 0o644);
        assert!(JobCredentials::for_job_with(&vars(&[(FERROGLOO_SECRET_FILE, open.display().to_string())])).is_err());
    }
}
