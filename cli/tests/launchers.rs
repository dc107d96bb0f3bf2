//! Programs started by other launchers join their jobs through `RankEnv::from_env`: Open MPI's
//! `mpirun` here (skipped, saying why, where it is not installed; CI installs it).

use std::process::Command;
use std::time::Duration;

const BENCH: &str = env!("CARGO_BIN_EXE_ferrogloo-bench");

/// `mpirun`'s path, or why this test cannot run here.
fn mpirun() -> Option<&'static str> {
    match Command::new("mpirun").arg("--version").output() {
        Ok(o) if o.status.success() && String::from_utf8_lossy(&o.stdout).contains("Open MPI") => Some("mpirun"),
        _ => {
            eprintln!("SKIPPED: Open MPI's mpirun is not installed here (apt-get install openmpi-bin)");
            None
        }
    }
}

#[test]
fn mpirun_starts_four_ranks_that_meet_through_a_file_store() {
    let Some(mpirun) = mpirun() else { return };
    let dir = tempfile::tempdir().expect("a store directory");
    let store = format!("FERROGLOO_STORE=file:{}", dir.path().display());
    let out = Command::new("timeout")
        .args(["120", mpirun, "--allow-run-as-root", "--oversubscribe", "-np", "4", "-x", &store])
        .args([BENCH, "--op", "allreduce,broadcast", "--sizes", "4K,1M", "-n", "3", "--timeout", "60"])
        .env("RUST_LOG", "ferrogloo=info")
        .output()
        .expect("run mpirun");
    let (stdout, stderr) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "mpirun failed ({}):\n{stdout}\n{stderr}", out.status);
    // Rank 0 prints the table for a job of 4; every rank says which launcher it found.
    assert!(stdout.contains("allreduce: 4 ranks"), "{stdout}");
    assert!(stdout.contains("Out of bounds values : 0 OK"), "{stdout}");
    let found = stderr.matches("launched by openmpi").count();
    assert_eq!(found, 4, "every rank names Open MPI as its launcher:\n{stderr}");
}

#[test]
fn a_slurm_batch_shell_is_not_taken_for_a_rank() {
    // sbatch's script sees SLURM_PROCID but is not one of srun's tasks: without the step id
    // the benchmark does not wait for 3 more ranks; it says at once how to start a job.
    let t = std::time::Instant::now();
    let out = Command::new("timeout")
        .args(["60", BENCH, "--op", "allreduce", "--sizes", "4K", "-n", "2"])
        .env("SLURM_PROCID", "0")
        .env("SLURM_NTASKS", "4")
        .env("SLURM_JOB_ID", "77")
        .env_remove("SLURM_STEP_ID")
        .output()
        .expect("run the benchmark");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("a Slurm batch shell, not a task started by srun"), "{stderr}");
    assert!(stderr.contains("give --np N"), "{stderr}");
    assert!(t.elapsed() < Duration::from_secs(30), "took {:?}", t.elapsed());
}
