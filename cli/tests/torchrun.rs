//! torchrun (PyTorch's launcher, from the venv `.ci/run` installs) starting ferrogloo ranks:
//! they find their place from its variables and meet in its TCPStore. Skipped, saying why,
//! where no python with torch is found (`FERROGLOO_TORCH_PYTHON`).

use std::process::{Command, Stdio};

const BENCH: &str = env!("CARGO_BIN_EXE_ferrogloo-bench");

/// A python with torch: `FERROGLOO_TORCH_PYTHON`, or the venv `.ci/run` makes.
fn torch_python() -> Option<String> {
    let home = std::env::var("HOME").unwrap_or_default();
    let candidates = [
        std::env::var("FERROGLOO_TORCH_PYTHON").ok(),
        Some(format!("{home}/.cache/ferrogloo-bench/torch-venv/bin/python")),
    ];
    let found = candidates.into_iter().flatten().find(|p| {
        Command::new(p)
            .args(["-c", "import torch.distributed"])
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success())
    });
    if found.is_none() {
        eprintln!("SKIPPED: no python with torch (set FERROGLOO_TORCH_PYTHON; .ci/run installs one)");
    }
    found
}

#[test]
fn torchrun_starts_ferrogloo_ranks_that_meet_in_its_store() {
    let Some(py) = torch_python() else { return };
    let torchrun = std::path::Path::new(&py).with_file_name("torchrun");
    if !torchrun.exists() {
        eprintln!("SKIPPED: no torchrun beside {py}");
        return;
    }
    let out = Command::new("timeout")
        .arg("120")
        .arg(&torchrun)
        .args(["--standalone", "--nproc-per-node", "3", "--no-python", BENCH])
        .args(["--op", "allreduce", "--sizes", "4K", "-n", "3", "--timeout", "60"])
        .env("RUST_LOG", "ferrogloo=info")
        .output()
        .expect("run torchrun");
    let (stdout, stderr) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "torchrun failed ({}):\n{stdout}\n{stderr}", out.status);
    assert!(stdout.contains("allreduce: 3 ranks") && stdout.contains("Out of bounds values : 0 OK"), "{stdout}");
    assert_eq!(stderr.matches("launched by torchrun").count(), 3, "{stderr}");
    // torchrun's agent numbers its attempts: the ranks' keys go under the first one's prefix.
    assert!(stderr.contains("/worker/attempt_0"), "{stderr}");
}
