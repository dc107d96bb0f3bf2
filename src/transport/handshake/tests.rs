//! The handshake's unit and property tests, one set for every backend: the messages' codec,
//! both sides run against each other in memory (whole, byte by byte, in random pieces), every
//! refusal, random and mutated bytes, replays and fake acceptors.

use super::codec::{Reader, decode_all, to_vec};
use super::machine::{Dial, Done, Event, Handshake, Local, Outgoing, Peer, Refusal};
use super::messages::{
    BackendKind, Challenge, HELLO_LEN, Hello, MAX_MESSAGE, MAX_PAYLOAD, Message, Sealed, Status, Type,
};
use proptest::prelude::*;
use std::collections::VecDeque;

const CTX: [u8; 16] = [7; 16];
const ADDRESS: &[u8] = b"127.0.0.1:4000";

/// One handshake between a connector and an acceptor, as the test sets it up.
#[derive(Debug, Clone)]
struct Setup {
    kind: BackendKind,
    connector: Local,
    to: usize,
    lane: u8,
    /// What the connector dialed.
    dialed: Vec<u8>,
    c_payload: Vec<u8>,
    /// The connector's ready payload, or a refusal instead.
    c_answer: Result<Vec<u8>, Status>,
    /// The acceptor's backend, endpoint (as its lookup finds it) and address.
    a_kind: BackendKind,
    acceptor: Option<Local>,
    address: Vec<u8>,
    taken: bool,
    /// The acceptor's payload, or a refusal instead.
    a_answer: Result<Vec<u8>, Status>,
    nonces: ([u8; 16], [u8; 16]),
}

fn local(rank: usize, size: usize, secret: Option<&[u8]>) -> Local {
    Local { ctx: CTX, rank, size, secret: secret.map(<[u8]>::to_vec) }
}

impl Setup {
    /// Rank 1 of 2 connects to rank 0; both with `secret`.
    fn new(secret: Option<&[u8]>) -> Self {
        Setup {
            kind: BackendKind::Tcp,
            connector: local(1, 2, secret),
            to: 0,
            lane: 0,
            dialed: ADDRESS.to_vec(),
            c_payload: b"connector's payload".to_vec(),
            c_answer: Ok(b"ready payload".to_vec()),
            a_kind: BackendKind::Tcp,
            acceptor: Some(local(0, 2, secret)),
            address: ADDRESS.to_vec(),
            taken: false,
            a_answer: Ok(b"acceptor's payload".to_vec()),
            nonces: ([1; 16], [2; 16]),
        }
    }

    /// The same, on `kind` (both sides).
    fn on(self, kind: BackendKind) -> Self {
        Setup { kind, a_kind: kind, ..self }
    }

    fn connector(&self) -> Handshake {
        Handshake::connect(Dial {
            kind: self.kind,
            local: self.connector.clone(),
            to: self.to,
            lane: self.lane,
            address: &self.dialed,
            payload: self.c_payload.clone(),
            nonce: self.nonces.0,
        })
    }

    fn acceptor(&self) -> Handshake {
        Handshake::accept(self.a_kind, self.nonces.1)
    }
}

/// What one side did.
#[derive(Debug, Default)]
struct Log {
    /// Everything it sent, in order.
    sent: Vec<Outgoing>,
    /// How it ended; `None`: it still waits.
    end: Option<Result<Done, Refusal>>,
}

/// Decides for `side` when the machine asks.
fn decide(hs: &mut Handshake, ev: &Event, s: &Setup, connector: bool) {
    match ev {
        Event::Hello(_) => hs.admit(s.acceptor.as_ref(), &s.address, s.taken),
        Event::Proved(_) => {
            let answer = if connector { &s.c_answer } else { &s.a_answer };
            match answer {
                Ok(p) => hs.respond(p),
                Err(st) => hs.refuse(*st),
            }
        }
        _ => {}
    }
}

/// Runs both sides against each other, delivering at most `chunk()` bytes per read; returns
/// each side's log (`end` is `None` where a side still waits when nothing more moves).
fn run(s: &Setup, chunk: &mut dyn FnMut() -> usize) -> (Log, Log) {
    // Side 0 is the connector; inboxes[i] holds what side i has yet to read.
    let mut sides = [s.connector(), s.acceptor()];
    let mut logs = [Log::default(), Log::default()];
    let mut inboxes = [VecDeque::<u8>::new(), VecDeque::<u8>::new()];
    for _ in 0..10_000 {
        let mut moved = false;
        for i in 0..2 {
            if logs[i].end.is_some() {
                continue;
            }
            let hs = &mut sides[i];
            let ev = hs.poll();
            match &ev {
                Event::Send(o) => {
                    assert!(o.bytes.len() <= MAX_MESSAGE);
                    inboxes[1 - i].extend(&o.bytes);
                    logs[i].sent.push(o.clone());
                    moved = true;
                }
                Event::Need(n) => {
                    assert!(*n > 0 && *n <= MAX_MESSAGE, "need {n}");
                    let k = (*n).min(chunk().max(1)).min(inboxes[i].len());
                    if k > 0 {
                        let bytes: Vec<u8> = inboxes[i].drain(..k).collect();
                        assert_eq!(hs.feed(&bytes), k, "a machine refused bytes it asked for");
                        moved = true;
                    }
                }
                Event::Hello(_) | Event::Proved(_) => {
                    decide(hs, &ev, s, i == 0);
                    moved = true;
                }
                Event::Done(d) => {
                    logs[i].end = Some(Ok(d.clone()));
                    moved = true;
                }
                Event::Refused(r) => {
                    logs[i].end = Some(Err(r.clone()));
                    moved = true;
                }
            }
        }
        if !moved {
            break;
        }
    }
    let [c, a] = logs;
    (c, a)
}

fn whole(s: &Setup) -> (Log, Log) {
    run(s, &mut || usize::MAX)
}

/// The acceptor's view of a finished handshake of `s`.
fn accepted(s: &Setup) -> Done {
    let ready = if s.kind.welcomes() { s.c_answer.clone().unwrap_or_default() } else { Vec::new() };
    Done { peer: Peer { rank: s.connector.rank, lane: s.lane }, payload: s.c_payload.clone(), ready }
}

/// The connector's view.
fn connected(s: &Setup) -> Done {
    let payload = if s.kind.welcomes() { s.a_answer.clone().unwrap_or_default() } else { Vec::new() };
    Done { peer: Peer { rank: s.to, lane: s.lane }, payload, ready: Vec::new() }
}

/// No message with a payload left a side that ended refused by its own check of the peer.
fn no_payload_sent(log: &Log) -> bool {
    !log.sent.iter().any(|o| o.payload)
}

const KINDS: [BackendKind; 3] = [BackendKind::Tcp, BackendKind::Shm, BackendKind::Ibverbs];

#[test]
fn both_sides_finish_with_each_others_payloads() {
    for secret in [None, Some(&b"s3cret"[..])] {
        for kind in KINDS {
            let s = Setup::new(secret).on(kind);
            let (c, a) = whole(&s);
            assert_eq!(c.end, Some(Ok(connected(&s))), "secret {secret:?} {kind:?}");
            assert_eq!(a.end, Some(Ok(accepted(&s))), "secret {secret:?} {kind:?}");
            let flags = |l: &Log| l.sent.iter().map(|o| o.payload).collect::<Vec<_>>();
            if kind.welcomes() {
                // Hello, proof and ready from the connector; challenge and welcome back.
                assert_eq!((flags(&c), flags(&a)), (vec![false, true, true], vec![false, true]));
            } else {
                // Hello and proof; a challenge back.
                assert_eq!((flags(&c), flags(&a)), (vec![false, true], vec![false]));
            }
        }
    }
}

#[test]
fn without_a_secret_the_macs_are_zero_and_with_one_they_are_not() {
    let (c, a) = whole(&Setup::new(None));
    let challenge: Challenge = decode_all(&a.sent[0].bytes, "a challenge").unwrap();
    assert_eq!(challenge.mac, [0; 32]);
    // Every message but the hello ends with its MAC.
    assert!(c.sent[1..].iter().chain(&a.sent).all(|o| o.bytes.ends_with(&[0; 32])));
    let (_, a) = whole(&Setup::new(Some(b"k")));
    let challenge: Challenge = decode_all(&a.sent[0].bytes, "a challenge").unwrap();
    assert_ne!(challenge.mac, [0; 32]);
}

#[test]
fn a_message_split_at_every_boundary_reads_the_same() {
    // One byte per read: every boundary of every message is a split.
    for kind in KINDS {
        let s = Setup::new(Some(b"k")).on(kind);
        let (c, a) = run(&s, &mut || 1);
        assert_eq!(c.end, Some(Ok(connected(&s))));
        assert_eq!(a.end, Some(Ok(accepted(&s))));
    }
    // Each message split once, at each point.
    let s = Setup::new(Some(b"k")).on(BackendKind::Shm);
    let (c, a) = whole(&s);
    for k in 1..HELLO_LEN {
        let mut acc = s.acceptor();
        let hello = &c.sent[0].bytes;
        assert_eq!(acc.poll(), Event::Need(HELLO_LEN));
        assert_eq!(acc.feed(&hello[..k]), k);
        assert_eq!(acc.poll(), Event::Need(HELLO_LEN - k));
        assert_eq!(acc.feed(&hello[k..]), HELLO_LEN - k);
        assert!(matches!(acc.poll(), Event::Hello(h) if h.from == 1 && h.to == 0));
    }
    for msg in c.sent.iter().chain(&a.sent) {
        for k in 0..=msg.bytes.len() {
            let (head, tail) = msg.bytes.split_at(k);
            let mut r = Reader::new(head);
            let whole = decode_all::<Message>(&msg.bytes, "a message").unwrap();
            match r.get::<Message>() {
                Ok(m) => assert_eq!((m, tail.is_empty()), (whole, true)),
                Err(super::codec::DecodeError::Short(n)) => assert!(n <= tail.len(), "need {n} of {}", tail.len()),
                Err(e) => panic!("a valid message's prefix of {k} bytes is {e}"),
            }
        }
    }
}

#[test]
fn the_machines_never_read_past_their_handshake() {
    for kind in KINDS {
        let s = Setup::new(Some(b"k")).on(kind);
        let (mut c, mut a) = (s.connector(), s.acceptor());
        let drive = |from: &mut Handshake, to: &mut Handshake, from_connector: bool| loop {
            match from.poll() {
                Event::Send(o) => {
                    let mut stream = o.bytes.clone();
                    stream.extend_from_slice(b"the first frame after the handshake");
                    assert_eq!(to.feed(&stream), o.bytes.len(), "took bytes that follow the message");
                }
                ev @ (Event::Hello(_) | Event::Proved(_)) => decide(from, &ev, &s, from_connector),
                _ => break,
            }
        };
        for turn in 0..6 {
            if turn % 2 == 0 {
                drive(&mut c, &mut a, true);
            } else {
                drive(&mut a, &mut c, false);
            }
        }
        assert_eq!(c.poll(), Event::Done(connected(&s)), "{kind:?}");
        assert_eq!(a.poll(), Event::Done(accepted(&s)), "{kind:?}");
        assert_eq!(a.feed(b"more"), 0, "a finished handshake takes nothing");
    }
}

#[test]
fn every_refusal_is_named_on_both_sides() {
    let s = Setup::new(Some(b"k"));
    let by_acceptor_at_hello: Vec<(Setup, Status)> = vec![
        (Setup { acceptor: None, ..s.clone() }, Status::UnknownContext),
        (
            Setup { acceptor: Some(Local { ctx: [8; 16], ..local(0, 2, Some(b"k")) }), ..s.clone() },
            Status::UnknownContext,
        ),
        (Setup { acceptor: Some(local(1, 3, Some(b"k"))), ..s.clone() }, Status::BadRank), // not rank `to`
        (Setup { acceptor: Some(local(0, 3, Some(b"k"))), ..s.clone() }, Status::BadRank), // sizes differ
        (Setup { connector: local(2, 2, Some(b"k")), ..s.clone() }, Status::BadRank),      // from >= size
        (
            Setup { connector: local(0, 2, Some(b"k")), acceptor: Some(local(0, 2, Some(b"k"))), ..s.clone() },
            Status::BadRank, // from <= to
        ),
        (Setup { acceptor: Some(local(0, 2, None)), ..s.clone() }, Status::SecretMismatch),
        (Setup { connector: local(1, 2, None), ..s.clone() }, Status::SecretMismatch),
        (Setup { taken: true, ..s.clone() }, Status::Duplicate),
        (Setup { a_kind: BackendKind::Ibverbs, ..s.clone() }, Status::WrongBackend),
    ];
    for (setup, status) in by_acceptor_at_hello {
        let (c, a) = whole(&setup);
        assert_eq!(a.end, Some(Err(Refusal::ByUs(status))), "{status:?}");
        assert_eq!(c.end, Some(Err(Refusal::ByPeer(status))), "{status:?}");
        assert!(no_payload_sent(&c) && no_payload_sent(&a), "{status:?}: a payload went to a refused peer");
    }
    // Refusals after the proofs: the acceptor's of the connector's payload, the connector's of
    // the acceptor's.
    for status in [Status::Settings, Status::Unavailable] {
        let shm = s.clone().on(BackendKind::Shm);
        let (c, a) = whole(&Setup { a_answer: Err(status), ..shm.clone() });
        assert_eq!((a.end, c.end), (Some(Err(Refusal::ByUs(status))), Some(Err(Refusal::ByPeer(status)))));
        let (c, a) = whole(&Setup { c_answer: Err(status), ..shm });
        assert_eq!((c.end, a.end), (Some(Err(Refusal::ByUs(status))), Some(Err(Refusal::ByPeer(status)))));
        // A TCP connector is done with its proof: it learns of a refusal from the closed
        // connection.
        let (c, a) = whole(&Setup { a_answer: Err(status), ..s.clone() });
        assert_eq!((a.end, c.end), (Some(Err(Refusal::ByUs(status))), Some(Ok(connected(&s)))));
    }
    // Different secrets: the connector finds the acceptor's proof wrong and sends nothing more.
    let (c, a) = whole(&Setup { connector: local(1, 2, Some(b"other")), ..s.clone() });
    assert_eq!(c.end, Some(Err(Refusal::ByUs(Status::WrongSecret))));
    assert!(no_payload_sent(&c));
    assert_eq!(a.end, None, "the acceptor waits for a proof that never comes");
    assert!(Refusal::ByUs(Status::WrongSecret).to_string().contains("shared secret"));
    assert!(Refusal::ByPeer(Status::WrongSecret).to_string().contains("shared secret"));
    for v in 0..=8 {
        let st = Status::from_u8(v).unwrap();
        assert!(!st.describe().is_empty() && Refusal::ByPeer(st).to_string().contains(st.describe()));
    }
    assert_eq!(Status::from_u8(9), None);
}

#[test]
fn a_recorded_connector_is_refused_before_the_acceptor_hands_anything_over() {
    // A genuine handshake, recorded; the connector's messages replayed to an acceptor of the
    // same endpoint (same context, ranks, secret and address) in a later handshake.
    for kind in KINDS {
        let s = Setup::new(Some(b"k")).on(kind);
        let (recorded, _) = whole(&s);
        let mut a = Handshake::accept(s.kind, [9; 16]);
        let mut sent = Vec::new();
        let mut replay = recorded.sent.iter().map(|o| o.bytes.clone());
        let end = loop {
            match a.poll() {
                Event::Send(o) => sent.push(o),
                Event::Need(_) => match replay.next() {
                    Some(b) => assert_eq!(a.feed(&b), b.len()),
                    None => break None,
                },
                ev @ (Event::Hello(_) | Event::Proved(_)) => decide(&mut a, &ev, &s, false),
                Event::Done(d) => break Some(Ok(d)),
                Event::Refused(r) => break Some(Err(r)),
            }
        };
        assert_eq!(end, Some(Err(Refusal::ByUs(Status::WrongSecret))), "{kind:?}");
        assert!(!sent.iter().any(|o| o.payload), "the acceptor answered a replay with its payload");
    }
}

#[test]
fn a_fake_acceptor_gets_a_hello_and_nothing_else() {
    let s = Setup::new(Some(b"k")).on(BackendKind::Ibverbs);
    // Without the secret, with another, with the real one's challenge from another
    // handshake, and relaying the real one's challenge from an address not its own.
    let (c, _) = whole(&Setup { acceptor: Some(local(0, 2, Some(b"guess"))), ..s.clone() });
    assert_eq!(c.end, Some(Err(Refusal::ByUs(Status::WrongSecret))));
    assert!(no_payload_sent(&c));
    let (c, _) = whole(&Setup { dialed: b"10.0.0.66:4000".to_vec(), ..s.clone() });
    assert_eq!(c.end, Some(Err(Refusal::ByUs(Status::WrongSecret))), "a relay from another address");
    assert!(no_payload_sent(&c));
    let (_, recorded) = whole(&Setup { nonces: ([3; 16], [4; 16]), ..s.clone() });
    let mut c = s.connector();
    assert!(matches!(c.poll(), Event::Send(_)));
    let challenge = &recorded.sent[0].bytes;
    assert_eq!(c.feed(challenge), challenge.len());
    assert_eq!(c.poll(), Event::Refused(Refusal::ByUs(Status::WrongSecret)));
    // Even a forged "accepted" with a zero MAC (what an acceptor without a secret sends).
    let mut c = s.connector();
    let _ = c.poll();
    let forged = to_vec(&Challenge { status: Status::Ok, nonce: [5; 16], mac: [0; 32] });
    c.feed(&forged);
    assert_eq!(c.poll(), Event::Refused(Refusal::ByUs(Status::WrongSecret)));
}

#[test]
fn malformed_messages_are_refused_in_words_without_an_answer() {
    let s = Setup::new(None);
    let (c, _) = whole(&s);
    let hello = c.sent[0].bytes.clone();
    let cases: Vec<(usize, u8, &str)> = vec![
        (0, b'X', "magic"),
        (4, 9, "version"),
        (6, 2, "due"), // a challenge where a hello was due
        (6, 77, "message"),
        (7, 4, "flags"),
        (8, 9, "backend"),
        (9, 2, "lane"),
        (10, 1, "reserved"),
    ];
    for (at, v, what) in cases {
        let mut bad = hello.clone();
        bad[at] = v;
        let mut acc = s.acceptor();
        acc.feed(&bad);
        match acc.poll() {
            Event::Refused(Refusal::Malformed(why)) => assert!(why.contains(what), "{why} (wanted {what})"),
            other => panic!("byte {at} = {v}: {other:?}"),
        }
        assert!(matches!(acc.poll(), Event::Refused(_)), "a refusal repeats and sends nothing");
    }
    // A welcome whose payload length is over the bound, and one with an unknown status.
    let s = s.on(BackendKind::Shm);
    let (_, a) = whole(&s);
    let mut c2 = s.connector();
    let _ = c2.poll();
    c2.feed(&a.sent[0].bytes);
    let _ = c2.poll(); // the proof
    let mut long = a.sent[1].bytes.clone();
    long[8..10].copy_from_slice(&((MAX_PAYLOAD + 1) as u16).to_le_bytes());
    assert_eq!(c2.feed(&long), 10, "nothing past the length is read");
    assert!(matches!(c2.poll(), Event::Refused(Refusal::Malformed(w)) if w.contains("payload")));
    let mut c3 = s.connector();
    let _ = c3.poll();
    let mut odd = a.sent[0].bytes.clone();
    odd[7] = 200;
    c3.feed(&odd);
    assert!(matches!(c3.poll(), Event::Refused(Refusal::Malformed(w)) if w.contains("status")));
}

#[test]
fn a_connector_with_a_payload_over_the_bound_sends_nothing() {
    let s = Setup { c_payload: vec![1; MAX_PAYLOAD + 1], ..Setup::new(None) };
    let mut c = s.connector();
    assert!(matches!(c.poll(), Event::Refused(Refusal::Malformed(_))));
}

fn setup_strategy() -> impl Strategy<Value = Setup> {
    (
        proptest::option::of(proptest::collection::vec(any::<u8>(), 0..40)),
        any::<bool>(),
        2usize..300,
        any::<(usize, usize)>(),
        prop_oneof![Just(BackendKind::Tcp), Just(BackendKind::Shm), Just(BackendKind::Ibverbs)],
        any::<u8>(),
        proptest::collection::vec(any::<u8>(), 0..=MAX_PAYLOAD),
        proptest::collection::vec(any::<u8>(), 0..64),
        proptest::collection::vec(any::<u8>(), 0..=MAX_PAYLOAD),
        proptest::collection::vec(any::<u8>(), 0..64),
        any::<([u8; 16], [u8; 16], [u8; 16])>(),
    )
        .prop_map(|(secret, _, size, (x, y), kind, lane, cp, rp, ap, addr, (ctx, n1, n2))| {
            let (to, from) = (x % (size - 1), 0);
            let from = (to + 1 + y % (size - 1 - to)).max(from);
            let l = |rank| Local { ctx, rank, size, secret: secret.clone() };
            Setup {
                kind,
                connector: l(from),
                to,
                lane: lane % kind.lanes(),
                dialed: addr.clone(),
                c_payload: cp,
                c_answer: Ok(rp),
                a_kind: kind,
                acceptor: Some(l(to)),
                address: addr,
                taken: false,
                a_answer: Ok(if kind.welcomes() { ap } else { Vec::new() }),
                nonces: (n1, n2),
            }
        })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 128, ..ProptestConfig::default() })]

    #[test]
    fn handshakes_round_trip_in_any_pieces(s in setup_strategy(), pieces in proptest::collection::vec(1usize..80, 1..50)) {
        let mut i = 0;
        let (c, a) = run(&s, &mut || { i += 1; pieces[i % pieces.len()] });
        prop_assert_eq!(c.end, Some(Ok(connected(&s))));
        prop_assert_eq!(a.end, Some(Ok(accepted(&s))));
    }

    #[test]
    fn messages_round_trip(m in prop_oneof![
        any::<(bool, u8, [u8; 16], u32, u32, u32, [u8; 16])>().prop_map(|(secret, k, ctx, from, to, size, nonce)| {
            let kind = [BackendKind::Tcp, BackendKind::Shm, BackendKind::Ibverbs][usize::from(k % 3)];
            Message::Hello(Hello { secret, kind, lane: k % kind.lanes(), ctx, from, to, size, nonce })
        }),
        (0u8..=8, any::<[u8; 16]>(), any::<[u8; 32]>()).prop_map(|(st, nonce, mac)| {
            Message::Challenge(Challenge { status: Status::from_u8(st).unwrap(), nonce, mac })
        }),
        (3u8..=5, 0u8..=8, proptest::collection::vec(any::<u8>(), 0..=MAX_PAYLOAD), any::<[u8; 32]>()).prop_map(
            |(ty, st, payload, mac)| {
                let ty = [Type::Proof, Type::Welcome, Type::Ready][usize::from(ty - 3)];
                let status = if ty == Type::Proof { Status::Ok } else { Status::from_u8(st).unwrap() };
                Message::Sealed(Sealed { ty, status, payload, mac })
            }
        ),
    ]) {
        let bytes = to_vec(&m);
        prop_assert!(bytes.len() <= MAX_MESSAGE);
        prop_assert_eq!(decode_all::<Message>(&bytes, "a message"), Ok(m));
    }

    #[test]
    fn random_bytes_never_panic_and_never_finish(
        bytes in proptest::collection::vec(any::<u8>(), 0..400),
        pieces in 1usize..64,
        secret in any::<bool>(),
    ) {
        let s = Setup::new(secret.then_some(&b"k"[..]));
        for mut hs in [s.acceptor(), s.connector()] {
            let mut fed = 0;
            for _ in 0..1000 {
                match hs.poll() {
                    Event::Need(n) => {
                        let k = n.min(pieces).min(bytes.len() - fed);
                        if k == 0 { break; }
                        prop_assert_eq!(hs.feed(&bytes[fed..fed + k]), k);
                        fed += k;
                    }
                    ev @ (Event::Hello(_) | Event::Proved(_)) => decide(&mut hs, &ev, &s, false),
                    Event::Send(o) => prop_assert!(!o.payload || !secret, "a payload sent to random bytes"),
                    Event::Done(_) => prop_assert!(!secret, "random bytes passed a proof"),
                    Event::Refused(_) => break,
                }
            }
        }
        // Whatever decodes as a message encodes back to the same bytes.
        if let Ok(m) = Reader::new(&bytes).get::<Message>() {
            prop_assert_eq!(&to_vec(&m)[..], &bytes[..to_vec(&m).len()]);
        }
    }

    #[test]
    fn a_flipped_byte_never_goes_unnoticed_under_a_secret(
        s in setup_strategy(),
        which in any::<usize>(),
        at in any::<usize>(),
        flip in 1u8..=255,
    ) {
        let s = Setup { connector: Local { secret: Some(b"k".to_vec()), ..s.connector }, acceptor: s.acceptor.map(|l| Local { secret: Some(b"k".to_vec()), ..l }), ..s };
        // Run the genuine handshake with one byte of one message flipped on its way.
        let (mut c, mut a) = (s.connector(), s.acceptor());
        let mut ends: [Option<Result<Done, Refusal>>; 2] = [None, None];
        let mut count = 0usize;
        let msgs = if s.kind.welcomes() { 5 } else { 3 };
        let target = which % msgs;
        let mut pending: [VecDeque<u8>; 2] = [VecDeque::new(), VecDeque::new()];
        for _ in 0..1000 {
            let mut moved = false;
            for side in 0..2 {
                if ends[side].is_some() { continue; }
                let hs = if side == 0 { &mut c } else { &mut a };
                let ev = hs.poll();
                match ev {
                    Event::Send(mut o) => {
                        if count == target {
                            let i = at % o.bytes.len();
                            o.bytes[i] ^= flip;
                        }
                        count += 1;
                        pending[1 - side].extend(o.bytes);
                        moved = true;
                    }
                    Event::Need(n) => {
                        let k = n.min(pending[side].len());
                        if k > 0 {
                            let b: Vec<u8> = pending[side].drain(..k).collect();
                            hs.feed(&b);
                            moved = true;
                        }
                    }
                    ev @ (Event::Hello(_) | Event::Proved(_)) => { decide(hs, &ev, &s, side == 0); moved = true; }
                    Event::Done(d) => { ends[side] = Some(Ok(d)); moved = true; }
                    Event::Refused(r) => { ends[side] = Some(Err(r)); moved = true; }
                }
            }
            if !moved { break; }
        }
        prop_assert!(!(matches!(ends[0], Some(Ok(_))) && matches!(ends[1], Some(Ok(_)))), "a flipped byte in message {} went unnoticed", target);
        if let Some(Ok(d)) = &ends[0] { prop_assert_eq!(d, &connected(&s)); }
        if let Some(Ok(d)) = &ends[1] { prop_assert_eq!(d, &accepted(&s)); }
    }
}
