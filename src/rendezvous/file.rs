//! A store in a directory of a shared filesystem.

use super::{Store, checked_add, parse_counter};
use crate::error::{Error, Result};
use sha2::{Digest, Sha256};
use std::fs;
use std::io::{self, Write};
use std::path::{Path, PathBuf};

/// A store kept as one file per key in a directory that every rank can reach: a local
/// directory for ranks on one host, an NFS (or other shared) mount for several hosts.
///
/// - Values are published atomically: written to a temporary file, then renamed into place,
///   so a reader sees the whole old value or the whole new one, never a torn write.
/// - Keys are escaped into safe file names (`/` and every byte outside `[A-Za-z0-9._-]`
///   become `%XX`; very long keys are shortened with a SHA-256 suffix).
/// - [`add`](Store::add) takes an advisory lock (`flock`, which Linux maps onto NFS byte-range
///   locks) on `DIR/.lock`; the kernel releases it if the holder dies.
/// - Waiting polls with exponential backoff (1 ms up to 100 ms).
///
/// A directory left over from an earlier job is harmless to a [`Context`](crate::Context):
/// every address a context publishes is stamped with a fresh random context id that rank 0
/// confirms over a live connection, so stale entries are recognised and skipped. Deleting old
/// directories is still good hygiene. On NFS, a client's negative lookup cache can delay the
/// sight of a new file by up to the mount's `acdirmax`; `lookupcache=positive` avoids that.
///
/// ```
/// use ferrogloo::rendezvous::{FileStore, Store};
/// let dir = tempfile::tempdir().unwrap();
/// let store = FileStore::new(dir.path()).unwrap();
/// store.set("rank/0", b"hello").unwrap();
/// assert_eq!(store.try_get("rank/0").unwrap().as_deref(), Some(&b"hello"[..]));
/// ```
#[derive(Debug, Clone)]
pub struct FileStore {
    dir: PathBuf,
}

/// Longest escaped key kept verbatim as a file name (most filesystems allow 255 bytes).
const MAX_NAME: usize = 200;

impl FileStore {
    /// Opens (creating if needed) the store in `dir`. Fails at once, with
    /// [`Error::Store`] naming the path, when the directory cannot be created or written.
    pub fn new(dir: impl AsRef<Path>) -> Result<Self> {
        let dir = dir.as_ref().to_path_buf();
        let failed = |what: &str, e: io::Error| Error::Store {
            key: None,
            detail: format!("{what} the store directory at path {}: {e}", dir.display()),
        };
        fs::create_dir_all(&dir).map_err(|e| failed("cannot create", e))?;
        // Prove the directory is writable now rather than at the first `set`.
        let store = FileStore { dir: dir.clone() };
        let probe = store.temp_path();
        fs::write(&probe, b"").and_then(|()| fs::remove_file(&probe)).map_err(|e| failed("cannot write to", e))?;
        Ok(store)
    }

    /// The directory holding the store.
    pub fn path(&self) -> &Path {
        &self.dir
    }

    fn key_path(&self, key: &str) -> PathBuf {
        self.dir.join(escape_key(key))
    }

    fn temp_path(&self) -> PathBuf {
        // A failing entropy source only weakens uniqueness; pid and a counter still separate
        // writers of this host.
        let rnd = getrandom::u64().unwrap_or(0);
        static COUNTER: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let n = COUNTER.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        self.dir.join(format!(".tmp-{}-{}-{rnd:016x}", std::process::id(), n))
    }

    fn publish(&self, key: &str, value: &[u8]) -> Result<()> {
        let tmp = self.temp_path();
        let res = (|| -> io::Result<()> {
            let mut f = fs::File::create(&tmp)?;
            f.write_all(value)?;
            drop(f);
            fs::rename(&tmp, self.key_path(key))
        })();
        res.map_err(|e| {
            let _ = fs::remove_file(&tmp);
            Error::store(key, format!("cannot write in the store directory at path {}: {e}", self.dir.display()))
        })
    }
}

impl Store for FileStore {
    fn set(&self, key: &str, value: &[u8]) -> Result<()> {
        self.publish(key, value)
    }

    fn try_get(&self, key: &str) -> Result<Option<Vec<u8>>> {
        match fs::read(self.key_path(key)) {
            Ok(v) => Ok(Some(v)),
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(Error::store(
                key,
                format!("cannot read in the store directory at path {}: {e}", self.dir.display()),
            )),
        }
    }

    fn add(&self, key: &str, delta: i64) -> Result<i64> {
        let lock_path = self.dir.join(".lock");
        let lock = fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&lock_path)
            .map_err(|e| Error::store(key, format!("cannot open {}: {e}", lock_path.display())))?;
        lock.lock().map_err(|e| Error::store(key, format!("cannot lock {}: {e}", lock_path.display())))?;
        let result = (|| {
            let old = match self.try_get(key)? {
                Some(v) => parse_counter(key, &v)?,
                None => 0,
            };
            let new = checked_add(key, old, delta)?;
            self.publish(key, new.to_string().as_bytes())?;
            Ok(new)
        })();
        // Closing the file releases the lock as well; unlocking first makes it prompt.
        let _ = lock.unlock();
        result
    }

    fn delete(&self, key: &str) -> Result<bool> {
        match fs::remove_file(self.key_path(key)) {
            Ok(()) => Ok(true),
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(false),
            Err(e) => Err(Error::store(
                key,
                format!("cannot delete in the store directory at path {}: {e}", self.dir.display()),
            )),
        }
    }

    fn describe(&self) -> String {
        format!("file:{}", self.dir.display())
    }

    /// Whether the directory is on a network filesystem (NFS, SMB/CIFS, Lustre, GPFS, Ceph,
    /// 9P, AFS, or FUSE, which sshfs and the like use), by `statfs`.
    fn reaches_other_hosts(&self) -> bool {
        const NETWORK: [i64; 10] = [
            0x6969,      // NFS
            0x517b,      // SMB
            0xff53_4d42, // CIFS
            0xfe53_4d42, // SMB2
            0x0bd0_0bd0, // Lustre
            0x4750_4653, // GPFS
            0x00c3_6400, // Ceph
            0x0102_1997, // 9P
            0x5346_414f, // AFS
            0x6573_5546, // FUSE
        ];
        let Ok(path) = std::ffi::CString::new(self.dir.as_os_str().as_encoded_bytes()) else { return true };
        let mut st = std::mem::MaybeUninit::<libc::statfs>::uninit();
        // SAFETY: `path` is a NUL-terminated string and `st` a writable statfs buffer, both
        // alive for the call.
        if unsafe { libc::statfs(path.as_ptr(), st.as_mut_ptr()) } != 0 {
            return true;
        }
        // SAFETY: statfs succeeded, so it filled the buffer.
        #[allow(clippy::unnecessary_cast, reason = "f_type's integer type differs between targets")]
        let kind = unsafe { st.assume_init() }.f_type as i64;
        NETWORK.contains(&kind)
    }
}

/// Escapes a key into a file name: `[A-Za-z0-9_-]` and non-leading `.` stay, everything else
/// becomes `%XX`. Names longer than [`MAX_NAME`] keep a readable head and a SHA-256 tail.
fn escape_key(key: &str) -> String {
    let mut out = String::with_capacity(key.len());
    for (i, b) in key.bytes().enumerate() {
        let keep = b.is_ascii_alphanumeric() || b == b'_' || b == b'-' || (b == b'.' && i > 0);
        if keep {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    if out.is_empty() {
        out.push_str("%EMPTY");
    }
    if out.len() > MAX_NAME {
        let digest = Sha256::digest(key.as_bytes());
        let hex: String = digest.iter().map(|b| format!("{b:02x}")).collect();
        let mut head = out[..MAX_NAME - 70].to_string();
        // Never cut an escape sequence in half.
        while head.ends_with('%') || head[..head.len().saturating_sub(1)].ends_with('%') {
            head.pop();
        }
        out = format!("{head}~{hex}");
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn escaping_is_injective_on_tricky_keys() {
        let keys = ["a/b", "a%2Fb", ".hidden", "..", "", "x y", "é", "a.b", &"k".repeat(500)];
        let names: Vec<String> = keys.iter().map(|k| escape_key(k)).collect();
        for (i, n) in names.iter().enumerate() {
            assert!(!n.contains('/') && !n.starts_with('.') && n.len() <= MAX_NAME, "{n}");
            for m in &names[i + 1..] {
                assert_ne!(n, m);
            }
        }
    }

    #[test]
    fn unwritable_directory_fails_at_once() {
        // A path under a regular file can never be created.
        let f = tempfile::NamedTempFile::new().unwrap();
        let err = FileStore::new(f.path().join("sub")).unwrap_err();
        assert!(matches!(err, Error::Store { key: None, .. }), "{err}");
        let text = err.to_string();
        assert!(text.contains("path") && !text.contains("key"), "{text}");
    }

    #[test]
    fn a_local_directory_is_not_a_network_store() {
        let dir = tempfile::tempdir().unwrap();
        let store = FileStore::new(dir.path()).unwrap();
        assert!(!store.reaches_other_hosts());
        assert_eq!(store.describe(), format!("file:{}", dir.path().display()));
    }
}
