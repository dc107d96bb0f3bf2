//! The handshake as a sans-IO state machine: received bytes go in ([`Handshake::feed`]), and
//! [`Handshake::poll`] says what to do next: send bytes, read more, decide (admit a hello, answer
//! a proven peer), or stop (done or refused). Timeouts and sockets stay with the driver.

use super::codec::{DecodeError, Decoded, Reader, to_vec};
use super::messages::{
    BackendKind, CHALLENGE_LEN, Challenge, HELLO_LEN, Hello, MAC_LEN, MAX_PAYLOAD, Sealed, Status, Type,
};
use crate::transport::ContextId;
use crate::transport::auth::{mac, mac_eq};
use std::collections::VecDeque;
use std::fmt;

/// What MACs are labelled with, one label per message that carries one.
const CHALLENGE_LABEL: &[u8] = b"ferrogloo-handshake-4 challenge";
const PROOF_LABEL: &[u8] = b"ferrogloo-handshake-4 proof";
const WELCOME_LABEL: &[u8] = b"ferrogloo-handshake-4 welcome";
const READY_LABEL: &[u8] = b"ferrogloo-handshake-4 ready";

/// Who this side is in its context.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Local {
    pub(crate) ctx: ContextId,
    pub(crate) rank: usize,
    pub(crate) size: usize,
    /// The job's shared secret, if it has one.
    pub(crate) secret: Option<Vec<u8>>,
}

/// The other side of a handshake: its rank, and which of the pair's connections this is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Peer {
    pub(crate) rank: usize,
    pub(crate) lane: u8,
}

/// Bytes to send.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Outgoing {
    pub(crate) bytes: Vec<u8>,
    /// The message carries this side's payload: whatever else only a proven peer may have
    /// (descriptors passed alongside) goes with it, and only with it.
    pub(crate) payload: bool,
}

/// A finished handshake.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Done {
    pub(crate) peer: Peer,
    /// The peer's payload (the connector's proof, or the acceptor's welcome).
    pub(crate) payload: Vec<u8>,
    /// The connector's ready payload, on the acceptor (of a backend whose acceptor welcomes).
    pub(crate) ready: Vec<u8>,
}

/// Why a handshake ended without a connection.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Refusal {
    /// What arrived is not the message the protocol expects next: a stranger, another program
    /// or version, damaged bytes. Nothing is answered.
    Malformed(String),
    /// The peer refused this side, for this reason.
    ByPeer(Status),
    /// This side refused the peer, for this reason (told to the peer where the protocol has a
    /// message to tell it with).
    ByUs(Status),
}

impl fmt::Display for Refusal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Refusal::Malformed(why) => write!(f, "not a valid handshake: {why}"),
            Refusal::ByPeer(s) => write!(f, "handshake refused: {}", s.describe()),
            Refusal::ByUs(Status::WrongSecret) => f.write_str(
                "the peer failed to prove the shared secret (the secrets differ, or it is not the endpoint \
                 whose address this side used)",
            ),
            Refusal::ByUs(s) => write!(f, "refused the peer's handshake ({s:?}): {}", s.describe()),
        }
    }
}

/// What the driver does next.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Event {
    /// Send these bytes, then poll again.
    Send(Outgoing),
    /// Read exactly this many bytes (a message takes at least that many more) and feed them.
    Need(usize),
    /// (Acceptor) A hello arrived: say which local endpoint it is for with
    /// [`Handshake::admit`].
    Hello(Hello),
    /// The peer proved the secret (or, without one, passed the checks); its payload is
    /// [`Handshake::payload`]. Answer with [`Handshake::respond`] and this side's payload, or
    /// [`Handshake::refuse`]. (Acceptors always, after the proof; connectors after the
    /// welcome, on backends whose acceptor welcomes.)
    Proved(Peer),
    /// The connection is the peer's.
    Done(Done),
    /// The connection is to be closed.
    Refused(Refusal),
}

/// Where the handshake stands.
#[derive(Debug, Clone)]
enum State {
    /// Reading a message of this type.
    Read(Type),
    /// (Acceptor) Waiting for [`Handshake::admit`].
    Admit(Hello),
    /// Waiting for [`Handshake::respond`] or [`Handshake::refuse`].
    Decide,
    Over(Result<Done, Refusal>),
}

/// One side of one handshake.
#[derive(Debug)]
pub(crate) struct Handshake {
    kind: BackendKind,
    connector: bool,
    /// The acceptor welcomes, and the connector answers with a ready message
    /// ([`BackendKind::welcomes`]).
    full: bool,
    nonce: [u8; 16],
    secret: Option<Vec<u8>>,
    /// The acceptor's address as its side knows it (what it published; what the connector
    /// dialed), length-prefixed: every MAC covers it, so that an answer relayed from another
    /// address does not check.
    bind: Vec<u8>,
    peer: Option<Peer>,
    /// The connector's own payload until it is sent; then the peer's.
    payload: Vec<u8>,
    /// Every message so far, as sent.
    transcript: Vec<u8>,
    /// The message being read.
    inbuf: Vec<u8>,
    out: VecDeque<Outgoing>,
    state: State,
}

/// The connector's side of a handshake.
#[derive(Debug, Clone)]
pub(crate) struct Dial<'a> {
    pub(crate) kind: BackendKind,
    pub(crate) local: Local,
    pub(crate) to: usize,
    pub(crate) lane: u8,
    /// The acceptor's address as this side found it (its store entry's address blob).
    pub(crate) address: &'a [u8],
    /// What this side hands the acceptor once it proved the secret.
    pub(crate) payload: Vec<u8>,
    /// Fresh random bytes.
    pub(crate) nonce: [u8; 16],
}

fn wire_u32(v: usize) -> u32 {
    u32::try_from(v).unwrap_or(u32::MAX)
}

/// `address` as the MACs cover it: its length, then its bytes.
fn bind(address: &[u8]) -> Vec<u8> {
    let mut b = (address.len() as u64).to_le_bytes().to_vec();
    b.extend_from_slice(address);
    b
}

impl Handshake {
    /// A connector: its hello is the first thing [`Handshake::poll`] gives to send.
    pub(crate) fn connect(d: Dial<'_>) -> Self {
        let hello = Hello {
            secret: d.local.secret.is_some(),
            kind: d.kind,
            lane: d.lane,
            ctx: d.local.ctx,
            from: wire_u32(d.local.rank),
            to: wire_u32(d.to),
            size: wire_u32(d.local.size),
            nonce: d.nonce,
        };
        let mut h = Handshake {
            kind: d.kind,
            connector: true,
            full: d.kind.welcomes(),
            nonce: d.nonce,
            secret: d.local.secret,
            bind: bind(d.address),
            peer: Some(Peer { rank: d.to, lane: d.lane }),
            payload: d.payload,
            transcript: Vec::new(),
            inbuf: Vec::new(),
            out: VecDeque::new(),
            state: State::Read(Type::Challenge),
        };
        if h.payload.len() > MAX_PAYLOAD || d.lane >= d.kind.lanes() {
            let why = format!("this side's payload of {} bytes or lane {} does not fit", h.payload.len(), d.lane);
            h.state = State::Over(Err(Refusal::Malformed(why)));
            return h;
        }
        let bytes = to_vec(&hello);
        h.transcript.extend_from_slice(&bytes);
        h.out.push_back(Outgoing { bytes, payload: false });
        h
    }

    /// An acceptor of connections of backend `kind`.
    pub(crate) fn accept(kind: BackendKind, nonce: [u8; 16]) -> Self {
        Handshake {
            kind,
            connector: false,
            full: kind.welcomes(),
            nonce,
            secret: None,
            bind: Vec::new(),
            peer: None,
            payload: Vec::new(),
            transcript: Vec::new(),
            inbuf: Vec::new(),
            out: VecDeque::new(),
            state: State::Read(Type::Hello),
        }
    }

    /// What to do next (see [`Event`]). Done and refused repeat once reached.
    pub(crate) fn poll(&mut self) -> Event {
        loop {
            if let Some(o) = self.out.pop_front() {
                return Event::Send(o);
            }
            match &self.state {
                State::Over(Ok(d)) => return Event::Done(d.clone()),
                State::Over(Err(r)) => return Event::Refused(r.clone()),
                State::Admit(h) => return Event::Hello(*h),
                State::Decide => match self.peer {
                    Some(p) => return Event::Proved(p),
                    None => self.over(Err(Refusal::Malformed("no peer to answer".into()))),
                },
                State::Read(ty) => {
                    let ty = *ty;
                    match self.probe(ty) {
                        Err(DecodeError::Short(n)) => return Event::Need(n),
                        Err(DecodeError::Malformed(why)) => self.over(Err(Refusal::Malformed(why))),
                        Ok(msg) => {
                            let raw = std::mem::take(&mut self.inbuf);
                            self.receive(msg, &raw);
                        }
                    }
                }
            }
        }
    }

    /// Takes received bytes: at most what the message being read still needs (the rest is
    /// not the handshake's). Returns how many it took.
    pub(crate) fn feed(&mut self, bytes: &[u8]) -> usize {
        let State::Read(ty) = self.state else { return 0 };
        let mut taken = 0;
        while taken < bytes.len() {
            let Err(DecodeError::Short(n)) = self.probe(ty) else { break };
            let k = n.min(bytes.len() - taken);
            self.inbuf.extend_from_slice(&bytes[taken..taken + k]);
            taken += k;
        }
        taken
    }

    /// (Acceptor, after [`Event::Hello`]) The local endpoint the hello asks for (`None`: no
    /// endpoint here has its context), its own address (the one it published), and whether
    /// that pair's connection on the hello's lane is there already. Anything else is a no-op.
    pub(crate) fn admit(&mut self, local: Option<&Local>, address: &[u8], taken: bool) {
        let State::Admit(h) = self.state else { return };
        let (from, to, size) = (h.from as usize, h.to as usize, h.size as usize);
        let status = match local {
            None => Status::UnknownContext,
            Some(l) if l.ctx != h.ctx => Status::UnknownContext,
            // Connections always come from the higher rank.
            Some(l) if to != l.rank || size != l.size || from >= size || from <= to => Status::BadRank,
            Some(l) if h.secret != l.secret.is_some() => Status::SecretMismatch,
            Some(_) if taken => Status::Duplicate,
            Some(_) => Status::Ok,
        };
        if status != Status::Ok {
            let c = Challenge { status, nonce: [0; 16], mac: [0; 32] };
            self.out.push_back(Outgoing { bytes: to_vec(&c), payload: false });
            self.over(Err(Refusal::ByUs(status)));
            return;
        }
        self.secret = local.and_then(|l| l.secret.clone());
        self.bind = bind(address);
        self.peer = Some(Peer { rank: from, lane: h.lane });
        let mut bytes = to_vec(&Challenge { status, nonce: self.nonce, mac: [0; 32] });
        self.seal(CHALLENGE_LABEL, &mut bytes);
        self.out.push_back(Outgoing { bytes, payload: false });
        self.state = State::Read(Type::Proof);
    }

    /// The peer's payload, once it proved the secret ([`Event::Proved`]).
    pub(crate) fn payload(&self) -> &[u8] {
        match self.state {
            State::Decide => &self.payload,
            _ => &[],
        }
    }

    /// (After [`Event::Proved`]) Hands the proven peer this side's payload (at most
    /// [`MAX_PAYLOAD`] bytes; an acceptor that does not welcome has none to give). Anything
    /// else is a no-op.
    pub(crate) fn respond(&mut self, payload: &[u8]) {
        if !matches!(self.state, State::Decide) {
            return;
        }
        if payload.len() > MAX_PAYLOAD {
            return self.refuse(Status::Unavailable);
        }
        let Some(peer) = self.peer else { return self.over(Err(Refusal::Malformed("no peer".into()))) };
        if self.connector {
            // The acceptor's payload came with its welcome.
            self.send_sealed(Type::Ready, Status::Ok, payload);
            let theirs = std::mem::take(&mut self.payload);
            self.over(Ok(Done { peer, payload: theirs, ready: Vec::new() }));
        } else if self.full {
            self.send_sealed(Type::Welcome, Status::Ok, payload);
            self.state = State::Read(Type::Ready);
        } else {
            let theirs = std::mem::take(&mut self.payload);
            self.over(Ok(Done { peer, payload: theirs, ready: Vec::new() }));
        }
    }

    /// (After [`Event::Proved`]) Refuses the proven peer, telling it `status` where the
    /// protocol has a message to tell it with. Anything else is a no-op.
    pub(crate) fn refuse(&mut self, status: Status) {
        if !matches!(self.state, State::Decide) {
            return;
        }
        let status = if status == Status::Ok { Status::Unavailable } else { status };
        if self.connector {
            self.send_sealed(Type::Ready, status, &[]);
        } else if self.full {
            self.send_sealed(Type::Welcome, status, &[]);
        }
        self.over(Err(Refusal::ByUs(status)));
    }

    fn over(&mut self, end: Result<Done, Refusal>) {
        self.inbuf.clear();
        self.state = State::Over(end);
    }

    /// Tries to decode the message being read from what came so far.
    fn probe(&self, ty: Type) -> Decoded<Incoming> {
        let mut r = Reader::new(&self.inbuf);
        let msg = match ty {
            Type::Hello => Incoming::Hello(r.get()?),
            Type::Challenge => Incoming::Challenge(r.get()?),
            ty => Incoming::Sealed(Sealed::read(&mut r, ty)?),
        };
        r.end("a handshake message")?;
        Ok(msg)
    }

    /// The MAC this side computes for `msg` (whose last 32 bytes are its MAC), which follows
    /// the transcript so far.
    fn mac_for(&self, label: &[u8], msg: &[u8]) -> [u8; 32] {
        let body = &msg[..msg.len().saturating_sub(MAC_LEN)];
        mac(self.secret.as_deref(), &[label, &self.bind, &self.transcript, body])
    }

    /// Fills in the MAC of an outgoing message and adds it to the transcript.
    fn seal(&mut self, label: &[u8], bytes: &mut [u8]) {
        let m = self.mac_for(label, bytes);
        let at = bytes.len().saturating_sub(MAC_LEN);
        bytes[at..].copy_from_slice(&m);
        self.transcript.extend_from_slice(bytes);
    }

    /// Whether a received message's MAC checks (always, without a secret); adds it to the
    /// transcript.
    fn unseal(&mut self, label: &[u8], raw: &[u8], got: &[u8; 32]) -> bool {
        let ok = self.secret.is_none() || mac_eq(&self.mac_for(label, raw), got);
        self.transcript.extend_from_slice(raw);
        ok
    }

    fn send_sealed(&mut self, ty: Type, status: Status, payload: &[u8]) {
        let label = match ty {
            Type::Proof => PROOF_LABEL,
            Type::Welcome => WELCOME_LABEL,
            _ => READY_LABEL,
        };
        let mut bytes = to_vec(&Sealed { ty, status, payload: payload.to_vec(), mac: [0; 32] });
        if status == Status::Ok {
            self.seal(label, &mut bytes);
        }
        self.out.push_back(Outgoing { bytes, payload: status == Status::Ok });
    }

    /// Acts on a complete message (`raw`: its bytes).
    fn receive(&mut self, msg: Incoming, raw: &[u8]) {
        match msg {
            Incoming::Hello(h) => {
                debug_assert_eq!(raw.len(), HELLO_LEN);
                if h.kind != self.kind {
                    let c = Challenge { status: Status::WrongBackend, nonce: [0; 16], mac: [0; 32] };
                    self.out.push_back(Outgoing { bytes: to_vec(&c), payload: false });
                    return self.over(Err(Refusal::ByUs(Status::WrongBackend)));
                }
                self.transcript.extend_from_slice(raw);
                self.state = State::Admit(h);
            }
            Incoming::Challenge(c) => {
                debug_assert_eq!(raw.len(), CHALLENGE_LEN);
                if c.status != Status::Ok {
                    return self.over(Err(Refusal::ByPeer(c.status)));
                }
                if !self.unseal(CHALLENGE_LABEL, raw, &c.mac) {
                    return self.over(Err(Refusal::ByUs(Status::WrongSecret)));
                }
                let mine = std::mem::take(&mut self.payload);
                self.send_sealed(Type::Proof, Status::Ok, &mine);
                match (self.full, self.peer) {
                    (true, _) => self.state = State::Read(Type::Welcome),
                    // Nothing comes back: the acceptor checks the proof and takes the connection.
                    (false, Some(peer)) => self.over(Ok(Done { peer, payload: Vec::new(), ready: Vec::new() })),
                    (false, None) => self.over(Err(Refusal::Malformed("no peer".into()))),
                }
            }
            Incoming::Sealed(s) => {
                if s.status != Status::Ok {
                    return self.over(Err(Refusal::ByPeer(s.status)));
                }
                let label = match s.ty {
                    Type::Proof => PROOF_LABEL,
                    Type::Welcome => WELCOME_LABEL,
                    _ => READY_LABEL,
                };
                if !self.unseal(label, raw, &s.mac) {
                    if s.ty == Type::Proof && self.full {
                        // Tell a misconfigured rank why; a stranger learns nothing it did not know.
                        self.send_sealed(Type::Welcome, Status::WrongSecret, &[]);
                    }
                    return self.over(Err(Refusal::ByUs(Status::WrongSecret)));
                }
                match (s.ty, self.peer) {
                    (Type::Ready, Some(peer)) => {
                        let payload = std::mem::take(&mut self.payload);
                        self.over(Ok(Done { peer, payload, ready: s.payload }));
                    }
                    (_, Some(_)) => {
                        self.payload = s.payload;
                        self.state = State::Decide;
                    }
                    (_, None) => self.over(Err(Refusal::Malformed("no peer".into()))),
                }
            }
        }
    }
}

/// A decoded message.
enum Incoming {
    Hello(Hello),
    Challenge(Challenge),
    Sealed(Sealed),
}
