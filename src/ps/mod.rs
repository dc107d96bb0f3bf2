//! A parameter server in the style of ps-lite: workers push values for the keys they touched
//! and pull fresh ones; servers own shards of the key space and answer through a handler.
//!
//! Servers and workers meet through a [`Store`] like any [`Context`] (no scheduler process):
//! server `i` is rank `i` of one context, worker `j` is rank `servers + j`. A role that never
//! arrives makes the others' [`Node::connect`] time out naming the role and who is missing.
//!
//! ```
//! use ferrogloo::ps::{Node, PsConfig, Role, SumStore};
//! use ferrogloo::{device::Device, rendezvous::HashStore};
//! let store = HashStore::new();
//! let cfg = PsConfig::new(1, 1);
//! std::thread::scope(|s| -> ferrogloo::Result<()> {
//!     let server = s.spawn(|| {
//!         let node = Node::connect(&store, &Device::in_process(), Role::Server, 0, cfg.clone())?;
//!         node.server(SumStore::<f32>::default())?.run()
//!     });
//!     let node = Node::connect(&store, &Device::in_process(), Role::Worker, 0, cfg.clone())?;
//!     let w = node.worker::<f32>()?;
//!     // Keys sorted and unique; two values for key 3, one for key 8.
//!     let ts = w.push(&[3, 8], &[1.0, 2.0, 5.0], &[2, 1])?;
//!     w.wait(ts)?;
//!     let pulled = w.wait(w.pull(&[3, 8])?)?;
//!     assert_eq!((pulled.values, pulled.lens), (vec![1.0, 2.0, 5.0], vec![2, 1]));
//!     drop(w); // says goodbye: the server's run returns once every worker has
//!     server.join().expect("server thread")?;
//!     Ok(())
//! })?;
//! # Ok::<(), ferrogloo::Error>(())
//! ```
//!
//! - **Requests** carry a timestamp ([`KvWorker::push`], [`pull`](KvWorker::pull),
//!   [`push_pull`](KvWorker::push_pull) return it; [`KvWorker::wait`] waits with the request's
//!   deadline, [`KvWorker::then`] is the callback form), a command id of the caller's, sorted
//!   unique `u64` keys (checked) and variable-length values per key.
//! - **Sharding** is by a hash of the key by default (dense small keys spread over every
//!   server), by key range on request, or by a function of yours; a request whose keys span
//!   several servers completes when every part has.
//! - **Servers** run a [`Handler`]: [`SumStore`] (pushes are summed into the stored values,
//!   pulls read them), [`SyncSgd`] (a key's update is applied when every live worker pushed
//!   its gradient, and every pusher gets the new weights), [`AsyncSgd`] (each push applied at
//!   once), or your own, which may answer later ([`Responder`]).
//! - **Faults**: a server that dies (its process killed: the connection closes) fails every
//!   pending and later request that needs it, naming the server and the keys; a server that
//!   hangs fails them at their deadline. Servers send heartbeats (every
//!   [`PsConfig::heartbeat`]); [`KvWorker::dead_servers`] lists those closed or silent for three
//!   heartbeats. A worker that dies (also one an answer can no longer reach) is dropped from
//!   the servers' synchronous rounds; the others go on. A malformed request is refused (its
//!   wait fails saying why) and a message that is no request is logged and skipped: neither
//!   ends a server's run. Messages are at most 1 GiB: a request that would be larger fails
//!   at once naming its size.
//! - **Replication** ([`PsConfig::replication`]): server `s+1` keeps a copy of server `s`'s
//!   state and answers for it once it dies.
//! - **ps-lite's environment** (`DMLC_ROLE`, ...): [`Node::from_env`] and [`run_scheduler`].
//! - **Rejoining**: a worker whose process died, restarted, calls [`Node::rejoin`]; servers
//!   with [`PsConfig::rejoin_wait`] meet it in a new context of its own (in the background,
//!   serving the others meanwhile; a meeting that fails is logged, and the server goes on
//!   waiting for the worker).
//!
//! [`Store`]: crate::rendezvous::Store
//! [`Context`]: crate::Context

mod config;
mod env;
mod fold;
mod handlers;
mod node;
mod pending;
mod request;
mod responder;
mod server;
mod wire;
mod worker;

pub use config::{Group, PsConfig, Role, Sharding};
pub use env::{EnvRole, config_from_env, role_from_env, run_scheduler};
#[cfg(test)]
pub(crate) use env::{config_in, role_in};
pub use handlers::{AsyncSgd, SumStore, SyncSgd};
pub use node::Node;
pub use pending::Reply;
pub use request::{Request, RequestMeta};
pub use responder::{Handler, Responder};
pub use server::KvServer;
pub use worker::KvWorker;

use std::time::Duration;

/// Where rejoining workers announce themselves in the store.
const REJOIN: &str = "ferrogloo-ps/rejoin";

/// The tag of parameter-server messages on the nodes' context.
const PS_TAG: u32 = 0x5053_0001;
/// The tag of the values that follow an answer's head ([`wire::Kind::ReplyHead`]), and a push's
/// ([`wire::Kind::PushHead`]).
const PS_VALUES_TAG: u32 = 0x5053_0002;
/// The parameter server's receives, as errors name them.
const PS_RECEIVE: &str = "parameter-server receive";
/// How often the receiving threads look at deadlines and stop flags.
const SLICE: Duration = Duration::from_millis(100);

/// A request's identity, returned by the worker's calls: unique and increasing among one
/// worker's requests (not consecutive).
pub type Timestamp = u64;
