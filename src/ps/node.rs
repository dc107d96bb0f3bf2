//! A node of the job ([`Node`]): meeting the others (connect, rejoin after a restart), the
//! barriers over roles, and rendezvous timeouts worded as the roles and ids that are missing.
//! A node becomes a worker or a server.

use super::config::{Group, PsConfig, Role, role_name};
use super::{Handler, KvServer, KvWorker, REJOIN};
use crate::Context;
use crate::device::Device;
use crate::error::{Error, Result};
use crate::rendezvous::Store;
use crate::types::Element;
use std::sync::Arc;

/// A node of the job: a server or a worker, connected to every other node.
pub struct Node {
    pub(super) ctx: Arc<Context>,
    pub(super) role: Role,
    pub(super) id: usize,
    pub(super) cfg: PsConfig,
    /// The job's store, when the node keeps it (for workers rejoining).
    pub(super) store: Option<Arc<dyn Store>>,
}

impl std::fmt::Debug for Node {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Node").field("role", &self.role).field("id", &self.id).finish()
    }
}

impl Node {
    /// Joins the job as `role` number `id` (servers `0..servers`, workers `0..workers`),
    /// meeting the others through `store` on `device`. Times out (after `cfg.timeout`) naming
    /// the roles and ids that did not arrive.
    pub fn connect<S: Store + ?Sized>(
        store: &S,
        device: &Device,
        role: Role,
        id: usize,
        cfg: PsConfig,
    ) -> Result<Node> {
        if cfg.servers == 0 || cfg.workers == 0 {
            return Err(Error::invalid(format!(
                "a parameter server needs at least one server and one worker, not {} and {}",
                cfg.servers, cfg.workers
            )));
        }
        let count = match role {
            Role::Worker => cfg.workers,
            Role::Server => cfg.servers,
        };
        if id >= count {
            return Err(Error::invalid(format!("{} {id} of {count}: no such {}", role_name(role), role_name(role))));
        }
        let rank = match role {
            Role::Server => id,
            Role::Worker => cfg.servers + id,
        };
        let ctx = Context::builder(rank, cfg.servers + cfg.workers)
            .timeout(cfg.timeout)
            .connect(store, device)
            .map_err(|e| name_roles(e, &cfg))?;
        Ok(Node { ctx: Arc::new(ctx), role, id, cfg, store: None })
    }

    /// Makes `ctx`, a context the job already has, a node of the parameter server: ranks
    /// `0..servers` are the servers and the workers follow, so this rank is `role` number `id`
    /// exactly when its rank says so. For a context the job formed another way, for example
    /// the survivors' context after a [shrink](Context::shrink) (workers then keep going when
    /// another worker dies, and with [`PsConfig::replication`] a server's backup takes over its
    /// keys, as on a context of their own). Requests time out after `cfg.timeout`, as on any
    /// node; the context keeps its own deadline for the barriers.
    ///
    /// Errors: [`Error::InvalidArgument`] when the context's size is not `servers + workers`
    /// or its rank is not that of `role` number `id`.
    pub fn over(ctx: Context, role: Role, id: usize, cfg: PsConfig) -> Result<Node> {
        if cfg.servers == 0 || cfg.workers == 0 {
            return Err(Error::invalid(format!(
                "a parameter server needs at least one server and one worker, not {} and {}",
                cfg.servers, cfg.workers
            )));
        }
        let n = cfg.servers + cfg.workers;
        let rank = match role {
            Role::Server => id,
            Role::Worker => cfg.servers + id,
        };
        let within = match role {
            Role::Server => id < cfg.servers,
            Role::Worker => id < cfg.workers,
        };
        if ctx.size() != n || ctx.rank() != rank || !within {
            return Err(Error::invalid(format!(
                "{} {id} of a parameter server of {} servers and {} workers is rank {rank} of {n}, but this is \
                 rank {} of a context of {}",
                role_name(role),
                cfg.servers,
                cfg.workers,
                ctx.rank(),
                ctx.size()
            )));
        }
        Ok(Node { ctx: Arc::new(ctx), role, id, cfg, store: None })
    }

    /// [`connect`](Self::connect), keeping the store: a server made this way watches it for
    /// workers that rejoin ([`PsConfig::rejoin_wait`]).
    pub fn connect_shared(
        store: Arc<dyn Store>,
        device: &Device,
        role: Role,
        id: usize,
        cfg: PsConfig,
    ) -> Result<Node> {
        let mut node = Node::connect(&*store, device, role, id, cfg)?;
        node.store = Some(store);
        Ok(node)
    }

    /// Worker `id`, restarted after its process died, joins the running job again: it meets
    /// every server (which must have [`PsConfig::rejoin_wait`] set and still be waiting for
    /// it) in a new context of its own. Handlers hear of it through
    /// [`Handler::worker_joined`].
    pub fn rejoin<S: Store + ?Sized>(store: &S, device: &Device, id: usize, cfg: PsConfig) -> Result<Node> {
        if id >= cfg.workers {
            return Err(Error::invalid(format!("worker {id} of {}: no such worker", cfg.workers)));
        }
        let generation = store.add(&format!("{REJOIN}/{id}/generations"), 1)? - 1;
        store.set(&format!("{REJOIN}/{id}/{generation}"), b"rejoin")?;
        let prefixed = crate::rendezvous::PrefixStore::new(format!("{REJOIN}/{id}/{generation}/"), store);
        let ctx = Context::builder(cfg.servers, cfg.servers + 1)
            .timeout(cfg.timeout)
            .connect(&prefixed, device)
            .map_err(|e| name_roles(e, &cfg))?;
        Ok(Node { ctx: Arc::new(ctx), role: Role::Worker, id, cfg, store: None })
    }

    /// This node's role.
    pub fn role(&self) -> Role {
        self.role
    }

    /// This node's number among its role.
    pub fn id(&self) -> usize {
        self.id
    }

    /// Blocks until every node of `group` (this node's role must be in it) has called
    /// `barrier` with it as often as this one, or the deadline passes naming who did not.
    pub fn barrier(&self, group: Group) -> Result<()> {
        barrier(&self.ctx, &self.cfg, self.role, group)
    }

    /// The node as a worker of values of type `T`.
    pub fn worker<T: Element>(self) -> Result<KvWorker<T>> {
        if self.role != Role::Worker {
            return Err(Error::invalid(format!("server {} cannot be a worker", self.id)));
        }
        KvWorker::start(self)
    }

    /// The node as a server answering requests for values of type `T` with `handler`; call
    /// [`KvServer::run`].
    pub fn server<T: Element, H: Handler<T> + Clone>(self, handler: H) -> Result<KvServer<T, H>> {
        if self.role != Role::Server {
            return Err(Error::invalid(format!("worker {} cannot be a server", self.id)));
        }
        Ok(KvServer::new(self, handler))
    }
}

/// The barrier of `group` on `ctx`, for a node of `role`.
pub(super) fn barrier(ctx: &Context, cfg: &PsConfig, role: Role, group: Group) -> Result<()> {
    let ranks: Vec<usize> = match (group, role) {
        (Group::All, _) => return ctx.barrier(),
        (Group::Workers, Role::Worker) => (cfg.servers..cfg.servers + cfg.workers).collect(),
        (Group::Servers, Role::Server) => (0..cfg.servers).collect(),
        (g, r) => return Err(Error::invalid(format!("a {} is not in the group {g:?}", role_name(r)))),
    };
    ctx.subgroup(&ranks)?.barrier().map_err(|e| name_roles(in_context(e, ctx), cfg))
}

/// `e` with the ranks a timeout waited for as ranks of `ctx` (errors name ranks of the mesh's
/// context, which a shrunk or sub-grouped context renumbers); others as they are.
fn in_context(e: Error, ctx: &Context) -> Error {
    match e {
        Error::Timeout { op, ranks, keys, waited } => Error::Timeout {
            op,
            ranks: ranks.iter().map(|&w| ctx.rank_of_world(w).unwrap_or(w)).collect(),
            keys,
            waited,
        },
        other => other,
    }
}

/// A rendezvous timeout in the parameter server's words: which roles are missing.
fn name_roles(e: Error, cfg: &PsConfig) -> Error {
    match e {
        Error::Timeout { op, ranks, keys, waited } if !ranks.is_empty() => {
            let servers: Vec<usize> = ranks.iter().copied().filter(|&r| r < cfg.servers).collect();
            let workers: Vec<usize> = ranks.iter().filter(|&&r| r >= cfg.servers).map(|r| r - cfg.servers).collect();
            let mut parts = Vec::new();
            if !servers.is_empty() {
                parts.push(format!("{} of {} servers missing (servers {servers:?})", servers.len(), cfg.servers));
            }
            if !workers.is_empty() {
                parts.push(format!("{} of {} workers missing (workers {workers:?})", workers.len(), cfg.workers));
            }
            Error::Timeout { op: format!("parameter-server {op}: {}", parts.join(", ")), ranks, keys, waited }
        }
        other => other,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn a_rendezvous_timeout_names_the_missing_roles_and_ids() {
        let cfg = PsConfig::new(3, 2);
        let e = Error::Timeout { op: "rendezvous".into(), ranks: vec![1, 3], keys: vec![], waited: Duration::ZERO };
        let Error::Timeout { op, ranks, .. } = name_roles(e, &cfg) else { panic!("not a timeout") };
        assert_eq!(
            op,
            "parameter-server rendezvous: 1 of 2 servers missing (servers [1]), 1 of 3 workers missing (workers [1])"
        );
        assert_eq!(ranks, [1, 3], "the ranks stay for callers that read them");
        let other = Error::invalid("x");
        assert_eq!(name_roles(other.clone(), &cfg).to_string(), other.to_string(), "other errors pass unchanged");
    }
}
