//! What `ferrogloo-run` decides before it starts anything: the hosts and their slots, and which
//! rank goes where.

use ferrogloo::{Error, Result};

/// A host and how many ranks it takes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Host {
    /// The name or address to reach it by (`localhost` for this machine).
    pub name: String,
    /// How many ranks it takes.
    pub slots: usize,
}

/// Parses `-H host1:4,host2:4`: hosts separated by commas, each `NAME` (one slot) or
/// `NAME:SLOTS`.
///
/// An IPv6 address has colons of its own, so a name with more than one `:` carries a slot
/// count only in brackets: `[2001:db8::5]:4` is four slots on `2001:db8::5`. Unbracketed,
/// `2001:db8::5` (or `2001:db8:0:0:0:0:0:5`) is the address alone, with one slot: it is never
/// split at its last colon. Entries that name the same machine twice are kept apart here;
/// [`merge_same`] joins them.
pub fn parse_hosts(spec: &str) -> Result<Vec<Host>> {
    spec.split(',').map(str::trim).filter(|h| !h.is_empty()).map(parse_host).collect()
}

/// One entry of `-H`: `name`, `name:N`, `[v6]`, `[v6]:N` or an unbracketed IPv6 address.
fn parse_host(h: &str) -> Result<Host> {
    let bad = |why: String| Error::invalid(format!("-H: {h:?}: {why}"));
    let (name, slots) = if let Some(inner) = h.strip_prefix('[') {
        let (name, after) = inner.split_once(']').ok_or_else(|| bad("the '[' is never closed".into()))?;
        if after.is_empty() {
            (name, None)
        } else {
            let slots = after.strip_prefix(':').ok_or_else(|| bad(format!("{after:?} after the ']' is not :SLOTS")))?;
            (name, Some(slots))
        }
    } else if h.matches(':').count() > 1 {
        // An IPv6 address, alone: only a bracketed one carries a slot count.
        (h, None)
    } else {
        match h.split_once(':') {
            Some((name, slots)) => (name, Some(slots)),
            None => (h, None),
        }
    };
    if name.is_empty() || name.contains(['[', ']']) {
        return Err(bad("names no host".into()));
    }
    let slots = match slots {
        None => 1,
        Some(s) => s.parse::<usize>().map_err(|_| bad(format!("the slot count {s:?} is not a number")))?,
    };
    if slots == 0 {
        return Err(bad("gives the host no slot".into()));
    }
    Ok(Host { name: name.to_string(), slots })
}

/// Parses a host file: one host per line, `name slots=N` (or just `name`: one slot); `#`
/// starts a comment. `slots=N` is the host's count of ranks. `max_slots=M` (Open MPI's cap on
/// oversubscription) is accepted and changes nothing unless it is smaller than the slots: then
/// the host takes `M`. Entries that name the same machine twice are kept apart here;
/// [`merge_same`] joins them.
pub fn parse_hostfile(text: &str) -> Result<Vec<Host>> {
    let mut hosts = Vec::new();
    for (i, line) in text.lines().enumerate() {
        let line = line.split('#').next().unwrap_or("").trim();
        let mut words = line.split_whitespace();
        let Some(name) = words.next() else {
            continue;
        };
        let (mut slots, mut max_slots) = (1usize, None::<usize>);
        for w in words {
            let number = |key: &str, n: &str| {
                n.parse::<usize>().map_err(|_| {
                    Error::invalid(format!("host file line {}: {name}: {key}={n:?} is not a number", i + 1))
                })
            };
            match w.split_once('=') {
                Some(("slots", n)) => slots = number("slots", n)?,
                Some(("max_slots", n)) => max_slots = Some(number("max_slots", n)?),
                _ => {
                    return Err(Error::invalid(format!(
                        "host file line {}: {name}: {w:?} is not slots=N or max_slots=M",
                        i + 1
                    )));
                }
            }
        }
        let slots = max_slots.map_or(slots, |m| slots.min(m));
        if slots == 0 {
            return Err(Error::invalid(format!("host file line {}: {name} has no slot", i + 1)));
        }
        hosts.push(Host { name: name.to_string(), slots });
    }
    Ok(hosts)
}

/// Joins the entries of `hosts` that name the same machine into one, at the place of the
/// first, with their slots summed: every entry that is this machine ([`is_local`]:
/// `localhost`, `127.0.0.1`, its name, ...), and entries of the same name (names compared
/// without regard to case, addresses as addresses: `2001:db8::5` is `2001:db8:0:0:0:0:0:5`).
/// Call it before [`place`], so that ranks sharing a machine get local ranks and a local size
/// that count all of them: `-H localhost:2,127.0.0.1:2` is one host of four slots, not two of
/// two.
pub fn merge_same(hosts: Vec<Host>) -> Vec<Host> {
    merge_same_by(hosts, is_local)
}

/// [`merge_same`], with `local` saying which names are this machine.
fn merge_same_by(hosts: Vec<Host>, local: impl Fn(&str) -> bool) -> Vec<Host> {
    // Per merged host: its key, and whether it is this machine.
    let mut seen: Vec<(String, bool)> = Vec::with_capacity(hosts.len());
    let mut out: Vec<Host> = Vec::with_capacity(hosts.len());
    for h in hosts {
        let key = machine_key(&h.name);
        let here = local(&h.name);
        match seen.iter().position(|(k, l)| *k == key || (here && *l)) {
            Some(i) => out[i].slots = out[i].slots.saturating_add(h.slots),
            None => {
                seen.push((key, here));
                out.push(h);
            }
        }
    }
    out
}

/// What two names of one machine share: the address, for an IP address in any of its
/// spellings, else the name in lower case (this machine's names are not joined: see
/// [`machine_of`]).
fn machine_key(name: &str) -> String {
    let bare = name.strip_prefix('[').and_then(|n| n.strip_suffix(']')).unwrap_or(name);
    match bare.parse::<std::net::IpAddr>() {
        Ok(ip) => ip.to_string(),
        Err(_) => bare.to_ascii_lowercase(),
    }
}

/// One key for every name of the machine `name` is: `this machine` for all of this
/// machine's names ([`is_local`]), else the address (any spelling) or the name in lower case. (May resolve the name.)
pub fn machine_of(name: &str) -> String {
    if is_local(name) { "this machine".to_string() } else { machine_key(name) }
}

/// Where one rank runs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Placement {
    /// The host (an index into the host list).
    pub host: usize,
    /// Its index among the ranks of its host.
    pub local_rank: usize,
    /// How many ranks its host runs.
    pub local_size: usize,
    /// Its host's index among the hosts that run ranks.
    pub cross_rank: usize,
}

/// Places `np` ranks host by host, filling each host's slots in order: ranks 0..slots₀ on the
/// first host, and so on. More ranks than slots is an error naming both. Each entry of `hosts`
/// is taken for a machine of its own: join entries naming one machine with [`merge_same`]
/// first.
pub fn place(np: usize, hosts: &[Host]) -> Result<Vec<Placement>> {
    let total = hosts.iter().fold(0usize, |sum, h| sum.saturating_add(h.slots));
    if np > total {
        return Err(Error::invalid(format!(
            "-np {np} is more ranks than the {total} slots of the hosts ({})",
            hosts.iter().map(|h| format!("{}:{}", h.name, h.slots)).collect::<Vec<_>>().join(",")
        )));
    }
    let mut out = Vec::with_capacity(np);
    let mut left = np;
    for (i, h) in hosts.iter().enumerate() {
        if left == 0 {
            break;
        }
        let here = h.slots.min(left);
        let cross = out.last().map_or(0, |p: &Placement| p.cross_rank + 1);
        out.extend((0..here).map(|local_rank| Placement { host: i, local_rank, local_size: here, cross_rank: cross }));
        left -= here;
    }
    Ok(out)
}

/// Whether `name` is this machine: `localhost`, a loopback address, this host's name, or an
/// address of one of its interfaces.
pub fn is_local(name: &str) -> bool {
    use std::net::ToSocketAddrs;
    if name == "localhost" {
        return true;
    }
    let mine = local_addresses();
    let host = nix::unistd::gethostname().ok().and_then(|h| h.into_string().ok());
    if host.as_deref() == Some(name) {
        return true;
    }
    match (name, 0).to_socket_addrs() {
        Ok(addrs) => addrs.map(|a| a.ip()).any(|ip| ip.is_loopback() || mine.contains(&ip)),
        Err(_) => false,
    }
}

/// This machine's interface addresses.
fn local_addresses() -> Vec<std::net::IpAddr> {
    nix::ifaddrs::getifaddrs()
        .map(|addrs| {
            addrs
                .filter_map(|a| a.address)
                .filter_map(|a| {
                    a.as_sockaddr_in()
                        .map(|v4| std::net::IpAddr::V4(v4.ip()))
                        .or_else(|| a.as_sockaddr_in6().map(|v6| std::net::IpAddr::V6(v6.ip())))
                })
                .collect()
        })
        .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hosts_parse_from_the_command_line_and_from_files() {
        let h = parse_hosts("a:2, b ,[fd00::1]:3,10.0.0.1:1").unwrap();
        let names: Vec<(&str, usize)> = h.iter().map(|h| (h.name.as_str(), h.slots)).collect();
        assert_eq!(names, [("a", 2), ("b", 1), ("fd00::1", 3), ("10.0.0.1", 1)]);
        for bad in ["a:x", "a:0", ":3"] {
            assert!(parse_hosts(bad).is_err(), "{bad}");
        }
        let f = parse_hostfile("# cluster\nnode1 slots=4\n\nnode2   # one\nnode3 slots=2\n").unwrap();
        let names: Vec<(&str, usize)> = f.iter().map(|h| (h.name.as_str(), h.slots)).collect();
        assert_eq!(names, [("node1", 4), ("node2", 1), ("node3", 2)]);
        let e = parse_hostfile("node1 cpus=4").unwrap_err();
        assert!(e.to_string().contains("line 1"), "{e}");
    }

    #[test]
    fn an_ipv6_address_carries_slots_only_in_brackets() {
        let h = parse_hosts("2001:db8::5,2001:db8:0:0:0:0:0:5,[2001:db8::5]:4,[::1],fe80::1%eth0,h:2").unwrap();
        let names: Vec<(&str, usize)> = h.iter().map(|h| (h.name.as_str(), h.slots)).collect();
        assert_eq!(
            names,
            [
                ("2001:db8::5", 1),
                ("2001:db8:0:0:0:0:0:5", 1),
                ("2001:db8::5", 4),
                ("::1", 1),
                ("fe80::1%eth0", 1),
                ("h", 2)
            ]
        );
        for (bad, words) in [
            ("[2001:db8::5", "the '[' is never closed"),
            ("[2001:db8::5]4", "after the ']' is not :SLOTS"),
            ("[2001:db8::5]:x", "the slot count \"x\" is not a number"),
            ("[2001:db8::5]:0", "gives the host no slot"),
            ("[]:2", "names no host"),
            ("a]:2", "names no host"),
            ("a:", "the slot count \"\" is not a number"),
        ] {
            let e = parse_hosts(bad).expect_err(bad);
            let text = e.to_string();
            assert!(text.contains(&format!("-H: {bad:?}")) && text.contains(words), "{text} (wanted {words:?})");
        }
    }

    #[test]
    fn max_slots_caps_slots_and_never_replaces_them() {
        let f = parse_hostfile("a slots=4 max_slots=8\nb max_slots=8 slots=4\nc slots=4 max_slots=2\nd max_slots=3\n")
            .unwrap();
        let names: Vec<(&str, usize)> = f.iter().map(|h| (h.name.as_str(), h.slots)).collect();
        assert_eq!(names, [("a", 4), ("b", 4), ("c", 2), ("d", 1)]);
        for (bad, words) in [
            ("a slots=4 max_slots=0", "line 1: a has no slot"),
            ("a\nb max_slots=x", "line 2: b: max_slots=\"x\" is not a number"),
            ("a slots=-1", "line 1: a: slots=\"-1\" is not a number"),
            ("a slots:4", "line 1: a: \"slots:4\" is not slots=N"),
        ] {
            let e = parse_hostfile(bad).expect_err(bad);
            assert!(e.to_string().contains(words), "{e} (wanted {words:?})");
        }
    }

    #[test]
    fn entries_naming_one_machine_merge_before_placement() {
        let local = |n: &str| ["localhost", "127.0.0.1", "me"].contains(&n);
        let hosts = parse_hosts("localhost:2,b:1,127.0.0.1:2,B:3,2001:db8::5,[2001:db8:0:0:0:0:0:5]:2,me").unwrap();
        let merged = merge_same_by(hosts, local);
        let names: Vec<(&str, usize)> = merged.iter().map(|h| (h.name.as_str(), h.slots)).collect();
        assert_eq!(names, [("localhost", 5), ("b", 4), ("2001:db8::5", 3)]);
        // Four ranks on one machine are local ranks 0-3 of 4, not twice 0-1 of 2.
        let p = place(4, &merge_same(parse_hosts("localhost:2,127.0.0.1:2").unwrap())).unwrap();
        let got: Vec<(usize, usize, usize, usize)> =
            p.iter().map(|p| (p.host, p.local_rank, p.local_size, p.cross_rank)).collect();
        assert_eq!(got, [(0, 0, 4, 0), (0, 1, 4, 0), (0, 2, 4, 0), (0, 3, 4, 0)]);
        // Distinct machines stay apart, and huge slot counts saturate instead of overflowing.
        let many = format!("x:{},y:{},x:1", usize::MAX, usize::MAX);
        let merged = merge_same_by(parse_hosts(&many).unwrap(), |_| false);
        assert_eq!(merged.iter().map(|h| h.slots).collect::<Vec<_>>(), [usize::MAX, usize::MAX]);
        assert_eq!(place(3, &merged).unwrap().len(), 3);
    }

    #[test]
    fn ranks_fill_hosts_in_order() {
        let hosts = parse_hosts("a:2,b:3,c:4").unwrap();
        let p = place(6, &hosts).unwrap();
        let got: Vec<(usize, usize, usize, usize)> =
            p.iter().map(|p| (p.host, p.local_rank, p.local_size, p.cross_rank)).collect();
        assert_eq!(got, [(0, 0, 2, 0), (0, 1, 2, 0), (1, 0, 3, 1), (1, 1, 3, 1), (1, 2, 3, 1), (2, 0, 1, 2)]);
        let e = place(10, &hosts).unwrap_err();
        assert!(e.to_string().contains("10 is more ranks than the 9 slots"), "{e}");
    }

    #[test]
    fn this_machine_is_local_and_a_stranger_is_not() {
        assert!(is_local("localhost"));
        assert!(is_local("127.0.0.1"));
        assert!(!is_local("192.0.2.123"));
    }
}
