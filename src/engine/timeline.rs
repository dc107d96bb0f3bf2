//! The Chrome-trace timeline (loads in Perfetto and chrome://tracing).
//!
//! The file is `{"traceEvents":[ ... ]}` at every moment: each cycle's events are written
//! with one positioned write over the old closing `\n]}` that ends with a new one, so a
//! process killed between cycles leaves complete JSON. (A kill that lands inside the write
//! of a batch larger than a page can cut it: the kernel may stop a write between pages.)
//!
//! One row per tensor: `NEGOTIATE_<OP>` from this rank's submission to the cycle that found
//! it ready (its `args` hold when each rank was first seen with it, in µs from the span's
//! start), `QUEUE` until it ran, `MEMCPY_IN_FUSION_BUFFER`, the collective
//! (`ALLREDUCE`, ...), `MEMCPY_OUT_FUSION_BUFFER`.

use super::exec::{Item, Span};
use crate::error::{Error, Result};
use std::collections::HashMap;
use std::fmt::Write as _;
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::time::Instant;

const HEAD: &str = "{\"traceEvents\":[";
const TAIL: &str = "\n]}";

/// `<path>.<rank>`
pub(crate) fn rank_path(p: &Path, rank: usize) -> PathBuf {
    let mut s = p.as_os_str().to_owned();
    s.push(format!(".{rank}"));
    PathBuf::from(s)
}

pub(crate) struct Timeline {
    file: File,
    path: PathBuf,
    /// Where the closing `\n]}` starts.
    end: u64,
    any: bool,
    batch: String,
    rows: HashMap<String, u64>,
    epoch: Instant,
    pid: usize,
}

impl Timeline {
    pub(crate) fn create(path: &Path, pid: usize, epoch: Instant) -> Result<Timeline> {
        let file = File::create(path).map_err(|e| Error::io(format!("creating the timeline {}", path.display()), e))?;
        let mut t = Timeline {
            file,
            path: path.to_path_buf(),
            end: HEAD.len() as u64,
            any: false,
            batch: String::new(),
            rows: HashMap::new(),
            epoch,
            pid,
        };
        let head = format!("{HEAD}{TAIL}");
        t.file
            .write_all_at(head.as_bytes(), 0)
            .map_err(|e| Error::io(format!("writing the timeline {}", path.display()), e))?;
        t.event(format!(
            "{{\"name\":\"process_name\",\"ph\":\"M\",\"pid\":{pid},\"args\":{{\"name\":\"rank {pid}\"}}}}"
        ));
        t.flush();
        Ok(t)
    }

    fn event(&mut self, json: String) {
        if !self.batch.is_empty() {
            self.batch.push_str(",\n");
        }
        self.batch.push_str(&json);
    }

    fn us(&self, t: Instant) -> f64 {
        t.saturating_duration_since(self.epoch).as_secs_f64() * 1e6
    }

    fn row(&mut self, name: &str) -> u64 {
        if let Some(&r) = self.rows.get(name) {
            return r;
        }
        let r = self.rows.len() as u64 + 1;
        self.rows.insert(name.to_string(), r);
        self.event(format!(
            "{{\"name\":\"thread_name\",\"ph\":\"M\",\"pid\":{},\"tid\":{r},\"args\":{{\"name\":{}}}}}",
            self.pid,
            json_str(name)
        ));
        r
    }

    fn span(&mut self, tid: u64, name: &str, start: Instant, end: Instant, args: &str) {
        let ts = self.us(start);
        let dur = (self.us(end) - ts).max(0.0);
        self.event(format!(
            "{{\"name\":\"{name}\",\"ph\":\"X\",\"ts\":{ts:.3},\"dur\":{dur:.3},\"pid\":{},\"tid\":{tid}{args}}}",
            self.pid
        ));
    }

    /// The events of one cycle's items.
    pub(crate) fn record(&mut self, items: &[Item], spans: &[Span]) {
        for (i, item) in items.iter().enumerate() {
            let tid = self.row(&item.name);
            let first_seen = item.seen.as_ref().and_then(|v| v.iter().flatten().min().copied());
            let start = item.submitted.or(first_seen).unwrap_or(item.decided);
            let mut args = String::new();
            if let Some(v) = &item.seen {
                let mut a = String::new();
                for (r, t) in v.iter().enumerate() {
                    if let Some(t) = t {
                        let _ = write!(
                            a,
                            "{}\"rank {r} ready\":{:.3}",
                            if a.is_empty() { "" } else { "," },
                            t.saturating_duration_since(start).as_secs_f64() * 1e6
                        );
                    }
                }
                if !a.is_empty() {
                    args = format!(",\"args\":{{{a}}}");
                }
            }
            let negotiate = format!("NEGOTIATE_{}", item.meta.kind.name().to_uppercase());
            self.span(tid, &negotiate, start, item.decided, &args);
            let ran = spans.iter().filter(|s| s.item == i).map(|s| s.start).min();
            if let Some(r) = ran {
                self.span(tid, "QUEUE", item.decided, r, "");
            }
            for s in spans.iter().filter(|s| s.item == i) {
                self.span(tid, s.phase, s.start, s.end, "");
            }
        }
    }

    /// Writes the pending events (one write, ending with the closing brackets). A failure to
    /// write is logged and the events dropped: the timeline never fails the engine.
    pub(crate) fn flush(&mut self) {
        if self.batch.is_empty() {
            return;
        }
        let mut s = String::with_capacity(self.batch.len() + 8);
        s.push_str(if self.any { ",\n" } else { "\n" });
        s.push_str(&self.batch);
        s.push_str(TAIL);
        self.batch.clear();
        match self.file.write_all_at(s.as_bytes(), self.end) {
            Ok(()) => {
                self.end += (s.len() - TAIL.len()) as u64;
                self.any = true;
            }
            Err(e) => {
                // A write cut short (a full disk) may have left part of the batch: put the old
                // end back.
                let _ = self.file.write_all_at(TAIL.as_bytes(), self.end);
                let _ = self.file.set_len(self.end + TAIL.len() as u64);
                tracing::warn!(path = %self.path.display(), error = %e, "cannot write the engine's timeline");
            }
        }
    }
}

/// `s` as a JSON string literal.
fn json_str(s: &str) -> String {
    let mut o = String::with_capacity(s.len() + 2);
    o.push('"');
    for c in s.chars() {
        match c {
            '"' => o.push_str("\\\""),
            '\\' => o.push_str("\\\\"),
            c if (c as u32) < 0x20 => {
                let _ = write!(o, "\\u{:04x}", c as u32);
            }
            c => o.push(c),
        }
    }
    o.push('"');
    o
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_file_is_json_after_every_flush() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("t.json");
        let epoch = Instant::now();
        let mut t = Timeline::create(&p, 0, epoch).unwrap();
        let parse = |p: &Path| {
            let s = std::fs::read_to_string(p).unwrap();
            assert!(s.starts_with(HEAD) && s.ends_with(TAIL), "{s}");
            s.matches("\"ph\"").count()
        };
        assert_eq!(parse(&p), 1);
        let tid = t.row("weird \"name\"\n\\");
        t.span(tid, "ALLREDUCE", epoch, Instant::now(), "");
        t.flush();
        assert_eq!(parse(&p), 3);
        t.flush();
        assert_eq!(parse(&p), 3);
        let tid = t.row("b");
        t.span(tid, "QUEUE", epoch, Instant::now(), ",\"args\":{\"rank 1 ready\":3.5}");
        t.flush();
        assert_eq!(parse(&p), 5);
        assert_eq!(json_str("a\"b\\\u{1}"), "\"a\\\"b\\\\\\u0001\"");
        assert_eq!(rank_path(Path::new("/x/tl.json"), 3), PathBuf::from("/x/tl.json.3"));
    }
}
