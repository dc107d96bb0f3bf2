//! A cycle's exchange of states (`Core::exchange`): each rank's state (and the small tensors
//! that travel with it) to every rank, through the host's area where the engine has one, over
//! the pairs otherwise, or by reduction (`agree.rs`) with the full requests to the coordinator
//! alone; and where each peer's envelope is kept.

use super::{Core, EAGER_KEPT_BYTES, EAGER_MESSAGE_BYTES, ENVELOPE_KEPT_BYTES, Kept};
use crate::Context;
use crate::algorithms::{CollectiveOptions, local};
use crate::comm::Scope;
use crate::engine::agree::{self, Round, Summary};
use crate::engine::cache::is_set;
use crate::engine::config::EngineConfig;
use crate::engine::controller::COORDINATOR;
use crate::engine::exec;
use crate::engine::wire;
use crate::engine::{CONTROL_TAG, REQUEST_TAG};
use crate::error::{Error, Result};
use crate::transport::LocalArea;
use crate::types::{Call, OpDesc};
use smallvec::SmallVec;
use std::sync::Arc;

/// Marks the engine's exchanges through the area (their descriptors' `extra`).
const EXCHANGE: u64 = 0x656e_6769_6e65_7863;
/// The first word of a rank's slot in an exchange: one envelope (for every rank), two (to
/// the coordinator, then to the others), or none (too large for the slot: it comes over the
/// pair, as without an area).
const ONE_ENVELOPE: u64 = 1;
const TWO_ENVELOPES: u64 = 2;
const BY_MESSAGE: u64 = 3;

/// The area the engine's exchanges go through: the host's, where it holds every rank of the
/// context as its members in rank order and says when steps begin (and the configuration
/// lets it: [`EngineConfig::negotiate_through_area`]).
pub(crate) fn exchange_area_of(ctx: &Context, cfg: &EngineConfig) -> Option<Arc<dyn LocalArea>> {
    if !cfg.negotiate_through_area {
        return None;
    }
    let area = ctx.comm().local_area()?;
    let in_order = area.members().iter().enumerate().all(|(i, &m)| i == m);
    (area.signals() && in_order && area.members().len() == ctx.size() && ctx.size() > 1).then(|| area.clone())
}

/// Writes `envelopes` into `slot` (see [`ONE_ENVELOPE`]); false where they do not fit.
fn put_envelopes(slot: &mut [u8], envelopes: &[&[u8]]) -> bool {
    let need = 8 + envelopes.iter().map(|e| 8 + e.len()).sum::<usize>();
    if need > slot.len() {
        slot[..8].copy_from_slice(&BY_MESSAGE.to_le_bytes());
        return false;
    }
    slot[..8].copy_from_slice(&(envelopes.len() as u64).to_le_bytes());
    let mut at = 8;
    for e in envelopes {
        slot[at..at + 8].copy_from_slice(&(e.len() as u64).to_le_bytes());
        slot[at + 8..at + 8 + e.len()].copy_from_slice(e);
        at += 8 + e.len();
    }
    true
}

/// The envelope for rank `me` in a slot [`put_envelopes`] wrote (`None`: it comes by
/// message), or what is wrong with the slot.
fn take_envelope(slot: &[u8], me: usize) -> std::result::Result<Option<&[u8]>, String> {
    let word = |at: usize| -> std::result::Result<u64, String> {
        let b = slot.get(at..at + 8).ok_or_else(|| format!("a slot of {} bytes ends at byte {at}", slot.len()))?;
        Ok(u64::from_le_bytes(b.try_into().unwrap_or([0; 8])))
    };
    let count = word(0)?;
    let pick = match count {
        BY_MESSAGE => return Ok(None),
        ONE_ENVELOPE => 0,
        TWO_ENVELOPES if me == COORDINATOR => 0,
        TWO_ENVELOPES => 1,
        c => return Err(format!("its slot says {c} envelopes")),
    };
    let mut at = 8;
    for i in 0..=pick {
        let len = usize::try_from(word(at)?).map_err(|_| "an envelope longer than memory".to_string())?;
        let body = at
            .checked_add(8)
            .and_then(|b| Some(b..b.checked_add(len)?))
            .and_then(|r| slot.get(r))
            .ok_or_else(|| format!("an envelope of {len} bytes at byte {at} runs past its slot"))?;
        if i == pick {
            return Ok(Some(body));
        }
        at += 8 + len;
    }
    Err("no envelope".into())
}

/// The envelope rank `p` gets: the one to the coordinator, or the one to the others where it
/// differs.
fn envelope_for<'e>(p: usize, to_coordinator: &'e [u8], to_others: Option<&'e [u8]>) -> &'e [u8] {
    match to_others {
        Some(m) if p != COORDINATOR => m,
        _ => to_coordinator,
    }
}

/// The next control message from rank `p`. Where the cycles go through the host's area
/// (`nudges`), a nudge `p` owed from before this cycle may come first: it is passed over and
/// counted in `nudged`.
pub(super) fn recv_past_nudges<'s, 'e>(
    s: &'s Scope<'s, 'e>,
    p: usize,
    nudges: bool,
    nudged: &mut usize,
) -> Result<Vec<u8>> {
    loop {
        let msg = s.irecv_bytes(&[p], CONTROL_TAG, wire::MAX_MESSAGE)?.wait()?.1;
        if !nudges || msg != [wire::WAKE] {
            return Ok(msg);
        }
        *nudged += 1;
    }
}

impl Core {
    /// Sends this rank's state to every rank and receives theirs (the direct bitwise
    /// allreduce), through the host's area where the engine has one
    /// ([`exchange_area`](Self::exchange_area)), else over the pairs. `first` is a state
    /// already received (the one that began the cycle). Small cached allreduces travel with
    /// the state ([`eager_limit`](super::eager_limit)), each once.
    pub(super) fn exchange(&mut self, first: Option<(usize, Vec<u8>)>) -> Result<()> {
        let n = self.size;
        let out = self.ctl.begin();
        // This rank's tensors that travel: pending in the cache and not sent yet, small enough,
        // within the message's and the kept bytes' bounds.
        let mut eager: Vec<(u32, &[u8])> = Vec::new();
        let mut newly: Vec<(u32, u64, usize)> = Vec::new();
        // Nothing travels while a rank has joined (those allreduces run as collectives).
        if self.eager_max > 0 && !self.ctl.any_joined() {
            let pending = self.ctl.cached_pending();
            let cache = self.ctl.cache();
            let sent = &mut self.sent;
            sent.retain(|slot, (version, _)| cache.version(*slot) == Some(*version));
            let mut kept: usize = sent.values().map(|(_, len)| len).sum();
            let mut total = 0;
            for (slot, meta, (payload, _, _)) in pending {
                if sent.contains_key(&slot) || !exec::eager_kind(meta) {
                    continue;
                }
                let (Some(p), Some(version)) = (payload.as_ref().map(|p| p.bytes()), cache.version(slot)) else {
                    continue;
                };
                if p.len() <= self.eager_max
                    && total + p.len() <= EAGER_MESSAGE_BYTES
                    && kept + p.len() <= EAGER_KEPT_BYTES
                {
                    total += p.len();
                    kept += p.len();
                    eager.push((slot, p));
                    newly.push((slot, version, p.len()));
                }
            }
        }
        // The envelopes go into buffers kept from cycle to cycle.
        let [mut to_coordinator, mut to_others] = std::mem::take(&mut self.envelopes);
        wire::envelope_into(&mut to_coordinator, out.to(COORDINATOR), &eager);
        let others_differ = out.to(COORDINATOR) != out.to((COORDINATOR + 1) % n.max(1));
        if others_differ {
            wire::envelope_into(&mut to_others, out.to((COORDINATOR + 1) % n.max(1)), &eager);
        }
        drop(eager);
        let others = others_differ.then_some(to_others.as_slice());
        self.sent.extend(newly.into_iter().map(|(slot, version, len)| (slot, (version, len))));
        let exchanged = match self.area.clone() {
            Some(area) => self.exchange_area(&*area, first, &to_coordinator, others),
            None if self.tree => self.exchange_tree(first, &to_coordinator),
            None => self.exchange_envelopes(first, &to_coordinator, others),
        };
        for b in [&mut to_coordinator, &mut to_others] {
            // A cycle's rare large message (many names at once) is not kept.
            if b.capacity() > ENVELOPE_KEPT_BYTES {
                *b = Vec::new();
            }
        }
        self.envelopes = [to_coordinator, to_others];
        exchanged
    }

    /// The rest of [`exchange`](Self::exchange) over the pairs: takes the state that began
    /// the cycle, and sends the envelopes and receives the others'.
    fn exchange_envelopes(
        &mut self,
        first: Option<(usize, Vec<u8>)>,
        to_coordinator: &[u8],
        to_others: Option<&[u8]>,
    ) -> Result<()> {
        let (me, n) = (self.rank, self.size);
        if let Some((p, msg)) = first {
            self.take_state(p, msg)?;
        }
        let need = self.ctl.awaiting();
        let got = self.ctx.scope(|s| {
            let mut sends: SmallVec<[_; 8]> = SmallVec::new();
            for p in (0..n).filter(|&p| p != me) {
                sends.push(s.isend(p, CONTROL_TAG, envelope_for(p, to_coordinator, to_others))?);
            }
            let recvs = need
                .iter()
                .map(|&p| s.irecv_bytes(&[p], CONTROL_TAG, wire::MAX_MESSAGE).map(|r| (p, r)))
                .collect::<Result<SmallVec<[_; 8]>>>()?;
            let mut got: SmallVec<[_; 8]> = SmallVec::with_capacity(recvs.len());
            for (p, r) in recvs {
                got.push((p, r.wait()?.1));
            }
            for s in sends {
                s.wait()?;
            }
            Ok(got)
        })?;
        for (p, msg) in got {
            self.take_state(p, msg)?;
        }
        Ok(())
    }

    /// [`exchange`](Self::exchange) by reduction: this rank's state as a summary, combined
    /// with the others' in `log2(n)` rounds of one message each ([`agree::rounds`]), after
    /// which every rank holds what all the states say together; then the ranks with names not
    /// in the cache send their state in full to the coordinator. `first` is a peer's message
    /// that came while this rank waited idle (a round's, which began the cycle).
    fn exchange_tree(&mut self, first: Option<(usize, Vec<u8>)>, to_coordinator: &[u8]) -> Result<()> {
        let (me, n) = (self.rank, self.size);
        let (wme, ctx) = (self.w(me), self.ctx.clone());
        let world: SmallVec<[usize; 16]> = (0..n).map(|r| self.w(r)).collect();
        let mut first = first;
        let mut acc = self.ctl.own_summary()?;
        let rounds = agree::rounds(me, n);
        // Names in full go to the coordinator beside the rounds, on a tag of their own, and
        // are taken once the rounds said who sent some. They leave after this rank's last
        // round message to the coordinator, if it has one: a large state stands on the
        // connection in front of what follows it until the coordinator takes it.
        let requests = me != COORDINATOR && is_set(&acc.requests, me);
        let after = rounds.iter().rposition(|r| r.parts().0 == COORDINATOR);
        // A buffer per round that sends: each is sent while the next rounds run.
        let mut outs: Vec<Vec<u8>> = rounds.iter().map(|_| Vec::new()).collect();
        ctx.scope(|s| {
            let mut request = None;
            if requests && after.is_none() {
                request = Some(s.isend(COORDINATOR, REQUEST_TAG, to_coordinator)?);
            }
            for (i, (round, out)) in rounds.into_iter().zip(outs.iter_mut()).enumerate() {
                let (peer, sends, takes) = round.parts();
                if sends {
                    *out = acc.encode();
                }
                let out: &Vec<u8> = out;
                let sent = sends.then(|| s.isend(peer, CONTROL_TAG, out)).transpose()?;
                // The peer's message: the one that began the cycle, else the next to come.
                let got = match takes.then(|| first.take_if(|(p, _)| *p == peer)).flatten() {
                    Some((_, msg)) => Some(msg),
                    None if takes => Some(s.irecv_bytes(&[peer], CONTROL_TAG, wire::MAX_MESSAGE)?.wait()?.1),
                    None => None,
                };
                sent.map_or(Ok(()), |s| s.wait())?;
                let theirs = got.map(|msg| Summary::decode(&msg, world[peer], n)).transpose()?;
                match (round, theirs) {
                    (Round::Swap { merge: true, .. }, Some(theirs)) => acc.merge(&theirs, wme, world[peer])?,
                    (Round::Take(_), Some(theirs)) => {
                        acc.same_cycle(&theirs, wme, world[peer])?;
                        acc = theirs;
                    }
                    _ => {}
                }
                if requests && after == Some(i) {
                    request = Some(s.isend(COORDINATOR, REQUEST_TAG, to_coordinator)?);
                }
            }
            request.map_or(Ok(()), |r| r.wait())
        })?;
        if let Some((p, msg)) = first {
            return Err(Error::Protocol {
                peer: Some(world[p]),
                detail: format!(
                    "engine: a message of {} bytes from rank {} that no round of rank {wme}'s cycle takes",
                    msg.len(),
                    world[p]
                ),
            });
        }
        self.ctl.agreed(acc)?;
        // Rank 0: every sender's names at once (each read as it comes, not one after another).
        let need = self.ctl.awaiting();
        let got = ctx.scope(|s| {
            let recvs = need
                .iter()
                .map(|&p| s.irecv_bytes(&[p], REQUEST_TAG, wire::MAX_MESSAGE).map(|r| (p, r)))
                .collect::<Result<Vec<_>>>()?;
            recvs.into_iter().map(|(p, r)| Ok((p, r.wait()?.1))).collect::<Result<Vec<_>>>()
        })?;
        for (p, msg) in got {
            self.take_state(p, msg)?;
        }
        Ok(())
    }

    /// [`exchange_envelopes`](Self::exchange_envelopes) through the host's area: one step, in
    /// which each rank writes its envelopes into its slot and reads the others' (the pairs
    /// carry no message, but for an envelope too large for a slot, and a nudge to a rank that
    /// waits idle away from the area). `first` is a peer's envelope that came by message.
    fn exchange_area(
        &mut self,
        area: &dyn LocalArea,
        first: Option<(usize, Vec<u8>)>,
        to_coordinator: &[u8],
        to_others: Option<&[u8]>,
    ) -> Result<()> {
        let (me, n) = (self.rank, self.size);
        let ctx = self.ctx.clone();
        let comm = ctx.comm();
        let desc = OpDesc::new(Call::Barrier).extra(EXCHANGE);
        let what = "engine: exchanging the cycle's state through shared memory";
        let mut fits = true;
        // Each peer's envelope, or None for one that comes by message.
        let mut got: SmallVec<[(usize, Option<Vec<u8>>); 8]> = SmallVec::new();
        let mut spare = std::mem::take(&mut self.spare);
        let stepped = local::run(comm, area, what, desc, &CollectiveOptions::default(), |l| {
            let t = l.step_then(
                |own: &mut [u8]| {
                    let envelopes: SmallVec<[&[u8]; 2]> = std::iter::once(to_coordinator).chain(to_others).collect();
                    fits = put_envelopes(own, &envelopes);
                },
                || {
                    for p in (0..n).filter(|&p| p != me && area.claim_idle(p)) {
                        // A failed peer fails the wait that follows.
                        let _ = ctx.send(p, CONTROL_TAG, &[wire::WAKE]);
                    }
                },
            )?;
            for p in (0..n).filter(|&p| p != me) {
                let envelope = take_envelope(t.read::<u8>(p, 0..area.slot_bytes()), me)
                    .map_err(|detail| Error::Protocol { peer: Some(self.w(p)), detail: format!("{what}: {detail}") })?;
                got.push((p, envelope.map(|e| spare.copy_of(e))));
            }
            Ok(())
        });
        self.spare = spare;
        stepped?;
        if !fits {
            tracing::debug!(
                rank = self.rank,
                bytes = to_coordinator.len() + to_others.map_or(0, <[u8]>::len),
                slot = area.slot_bytes(),
                "engine: this cycle's state does not fit a slot of the area: it goes over the pairs"
            );
        }
        let mut first = first;
        let by_message: SmallVec<[usize; 8]> = got
            .iter()
            .filter(|(p, e)| e.is_none() && first.as_ref().is_none_or(|(f, _)| f != p))
            .map(|&(p, _)| p)
            .collect();
        let mut received: SmallVec<[(usize, Vec<u8>); 8]> = SmallVec::new();
        let mut nudged = 0;
        if !fits || !by_message.is_empty() {
            self.ctx.scope(|s| {
                let mut sends: SmallVec<[_; 8]> = SmallVec::new();
                if !fits {
                    for p in (0..n).filter(|&p| p != me) {
                        sends.push(s.isend(p, CONTROL_TAG, envelope_for(p, to_coordinator, to_others))?);
                    }
                }
                for &p in &by_message {
                    received.push((p, recv_past_nudges(s, p, true, &mut nudged)?));
                }
                sends.into_iter().try_for_each(|s| s.wait())
            })?;
        }
        self.owed_nudges = self.owed_nudges.saturating_sub(nudged);
        for (p, envelope) in got {
            let msg = match envelope {
                Some(msg) => msg,
                None => match first.take_if(|(f, _)| *f == p) {
                    Some((_, msg)) => msg,
                    None => match received.iter().position(|(r, _)| *r == p) {
                        Some(i) => received.swap_remove(i).1,
                        None => {
                            return Err(Error::Protocol {
                                peer: Some(self.w(p)),
                                detail: format!("{what}: no envelope came"),
                            });
                        }
                    },
                },
            };
            self.take_state(p, msg)?;
        }
        if let Some((p, _)) = first {
            return Err(Error::Protocol {
                peer: Some(self.w(p)),
                detail: format!(
                    "{what}: a state message came from rank {} while its envelope was in its slot",
                    self.w(p)
                ),
            });
        }
        Ok(())
    }

    /// Rank `p`'s envelope of this cycle: its state to the controller, the tensors it carries
    /// kept under what their slots hold (the same on every rank at a cycle's start).
    fn take_state(&mut self, p: usize, msg: Vec<u8>) -> Result<()> {
        let (state, tensors) = wire::open_envelope(&msg, self.w(p))?;
        self.ctl.receive_state(p, state)?;
        if tensors.is_empty() {
            self.spare.give(msg);
            return Ok(());
        }
        // One tensor (a warm cycle's case) is kept where it came, in the message, which is
        // then little more than the tensor. Several are copied out each: a tensor kept long (its
        // name stalls) must not hold on to a message of others' bytes.
        if let [(slot, bytes)] = tensors[..] {
            let (slot, at, len) = (slot, bytes.as_ptr() as usize - msg.as_ptr() as usize, bytes.len());
            self.keep(p, slot, Arc::new(msg), at, len);
            return Ok(());
        }
        for (slot, bytes) in tensors {
            self.keep(p, slot, Arc::new(bytes.to_vec()), 0, bytes.len());
        }
        self.spare.give(msg);
        Ok(())
    }

    /// Keeps rank `p`'s tensor for `slot`, `len` bytes at `at` in `msg`, under the slot's
    /// version now.
    fn keep(&mut self, p: usize, slot: u32, msg: Arc<Vec<u8>>, at: usize, len: usize) {
        if let (Some(version), Some(kept)) = (self.ctl.cache().version(slot), self.kept.get_mut(p))
            && let Some(old) = kept.insert(slot, Kept { version, msg, at, len })
        {
            self.spare.give_shared(old.msg);
        }
    }
}
