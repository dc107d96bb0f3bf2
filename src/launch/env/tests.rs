//! Tests of launcher detection: every launcher's variables, their contradictions, Slurm's node
//! lists and stores.

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
            "http://gnode07:13456/slurm-123456.0",
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
fn srun_with_slurms_pmi2_is_slurm_and_hydra_inside_an_allocation_is_mpich() {
    let step = [
        ("SLURM_PROCID", "1"),
        ("SLURM_NTASKS", "2"),
        ("SLURM_LOCALID", "1"),
        ("SLURM_STEP_ID", "3"),
        ("SLURM_JOB_ID", "77"),
        ("SLURM_STEP_NODELIST", "n1"),
        ("SLURM_TASKS_PER_NODE", "2"),
    ];
    // srun --mpi=pmi2: Slurm's PMI sets PMI_RANK and PMI_SIZE, no MPI_LOCALRANKID.
    let pmi2: Vec<_> = step.iter().copied().chain([("PMI_RANK", "1"), ("PMI_SIZE", "2")]).collect();
    let got = detect(&env(&pmi2)).expect("detected").expect("a launcher");
    assert_eq!((got.launcher, got.rank, got.size), (Some(Launcher::Slurm), 1, 2));
    assert!(got.store.starts_with("http://n1:") && got.store.ends_with("/slurm-77.3"), "{}", got.store);
    // mpiexec (Hydra) run inside an allocation: its own variables, MPI_LOCALRANKID among them.
    let hydra: Vec<_> = step
        .iter()
        .copied()
        .chain([
            ("PMI_RANK", "4"),
            ("PMI_SIZE", "6"),
            ("MPI_LOCALRANKID", "0"),
            ("MPI_LOCALNRANKS", "3"),
            ("FERROGLOO_STORE", "file:/shared"),
        ])
        .collect();
    let got = detect(&env(&hydra)).expect("detected").expect("a launcher");
    assert_eq!((got.launcher, got.rank, got.size), (Some(Launcher::Mpich), 4, 6));
    // Named explicitly, Slurm's PMI-2 variables are read as MPICH's (the user said so).
    let named: Vec<_> =
        pmi2.iter().copied().chain([("FERROGLOO_LAUNCHER", "mpich"), ("FERROGLOO_STORE", "file:/s")]).collect();
    let got = detect(&env(&named)).expect("detected").expect("a launcher");
    assert_eq!((got.launcher, got.rank, got.size), (Some(Launcher::Mpich), 1, 2));
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
    let cases: [(&str, &[&str]); 9] = [
        ("gnode[01-04,10]", &["gnode01", "gnode02", "gnode03", "gnode04", "gnode10"]),
        ("a1,b[7-9]", &["a1", "b7", "b8", "b9"]),
        ("n[098-101]", &["n098", "n099", "n100", "n101"]),
        ("x[1,3]-ib,login", &["x1-ib", "x3-ib", "login"]),
        ("solo", &["solo"]),
        // Several groups: every combination, the last group fastest, as Slurm orders them.
        ("a[1-2]b[3-4]", &["a1b3", "a1b4", "a2b3", "a2b4"]),
        ("r[01-02]n[8-9,10]-ib", &["r01n8-ib", "r01n9-ib", "r01n10-ib", "r02n8-ib", "r02n9-ib", "r02n10-ib"]),
        ("[1-2]x,y[0]z[00]", &["1x", "2x", "y0z00"]),
        ("a,b,", &["a", "b"]),
    ];
    for (list, want) in cases {
        assert_eq!(expand_nodelist(list).unwrap(), want, "{list}");
    }
    assert_eq!(expand_nodelist(&format!("n[1-{MAX_NODELIST_HOSTS}]")).unwrap().len(), MAX_NODELIST_HOSTS);
}

#[test]
fn malformed_slurm_node_lists_are_errors_naming_them() {
    for (bad, why) in [
        ("n[1-", "unclosed"),
        ("n[a-b]", "not a number"),
        ("n[5-2]", "backwards"),
        ("n[[1]]", "nested"),
        ("n[1]]", "without its"),
        ("n]1[", "without its"),
        ("a[1-2]b[3-4", "unclosed"),
        (",", "empty name"),
        ("a,,b", "empty name"),
        ("n[]", "not a number"),
        ("n[1,]", "not a number"),
        ("n[1-2-3]", "not a number"),
        ("n[-3]", "not a number"),
        ("n[0-99999999999999999999999]", "too large"),
        ("n[0-18446744073709551615]", "more than 1048576 hosts"),
        ("a[0-1023]b[0-1024]", "more than 1048576 hosts"),
        ("a[1-1048576],b", "more than 1048576 hosts"),
        ("a[0-1048575]x[0-1]", "more than 1048576 hosts"),
    ] {
        let e = expand_nodelist(bad).expect_err(bad);
        let text = e.to_string();
        assert!(text.contains(&format!("{bad:?}")) && text.contains(why), "{bad}: {text} (wanted {why:?})");
    }
    let long = format!("{}[1-2]", "n".repeat(300));
    assert!(expand_nodelist(&long).unwrap_err().to_string().contains("longer than 255"));
    let long = format!("n[0-1000]{}", "x".repeat(100_000));
    assert!(expand_nodelist(&long).unwrap_err().to_string().contains("longer than 255"));
    // Under srun, the error names the variable too.
    let e = detect(&env(&[
        ("SLURM_PROCID", "0"),
        ("SLURM_NTASKS", "2"),
        ("SLURM_STEP_ID", "0"),
        ("SLURM_JOB_ID", "1"),
        ("SLURM_STEP_NODELIST", "a[2-1]"),
    ]))
    .unwrap_err();
    assert!(e.to_string().contains("SLURM_STEP_NODELIST=\"a[2-1]\": a range that runs backwards"), "{e}");
}

fn srun_task(job: &str, step: &str) -> Vec<(&'static str, String)> {
    vec![
        ("SLURM_PROCID", "0".into()),
        ("SLURM_NTASKS", "2".into()),
        ("SLURM_STEP_ID", step.into()),
        ("SLURM_JOB_ID", job.into()),
        ("SLURM_STEP_NODELIST", "a[1-2]b[3-4]".into()),
    ]
}

fn store_of(vars: &[(&str, String)]) -> Result<String> {
    let pairs: Vec<(&str, &str)> = vars.iter().map(|(k, v)| (*k, v.as_str())).collect();
    Ok(detect(&env(&pairs))?.expect("a Slurm rank").store)
}

#[test]
fn concurrent_slurm_steps_get_stores_of_their_own() {
    // Two srun steps of one allocation, at once: neither the port nor the scope is shared.
    let (a, b) = (store_of(&srun_task("77", "0")).unwrap(), store_of(&srun_task("77", "1")).unwrap());
    assert_eq!(a, "http://a1b3:10077/slurm-77.0");
    assert_eq!(b, "http://a1b3:17996/slurm-77.1");
    let mut ports = std::collections::HashSet::new();
    for step in 0..10_000u64 {
        let (port, scope) = slurm_store(77, step);
        assert!((SLURM_PORT_BASE..SLURM_PORT_BASE + 10_000).contains(&port), "{port}");
        assert!(ports.insert(port), "step {step} reuses port {port}");
        assert_eq!(scope, format!("slurm-77.{step}"));
    }
    // Step 1 of a job does not take step 0's port of the next job.
    assert_ne!(slurm_store(77, 1).0, slurm_store(78, 0).0);
    // The largest ids do not overflow.
    let (port, scope) = slurm_store(u64::MAX, u64::MAX);
    assert!((SLURM_PORT_BASE..SLURM_PORT_BASE + 10_000).contains(&port), "{port}");
    assert_eq!(scope, format!("slurm-{}.{}", u64::MAX, u64::MAX));
    let e = store_of(&srun_task("77", "extern")).unwrap_err();
    assert!(e.to_string().contains("SLURM_STEP_ID=\"extern\" is not a number"), "{e}");
    let e = store_of(&srun_task("-1", "0")).unwrap_err();
    assert!(e.to_string().contains("SLURM_JOB_ID=\"-1\" is not a number"), "{e}");
}

#[test]
fn slurm_tasks_per_node_repeat_counts_never_overflow() {
    let task = |spec: &str, node: &str| {
        let mut vars = srun_task("5", "0");
        vars.extend([("SLURM_TASKS_PER_NODE", spec.to_string()), ("SLURM_NODEID", node.to_string())]);
        let pairs: Vec<(&str, &str)> = vars.iter().map(|(k, v)| (*k, v.as_str())).collect();
        detect(&env(&pairs)).map(|e| e.expect("a Slurm rank").local_size)
    };
    assert_eq!(task("2(x3),1", "3").unwrap(), Some(1));
    assert_eq!(task("2(x18446744073709551615)", "7").unwrap(), Some(2));
    for (spec, node, words) in [
        ("2(x18446744073709551615),1", "0", "SLURM_TASKS_PER_NODE=\"2(x18446744073709551615),1\": its repeat counts"),
        ("1,2(x18446744073709551615)", "9", "SLURM_TASKS_PER_NODE=\"1,2(x18446744073709551615)\": its repeat counts"),
        ("2(x18446744073709551616)", "0", "is not a list like 2(x3),1"),
        ("2(x3", "0", "is not a list like 2(x3),1"),
        ("2(x3),1", "4", "SLURM_NODEID=4 is beyond"),
    ] {
        let e = task(spec, node).expect_err(spec);
        assert!(e.to_string().contains(words), "{e} (wanted {words:?})");
    }
}
