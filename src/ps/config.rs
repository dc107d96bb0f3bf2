//! The job's shape and behaviour: node roles, how keys map to servers (and which server backs
//! up which), the configuration every node shares, and the groups a barrier waits for.

use std::sync::Arc;
use std::time::Duration;

/// A node's role.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Role {
    /// Pushes and pulls.
    Worker,
    /// Owns a shard of the keys.
    Server,
}

/// A role as messages name it.
pub(super) fn role_name(role: Role) -> &'static str {
    match role {
        Role::Worker => "worker",
        Role::Server => "server",
    }
}

/// Which server owns a key.
#[derive(Clone, Default)]
#[non_exhaustive]
pub enum Sharding {
    /// A hash of the key (dense small keys spread over every server).
    #[default]
    Hash,
    /// Equal ranges of the `u64` key space (ps-lite's way: small keys all land on server 0).
    Range,
    /// `f(key, servers)`, which must be below `servers` and the same on every node.
    Custom(Arc<dyn Fn(u64, usize) -> usize + Send + Sync>),
}

impl std::fmt::Debug for Sharding {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Sharding::Hash => "Hash",
            Sharding::Range => "Range",
            Sharding::Custom(_) => "Custom",
        })
    }
}

impl Sharding {
    /// The server of `key` among `servers`.
    pub fn server_of(&self, key: u64, servers: usize) -> usize {
        let s = servers.max(1);
        match self {
            Sharding::Hash => (splitmix(key) % s as u64) as usize,
            Sharding::Range => ((u128::from(key) * s as u128) >> 64) as usize,
            Sharding::Custom(f) => f(key, s),
        }
    }
}

fn splitmix(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

/// The server that keeps a copy of server `s`'s state.
pub(super) fn backup_of(s: usize, servers: usize) -> usize {
    (s + 1) % servers.max(1)
}

/// The job's shape and behaviour; every node must use the same.
#[derive(Debug, Clone)]
pub struct PsConfig {
    /// Number of workers.
    pub workers: usize,
    /// Number of servers.
    pub servers: usize,
    /// Deadline of the rendezvous and of each request.
    pub timeout: Duration,
    /// How keys map to servers.
    pub sharding: Sharding,
    /// How often servers tell workers they are alive (`None`: never).
    pub heartbeat: Option<Duration>,
    /// Keep a copy of each server's state on the next server (its backup), which answers for
    /// it once it dies. Workers send every push to both; handlers must be deterministic in
    /// what they store (the ones here are; float sums may differ in the last bits).
    pub replication: bool,
    /// How long a server waits for a worker whose process died to come back
    /// ([`Node::rejoin`]) before counting it gone (`None`: it is gone at once). Needs a
    /// node made with [`Node::connect_shared`] (or [`Node::from_env`]), which keeps the store.
    ///
    /// [`Node::rejoin`]: super::Node::rejoin
    /// [`Node::connect_shared`]: super::Node::connect_shared
    /// [`Node::from_env`]: super::Node::from_env
    pub rejoin_wait: Option<Duration>,
}

impl PsConfig {
    /// `workers` workers and `servers` servers, hash sharding, 30 s deadlines, a heartbeat
    /// every second.
    pub fn new(workers: usize, servers: usize) -> Self {
        PsConfig {
            workers,
            servers,
            timeout: Duration::from_secs(30),
            sharding: Sharding::Hash,
            heartbeat: Some(Duration::from_secs(1)),
            replication: false,
            rejoin_wait: None,
        }
    }

    /// Whether servers keep copies of each other's state: replication asked for, and another
    /// server to keep the copy.
    pub(super) fn replicates(&self) -> bool {
        self.replication && self.servers > 1
    }
}

/// The nodes a [`Node::barrier`] waits for.
///
/// [`Node::barrier`]: super::Node::barrier
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Group {
    /// Every worker.
    Workers,
    /// Every server.
    Servers,
    /// Everyone.
    All,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_server_is_backed_up_by_the_next_and_the_last_by_the_first() {
        assert_eq!((0..3).map(|s| backup_of(s, 3)).collect::<Vec<_>>(), [1, 2, 0]);
        assert_eq!(backup_of(0, 0), 0, "no servers: no division by zero");
        let mut cfg = PsConfig::new(2, 1);
        cfg.replication = true;
        assert!(!cfg.replicates(), "one server has nobody to keep its copy");
        cfg.servers = 2;
        assert!(cfg.replicates());
    }
}
