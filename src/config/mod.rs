//! The environment variables ferrogloo reads (`FERROGLOO_*`, Horovod's `HOROVOD_*`, ps-lite's
//! `DMLC_*`), each named once here with its default, its meaning and who reads it; and the one
//! place the process environment is read (the crate's `Vars`), with readers that parse a value
//! and, when it does not parse, say so naming the variable and its value
//! (`FERROGLOO_TIMEOUT="x" is not a positive number of seconds`).
//!
//! The README's table "Environment variables" is this table (a test keeps the two equal). The
//! names a launcher sets for the ranks it starts, or hands on to them, are public constants here
//! (each constant's name is the variable's); the others (tuning knobs, the engine's and ps-lite's
//! variables, the launchers' plumbing) are read only inside the crate.
//!
//! Rules every reader follows: a variable set to the empty string counts as unset (as does one
//! that is not Unicode); values are read without the white space around them, except secrets and
//! paths, which are taken as they are; a value that is set but does not parse is an
//! [`Error::InvalidArgument`](crate::Error::InvalidArgument) naming the variable and the value,
//! never a silent default.

mod vars;

#[cfg(test)]
mod tests;

pub(crate) use vars::Vars;

/// One variable of the table: its name, its default, what it does, and who reads it.
#[cfg_attr(not(test), allow(dead_code))] // read by the test that keeps the README's table equal
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Variable {
    /// The variable's name.
    pub(crate) name: &'static str,
    /// The value it has when unset, in words where no single value says it.
    pub(crate) default: &'static str,
    /// What it does.
    pub(crate) meaning: &'static str,
    /// Which functions read it.
    pub(crate) read_by: &'static str,
}

/// Defines each variable's constant (documented with its meaning, default and reader) and
/// [`TABLE`], in the order given.
macro_rules! variables {
    ($($vis:vis $name:ident, default $default:literal, read by $read_by:literal: $meaning:literal;)*) => {
        $(
            #[doc = concat!("`", stringify!($name), "`: ", $meaning, "\n\nDefault: ", $default, ". Read by ", $read_by, ".")]
            $vis const $name: &str = stringify!($name);
        )*
        /// Every variable, as the README's table lists them.
        #[cfg_attr(not(test), allow(dead_code))]
        pub(crate) const TABLE: &[Variable] = &[$(Variable {
            name: $name,
            default: $default,
            meaning: $meaning,
            read_by: $read_by,
        }),*];
    };
}

variables! {
    // A rank's place in its job: set by ferrogloo-run and `--np` (and read by hand-written
    // launch scripts' ranks).
    pub FERROGLOO_RANK, default "unset", read by "`launch::RankEnv::from_env`":
        "this process's rank (`ferrogloo-run` and `--np` set it)";
    pub FERROGLOO_SIZE, default "unset", read by "`launch::RankEnv::from_env`":
        "the number of ranks";
    pub FERROGLOO_LOCAL_RANK, default "unset", read by "`launch::RankEnv::from_env`":
        "this rank's index among the ranks of its host";
    pub FERROGLOO_LOCAL_SIZE, default "unset", read by "`launch::RankEnv::from_env`":
        "the number of ranks on this rank's host";
    pub FERROGLOO_STORE, default "unset", read by "`launch::RankEnv::from_env`, `rendezvous::open_from_env`, `ps::Node::from_env`":
        "the store URL (`file:DIR`, `http://HOST:PORT/SCOPE` or `tcpstore://HOST:PORT[/PREFIX]`); overrides the store of every launcher";
    pub(crate) FERROGLOO_LAUNCHER, default "the first launcher whose variables are set", read by "`launch::RankEnv::from_env`":
        "which launcher's variables to read (`ferrogloo`, `horovod`, `torchrun`, `openmpi`, `mpich`, `slurm`), or `none` (a job of one)";
    pub FERROGLOO_TIMEOUT, default "`30`", read by "`context::default_timeout` (contexts, `rendezvous::open`, `Engine::from_env`)":
        "the default deadline in seconds (fractions allowed) of rendezvous, of store requests and of every call of a context built without `.timeout(..)`";
    pub FERROGLOO_HEARTBEAT, default "off", read by "`ContextBuilder::connect`":
        "seconds between heartbeats among a context's ranks (fractions allowed; `0`: off): a peer silent for 4 of them is taken for dead and its connection closed, for contexts built without `.heartbeat(..)`";

    // The device: transport, listening address, host identity, transports' settings.
    pub FERROGLOO_TRANSPORT, default "`tcp+shm`", read by "`device::Transport::from_env` (`Device::from_env`, `RankEnv::connect`, `ps::Node::from_env`)":
        "`tcp`, `shm`, `tcp+shm` (also `auto`: shared memory on one host, TCP across) or `ibverbs+shm` (also `ibverbs`, `rdma`: shared memory on one host, RDMA across; feature `ibverbs`)";
    pub FERROGLOO_ADDR, default "unset", read by "`device::TcpAttr::from_env`":
        "the IP address a TCP device (or the ibverbs handshake) listens on (`--np` sets `127.0.0.1` for its ranks when none of `FERROGLOO_ADDR`, `FERROGLOO_IFACE`, `FERROGLOO_HOSTNAME` is set)";
    pub FERROGLOO_IFACE, default "unset", read by "`device::TcpAttr::from_env`":
        "the network interface to listen on (its first address)";
    pub FERROGLOO_HOSTNAME, default "unset", read by "`device::TcpAttr::from_env`":
        "a host name whose address to listen on (with none of these three set: this host name's address unless it is loopback, else the default route's interface's, else loopback)";
    pub FERROGLOO_HOST_ID, default "host name, boot id and network namespace", read by "`device::host_id`":
        "this host's identity: ranks with equal identities share memory";
    pub(crate) FERROGLOO_SHM_SINGLE_COPY, default "unset: messages two copies, collectives measured", read by "`device::ShmAttr::from_env`":
        "`1`: large messages and the shared area's collectives between ranks of one host copy straight between the ranks' memory (`process_vm_readv`, and `process_vm_writev` for collectives) where the kernel allows it; `0`: both always copy through shared memory (two copies)";
    pub(crate) FERROGLOO_COST_MODEL, default "measured by each context", read by "`cost::CostModel::from_env` (the `Auto` allreduce)":
        "the links' cost model, `latency_us=50,link_gbs=1.25,reduce_gbs=8` (the same on every rank), instead of measuring it";
    pub(crate) FERROGLOO_IB_DEVICE, default "the first with an active port", read by "`device::IbAttr::from_env`":
        "the RDMA device (`mlx5_0`), or `sim` for the simulated provider";
    pub(crate) FERROGLOO_IB_PORT, default "`1`", read by "`device::IbAttr::from_env`":
        "the RDMA device's port";
    pub(crate) FERROGLOO_IB_GID_INDEX, default "RoCE: the first RoCE v2 entry with an IPv4 address, else 0", read by "`device::IbAttr::from_env`":
        "the GID table index (RoCE v2 address choice)";
    pub(crate) FERROGLOO_IB_REG_CACHE, default "on where registrations follow the page tables", read by "the ibverbs transport":
        "`1` caches the RDMA registrations of user buffers (sound only if the program never frees a buffer it communicates from), `0` never";

    // The job's secrets.
    pub FERROGLOO_SECRET_FILE, default "unset", read by "`credentials::Credentials::secret_from_env` (contexts), `JobCredentials::for_job`":
        "a file holding the job's secret (its content without the final line break), readable by its owner only: a file its group or others can read or change is refused, naming it and its mode, and so are an empty one and another user's";
    pub FERROGLOO_SECRET, default "unset", read by "`credentials::Credentials::secret_from_env` (contexts), `JobCredentials::for_job`":
        "the secret itself: weaker (the process's environment shows it to its user and root, and every program it starts inherits it); the file wins when both are set";
    pub FERROGLOO_STORE_TOKEN_FILE, default "unset", read by "`credentials::Credentials::store_token_from_env` (`rendezvous::open`, `ferrogloo-store-server`), `JobCredentials::for_job`":
        "a file holding the HTTP store's bearer token (same rules), sent as `Authorization: Bearer` with every request";
    pub FERROGLOO_STORE_TOKEN, default "unset", read by "`credentials::Credentials::store_token_from_env` (`rendezvous::open`, `ferrogloo-store-server`), `JobCredentials::for_job`":
        "the token itself (weaker, as above)";

    // Launchers' plumbing: set by ferrogloo-run and `--np` for their ranks.
    pub(crate) FERROGLOO_LIFELINE, default "unset", read by "`launch::RankEnv::from_env`":
        "set by the launcher (`launch::spawn_tied`): `FD:DEV:INO` of the inherited pipe whose hang-up says the launcher is gone";
    pub FERROGLOO_ELASTIC, default "`0`", read by "`launch::elastic::run`":
        "`1`: this worker is in an elastic job (`ferrogloo-run --min-np`)";
    pub FERROGLOO_WORKER, default "unset", read by "`launch::elastic::run`":
        "this worker's id in an elastic job: stable across generations, unlike its rank";
    pub FERROGLOO_ELASTIC_TIMEOUT, default "`60`", read by "`launch::elastic::run`":
        "how long, in seconds, a worker waits for the next generation after a membership error";

    // Horovod's launcher (horovodrun; ferrogloo-run sets the first six too).
    pub HOROVOD_RANK, default "unset", read by "`launch::RankEnv::from_env`":
        "this process's rank, under horovodrun";
    pub HOROVOD_SIZE, default "unset", read by "`launch::RankEnv::from_env`":
        "the number of ranks, under horovodrun";
    pub HOROVOD_LOCAL_RANK, default "unset", read by "`launch::RankEnv::from_env`":
        "this rank's index among the ranks of its host, under horovodrun";
    pub HOROVOD_LOCAL_SIZE, default "unset", read by "`launch::RankEnv::from_env`":
        "the number of ranks on this rank's host, under horovodrun";
    pub HOROVOD_CROSS_RANK, default "unset", read by "Horovod programs (not ferrogloo)":
        "the index of this rank's host";
    pub HOROVOD_CROSS_SIZE, default "unset", read by "Horovod programs (not ferrogloo)":
        "the number of hosts";
    pub(crate) HOROVOD_GLOO_RENDEZVOUS_ADDR, default "unset", read by "`launch::RankEnv::from_env`":
        "the host of horovodrun's HTTP rendezvous server, the job's store";
    pub(crate) HOROVOD_GLOO_RENDEZVOUS_PORT, default "unset", read by "`launch::RankEnv::from_env`":
        "its port";
    pub(crate) HOROVOD_GLOO_IFACE, default "unset", read by "`launch::RankEnv::from_env`":
        "the network interface horovodrun asks ranks to use";

    // The engine (Horovod's names where the meaning is the same).
    pub(crate) HOROVOD_FUSION_THRESHOLD, default "`67108864`", read by "`engine::EngineConfig::from_env`":
        "bytes of the fusion buffer, 64 MiB by default (`fusion_threshold`); 0 turns fusion off";
    pub(crate) FERROGLOO_ENGINE_AREA, default "`1`", read by "`engine::EngineConfig::from_env`":
        "`0`: the engine's negotiation goes over the pairs even where every rank shares one host's shared-memory area (`1`, the default: through the area, one step per cycle; `negotiate_through_area`)";
    pub(crate) FERROGLOO_ENGINE_TREE_FROM, default "`auto`", read by "`engine::EngineConfig::from_env`":
        "over the pairs, engines of at least this many ranks agree each cycle in log2(n) rounds of one message (a bitwise reduction) instead of every rank sending its state to every other (`tree_negotiation_from`); 0: never; `auto`: measured as the engine starts (8 ranks or more)";
    pub(crate) FERROGLOO_FUSION_MAX_TENSOR, default "`1048576`", read by "`engine::EngineConfig::from_env`":
        "allreduces larger than this many bytes (1 MiB by default) run alone, in place (`fusion_max_tensor`)";
    pub(crate) HOROVOD_CYCLE_TIME, default "`1`", read by "`engine::EngineConfig::from_env`":
        "the longest wait, in milliseconds, for a burst of submissions to end (`batch_window`; there is no fixed cycle)";
    pub(crate) FERROGLOO_ENGINE_BATCH_GAP_US, default "`100`", read by "`engine::EngineConfig::from_env`":
        "a burst has ended when no submission came for this many microseconds (`batch_gap`)";
    pub(crate) HOROVOD_CACHE_CAPACITY, default "`1024`", read by "`engine::EngineConfig::from_env`":
        "response cache slots (`cache_capacity`); 0 turns the cache off";
    pub(crate) HOROVOD_STALL_CHECK_TIME_SECONDS, default "`60`", read by "`engine::EngineConfig::from_env`":
        "report names some ranks submitted and others not after this many seconds (`stall_check`)";
    pub(crate) HOROVOD_STALL_CHECK_DISABLE, default "`0`", read by "`engine::EngineConfig::from_env`":
        "`1` (or `true`, `yes`, `on`) turns the stall report off";
    pub(crate) HOROVOD_STALL_SHUTDOWN_TIME_SECONDS, default "`0`", read by "`engine::EngineConfig::from_env`":
        "fail the engine on every rank when a name waited this many seconds (`stall_shutdown`); 0: never";
    pub(crate) HOROVOD_TIMELINE, default "unset", read by "`engine::EngineConfig::from_env`":
        "write a Chrome-trace timeline to this file (`timeline`; rank 0 only)";
    pub(crate) FERROGLOO_TIMELINE_ALL_RANKS, default "`0`", read by "`engine::EngineConfig::from_env`":
        "`1` (or `true`, `yes`, `on`): every rank writes a timeline, to the file name with `.<rank>` appended";

    // ps-lite's environment, for the parameter server.
    pub(crate) DMLC_ROLE, default "unset", read by "`ps::role_from_env`, `ps::Node::from_env`":
        "`worker`, `server` or `scheduler` (which serves the job's store)";
    pub(crate) DMLC_NUM_WORKER, default "unset", read by "`ps::config_from_env`, `ps::Node::from_env`, `ps::run_scheduler`":
        "the number of workers";
    pub(crate) DMLC_NUM_SERVER, default "unset", read by "`ps::config_from_env`, `ps::Node::from_env`, `ps::run_scheduler`":
        "the number of servers";
    pub(crate) DMLC_PS_ROOT_URI, default "unset", read by "`ps::Node::from_env`":
        "the scheduler's host, where the job's store is (unless `FERROGLOO_STORE` is set)";
    pub(crate) DMLC_PS_ROOT_PORT, default "unset", read by "`ps::Node::from_env`, `ps::run_scheduler`":
        "the port of the scheduler's store";
    pub(crate) DMLC_WORKER_ID, default "the order of arrival", read by "`ps::Node::from_env`":
        "this worker's number";
    pub(crate) DMLC_SERVER_ID, default "the order of arrival", read by "`ps::Node::from_env`":
        "this server's number";
    pub(crate) DMLC_INTERFACE, default "unset", read by "`ps::Node::from_env`":
        "the network interface a node listens on (as `FERROGLOO_IFACE`)";
}
