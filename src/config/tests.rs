//! The table against the README and the sources, the readers' rules, and every module's
//! reader fed through a lookup instead of the process environment.

use super::*;
use crate::device::{IbAttr, ShmAttr, TcpAttr, Transport};
use crate::engine::EngineConfig;
use crate::error::Error;
use proptest::prelude::*;
use std::collections::{BTreeSet, HashMap};
use std::path::{Path, PathBuf};
use std::time::Duration;

/// A lookup over `pairs`.
fn map(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> + use<> {
    let m: HashMap<String, String> = pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
    move |k| m.get(k).cloned()
}

/// The README's row of `v`.
fn row(v: &Variable) -> String {
    format!("| `{}` | {} | {} | {} |", v.name, v.default, v.meaning, v.read_by)
}

/// The rows of the README's table of environment variables (header and separator left out),
/// and the whole table as it should be, for the failure message.
fn readme_rows() -> Vec<String> {
    let readme = include_str!("../../README.md");
    let section = readme.split("\n## Environment variables\n").nth(1).expect("a section \"## Environment variables\"");
    let table: Vec<String> = section
        .lines()
        .skip_while(|l| !l.starts_with('|'))
        .take_while(|l| l.starts_with('|'))
        .map(str::to_string)
        .collect();
    assert!(table.len() > 2, "no table under \"## Environment variables\"");
    assert_eq!(table[0], HEADER, "the table's header");
    table[2..].to_vec()
}

const HEADER: &str = "| variable | default | what it does | read by |";

/// Rows of the README's table that are not ferrogloo's variables.
const FOREIGN: [&str; 1] = ["RUST_LOG"];

#[test]
fn the_readme_table_is_this_table() {
    let rows: Vec<String> = readme_rows().into_iter().filter(|r| !FOREIGN.iter().any(|f| r.contains(f))).collect();
    let want: Vec<String> = TABLE.iter().map(row).collect();
    let expected = format!("{HEADER}\n|---|---|---|---|\n{}", want.join("\n"));
    for v in TABLE {
        let found = rows.iter().find(|r| r.starts_with(&format!("| `{}` |", v.name)));
        let found =
            found.unwrap_or_else(|| panic!("{} is not in the README's table; the table is:\n{expected}", v.name));
        let cells: Vec<&str> = found.split(" | ").collect();
        assert_eq!(cells[1], v.default, "{}'s default in the README; the table is:\n{expected}", v.name);
    }
    assert_eq!(rows, want, "the README's table differs from config's; it should read:\n{expected}");
}

#[test]
fn every_name_is_one_variable_of_ferrogloo_horovod_or_ps_lite() {
    let mut seen = BTreeSet::new();
    for v in TABLE {
        assert!(seen.insert(v.name), "{} twice", v.name);
        assert!(["FERROGLOO_", "HOROVOD_", "DMLC_"].iter().any(|p| v.name.starts_with(p)), "{}", v.name);
        assert!(v.name.bytes().all(|b| b.is_ascii_uppercase() || b.is_ascii_digit() || b == b'_'), "{}", v.name);
        for (what, text) in [("default", v.default), ("meaning", v.meaning), ("reader", v.read_by)] {
            assert!(!text.is_empty() && !text.contains('|') && !text.contains('\n'), "{}'s {what}: {text:?}", v.name);
        }
    }
}

/// The `.rs` files under `dir`, recursively.
fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// The directory a file's submodules live in: its own for `mod.rs` and `lib.rs`, else one
/// named after it.
fn submodule_dir(file: &Path) -> PathBuf {
    let dir = file.parent().unwrap();
    match file.file_name().and_then(|n| n.to_str()) {
        Some("mod.rs" | "lib.rs") => dir.to_path_buf(),
        _ => dir.join(file.file_stem().unwrap()),
    }
}

/// `text` without its unit-test modules (`#[cfg(test)]` on a `mod NAME {` at the start of a
/// line, up to its closing `}` at the start of a line, as rustfmt writes them); and the files
/// of test modules it declares (`#[cfg(test)] mod NAME;`), under `dir`.
fn without_tests(text: &str, dir: &Path) -> (String, Vec<PathBuf>) {
    let lines: Vec<&str> = text.lines().collect();
    let (mut kept, mut test_files) = (String::new(), Vec::new());
    let mut i = 0;
    while i < lines.len() {
        if lines[i].trim() == "#[cfg(test)]" {
            let item = lines.get(i + 1).copied().unwrap_or("");
            let name = item.split("mod ").nth(1).filter(|_| !item.starts_with(' ') && item.contains("mod "));
            match name {
                Some(n) if n.ends_with(';') => {
                    let n = n.trim_end_matches(';');
                    test_files.push(dir.join(format!("{n}.rs")));
                    test_files.push(dir.join(n));
                    i += 2;
                    continue;
                }
                Some(n) if n.ends_with('{') => {
                    let end = (i + 2..lines.len()).find(|&j| lines[j] == "}").expect("the test module's end");
                    i = end + 1;
                    continue;
                }
                _ => {}
            }
        }
        kept.push_str(lines[i]);
        kept.push('\n');
        i += 1;
    }
    (kept, test_files)
}

#[test]
fn only_config_reads_the_environment_or_names_a_variable() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let config = src.join("config");
    let mut files = Vec::new();
    rust_files(&src, &mut files);
    let mut test_only: Vec<PathBuf> = Vec::new();
    let mut checked = Vec::new();
    for file in &files {
        let text = std::fs::read_to_string(file).unwrap();
        let (code, tests) = without_tests(&text, &submodule_dir(file));
        test_only.extend(tests);
        checked.push((file, code));
    }
    let forbidden = ["env::var", "std::env::{", "use std::env;", "getenv", "\"FERROGLOO_", "\"HOROVOD_", "\"DMLC_"];
    let mut found = Vec::new();
    for (file, code) in &checked {
        let is_test =
            file.file_name().is_some_and(|n| n == "tests.rs") || test_only.iter().any(|t| file.starts_with(t));
        if file.starts_with(&config) || is_test {
            continue;
        }
        for (n, line) in code.lines().enumerate() {
            for f in forbidden.iter().filter(|f| line.contains(*f)) {
                found.push(format!("{}:{}: {f}", file.strip_prefix(&src).unwrap().display(), n + 1));
            }
        }
    }
    assert!(found.is_empty(), "the environment read, or a variable named, outside src/config/:\n{}", found.join("\n"));
    // The walk saw the crate (and left out what it should).
    assert!(checked.len() > 50, "{} files", checked.len());
    assert!(test_only.iter().any(|t| t.ends_with("handshake/tests.rs")), "{test_only:?}");
}

#[test]
fn the_walk_leaves_out_test_modules_only() {
    let dir = Path::new("/x/src/a");
    let text = "fn f() {}\n#[cfg(test)]\nmod tests {\n    const X: &str = \"FERROGLOO_Y\";\n}\nfn g() {}\n\
                #[cfg(test)]\npub(crate) mod attacks;\n#[cfg(test)]\nfn h() {}\n";
    let (code, files) = without_tests(text, dir);
    assert_eq!(code, "fn f() {}\nfn g() {}\n#[cfg(test)]\nfn h() {}\n");
    assert_eq!(files, [dir.join("attacks.rs"), dir.join("attacks")]);
    assert_eq!(submodule_dir(Path::new("/x/src/a/mod.rs")), dir);
    assert_eq!(submodule_dir(Path::new("/x/src/b.rs")), Path::new("/x/src/b"));
}

#[test]
fn blank_is_unset_values_are_trimmed_secrets_and_paths_kept() {
    let f = map(&[("A", ""), ("B", "  "), ("C", " x "), ("D", " /p q ")]);
    let v = Vars::lookup(&f);
    for name in ["A", "B", "Z"] {
        assert_eq!(v.text(name), None, "{name}");
        assert!(!v.is_set(name), "{name}");
        assert_eq!(v.parse::<u32>(name, "n").unwrap(), None, "{name}");
    }
    assert_eq!(v.raw("A"), None);
    assert_eq!(v.raw("B").as_deref(), Some("  "));
    assert_eq!(v.text("C").as_deref(), Some("x"));
    assert_eq!(v.raw("C").as_deref(), Some(" x "));
    assert_eq!(v.path("D"), Some(PathBuf::from(" /p q ")));
    let e = v.required("A", "set by X").unwrap_err();
    assert!(matches!(e, Error::InvalidArgument(_)) && e.to_string().contains("A is not set (set by X)"), "{e}");
}

#[test]
fn switches_read_as_documented() {
    let f = map(&[("ONE", " 1 "), ("ZERO", "0"), ("TRUE", "true"), ("YES", "yes"), ("ON", "on"), ("NO", "no")]);
    let v = Vars::lookup(&f);
    let is_one: Vec<bool> = ["ONE", "ZERO", "TRUE", "NO", "UNSET"].map(|n| v.is_one(n)).to_vec();
    assert_eq!(is_one, [true, false, false, false, false]);
    let truthy: Vec<bool> = ["ONE", "ZERO", "TRUE", "YES", "ON", "NO", "UNSET"].map(|n| v.truthy(n)).to_vec();
    assert_eq!(truthy, [true, false, true, true, true, false, false]);
    let on_off: Vec<Option<bool>> = ["ONE", "ZERO", "TRUE", "UNSET"].map(|n| v.on_off(n)).to_vec();
    assert_eq!(on_off, [Some(true), Some(false), None, None]);
}

proptest! {
    /// Whatever the value, a number reader either reads it or says which variable holds what.
    #[test]
    fn a_bad_value_is_an_error_naming_the_variable_and_the_value(value in "\\PC{1,12}") {
        let f = map(&[("FERROGLOO_X", value.as_str())]);
        let v = Vars::lookup(&f);
        let expected = value.trim().parse::<f64>().ok().filter(|x| x.is_finite() && *x > 0.0);
        match v.seconds("FERROGLOO_X", |s| s > 0.0, "a positive number of seconds") {
            Ok(Some(d)) => prop_assert_eq!(Some(d), expected.and_then(|s| Duration::try_from_secs_f64(s).ok())),
            Ok(None) => prop_assert!(value.trim().is_empty()),
            Err(e) => {
                prop_assert!(matches!(e, Error::InvalidArgument(_)));
                let text = format!("FERROGLOO_X={value:?} is not a positive number of seconds");
                prop_assert!(e.to_string().contains(&text), "{} (wanted {})", e, text);
                prop_assert!(expected.and_then(|s| Duration::try_from_secs_f64(s).ok()).is_none());
            }
        }
    }
}

#[test]
fn the_timeout_reads_positive_seconds() {
    let read = |v: &str| crate::context::timeout_in(&Vars::lookup(&map(&[(FERROGLOO_TIMEOUT, v)])));
    assert_eq!(read("").unwrap(), crate::context::DEFAULT_TIMEOUT);
    assert_eq!(read("2.5").unwrap(), Duration::from_millis(2500));
    assert_eq!(read(" 7 ").unwrap(), Duration::from_secs(7));
    for bad in ["0", "-1", "soon", "inf", "NaN", "1e300"] {
        let e = read(bad).unwrap_err();
        let text = format!("FERROGLOO_TIMEOUT={bad:?} is not a positive number of seconds");
        assert!(matches!(e, Error::InvalidArgument(_)) && e.to_string().contains(&text), "{e}");
    }
}

#[test]
fn the_device_s_settings_read_from_a_lookup() {
    let none = map(&[]);
    let v = Vars::lookup(&none);
    assert_eq!(Transport::read(&v).unwrap(), Transport::Auto);
    assert!(!ShmAttr::read(&v).single_copy);
    assert_eq!(ShmAttr::read(&v).collective_copy, crate::device::ShmCopy::Measure);
    let tcp = TcpAttr::read(&v).unwrap();
    assert!(tcp.ip.is_none() && tcp.iface.is_none() && tcp.hostname.is_none());
    let ib = IbAttr::read(&v).unwrap();
    assert_eq!((ib.device, ib.port, ib.gid_index), (None, 1, None));

    let set = map(&[
        (FERROGLOO_TRANSPORT, " TCP "),
        (FERROGLOO_SHM_SINGLE_COPY, "1"),
        (FERROGLOO_ADDR, " 10.1.2.3"),
        (FERROGLOO_IFACE, "eth1"),
        (FERROGLOO_HOSTNAME, "node7"),
        (FERROGLOO_IB_DEVICE, "mlx5_1"),
        (FERROGLOO_IB_PORT, "2"),
        (FERROGLOO_IB_GID_INDEX, "3"),
        (FERROGLOO_HOST_ID, "rack4"),
    ]);
    let v = Vars::lookup(&set);
    assert_eq!(Transport::read(&v).unwrap(), Transport::Tcp);
    assert!(ShmAttr::read(&v).single_copy);
    assert_eq!(ShmAttr::read(&v).collective_copy, crate::device::ShmCopy::Single);
    let off = map(&[(FERROGLOO_SHM_SINGLE_COPY, "0")]);
    let off = ShmAttr::read(&Vars::lookup(&off));
    assert_eq!((off.single_copy, off.collective_copy), (false, crate::device::ShmCopy::Two));
    let tcp = TcpAttr::read(&v).unwrap();
    assert_eq!(tcp.ip, Some("10.1.2.3".parse().unwrap()));
    assert_eq!((tcp.iface.as_deref(), tcp.hostname.as_deref()), (Some("eth1"), Some("node7")));
    let ib = IbAttr::read(&v).unwrap();
    assert_eq!((ib.device.as_deref(), ib.port, ib.gid_index), (Some("mlx5_1"), 2, Some(3)));
    assert_eq!(ib.tcp.ip, tcp.ip);
    assert_eq!(crate::device::host_id_in(&v), "rack4");

    for (name, value, words) in [
        (FERROGLOO_TRANSPORT, "carrier-pigeon", "FERROGLOO_TRANSPORT=\"carrier-pigeon\": unknown transport"),
        (FERROGLOO_ADDR, "10.1.2", "FERROGLOO_ADDR=\"10.1.2\" is not an IP address"),
        (FERROGLOO_IB_PORT, "256", "FERROGLOO_IB_PORT=\"256\" is not a number from 0 to 255"),
        (FERROGLOO_IB_GID_INDEX, "-1", "FERROGLOO_IB_GID_INDEX=\"-1\" is not a number from 0 to 255"),
    ] {
        let f = map(&[(name, value)]);
        let v = Vars::lookup(&f);
        let e = match name {
            FERROGLOO_TRANSPORT => Transport::read(&v).unwrap_err(),
            FERROGLOO_ADDR => TcpAttr::read(&v).unwrap_err(),
            _ => IbAttr::read(&v).unwrap_err(),
        };
        assert!(matches!(e, Error::InvalidArgument(_)), "{e}");
        assert!(e.to_string().contains(words), "{e} (wanted {words:?})");
        assert_eq!(e.to_string().matches("invalid argument").count(), 1, "{e}");
    }
}

#[test]
fn the_engine_s_settings_read_from_a_lookup() {
    let c = EngineConfig::from_vars(&map(&[
        (HOROVOD_FUSION_THRESHOLD, "1000"),
        (FERROGLOO_FUSION_MAX_TENSOR, "10"),
        (HOROVOD_CYCLE_TIME, "2.5"),
        (FERROGLOO_ENGINE_BATCH_GAP_US, "7"),
        (HOROVOD_CACHE_CAPACITY, "0"),
        (HOROVOD_STALL_CHECK_TIME_SECONDS, "5"),
        (HOROVOD_STALL_SHUTDOWN_TIME_SECONDS, "9"),
        (HOROVOD_TIMELINE, "/tmp/t.json"),
        (FERROGLOO_TIMELINE_ALL_RANKS, "yes"),
        (FERROGLOO_ENGINE_AREA, "0"),
        (FERROGLOO_ENGINE_TREE_FROM, "3"),
    ]))
    .unwrap();
    assert!(!c.negotiate_through_area && EngineConfig::default().negotiate_through_area);
    assert_eq!((c.tree_negotiation_from, EngineConfig::default().tree_negotiation_from), (Some(3), None));
    assert_eq!([2, 3, 9].map(|n| c.tree_for(n)), [Some(false), Some(true), Some(true)]);
    let never = EngineConfig { tree_negotiation_from: Some(0), ..c.clone() };
    assert_eq!(never.tree_for(1000), Some(false));
    let one = EngineConfig { tree_negotiation_from: Some(1), ..c.clone() };
    assert_eq!(one.tree_for(1), Some(false), "one rank has nobody to agree with");
    let auto = |v: &str| EngineConfig::from_vars(&map(&[(FERROGLOO_ENGINE_TREE_FROM, v)]));
    assert_eq!(
        (auto("AUTO").unwrap().tree_negotiation_from, auto("8").unwrap().tree_negotiation_from),
        (None, Some(8))
    );
    let e = auto("many").unwrap_err();
    assert!(e.to_string().contains("FERROGLOO_ENGINE_TREE_FROM=\"many\" is not a number of ranks or auto"), "{e}");
    let measured = EngineConfig::default();
    assert_eq!([1, 7, 8, 64].map(|n| measured.tree_for(n)), [Some(false), Some(false), None, None]);
    assert_eq!((c.fusion_threshold, c.fusion_max_tensor, c.cache_capacity), (1000, 10, 0));
    assert_eq!((c.batch_window, c.batch_gap), (Duration::from_micros(2500), Duration::from_micros(7)));
    assert_eq!((c.stall_check, c.stall_shutdown), (Some(Duration::from_secs(5)), Some(Duration::from_secs(9))));
    assert_eq!(c.timeline.as_deref(), Some(Path::new("/tmp/t.json")));
    assert!(c.timeline_all_ranks);
    let off = EngineConfig::from_vars(&map(&[(HOROVOD_STALL_CHECK_DISABLE, "1")])).unwrap();
    assert_eq!(off.stall_check, None);
    let area = |v: &str| EngineConfig::from_vars(&map(&[(FERROGLOO_ENGINE_AREA, v)]));
    assert!(!area("off").unwrap().negotiate_through_area && area("yes").unwrap().negotiate_through_area);
    let e = area("sometimes").unwrap_err();
    assert!(e.to_string().contains("FERROGLOO_ENGINE_AREA=\"sometimes\""), "{e}");
    let e = EngineConfig::from_vars(&map(&[(HOROVOD_CYCLE_TIME, "-1")])).unwrap_err();
    assert!(e.to_string().contains("HOROVOD_CYCLE_TIME=\"-1\" is not a non-negative number"), "{e}");
}

#[test]
fn an_elastic_worker_reads_its_id_and_wait() {
    let read = |pairs: &[(&str, &str)]| crate::launch::elastic::worker_in(&Vars::lookup(&map(pairs)));
    assert_eq!(read(&[(FERROGLOO_WORKER, "3")]).unwrap(), None, "not elastic without FERROGLOO_ELASTIC=1");
    assert_eq!(read(&[(FERROGLOO_ELASTIC, "1"), (FERROGLOO_WORKER, "3")]).unwrap(), Some((3, Duration::from_secs(60))));
    let waits = read(&[(FERROGLOO_ELASTIC, "1"), (FERROGLOO_WORKER, "3"), (FERROGLOO_ELASTIC_TIMEOUT, "0.5")]);
    assert_eq!(waits.unwrap(), Some((3, Duration::from_millis(500))));
    let e = read(&[(FERROGLOO_ELASTIC, "1")]).unwrap_err();
    assert!(e.to_string().contains("FERROGLOO_ELASTIC=1 but FERROGLOO_WORKER is not a worker id"), "{e}");
    let e = read(&[(FERROGLOO_ELASTIC, "1"), (FERROGLOO_WORKER, "3"), (FERROGLOO_ELASTIC_TIMEOUT, "2e9")]).unwrap_err();
    assert!(
        e.to_string().contains("FERROGLOO_ELASTIC_TIMEOUT=\"2e9\" is not a number of seconds from 0 to 1e9"),
        "{e}"
    );
}

#[test]
fn ps_lite_s_variables_read_from_a_lookup() {
    let f = map(&[(DMLC_ROLE, " server "), (DMLC_NUM_WORKER, "4"), (DMLC_NUM_SERVER, "2")]);
    let v = Vars::lookup(&f);
    assert_eq!(crate::ps::role_in(&v).unwrap(), crate::ps::EnvRole::Node(crate::ps::Role::Server));
    let cfg = crate::ps::config_in(&v).unwrap();
    assert_eq!((cfg.workers, cfg.servers), (4, 2));
    let e = crate::ps::config_in(&Vars::lookup(&map(&[(DMLC_NUM_WORKER, "4")]))).unwrap_err();
    assert!(e.to_string().contains("DMLC_NUM_SERVER is not set (a ps-lite job sets DMLC_ROLE,"), "{e}");
    let e = crate::ps::config_in(&Vars::lookup(&map(&[(DMLC_NUM_WORKER, "four")]))).unwrap_err();
    assert!(e.to_string().contains("DMLC_NUM_WORKER=\"four\" is not a number"), "{e}");
    let e = crate::ps::role_in(&Vars::lookup(&map(&[(DMLC_ROLE, "boss")]))).unwrap_err();
    assert!(e.to_string().contains("DMLC_ROLE=\"boss\": worker, server or scheduler"), "{e}");
}

/// A documented default, as a value a variable can be set to (without its backticks).
fn default_of(name: &str) -> &'static str {
    let v = TABLE.iter().find(|v| v.name == name).unwrap_or_else(|| panic!("{name} is not in the table"));
    v.default.trim_matches('`')
}

#[test]
fn setting_a_variable_to_its_documented_default_changes_nothing() {
    let none = map(&[]);
    let unset = Vars::lookup(&none);
    let with = |name: &str| map(&[(name, default_of(name))]);
    let timeout = |f: &dyn Fn(&str) -> Option<String>| crate::context::timeout_in(&Vars::lookup(f)).unwrap();
    assert_eq!(timeout(&with(FERROGLOO_TIMEOUT)), timeout(&none));
    let transport = |f: &dyn Fn(&str) -> Option<String>| Transport::read(&Vars::lookup(f)).unwrap();
    assert_eq!(transport(&with(FERROGLOO_TRANSPORT)), transport(&none));
    assert_eq!(
        ShmAttr::read(&Vars::lookup(&with(FERROGLOO_SHM_SINGLE_COPY))).single_copy,
        ShmAttr::default().single_copy
    );
    assert_eq!(IbAttr::read(&Vars::lookup(&with(FERROGLOO_IB_PORT))).unwrap().port, IbAttr::default().port);
    let elastic = map(&[(FERROGLOO_ELASTIC, "1"), (FERROGLOO_WORKER, "0")]);
    let elastic_default = map(&[
        (FERROGLOO_ELASTIC, "1"),
        (FERROGLOO_WORKER, "0"),
        (FERROGLOO_ELASTIC_TIMEOUT, default_of(FERROGLOO_ELASTIC_TIMEOUT)),
    ]);
    let worker = |f: &dyn Fn(&str) -> Option<String>| crate::launch::elastic::worker_in(&Vars::lookup(f)).unwrap();
    assert_eq!(worker(&elastic_default), worker(&elastic));
    assert_eq!(worker(&with(FERROGLOO_ELASTIC)), None);
    for name in [
        HOROVOD_FUSION_THRESHOLD,
        FERROGLOO_FUSION_MAX_TENSOR,
        HOROVOD_CYCLE_TIME,
        FERROGLOO_ENGINE_BATCH_GAP_US,
        HOROVOD_CACHE_CAPACITY,
        HOROVOD_STALL_CHECK_TIME_SECONDS,
        HOROVOD_STALL_CHECK_DISABLE,
        HOROVOD_STALL_SHUTDOWN_TIME_SECONDS,
        FERROGLOO_TIMELINE_ALL_RANKS,
        FERROGLOO_ENGINE_AREA,
        FERROGLOO_ENGINE_TREE_FROM,
    ] {
        assert_eq!(EngineConfig::from_vars(&with(name)).unwrap(), EngineConfig::default(), "{name}");
    }
    assert_eq!(EngineConfig::read(&unset).unwrap(), EngineConfig::default());
}

/// The variable that makes [`defaults_under_a_full_environment`] run.
const CHILD: &str = "FERROGLOO_TEST_CONFIG_CHILD";

#[test]
#[ignore = "run as a child process by no_default_reads_the_environment"]
fn defaults_under_a_full_environment() {
    if Vars::process().raw(CHILD).is_none() {
        return;
    }
    // The environment is visible here: from_env() sees it...
    assert!(ShmAttr::from_env().single_copy);
    assert_eq!(TcpAttr::from_env().unwrap().ip, Some("10.9.8.7".parse().unwrap()));
    assert_eq!(IbAttr::from_env().unwrap().port, 7);
    assert_eq!(EngineConfig::from_env().unwrap().fusion_threshold, 5);
    assert_eq!(crate::context::default_timeout().unwrap(), Duration::from_secs(3));
    // ...and no default() does.
    assert!(!ShmAttr::default().single_copy);
    assert!(TcpAttr::default().ip.is_none() && TcpAttr::default().iface.is_none());
    assert_eq!((IbAttr::default().port, IbAttr::default().device), (1, None));
    assert_eq!(EngineConfig::default().fusion_threshold, 64 << 20);
    assert_eq!(EngineConfig::default().cache_capacity, 1024);
    assert_eq!(crate::context::DEFAULT_TIMEOUT, Duration::from_secs(30));
    println!("RESULT defaults untouched");
}

#[test]
fn no_default_reads_the_environment() {
    let exe = std::env::current_exe().unwrap();
    let test = "config::tests::defaults_under_a_full_environment";
    let out = std::process::Command::new(exe)
        .args(["--ignored", "--exact", test, "--nocapture", "--test-threads=1"])
        .env(CHILD, "1")
        .env(FERROGLOO_SHM_SINGLE_COPY, "1")
        .env(FERROGLOO_ADDR, "10.9.8.7")
        .env(FERROGLOO_IFACE, "eth9")
        .env(FERROGLOO_IB_PORT, "7")
        .env(FERROGLOO_IB_DEVICE, "sim")
        .env(HOROVOD_FUSION_THRESHOLD, "5")
        .env(HOROVOD_CACHE_CAPACITY, "3")
        .env(FERROGLOO_TIMEOUT, "3")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && stdout.contains("RESULT defaults untouched"),
        "{stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
#[ignore = "run as a child process by a_bad_token_does_not_stop_a_context_nor_a_bad_secret_a_store"]
fn credentials_under_a_bad_environment() {
    if Vars::process().raw(CHILD).is_none() {
        return;
    }
    use crate::device::Device;
    use crate::rendezvous::HashStore;
    let which = Vars::process().raw("FERROGLOO_TEST_BAD").unwrap_or_default();
    if which == "token" {
        // A token that cannot go in a header: contexts form all the same.
        let ctx = crate::Context::builder(0, 1).connect(&HashStore::new(), &Device::in_process());
        assert!(ctx.is_ok(), "{:?}", ctx.err());
        let e = crate::credentials::Credentials::store_token_from_env().unwrap_err().to_string();
        assert!(e.contains("FERROGLOO_STORE_TOKEN"), "{e}");
    } else {
        // A secret file others can read: stores open all the same, contexts refuse to form.
        let store = crate::rendezvous::open("file:/tmp/ferrogloo-config-test-store");
        assert!(store.is_ok(), "{:?}", store.err());
        let e =
            crate::Context::builder(0, 1).connect(&HashStore::new(), &Device::in_process()).unwrap_err().to_string();
        assert!(e.contains("forming the context of rank 0 of 1") && e.contains("FERROGLOO_SECRET_FILE"), "{e}");
    }
    println!("RESULT independent");
}

#[test]
fn a_bad_token_does_not_stop_a_context_nor_a_bad_secret_a_store() {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().unwrap();
    let open_secret = dir.path().join("secret");
    std::fs::write(&open_secret, b"everyone can read this").unwrap();
    std::fs::set_permissions(&open_secret, std::fs::Permissions::from_mode(0o644)).unwrap();
    let exe = std::env::current_exe().unwrap();
    let test = "config::tests::credentials_under_a_bad_environment";
    for (bad, var, value) in [
        ("token", FERROGLOO_STORE_TOKEN, "two words".to_string()),
        ("secret", FERROGLOO_SECRET_FILE, open_secret.display().to_string()),
    ] {
        let out = std::process::Command::new(&exe)
            .args(["--ignored", "--exact", test, "--nocapture", "--test-threads=1"])
            .env(CHILD, "1")
            .env("FERROGLOO_TEST_BAD", bad)
            .env(var, value)
            .env_remove(FERROGLOO_SECRET)
            .output()
            .unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success() && stdout.contains("RESULT independent"),
            "bad {bad}: {stdout}{}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
}
