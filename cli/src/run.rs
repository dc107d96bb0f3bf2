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

/// Parses `-H host1:4,host2:4` (a host without `:N` takes one slot).
pub fn parse_hosts(spec: &str) -> Result<Vec<Host>> {
    spec.split(',')
        .map(str::trim)
        .filter(|h| !h.is_empty())
        .map(|h| {
            // An IPv6 address in brackets keeps its colons: [fd00::1]:4.
            let (name, slots) = match h.rsplit_once(':') {
                Some((n, s)) if !n.ends_with(':') && (n.starts_with('[') == n.ends_with(']')) && !s.contains(']') => {
                    let slots = s
                        .parse::<usize>()
                        .map_err(|_| Error::invalid(format!("-H: {h:?}: the slot count {s:?} is not a number")))?;
                    (n, slots)
                }
                _ => (h, 1),
            };
            let name = name.trim_start_matches('[').trim_end_matches(']');
            if name.is_empty() || slots == 0 {
                return Err(Error::invalid(format!("-H: {h:?} names no host, or gives it no slot")));
            }
            Ok(Host { name: name.to_string(), slots })
        })
        .collect()
}

/// Parses a host file: one host per line, `name slots=N` (or just `name`: one slot); `#`
/// starts a comment.
pub fn parse_hostfile(text: &str) -> Result<Vec<Host>> {
    let mut hosts = Vec::new();
    for (i, line) in text.lines().enumerate() {
        let line = line.split('#').next().unwrap_or("").trim();
        if line.is_empty() {
            continue;
        }
        let mut words = line.split_whitespace();
        let name = words.next().unwrap_or_default().to_string();
        let mut slots = 1;
        for w in words {
            match w.split_once('=') {
                Some(("slots" | "max_slots", n)) => {
                    slots = n.parse().map_err(|_| {
                        Error::invalid(format!("host file line {}: slots={n:?} is not a number", i + 1))
                    })?;
                }
                _ => return Err(Error::invalid(format!("host file line {}: {w:?} is not slots=N", i + 1))),
            }
        }
        if slots == 0 {
            return Err(Error::invalid(format!("host file line {}: {name} has no slot", i + 1)));
        }
        hosts.push(Host { name, slots });
    }
    Ok(hosts)
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
/// first host, and so on. More ranks than slots is an error naming both.
pub fn place(np: usize, hosts: &[Host]) -> Result<Vec<Placement>> {
    let total: usize = hosts.iter().map(|h| h.slots).sum();
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
        let f = parse_hostfile("# cluster\nnode1 slots=4\n\nnode2   # one\nnode3 max_slots=2\n").unwrap();
        let names: Vec<(&str, usize)> = f.iter().map(|h| (h.name.as_str(), h.slots)).collect();
        assert_eq!(names, [("node1", 4), ("node2", 1), ("node3", 2)]);
        let e = parse_hostfile("node1 cpus=4").unwrap_err();
        assert!(e.to_string().contains("line 1"), "{e}");
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
