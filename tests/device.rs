//! Choosing where a device listens.

use ferrogloo::Error;
use ferrogloo::device::{Device, Family, IbAttr, TcpAttr, Transport};
use std::net::{IpAddr, Ipv4Addr, TcpListener};

#[test]
fn interface_hostname_and_ip_select_the_address() {
    let by_iface = Device::tcp(&TcpAttr::iface("lo")).unwrap();
    assert_eq!(by_iface.local_addr().expect("a TCP device").ip(), IpAddr::V4(Ipv4Addr::LOCALHOST));
    let by_host = Device::tcp(&TcpAttr::hostname("localhost")).unwrap();
    assert!(by_host.local_addr().expect("a TCP device").ip().is_loopback());
    let by_ip = Device::tcp(&TcpAttr::ip("127.0.0.2".parse().unwrap())).unwrap();
    assert_eq!(by_ip.local_addr().expect("a TCP device").ip().to_string(), "127.0.0.2");
    assert_ne!(by_iface.local_addr().expect("a TCP device").port(), 0);
}

#[test]
fn a_port_range_skips_ports_in_use() {
    // Occupy the first port of a range; the device takes the next free one.
    let taken = TcpListener::bind("127.0.0.1:0").unwrap();
    let p = taken.local_addr().unwrap().port();
    if p == u16::MAX {
        return;
    }
    let attr = TcpAttr { ports: p..=p.saturating_add(20), ..TcpAttr::loopback() };
    let dev = Device::tcp(&attr).unwrap();
    assert!(
        dev.local_addr().expect("a TCP device").port() > p && dev.local_addr().expect("a TCP device").port() <= p + 20
    );
    // A range with every port taken is an I/O error naming the address.
    let only = TcpAttr { ports: p..=p, ..TcpAttr::loopback() };
    assert!(matches!(Device::tcp(&only), Err(Error::Io { .. })));
}

#[test]
fn bad_device_attributes_are_clear_errors() {
    let e = Device::tcp(&TcpAttr::iface("no-such-if0")).unwrap_err();
    assert!(
        matches!(e, Error::InvalidArgument(ref m) if m.contains("no-such-if0") && m.contains("lo (127.0.0.1)")),
        "{e}"
    );
    let e = Device::tcp(&TcpAttr::ip("0.0.0.0".parse().unwrap())).unwrap_err();
    assert!(matches!(e, Error::InvalidArgument(_)), "{e}");
    let v6_on_v4_iface = TcpAttr { family: Family::V6, ..TcpAttr::ip("127.0.0.1".parse().unwrap()) };
    // An explicit IP wins over the family.
    assert!(Device::tcp(&v6_on_v4_iface).unwrap().local_addr().expect("a TCP device").is_ipv4());
}

#[test]
fn by_default_a_device_listens_where_other_hosts_can_reach_it() {
    // Gloo's rule: the host name's address unless it is loopback, else the default route's
    // interface; loopback only on a host with neither.
    let route = std::fs::read_to_string("/proc/net/route").unwrap_or_default();
    let has_default_route = route.lines().skip(1).any(|l| l.split_whitespace().nth(1) == Some("00000000"));
    let ip = TcpAttr::default().resolve().unwrap();
    if has_default_route {
        assert!(!ip.is_loopback(), "default address {ip} with a default route present");
        let dev = Device::tcp(&TcpAttr::default()).unwrap();
        assert_eq!(dev.local_addr().expect("a TCP device").ip(), ip);
    } else {
        eprintln!("SKIPPED: no default route; the default is {ip}");
    }
    assert_eq!(Device::loopback().unwrap().local_addr().expect("a TCP device").ip(), IpAddr::V4(Ipv4Addr::LOCALHOST));
}

#[test]
fn the_host_identity_is_stable_and_names_the_host() {
    let id = ferrogloo::device::host_id();
    assert_eq!(id, ferrogloo::device::host_id());
    if std::env::var_os("FERROGLOO_HOST_ID").is_none() {
        let name = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap_or_default();
        assert!(id.starts_with(&format!("{}/", name.trim())), "{id:?} does not start with the host name");
    }
    assert_eq!(Device::in_process().backend_name(), "memory");
    assert!(Device::in_process().local_addr().is_none());
}

/// Without the cargo feature, the ibverbs transport is refused naming the feature.
#[cfg(not(feature = "ibverbs"))]
#[test]
fn without_the_feature_ibverbs_is_refused_naming_it() {
    for made in [Device::ibverbs(&IbAttr::default()), Device::with_transport(Transport::Ibverbs, &TcpAttr::loopback())]
    {
        match made {
            Err(Error::Unsupported { what, feature }) => {
                assert!(what.contains("ibverbs"), "{what}");
                assert_eq!(feature.as_deref(), Some("ibverbs"));
            }
            other => panic!("expected Unsupported naming the feature, got {other:?}"),
        }
    }
}

/// With the feature and no RDMA device on the host, every way to ask for the real provider
/// says that no RDMA device was found: no panic, no hang.
#[cfg(feature = "ibverbs")]
#[test]
fn with_the_feature_and_no_rdma_device_every_entry_point_says_so() {
    let devices = std::fs::read_dir("/sys/class/infiniband").map(|d| d.count()).unwrap_or(0);
    if devices > 0 {
        eprintln!("skipped: this host has {devices} RDMA device(s); the no-device path cannot be checked here");
        return;
    }
    let t = std::time::Instant::now();
    let attempts = [
        ("Device::ibverbs(default)", Device::ibverbs(&IbAttr::default())),
        ("Device::ibverbs(mlx5_0)", Device::ibverbs(&IbAttr { device: Some("mlx5_0".into()), ..IbAttr::default() })),
        ("Device::ibverbs(port 2)", Device::ibverbs(&IbAttr { port: 2, ..IbAttr::default() })),
        ("Device::with_transport(Ibverbs)", Device::with_transport(Transport::Ibverbs, &TcpAttr::loopback())),
    ];
    for (how, made) in attempts {
        match made {
            Err(e) => assert!(e.to_string().contains("no RDMA device was found"), "{how}: {e}"),
            Ok(d) => panic!("{how}: a device ({}) on a host without RDMA devices", d.backend_name()),
        }
    }
    assert!(t.elapsed() < std::time::Duration::from_secs(5), "took {:?}", t.elapsed());
    // The simulated provider needs no device.
    let sim = Device::ibverbs(&IbAttr { device: Some("sim".into()), ..IbAttr::default() });
    assert_eq!(sim.map(|d| d.backend_name().to_string()).ok().as_deref(), Some("ibverbs"));
}

#[test]
fn a_device_made_from_a_transport_has_the_transport_s_name_and_parsing_takes_names_and_aliases() {
    for t in [Transport::Tcp, Transport::Shm, Transport::Auto] {
        let d = Device::with_transport(t, &TcpAttr::loopback()).unwrap();
        assert_eq!(d.backend_name(), t.name());
        assert_eq!(t.name().parse::<Transport>().unwrap(), t);
    }
    for (alias, t) in [("auto", Transport::Auto), ("ibverbs", Transport::Ibverbs), ("RDMA", Transport::Ibverbs)] {
        assert_eq!(alias.parse::<Transport>().unwrap(), t);
    }
    assert_eq!(Transport::Ibverbs.name(), "ibverbs+shm");
    let e = "carrier-pigeon".parse::<Transport>().unwrap_err().to_string();
    assert!(e.contains("carrier-pigeon") && e.contains("tcp+shm"), "{e}");
}

#[test]
fn devices_combine_a_same_host_half_with_a_remote_half_and_nothing_else() {
    let shm = || Device::shared_memory(&ferrogloo::device::ShmAttr::default());
    let tcp = Device::loopback().unwrap();
    let both = Device::combine(&shm(), &tcp).unwrap();
    assert_eq!(both.backend_name(), "tcp+shm");
    assert_eq!(both.local_addr(), tcp.local_addr(), "the remote half's listener");
    // Threads of one process do not reach the other processes of a host; shared memory does
    // not reach other hosts; a combined device is no half.
    for (same, other, why) in [
        (Device::in_process(), tcp.clone(), "does not connect the processes of one host"),
        (shm(), shm(), "cannot be the half of a device that reaches other hosts"),
        (shm(), both.clone(), "cannot be the half of a device that reaches other hosts"),
    ] {
        match Device::combine(&same, &other) {
            Err(Error::InvalidArgument(m)) => assert!(m.contains(why), "{m}"),
            other => panic!("expected a refusal saying {why:?}, got {other:?}"),
        }
    }
}

#[test]
fn a_device_has_this_host_s_identity_until_told_another() {
    let d = Device::in_process();
    assert_eq!(d.host(), ferrogloo::device::host_id());
    let moved = d.clone().on_host("pretend-host-7");
    assert_eq!(moved.host(), "pretend-host-7");
    assert_eq!(d.host(), ferrogloo::device::host_id(), "the original keeps its identity");
    assert_eq!(moved.backend_name(), "memory");
}
