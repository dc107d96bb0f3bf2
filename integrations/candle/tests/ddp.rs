//! The `ddp` example as OS processes: at 2 and 3 ranks its per-epoch losses match the
//! single-process run over the whole batch within float rounding, and every rank ends with
//! rank 0's weights; torchrun starts it too (where a python with torch is found).

use std::path::PathBuf;
use std::process::{Command, Output, Stdio};

/// The example's binary, which `cargo test` builds beside this test (`cargo test --test ddp`
/// alone does not rebuild examples: it would run whatever binary is there).
fn ddp() -> PathBuf {
    let exe = std::env::current_exe().expect("test binary");
    let profile = exe.parent().and_then(|deps| deps.parent()).expect("target/<profile>/deps/<test>");
    let bin = profile.join("examples").join("ddp");
    assert!(bin.exists(), "{} is missing: cargo test builds the examples", bin.display());
    bin
}

/// Runs `cmd` under `timeout` (a hang is a failure) and returns what it printed.
fn run(cmd: &mut Command) -> Output {
    let out = cmd.stdin(Stdio::null()).output().expect("starting the example");
    let (o, e) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "{cmd:?} failed ({}):\n{o}\n{e}", out.status);
    out
}

fn timed(secs: u32) -> Command {
    let mut c = Command::new("timeout");
    c.arg(secs.to_string());
    c
}

/// The per-epoch losses rank 0 printed, and the summary line.
fn losses(out: &Output) -> (Vec<f64>, String) {
    let text = String::from_utf8_lossy(&out.stdout);
    let l: Vec<f64> = text
        .lines()
        .filter_map(|l| l.strip_prefix("epoch ").and_then(|r| r.split("loss ").nth(1)))
        .map(|v| v.trim().parse().expect("a loss"))
        .collect();
    let last = text.lines().last().unwrap_or_default().to_string();
    (l, last)
}

const ARGS: [&str; 6] = ["--epochs", "4", "--samples", "768", "--batch", "48"];

#[test]
fn losses_match_one_process_over_the_whole_batch_and_weights_end_identical() {
    let (single, last) = losses(&run(timed(300).arg(ddp()).args(ARGS)));
    assert_eq!(single.len(), 4, "{last}");
    assert!(single[3] < single[0] * 0.8, "the loss did not fall: {single:?}");
    assert!(last.starts_with("ddp: 1 ranks, 4 epochs") && last.ends_with("weights identical on every rank"), "{last}");
    for n in [2, 3] {
        let (got, last) = losses(&run(timed(300).arg(ddp()).args(ARGS).args(["--np", &n.to_string()])));
        let want =
            format!("ddp: {n} ranks, 4 epochs, loss {:.6} -> {:.6}, weights identical on every rank", got[0], got[3]);
        assert_eq!(last, want);
        assert_eq!(got.len(), single.len(), "{n} ranks");
        for (e, (a, b)) in got.iter().zip(&single).enumerate() {
            // Sums in another order: the same to about 1e-6 relative per step.
            assert!((a - b).abs() <= 1e-4 * b.abs(), "{n} ranks, epoch {}: loss {a} vs one process {b}", e + 1);
        }
    }
}

#[test]
fn a_batch_that_does_not_split_evenly_is_refused_on_every_rank() {
    let out = timed(120).arg(ddp()).args(["--np", "3", "--batch", "50"]).output().expect("starting the example");
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(err.matches("--batch 50 must be a positive multiple of the 3 ranks").count(), 3, "{err}");
}

/// A python with torch: `FERROGLOO_TORCH_PYTHON`, or the venv `.ci/run` makes.
fn torchrun() -> Option<PathBuf> {
    let home = std::env::var("HOME").unwrap_or_default();
    let candidates = [
        std::env::var("FERROGLOO_TORCH_PYTHON").ok(),
        Some(format!("{home}/.cache/ferrogloo-bench/torch-venv/bin/python")),
    ];
    let py = candidates.into_iter().flatten().find(|p| {
        Command::new(p)
            .args(["-c", "import torch.distributed"])
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success())
    });
    let run = py.map(|p| PathBuf::from(p).with_file_name("torchrun")).filter(|t| t.exists());
    if run.is_none() {
        eprintln!("SKIPPED: no torchrun beside a python with torch (set FERROGLOO_TORCH_PYTHON; .ci/run installs one)");
    }
    run
}

#[test]
fn torchrun_starts_it_with_no_ferrogloo_variables() {
    let Some(torchrun) = torchrun() else { return };
    let mut cmd = timed(300);
    cmd.arg(torchrun).args(["--standalone", "--nproc-per-node", "2", "--no-python"]).arg(ddp()).args(ARGS);
    for (k, _) in std::env::vars().filter(|(k, _)| k.starts_with("FERROGLOO_")) {
        cmd.env_remove(k);
    }
    let (l, last) = losses(&run(&mut cmd));
    assert!(last.starts_with("ddp: 2 ranks, 4 epochs") && l.len() == 4 && l[3] < l[0], "{last}");
}
