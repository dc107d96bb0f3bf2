//! Ranks as threads of one process: a backend with no sockets and no I/O thread.
//!
//! Endpoints register in a table of this process, keyed by context id and rank; the address
//! an endpoint publishes names this process, so an entry from another process (or a stale one
//! of an earlier context) is refused rather than joined. A pair is a [`Link`] both ranks hold:
//! per direction, the receiver's [`Matcher`] and the sends waiting for room. A send is matched
//! by the posting thread itself: it copies straight into a posted receive, into the early
//! budget, or (too large for the budget) waits in order until the receiver posts, exactly as a
//! TCP sender is held back by the peer not reading. Waits sleep on their completion.

use crate::error::{Error, Result};
use crate::sync::{lock, wait_timeout};
use crate::transport::matching::{Dispatch, Header, Matcher, RecvOp};
use crate::transport::{
    ALL_GROUPS, AbortCause, Backend, Completion, ConnectError, ContextId, Done, Endpoint, EndpointSpec, Key, Mesh,
    Pair, Passive, RecvTarget, SendBuf,
};
use crate::types::OpDesc;
use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Condvar, Mutex, OnceLock};
use std::time::Instant;

/// The endpoints of this process, by context id and rank.
type Table = Mutex<HashMap<(ContextId, usize), Arc<Node>>>;

fn table() -> &'static Table {
    static TABLE: OnceLock<Table> = OnceLock::new();
    TABLE.get_or_init(Mutex::default)
}

/// The in-process backend of a [`Device`](crate::device::Device).
#[derive(Debug)]
pub(crate) struct MemoryDevice {
    /// Bytes per pair and direction that may arrive before their receive is posted.
    early_budget: usize,
}

impl MemoryDevice {
    pub(crate) fn new(early_budget: usize) -> Self {
        MemoryDevice { early_budget }
    }
}

/// What an endpoint publishes: `memory:<process id>`.
fn address() -> Vec<u8> {
    format!("memory:{}", std::process::id()).into_bytes()
}

impl Backend for MemoryDevice {
    fn name(&self) -> &str {
        "memory"
    }

    fn host_only(&self) -> bool {
        true
    }

    fn endpoint(&self, spec: EndpointSpec) -> Result<Box<dyn Endpoint>> {
        let node = Arc::new(Node {
            rank: spec.rank,
            size: spec.size,
            secret: spec.secret,
            budget: self.early_budget,
            links: Mutex::new(vec![None; spec.size]),
            joined: Condvar::new(),
        });
        let mut t = lock(table());
        if t.contains_key(&(spec.ctx, spec.rank)) {
            return Err(Error::invalid(format!("rank {} of this context is already registered", spec.rank)));
        }
        t.insert((spec.ctx, spec.rank), node.clone());
        Ok(Box::new(MemoryEndpoint { guard: Some(NodeGuard { ctx: spec.ctx, node }) }))
    }
}

/// One rank's endpoint, as peers find it in the table.
struct Node {
    rank: usize,
    size: usize,
    secret: Option<Vec<u8>>,
    budget: usize,
    /// The link to each peer, once connected.
    links: Mutex<Vec<Option<Arc<Link>>>>,
    joined: Condvar,
}

/// Withdraws a node from the table and closes its links when dropped.
struct NodeGuard {
    ctx: ContextId,
    node: Arc<Node>,
}

impl Drop for NodeGuard {
    fn drop(&mut self) {
        lock(table()).remove(&(self.ctx, self.node.rank));
        let me = self.node.rank;
        let local = Error::Aborted { rank: me, reason: "this rank closed the context".into() };
        let remote = Error::PeerClosed { rank: me, op: String::new(), detail: "it closed its context".into() };
        for link in lock(&self.node.links).iter().flatten() {
            link.shut(me, ALL_GROUPS, &local, &remote);
        }
    }
}

struct MemoryEndpoint {
    guard: Option<NodeGuard>,
}

impl MemoryEndpoint {
    fn node(&self) -> &Arc<Node> {
        // The guard is taken only by `finish`, which consumes the endpoint.
        &self.guard.as_ref().expect("memory endpoint used after finish").node
    }
}

impl Endpoint for MemoryEndpoint {
    fn address(&self) -> Vec<u8> {
        address()
    }

    fn connect(&mut self, peer: usize, addr: &[u8], _deadline: Instant) -> std::result::Result<(), ConnectError> {
        let refused = |detail: String| ConnectError::Refused(Error::Protocol { peer: Some(peer), detail });
        if addr != address().as_slice() {
            return Err(refused(format!(
                "its address {:?} is not in this process: the memory transport joins only ranks that are \
                 threads of one process",
                String::from_utf8_lossy(addr)
            )));
        }
        let Some(guard) = &self.guard else { return Err(refused("connect after finish".into())) };
        let theirs = lock(table()).get(&(guard.ctx, peer)).cloned();
        let Some(theirs) = theirs else {
            return Err(refused("it has no context with this id (a stale or foreign rendezvous)".into()));
        };
        let mine = &guard.node;
        if theirs.size != mine.size || peer >= mine.rank {
            return Err(refused(format!(
                "the ranks or world size do not fit (rank {} of {} connecting to rank {peer} of {})",
                mine.rank, mine.size, theirs.size
            )));
        }
        if theirs.secret != mine.secret {
            return Err(refused("the shared secrets differ".into()));
        }
        // Each rank's budget bounds what it holds of messages sent to it.
        let link = Arc::new(Link::new(peer, mine.rank, theirs.budget, mine.budget));
        {
            let mut their_links = lock(&theirs.links);
            if their_links[mine.rank].is_some() {
                return Err(refused("it already has a connection for this pair".into()));
            }
            their_links[mine.rank] = Some(link.clone());
            theirs.joined.notify_all();
        }
        lock(&mine.links)[peer] = Some(link);
        Ok(())
    }

    fn wait_connected(&mut self, peers: &[usize], until: Instant) -> Vec<usize> {
        let node = self.node();
        let mut links = lock(&node.links);
        loop {
            let missing: Vec<usize> = peers.iter().copied().filter(|&p| links[p].is_none()).collect();
            let now = Instant::now();
            if missing.is_empty() || now >= until {
                return missing;
            }
            links = wait_timeout(&node.joined, links, until - now);
        }
    }

    fn finish(mut self: Box<Self>) -> Mesh {
        let guard = self.guard.take().expect("memory endpoint finished twice");
        let me = guard.node.rank;
        let pairs = lock(&guard.node.links)
            .iter()
            .enumerate()
            .map(|(p, l)| l.clone().filter(|_| p != me).map(|link| Arc::new(MemoryPair { me, link }) as Arc<dyn Pair>))
            .collect();
        Mesh { pairs, progress: Arc::new(Passive), local: None, _guard: Box::new(guard) }
    }
}

/// A send waiting at the receiver for room (a receive, or early budget).
struct Waiting {
    header: Header,
    buf: SendBuf,
    done: Arc<Completion>,
}

/// One direction of a link: messages from `from` to `to`.
struct Dir {
    from: usize,
    to: usize,
    /// The receiver's matching of messages from the other side.
    matcher: Matcher,
    /// Sends that found no room, in the order they were posted.
    waiting: VecDeque<Waiting>,
}

impl Dir {
    /// Offers a message to the receiver: copies it where the matching says, or returns it when
    /// there is no room yet.
    fn offer(&mut self, w: Waiting) -> Option<Waiting> {
        // SAFETY: the poster lent the send buffer until its completion (contract rule 5), which
        // happens below, after the last read of it.
        let src = unsafe { std::slice::from_raw_parts(w.buf.ptr, w.buf.len) };
        match self.matcher.incoming(w.header) {
            Dispatch::Deliver(mut d) => {
                d.put(src);
                d.finish(self.from);
            }
            Dispatch::Early(mut early) => {
                early.extend(src);
                self.matcher.early_arrived(early);
            }
            Dispatch::Discard => {}
            Dispatch::Stall => return Some(w),
        }
        w.done.complete(Ok(Done { peer: self.to, len: src.len() }));
        None
    }

    /// A send: offered now, or queued behind the sends already waiting (order is kept).
    fn send(&mut self, w: Waiting) {
        if !self.waiting.is_empty() {
            self.waiting.push_back(w);
        } else if let Some(w) = self.offer(w) {
            self.waiting.push_back(w);
        }
    }

    /// A receive: posted, then the waiting sends get another chance.
    fn recv(&mut self, op: RecvOp) -> Result<()> {
        self.matcher.post(op)?;
        self.drain();
        Ok(())
    }

    /// Withdraws `done` as a receive and as a waiting send.
    fn cancel(&mut self, done: &Arc<Completion>) {
        self.matcher.cancel(done);
        self.waiting.retain(|w| !Arc::ptr_eq(&w.done, done));
        // A cancelled receive may have been what a waiting send stalled behind.
        self.drain();
    }

    /// Gives up on `group` ([`ALL_GROUPS`]: everything) on this direction: posted receives and waiting sends
    /// fail with `receiver` and `sender`, each side's error; what waited behind them goes on.
    fn shut(&mut self, group: u64, receiver: &Error, sender: &Error) {
        if group == ALL_GROUPS {
            self.matcher.close(receiver);
            self.fail_waiting(None, sender);
        } else {
            self.matcher.abort_group(group, receiver);
            self.fail_waiting(Some(group), sender);
            self.drain();
        }
    }

    /// Offers waiting sends, in order, until one finds no room.
    fn drain(&mut self) {
        while let Some(w) = self.waiting.pop_front() {
            if let Some(w) = self.offer(w) {
                self.waiting.push_front(w);
                return;
            }
        }
    }

    /// Fails waiting sends of `group` (all of them for `None`) with `err`.
    fn fail_waiting(&mut self, group: Option<u64>, err: &Error) {
        self.waiting.retain(|w| {
            let fail = group.is_none_or(|g| w.header.key.group == g);
            if fail {
                w.done.complete(Err(err.clone()));
            }
            !fail
        });
    }
}

/// The connection of two ranks: `ranks[i]` receives through `dirs[i]`.
struct Link {
    ranks: [usize; 2],
    dirs: Mutex<[Dir; 2]>,
}

impl Link {
    fn new(low: usize, high: usize, budget_low: usize, budget_high: usize) -> Self {
        let dir =
            |to, from, budget| Dir { from, to, matcher: Matcher::new(to, from, budget), waiting: VecDeque::new() };
        Link { ranks: [low, high], dirs: Mutex::new([dir(low, high, budget_low), dir(high, low, budget_high)]) }
    }

    fn side(&self, rank: usize) -> usize {
        usize::from(self.ranks[1] == rank)
    }

    fn other(&self, rank: usize) -> usize {
        self.ranks[1 - self.side(rank)]
    }

    /// Rank `me` gives up on `group` (0: the whole link): its own operations fail with
    /// `local`, the peer's with `remote`.
    fn shut(&self, me: usize, group: u64, local: &Error, remote: &Error) {
        let (mine, theirs) = (self.side(me), 1 - self.side(me));
        let mut dirs = lock(&self.dirs);
        // My receives and the peer's sends are in my direction; the peer's receives and my sends
        // in the other.
        dirs[mine].shut(group, local, remote);
        dirs[theirs].shut(group, remote, local);
    }
}

/// A rank's pair with itself, on every backend: its sends to itself are matched with its own
/// receives as a peer's would be (in order per key, checked, within `budget` bytes early).
pub(crate) fn loopback(rank: usize, budget: usize) -> Arc<dyn Pair> {
    Arc::new(Loopback {
        rank,
        dir: Mutex::new(Dir {
            from: rank,
            to: rank,
            matcher: Matcher::new(rank, rank, budget),
            waiting: VecDeque::new(),
        }),
    })
}

/// See [`loopback`].
struct Loopback {
    rank: usize,
    dir: Mutex<Dir>,
}

impl Pair for Loopback {
    fn sinks(&self) -> bool {
        true
    }

    fn aborted(&self, group: u64) -> Option<Error> {
        lock(&self.dir).matcher.aborted(group)
    }

    fn hold_until_posted(&self, key: Key) {
        lock(&self.dir).matcher.hold(key);
    }

    fn peer(&self) -> usize {
        self.rank
    }

    unsafe fn post_send(&self, key: Key, desc: OpDesc, buf: SendBuf, done: &Arc<Completion>) -> Result<()> {
        buf.mem.require_host("loopback")?;
        let mut dir = lock(&self.dir);
        if let Some(e) = dir.matcher.refusal(key.group) {
            return Err(e);
        }
        dir.send(Waiting { header: Header { key, desc, len: buf.len as u64 }, buf, done: done.clone() });
        Ok(())
    }

    unsafe fn post_recv(&self, key: Key, desc: OpDesc, target: RecvTarget, done: &Arc<Completion>) -> Result<()> {
        target.mem().require_host("loopback")?;
        lock(&self.dir).recv(RecvOp { key, desc, target, done: done.clone() })
    }

    fn abort(&self, group: u64, local: &Error, _cause: &AbortCause) {
        lock(&self.dir).shut(group, local, local);
    }

    fn cancel(&self, done: &Arc<Completion>) {
        lock(&self.dir).cancel(done);
    }
}

/// A pair of the memory backend: this rank's handle on a link.
struct MemoryPair {
    me: usize,
    link: Arc<Link>,
}

impl Pair for MemoryPair {
    fn sinks(&self) -> bool {
        true
    }

    fn aborted(&self, group: u64) -> Option<Error> {
        lock(&self.link.dirs)[self.link.side(self.me)].matcher.aborted(group)
    }

    fn hold_until_posted(&self, key: Key) {
        lock(&self.link.dirs)[self.link.side(self.me)].matcher.hold(key);
    }

    fn peer(&self) -> usize {
        self.link.other(self.me)
    }

    unsafe fn post_send(&self, key: Key, desc: OpDesc, buf: SendBuf, done: &Arc<Completion>) -> Result<()> {
        buf.mem.require_host("memory")?;
        let (mine, theirs) = (self.link.side(self.me), 1 - self.link.side(self.me));
        let mut dirs = lock(&self.link.dirs);
        if let Some(e) = dirs[mine].matcher.refusal(key.group) {
            return Err(e);
        }
        dirs[theirs].send(Waiting { header: Header { key, desc, len: buf.len as u64 }, buf, done: done.clone() });
        Ok(())
    }

    unsafe fn post_recv(&self, key: Key, desc: OpDesc, target: RecvTarget, done: &Arc<Completion>) -> Result<()> {
        target.mem().require_host("memory")?;
        let mine = self.link.side(self.me);
        lock(&self.link.dirs)[mine].recv(RecvOp { key, desc, target, done: done.clone() })
    }

    fn abort(&self, group: u64, local: &Error, cause: &AbortCause) {
        self.link.shut(self.me, group, local, &cause.clone().into_error());
    }

    fn cancel(&self, done: &Arc<Completion>) {
        for dir in lock(&self.link.dirs).iter_mut() {
            dir.cancel(done);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::transport::{Done, RecvBuf, random16};
    use std::time::Duration;

    /// The meshes of ranks 0 and 1 of a fresh context, on devices with early budgets `b0` and
    /// `b1`.
    fn meshes(b0: usize, b1: usize) -> (Mesh, Mesh) {
        let ctx = random16();
        let spec = |rank| EndpointSpec { ctx, rank, size: 2, secret: None, host: String::new() };
        let e0 = MemoryDevice::new(b0).endpoint(spec(0)).unwrap();
        let mut e1 = MemoryDevice::new(b1).endpoint(spec(1)).unwrap();
        e1.connect(0, &address(), Instant::now() + Duration::from_secs(1)).unwrap();
        (e0.finish(), e1.finish())
    }

    #[test]
    fn each_rank_s_budget_bounds_what_it_holds() {
        // Rank 0 holds at most 1000 bytes early, rank 1 a megabyte.
        let (m0, m1) = meshes(1000, 1 << 20);
        let (p0, p1) = (m0.pairs[1].clone().unwrap(), m1.pairs[0].clone().unwrap());
        let data = vec![7u8; 5000];
        let key = Key { group: 0, tag: 1 };
        let to_0 = Completion::new();
        let to_1 = Completion::new();
        // SAFETY: `data` outlives both sends, which finish below.
        unsafe {
            p1.post_send(key, OpDesc::P2P, SendBuf::from_slice(&data), &to_0).unwrap();
            p0.post_send(key, OpDesc::P2P, SendBuf::from_slice(&data), &to_1).unwrap();
        }
        assert!(to_0.outcome().is_none(), "5000 bytes do not fit rank 0's budget: the send waits");
        assert_eq!(to_1.outcome().unwrap().unwrap(), Done { peer: 1, len: 5000 }, "rank 1 holds it early");
        let mut got = vec![0u8; 5000];
        let recv = Completion::new();
        // SAFETY: `got` outlives the receive, which finishes at once.
        unsafe { p0.post_recv(key, OpDesc::P2P, RecvTarget::Exact(RecvBuf::from_slice(&mut got)), &recv).unwrap() };
        assert_eq!(recv.outcome().unwrap().unwrap(), Done { peer: 1, len: 5000 });
        assert!(to_0.outcome().unwrap().is_ok() && got == data);
    }
}
