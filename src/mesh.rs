//! Forming a mesh through a store, over any backend: the store entries, the context id that
//! keeps an earlier job's entries out, who connects to whom, and what a rank says while it
//! waits.
//!
//! Each rank publishes `ferrogloo.rank.<r>`:
//!
//! ```text
//! ferrogloo-v2 <context id, 32 hex digits> <size> <backend> <host identity> <address> [cost=<model>]
//! ```
//!
//! with the host identity, the backend's address blob and the cost model percent-encoded (so
//! the entry stays one line of printable text). The last field is there when the rank was given
//! a cost model (its exact text); every rank must publish the same one or none, else every rank
//! fails formation with [`Error::Mismatch`] naming the two ranks (a rank without a model
//! measures one as the context forms, in a collective that a rank given one never joins). Rank 0 chooses a fresh random context id and publishes first; every
//! other rank reads rank 0's entry, makes its endpoint for that id and connects to rank 0,
//! which refuses an id it does not know: so an entry left by an earlier job is recognised (the
//! connect is refused, or nothing answers) and the rank waits for a fresh one. Then it
//! publishes its own entry, connects to every lower rank whose entry carries the id, and waits
//! for the higher ranks to connect to it.

use crate::error::{Error, Result, ranks_text, secs};
use crate::rendezvous::{Backoff, Store};
use crate::transport::{Backend, ConnectError, ContextId, Endpoint, EndpointSpec, Mesh, Passive, random16};
use percent_encoding::{AsciiSet, CONTROLS, percent_decode, percent_encode};
use std::time::{Duration, Instant};

/// What to form.
#[derive(Debug, Clone)]
pub(crate) struct MeshSpec {
    pub(crate) rank: usize,
    pub(crate) size: usize,
    pub(crate) timeout: Duration,
    pub(crate) secret: Option<Vec<u8>>,
    /// This rank's host identity.
    pub(crate) host: String,
    /// The cost model this rank was given ([`CostModel::to_exact_text`](crate::CostModel)),
    /// which every rank must give alike.
    pub(crate) cost: Option<String>,
}

/// How often a waiting rank says what it waits for.
const LOG_EVERY: Duration = Duration::from_secs(5);

/// What a rank waits for, in words.
const FIRST_ENTRY: &str = "to publish its entry (rank 0 chooses the context id)";
const ENTRY: &str = "to publish its entry";
const CONNECT: &str = "to connect";

/// Bytes escaped in the entry's text fields.
const FIELD: &AsciiSet = &CONTROLS.add(b' ').add(b'%');

/// The store key of a rank's entry.
pub(crate) fn key(rank: usize) -> String {
    format!("ferrogloo.rank.{rank}")
}

/// What a rank publishes.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Entry {
    ctx: ContextId,
    size: usize,
    backend: String,
    host: String,
    addr: Vec<u8>,
    cost: Option<String>,
}

/// The prefix of the entry's cost-model field.
const COST_FIELD: &str = "cost=";

impl Entry {
    fn encode(&self) -> Vec<u8> {
        let hex: String = self.ctx.iter().map(|b| format!("{b:02x}")).collect();
        let mut text = format!(
            "ferrogloo-v2 {hex} {} {} {} {}",
            self.size,
            percent_encode(self.backend.as_bytes(), FIELD),
            percent_encode(self.host.as_bytes(), FIELD),
            percent_encode(&self.addr, FIELD)
        );
        if let Some(cost) = &self.cost {
            text = format!("{text} {COST_FIELD}{}", percent_encode(cost.as_bytes(), FIELD));
        }
        text.into_bytes()
    }

    fn parse(raw: &[u8]) -> Option<Self> {
        let s = std::str::from_utf8(raw).ok()?;
        let mut it = s.split(' ');
        if it.next()? != "ferrogloo-v2" {
            return None;
        }
        let hex = it.next()?;
        if hex.len() != 32 {
            return None;
        }
        let mut ctx = [0u8; 16];
        for (i, b) in ctx.iter_mut().enumerate() {
            *b = u8::from_str_radix(hex.get(2 * i..2 * i + 2)?, 16).ok()?;
        }
        let size = it.next()?.parse().ok()?;
        let text = |f: &str| percent_decode(f.as_bytes()).decode_utf8().ok().map(|c| c.into_owned());
        let backend = text(it.next()?)?;
        let host = text(it.next()?)?;
        let addr = percent_decode(it.next()?.as_bytes()).collect();
        let cost = match it.next() {
            None => None,
            Some(field) => Some(text(field.strip_prefix(COST_FIELD)?)?),
        };
        it.next().is_none().then_some(Entry { ctx, size, backend, host, addr, cost })
    }
}

/// Forms the mesh of `spec` on `backend` through `store`. Returns it with every rank's host
/// identity.
pub(crate) fn form<S: Store + ?Sized>(
    store: &S,
    backend: &dyn Backend,
    spec: &MeshSpec,
) -> Result<(Mesh, Vec<String>)> {
    let host = spec.host.clone();
    if spec.size == 1 {
        return Ok((
            Mesh { pairs: vec![None], progress: std::sync::Arc::new(Passive), local: None, _guard: Box::new(()) },
            vec![host],
        ));
    }
    if backend.host_only() && store.reaches_other_hosts() {
        tracing::warn!(
            "rank {} publishes a {} endpoint only this host can reach into {}, which other hosts can read: \
             ranks on other hosts will not connect to it (listen elsewhere with FERROGLOO_IFACE, \
             FERROGLOO_HOSTNAME or FERROGLOO_ADDR)",
            spec.rank,
            backend.name(),
            store.describe()
        );
    }
    let rv = Rendezvous::new(store, spec);
    let (rank, size) = (spec.rank, spec.size);
    let mut hosts = vec![String::new(); size];
    hosts[rank] = host.clone();
    // The cost model each rank was given (checked alike once every entry is read).
    let mut costs = vec![None; size];
    costs[rank] = spec.cost.clone();
    let endpoint =
        |ctx| backend.endpoint(EndpointSpec { ctx, rank, size, secret: spec.secret.clone(), host: host.clone() });
    let mine = |ctx, ep: &dyn Endpoint| Entry {
        ctx,
        size,
        backend: backend.name().to_string(),
        host: host.clone(),
        addr: ep.address(),
        cost: spec.cost.clone(),
    };

    // 1. Agree on the context id (rank 0 chooses it; others confirm it with rank 0).
    let (ctx, mut ep) = if rank == 0 {
        let ctx = random16();
        let ep = endpoint(ctx)?;
        rv.publish(0, &mine(ctx, &*ep))?;
        (ctx, ep)
    } else {
        let mut last: Option<Vec<u8>> = None;
        let mut refused: Option<Error> = None;
        // The endpoint of the entry being tried: kept while retrying a connection failure, so
        // that what it has connected stays (rank 0 refuses a lane twice).
        let mut current: Option<(ContextId, Box<dyn Endpoint>)> = None;
        let mut retry = Backoff::new();
        let mut log = rv.log(FIRST_ENTRY);
        loop {
            // A connection that failed (a link still coming up, a listener not reachable yet)
            // is tried again with backoff unless a fresh entry shows up; a refused connection
            // (a stale entry) waits for a fresh one.
            let again = current.is_some() && retry.sleep_until(rv.deadline);
            let raw = if again {
                rv.store.try_get(&key(0))?
            } else {
                Some(rv.next_value(0, last.as_deref(), FIRST_ENTRY, refused.as_ref())?)
            };
            let Some(raw) = raw else { continue };
            log.tick(&rv, &[0]);
            let entry = match Entry::parse(&raw) {
                Some(e) if e.size == size && e.backend == backend.name() => e,
                other => {
                    if let Some(e) = other.filter(|e| e.size == size) {
                        refused = Some(Error::invalid(format!(
                            "rank 0 published a {} endpoint and this rank uses {}",
                            e.backend,
                            backend.name()
                        )));
                    }
                    tracing::debug!(key = %key(0), "skipping an entry of another job, world size or backend");
                    current = None;
                    last = Some(raw);
                    continue;
                }
            };
            // The same entry again keeps its endpoint (and what it has connected).
            let mut ep = match current.take() {
                Some((c, ep)) if c == entry.ctx && last.as_deref() == Some(raw.as_slice()) => ep,
                _ => {
                    last = Some(raw);
                    endpoint(entry.ctx)?
                }
            };
            match ep.connect(0, &entry.addr, rv.deadline) {
                Ok(()) => {
                    hosts[0] = entry.host;
                    costs[0] = entry.cost;
                    break (entry.ctx, ep);
                }
                Err(ConnectError::Retry(e)) => {
                    tracing::debug!(error = %e, "rank 0's entry did not answer; trying again");
                    current = Some((entry.ctx, ep));
                    refused = Some(e);
                }
                Err(ConnectError::Refused(e)) => {
                    // A live endpoint that does not know the id: wait for a fresh entry.
                    tracing::debug!(error = %e, "rank 0's entry refused; waiting for a fresh one");
                    refused = Some(e);
                }
            }
        }
    };
    if rank > 0 {
        rv.publish(rank, &mine(ctx, &*ep))?;
    }

    // 2. Connect to every lower rank but 0, whose entries must carry this context id.
    for peer in 1..rank {
        let mut last: Option<Vec<u8>> = None;
        let entry = loop {
            let raw = rv.next_value(peer, last.as_deref(), ENTRY, None)?;
            match Entry::parse(&raw) {
                Some(e) if e.ctx == ctx && e.size == size => break e,
                _ => last = Some(raw),
            }
        };
        // Connection failures (a link still coming up) are retried until the deadline; then
        // the peer is what the rendezvous waited for (it may have died after publishing).
        let mut retry = Backoff::new();
        loop {
            match ep.connect(peer, &entry.addr, rv.deadline) {
                Ok(()) => break,
                Err(ConnectError::Retry(e)) if retry.sleep_until(rv.deadline) => {
                    tracing::debug!(peer, error = %e, "connecting failed; trying again");
                }
                Err(ConnectError::Retry(e)) => {
                    return Err(Error::Timeout {
                        op: format!(
                            "rendezvous of rank {rank} (of {size}) in {}: connecting to rank {peer}, which \
                             published its endpoint but did not take the connection (last: {e})",
                            store.describe()
                        ),
                        ranks: vec![peer],
                        keys: Vec::new(),
                        waited: spec.timeout,
                    });
                }
                Err(e) => return Err(e.into_error()),
            }
        }
        hosts[peer] = entry.host;
        costs[peer] = entry.cost;
    }

    // 3. Wait for every higher rank to connect to us.
    let mut higher: Vec<usize> = (rank + 1..size).collect();
    let mut log = rv.log(CONNECT);
    while !higher.is_empty() {
        let until = rv.deadline.min(Instant::now() + LOG_EVERY);
        higher = ep.wait_connected(&higher, until);
        if higher.is_empty() {
            break;
        }
        if Instant::now() >= rv.deadline {
            let keys: Vec<String> =
                higher.iter().filter(|&&r| store.try_get(&key(r)).ok().flatten().is_none()).map(|&r| key(r)).collect();
            return Err(Error::Timeout {
                op: format!(
                    "rendezvous of rank {rank} (of {size}) in {}: waiting for higher ranks {CONNECT}",
                    store.describe()
                ),
                ranks: higher,
                keys,
                waited: spec.timeout,
            });
        }
        log.tick(&rv, &higher);
    }
    // Their host identities: each published its entry before it connected to any rank but 0
    // (to rank 0 it connects first, to learn the context id), so rank 0 may wait a moment.
    for r in rank + 1..size {
        let mut last: Option<Vec<u8>> = None;
        let entry = loop {
            let raw = rv.next_value(r, last.as_deref(), ENTRY, None)?;
            match Entry::parse(&raw) {
                Some(e) if e.ctx == ctx => break e,
                _ => last = Some(raw),
            }
        };
        hosts[r] = entry.host;
        costs[r] = entry.cost;
    }
    // Every rank read every entry, so each finds a difference and fails alike.
    if let Some(other) = costs.iter().position(|c| *c != costs[rank]) {
        let given = |c: &Option<String>| match c {
            Some(text) => format!("was given the cost model {text}"),
            None => "was given none (it measures one)".to_string(),
        };
        return Err(Error::Mismatch {
            rank: other,
            detail: format!(
                "rank {other} {} and rank {rank} {}: give every rank the same cost model or none \
                 (ContextBuilder::cost_model, FERROGLOO_COST_MODEL)",
                given(&costs[other]),
                given(&costs[rank])
            ),
        });
    }
    Ok((ep.finish(), hosts))
}

/// Store access during rendezvous, all against one deadline.
struct Rendezvous<'a, S: ?Sized> {
    store: &'a S,
    start: Instant,
    deadline: Instant,
    timeout: Duration,
    rank: usize,
    size: usize,
}

/// Says every [`LOG_EVERY`] what a rank still waits for.
struct WaitLog {
    what: &'static str,
    next: Instant,
}

impl WaitLog {
    fn tick<S: Store + ?Sized>(&mut self, rv: &Rendezvous<'_, S>, ranks: &[usize]) {
        let now = Instant::now();
        if now >= self.next {
            self.next = now + LOG_EVERY;
            tracing::info!(
                "rank {} of {}: still waiting for {} {}, {} of {}, in {}",
                rv.rank,
                rv.size,
                ranks_text(ranks),
                self.what,
                secs(&now.duration_since(rv.start)),
                secs(&rv.timeout),
                rv.store.describe()
            );
        }
    }
}

impl<'a, S: Store + ?Sized> Rendezvous<'a, S> {
    fn new(store: &'a S, spec: &MeshSpec) -> Self {
        let start = Instant::now();
        Rendezvous {
            store,
            start,
            deadline: start + spec.timeout,
            timeout: spec.timeout,
            rank: spec.rank,
            size: spec.size,
        }
    }

    fn log(&self, what: &'static str) -> WaitLog {
        WaitLog { what, next: self.start + LOG_EVERY }
    }

    fn publish(&self, rank: usize, e: &Entry) -> Result<()> {
        self.store.set(&key(rank), &e.encode())
    }

    /// The value of `rank`'s key once it exists and differs from `old`.
    /// `refused` is why the previous value did not work, for the timeout message.
    fn next_value(
        &self,
        rank: usize,
        old: Option<&[u8]>,
        what: &'static str,
        refused: Option<&Error>,
    ) -> Result<Vec<u8>> {
        let k = key(rank);
        let mut backoff = Backoff::new();
        let mut log = self.log(what);
        loop {
            if let Some(v) = self.store.try_get(&k)?
                && old != Some(v.as_slice())
            {
                return Ok(v);
            }
            log.tick(self, &[rank]);
            if !backoff.sleep_until(self.deadline) {
                let stale = match (old, refused) {
                    (_, Some(e)) => format!(" (the entry found did not work: {e})"),
                    (Some(_), None) => " (only a stale entry from another job was found)".to_string(),
                    (None, None) => String::new(),
                };
                return Err(Error::Timeout {
                    op: format!(
                        "rendezvous of rank {} (of {}) in {}: waiting for rank {rank} {what}{stale}",
                        self.rank,
                        self.size,
                        self.store.describe()
                    ),
                    ranks: vec![rank],
                    keys: vec![k],
                    waited: self.timeout,
                });
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn entries_round_trip_and_strangers_do_not_parse() {
        let e = Entry {
            ctx: [0xab; 16],
            size: 5,
            backend: "tcp".into(),
            host: "node 7/boot%1".into(),
            addr: b"127.0.0.1:4000".to_vec(),
            cost: None,
        };
        let raw = e.encode();
        assert!(!raw.contains(&b'\n'));
        assert_eq!(Entry::parse(&raw), Some(e.clone()));
        let given = Entry { cost: Some("latency_us=50.5,link_gbs=1.25,reduce_gbs=8.0".into()), ..e };
        let raw = given.encode();
        assert!(raw.ends_with(b" cost=latency_us=50.5,link_gbs=1.25,reduce_gbs=8.0"));
        assert_eq!(Entry::parse(&raw), Some(given));
        let hex = "ab".repeat(16);
        for bad in [
            &b"ferrogloo-v1 00 2 127.0.0.1:1"[..],
            b"",
            b"ferrogloo-v2 zz 2 tcp h a",
            b"\xff\xfe",
            format!("ferrogloo-v2 {hex} 2 tcp h a model=x").as_bytes(),
            format!("ferrogloo-v2 {hex} 2 tcp h a cost=x extra").as_bytes(),
        ] {
            assert_eq!(Entry::parse(bad), None);
        }
    }
}
