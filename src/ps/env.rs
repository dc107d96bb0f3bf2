//! ps-lite's environment: `DMLC_ROLE`, `DMLC_NUM_WORKER`, `DMLC_NUM_SERVER`,
//! `DMLC_PS_ROOT_URI`, `DMLC_PS_ROOT_PORT`, `DMLC_INTERFACE`, so that launch scripts written
//! for ps-lite start a ferrogloo job unchanged.
//!
//! The scheduler (`DMLC_ROLE=scheduler`) has one job here: it serves the store (a PyTorch
//! TCPStore at `DMLC_PS_ROOT_URI:DMLC_PS_ROOT_PORT`) the others meet through, until every
//! node has connected and then until every node has gone (a restarted worker rejoins through
//! it meanwhile). Nodes take their number from `DMLC_WORKER_ID`/`DMLC_SERVER_ID` when
//! set, else in order of arrival (a counter in the store). `FERROGLOO_STORE`, when set, is
//! used instead of the scheduler's store.

use super::{Node, PsConfig, Role};
use crate::config::{
    DMLC_INTERFACE, DMLC_NUM_SERVER, DMLC_NUM_WORKER, DMLC_PS_ROOT_PORT, DMLC_PS_ROOT_URI, DMLC_ROLE, DMLC_SERVER_ID,
    DMLC_WORKER_ID, FERROGLOO_STORE, Vars,
};
use crate::device::{Device, TcpAttr, Transport};
use crate::error::{Error, Result};
use crate::rendezvous::{Store, TcpStore, TcpStoreServer};
use std::time::{Duration, Instant};

/// What the environment says this process is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EnvRole {
    /// A worker or a server.
    Node(Role),
    /// ps-lite's scheduler: here, the store's server.
    Scheduler,
}

/// What a ps-lite job sets, for the error when one is missing.
fn hint() -> String {
    format!(
        "a ps-lite job sets {DMLC_ROLE}, {DMLC_NUM_WORKER}, {DMLC_NUM_SERVER}, {DMLC_PS_ROOT_URI} and {DMLC_PS_ROOT_PORT}"
    )
}

/// `name`, which a ps-lite job sets, as a `T`; an error says it is not `what`.
fn need<T: std::str::FromStr>(vars: &Vars<'_>, name: &str, what: &str) -> Result<T> {
    vars.parse_required(name, what, &hint())
}

/// The role `DMLC_ROLE` names.
pub fn role_from_env() -> Result<EnvRole> {
    role_in(&Vars::process())
}

/// [`role_from_env`] as `vars` give the variables.
pub(crate) fn role_in(vars: &Vars<'_>) -> Result<EnvRole> {
    match vars.required(DMLC_ROLE, &hint())?.as_str() {
        "worker" => Ok(EnvRole::Node(Role::Worker)),
        "server" => Ok(EnvRole::Node(Role::Server)),
        "scheduler" => Ok(EnvRole::Scheduler),
        other => Err(Error::invalid(format!("{DMLC_ROLE}={other:?}: worker, server or scheduler"))),
    }
}

/// The job's shape from `DMLC_NUM_WORKER` and `DMLC_NUM_SERVER` (other settings default).
pub fn config_from_env() -> Result<PsConfig> {
    config_in(&Vars::process())
}

/// [`config_from_env`] as `vars` give the variables.
pub(crate) fn config_in(vars: &Vars<'_>) -> Result<PsConfig> {
    Ok(PsConfig::new(need(vars, DMLC_NUM_WORKER, "a number")?, need(vars, DMLC_NUM_SERVER, "a number")?))
}

/// The scheduler's port.
fn root_port(vars: &Vars<'_>) -> Result<u16> {
    need(vars, DMLC_PS_ROOT_PORT, "a port number")
}

/// The scheduler's store: `DMLC_PS_ROOT_URI:DMLC_PS_ROOT_PORT`.
fn root(vars: &Vars<'_>) -> Result<String> {
    Ok(format!("{}:{}", vars.required(DMLC_PS_ROOT_URI, &hint())?, root_port(vars)?))
}

const CONNECTED: &str = "ferrogloo-ps/connected";

impl Node {
    /// Joins the ps-lite-style job the environment describes (`DMLC_*`), with `cfg`'s
    /// settings (its counts are checked against `DMLC_NUM_WORKER`/`DMLC_NUM_SERVER`).
    pub fn from_env(cfg: PsConfig) -> Result<Node> {
        let vars = Vars::process();
        let EnvRole::Node(role) = role_in(&vars)? else {
            return Err(Error::invalid(format!("{DMLC_ROLE}=scheduler: run ferrogloo::ps::run_scheduler instead")));
        };
        let shape = config_in(&vars)?;
        if (shape.workers, shape.servers) != (cfg.workers, cfg.servers) {
            return Err(Error::invalid(format!(
                "the environment says {} workers and {} servers, the configuration {} and {}",
                shape.workers, shape.servers, cfg.workers, cfg.servers
            )));
        }
        let store: std::sync::Arc<dyn Store> = match vars.text(FERROGLOO_STORE) {
            Some(url) => crate::rendezvous::open(&url)?.into(),
            None => std::sync::Arc::new(TcpStore::connect(&root(&vars)?, "ferrogloo-ps", cfg.timeout)?),
        };
        let (id_var, counter) = match role {
            Role::Worker => (DMLC_WORKER_ID, "ferrogloo-ps/next-worker"),
            Role::Server => (DMLC_SERVER_ID, "ferrogloo-ps/next-server"),
        };
        let id = match vars.parse(id_var, "a number")? {
            Some(id) => id,
            None => {
                usize::try_from(store.add(counter, 1)? - 1).map_err(|_| Error::invalid("a negative node number"))?
            }
        };
        let mut attr = TcpAttr::read(&vars)?;
        if let Some(iface) = vars.text(DMLC_INTERFACE) {
            attr.iface = Some(iface);
        }
        let device = Device::with_transport(Transport::read(&vars)?, &attr)?;
        let node = Node::connect_shared(store.clone(), &device, role, id, cfg)?;
        store.add(CONNECTED, 1)?;
        Ok(node)
    }
}

/// The scheduler's part: serves the job's store at `DMLC_PS_ROOT_URI:DMLC_PS_ROOT_PORT` until
/// every worker and server has connected (or `timeout` passes, naming how many did not), and
/// then for as long as any node holds a connection to it (servers keep theirs, so a worker
/// restarted later rejoins through it, [`Node::rejoin`]); it returns once every node has
/// exited or died.
pub fn run_scheduler(timeout: Duration) -> Result<()> {
    let vars = Vars::process();
    let cfg = config_in(&vars)?;
    let server = TcpStoreServer::start(("0.0.0.0", root_port(&vars)?))?;
    schedule(&server, cfg.workers + cfg.servers, timeout)
}

/// Serves `server` until `nodes` nodes have said they connected (or `timeout` passes), then
/// until no connection to it is left.
fn schedule(server: &TcpStoreServer, nodes: usize, timeout: Duration) -> Result<()> {
    {
        let store = TcpStore::connect(&server.local_addr().to_string(), "ferrogloo-ps", timeout)?;
        let want = nodes as i64;
        let deadline = Instant::now() + timeout;
        loop {
            let n = store.add(CONNECTED, 0)?;
            if n >= want {
                break;
            }
            if Instant::now() >= deadline {
                return Err(Error::Timeout {
                    op: format!("parameter-server scheduler: {n} of {want} nodes connected"),
                    ranks: Vec::new(),
                    keys: vec![CONNECTED.to_string()],
                    waited: timeout,
                });
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
    // Its own connection is closed: what is left are the nodes'.
    tracing::info!(nodes, "parameter-server scheduler: every node connected; serving the store until they have gone");
    while server.connections() > 0 {
        std::thread::sleep(Duration::from_millis(50));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::mpsc;

    #[test]
    fn the_scheduler_serves_the_store_until_every_node_has_gone() -> Result<()> {
        let server = TcpStoreServer::start("127.0.0.1:0")?;
        let addr = server.local_addr().to_string();
        let (done_tx, done) = mpsc::channel();
        let scheduler = std::thread::spawn(move || {
            let _ = done_tx.send(schedule(&server, 2, Duration::from_secs(20)).map_err(|e| e.to_string()));
        });
        let t = Duration::from_secs(10);
        let (a, b) = (TcpStore::connect(&addr, "ferrogloo-ps", t)?, TcpStore::connect(&addr, "ferrogloo-ps", t)?);
        a.add(CONNECTED, 1)?;
        b.add(CONNECTED, 1)?;
        // Every node connected, and the scheduler goes on serving while they live (it used to
        // stop here, and a restarted worker had no store to rejoin through).
        assert!(done.recv_timeout(Duration::from_millis(500)).is_err(), "the scheduler stopped with nodes alive");
        a.set("later", b"rejoin")?;
        assert_eq!(b.get("later", t)?, b"rejoin");
        drop(a);
        assert!(done.recv_timeout(Duration::from_millis(300)).is_err(), "the scheduler stopped with a node alive");
        drop(b);
        let ended = done.recv_timeout(Duration::from_secs(10));
        assert_eq!(ended, Ok(Ok(())), "the scheduler did not end once every node had gone");
        scheduler.join().map_err(|_| Error::invalid("the scheduler thread panicked"))?;
        Ok(())
    }
}
