//! PyTorch's TCPStore, against the real thing (torch from PyPI, in the venv `.ci/run` makes):
//! our client against PyTorch's server, PyTorch's client against our server, each reading what
//! the other wrote (torchrun starting ferrogloo ranks: cli/tests/torchrun.rs). Pinned:
//! torch 2.15.0 (the protocol is the same from 2.5 on). Skipped, saying why, without a torch.

mod common;

use ferrogloo::rendezvous::{Store, TcpStore, TcpStoreServer};
use std::io::{BufRead, BufReader, Lines};
use std::process::{Child, ChildStdout, Command, Stdio};
use std::time::Duration;

/// A python that imports torch: `FERROGLOO_TORCH_PYTHON`, else the benchmark's venv.
fn torch_python() -> Option<String> {
    let home = std::env::var("HOME").unwrap_or_default();
    let candidates = [
        std::env::var("FERROGLOO_TORCH_PYTHON").ok(),
        Some(format!("{home}/.cache/ferrogloo-bench/torch-venv/bin/python")),
    ];
    for p in candidates.into_iter().flatten() {
        let ok = Command::new(&p)
            .args(["-c", "import torch.distributed"])
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success());
        if ok {
            return Some(p);
        }
    }
    eprintln!("SKIPPED: no python with torch (set FERROGLOO_TORCH_PYTHON; .ci/run installs one)");
    None
}

/// Kills the python when dropped.
struct Py(Child);

impl Drop for Py {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn python(py: &str, script: &str, args: &[&str]) -> (Py, Lines<BufReader<ChildStdout>>) {
    let mut child = Command::new("timeout")
        .args(["60", py, "-c", script])
        .args(args)
        .stdout(Stdio::piped())
        .spawn()
        .expect("start python");
    let out = child.stdout.take().expect("stdout");
    (Py(child), BufReader::new(out).lines())
}

fn next_line(lines: &mut Lines<BufReader<ChildStdout>>) -> String {
    lines.next().and_then(Result::ok).unwrap_or_default()
}

#[test]
fn our_client_reads_and_writes_pytorchs_server() {
    let Some(py) = torch_python() else { return };
    let script = r#"
import datetime, torch.distributed as dist
s = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=30))
print(s.port, flush=True)
v = s.get("from_rust")
s.set("from_torch", b"hello from torch")
n = s.add("counter", 10)
print("GOT", v.decode(), n, flush=True)
s.get("done")
"#;
    let (_py, mut lines) = python(&py, script, &[]);
    let port = next_line(&mut lines);
    assert!(port.parse::<u16>().is_ok(), "the server's port: {port:?}");
    let store = TcpStore::connect(&format!("127.0.0.1:{port}"), "", Duration::from_secs(20)).expect("connect");
    assert_eq!(store.add("counter", 5).expect("add"), 5);
    store.set("from_rust", b"42").expect("set");
    assert_eq!(store.get("from_torch", Duration::from_secs(20)).expect("get"), b"hello from torch");
    assert_eq!(next_line(&mut lines), "GOT 42 15", "torch read our key and added to our counter");
    assert_eq!(store.try_get("counter").expect("try_get"), Some(b"15".to_vec()));
    store.set("done", b"").expect("set");
}

#[test]
fn pytorchs_client_reads_and_writes_our_server() {
    let Some(py) = torch_python() else { return };
    let server = TcpStoreServer::start("127.0.0.1:0").expect("server");
    let port = server.local_addr().port().to_string();
    let ours = TcpStore::connect(&server.local_addr().to_string(), "", Duration::from_secs(10)).expect("connect");
    ours.set("from_rust", b"ferro").expect("set");
    let script = r#"
import datetime, sys, torch.distributed as dist
s = dist.TCPStore("127.0.0.1", int(sys.argv[1]), is_master=False, wait_for_workers=False, timeout=datetime.timedelta(seconds=30))
print("GOT", s.get("from_rust").decode(), flush=True)
s.set("from_torch", b"x")
print("ADD", s.add("cnt", 3), s.add("cnt", 4), flush=True)
print("CMP", s.compare_set("c", b"", b"first").decode(), s.compare_set("c", b"zzz", b"second").decode(), flush=True)
print("CHECK", s.check(["from_rust"]), s.check(["nope"]), flush=True)
try:
    s.wait(["never"], datetime.timedelta(milliseconds=300))
    print("WAITED", flush=True)
except Exception:
    print("TIMEOUT", flush=True)
s.set("after_timeout", b"ok")
print("DELETED", s.delete_key("from_torch"), s.delete_key("from_torch"), flush=True)
"#;
    let (_py, mut lines) = python(&py, script, &[&port]);
    assert_eq!(next_line(&mut lines), "GOT ferro");
    assert_eq!(next_line(&mut lines), "ADD 3 7");
    assert_eq!(next_line(&mut lines), "CMP first first");
    assert_eq!(next_line(&mut lines), "CHECK True False");
    assert_eq!(next_line(&mut lines), "TIMEOUT", "a wait on a missing key times out in torch's client");
    assert_eq!(next_line(&mut lines), "DELETED True False");
    // What torch wrote, read by ours, after its timed-out wait on the same connection.
    assert_eq!(ours.get("after_timeout", Duration::from_secs(10)).expect("get"), b"ok");
    assert_eq!(ours.try_get("cnt").expect("try_get"), Some(b"7".to_vec()));
    assert_eq!(ours.try_get("from_torch").expect("try_get"), None);
}
