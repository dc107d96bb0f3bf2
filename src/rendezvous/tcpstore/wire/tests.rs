//! Property and unit tests of the wire types: every request and reply round-trips however its
//! bytes are cut, random and damaged bytes never panic a decoder, and each limit is refused as
//! soon as a length or count announces it.

use super::*;
use proptest::collection::vec;
use proptest::prelude::*;

fn bytes(max: usize) -> impl Strategy<Value = Vec<u8>> {
    vec(any::<u8>(), 0..max)
}

/// Every request, with random keys and values.
fn request() -> impl Strategy<Value = Request> {
    let (k, v, keys) = (|| bytes(24), || bytes(64), || vec(bytes(24), 0..5));
    prop_oneof![
        any::<u32>().prop_map(|magic| Request::Validate { magic }),
        (k(), v()).prop_map(|(key, value)| Request::Set { key, value }),
        (k(), v(), v()).prop_map(|(key, expected, desired)| Request::CompareSet { key, expected, desired }),
        k().prop_map(|key| Request::Get { key }),
        (k(), any::<i64>()).prop_map(|(key, delta)| Request::Add { key, delta }),
        keys().prop_map(|keys| Request::Check { keys }),
        keys().prop_map(|keys| Request::Wait { keys }),
        Just(Request::GetNumKeys),
        k().prop_map(|key| Request::DeleteKey { key }),
        (k(), v()).prop_map(|(key, value)| Request::Append { key, value }),
        keys().prop_map(|keys| Request::MultiGet { keys }),
        vec((k(), v()), 0..4).prop_map(|pairs| Request::MultiSet { pairs }),
        Just(Request::CancelWait),
        any::<u32>().prop_map(|nonce| Request::Ping { nonce }),
        Just(Request::ListKeys),
    ]
}

/// Every reply, with random values.
fn response() -> impl Strategy<Value = Response> {
    prop_oneof![
        any::<u32>().prop_map(Response::Pong),
        bytes(64).prop_map(Response::Value),
        any::<i64>().prop_map(Response::Int),
        any::<bool>().prop_map(Response::Check),
        Just(Response::WaitDone),
        Just(Response::WaitCanceled),
        vec(bytes(64), 0..5).prop_map(Response::Values),
        vec(bytes(24), 0..5).prop_map(Response::Keys),
    ]
}

fn shape() -> impl Strategy<Value = Shape> {
    prop_oneof![
        Just(Shape::Pong),
        Just(Shape::Value),
        Just(Shape::Int),
        Just(Shape::Check),
        Just(Shape::Wait),
        (0..4usize).prop_map(Shape::Values),
        Just(Shape::Keys),
    ]
}

fn encoded(r: &Request) -> Vec<u8> {
    let mut b = Vec::new();
    r.encode(&mut b);
    b
}

fn written(r: &Response) -> Vec<u8> {
    let mut b = Vec::new();
    r.write_to(&mut b).unwrap();
    b
}

/// Feeds `parts` to `decode` one after another until a message is whole or an error: what it
/// found, with the bytes a whole message took counted from the start of the first part.
fn feed<T>(
    parts: &[&[u8]],
    mut decode: impl FnMut(&[u8]) -> Result<Decoded<T>, WireError>,
) -> Result<Decoded<T>, WireError> {
    let mut last = Decoded::NeedMore(0);
    let mut before = 0;
    for p in std::iter::once(&[][..]).chain(parts.iter().copied()) {
        match decode(p)? {
            Decoded::Done(m, used) => return Ok(Decoded::Done(m, before + used)),
            more => last = more,
        }
        before += p.len();
    }
    Ok(last)
}

fn requests(parts: &[&[u8]]) -> Result<Decoded<Request>, WireError> {
    let mut d = RequestDecoder::new();
    feed(parts, |b| d.decode(b))
}

fn replies(shape: Shape, parts: &[&[u8]]) -> Result<Decoded<Response>, WireError> {
    let mut d = ResponseDecoder::new(shape);
    feed(parts, |b| d.decode(b))
}

/// Checks that `b`, one whole message, decodes to `want` cut anywhere and fed in two parts or
/// byte by byte, and that a cut message asks for no more than its rest.
fn decodes_cut_anywhere<T: PartialEq + std::fmt::Debug>(
    b: &[u8],
    want: &T,
    decode: impl Fn(&[&[u8]]) -> Result<Decoded<T>, WireError>,
) -> Result<(), TestCaseError> {
    for i in 0..=b.len() {
        match decode(&[&b[..i]]) {
            Ok(Decoded::NeedMore(n)) => prop_assert!(i < b.len() && n >= 1 && n <= b.len() - i, "cut at {i}: {n}"),
            Ok(Decoded::Done(m, used)) => prop_assert!(i == b.len() && used == i && &m == want, "cut at {i}"),
            Err(e) => prop_assert!(false, "cut at {i}: {e}"),
        }
        match decode(&[&b[..i], &b[i..]]) {
            Ok(Decoded::Done(m, used)) => prop_assert!(&m == want && used == b.len(), "split at {i}: {m:?}"),
            other => prop_assert!(false, "split at {i}: {other:?}"),
        }
    }
    let bytewise: Vec<&[u8]> = b.chunks(1).collect();
    match decode(&bytewise) {
        Ok(Decoded::Done(m, used)) => prop_assert!(&m == want && used == b.len()),
        other => prop_assert!(false, "byte by byte: {other:?}"),
    }
    Ok(())
}

proptest! {
    #[test]
    fn every_request_round_trips_cut_anywhere(req in request(), next in request()) {
        let b = encoded(&req);
        decodes_cut_anywhere(&b, &req, requests)?;
        // Two requests in a row: the first takes only its own bytes, and the rest decodes on.
        let mut two = b.clone();
        next.encode(&mut two);
        let mut d = RequestDecoder::new();
        prop_assert_eq!(d.decode(&two), Ok(Decoded::Done(req, b.len())));
        prop_assert_eq!(d.decode(&two[b.len()..]), Ok(Decoded::Done(next, two.len() - b.len())));
    }

    #[test]
    fn every_reply_round_trips_cut_anywhere(resp in response()) {
        let b = written(&resp);
        decodes_cut_anywhere(&b, &resp, |parts| replies(resp.shape(), parts))?;
    }

    #[test]
    fn random_bytes_decode_alike_however_cut_and_never_panic(
        data in bytes(160),
        op in prop_oneof![0..20u8, any::<u8>()],
        cut in any::<prop::sample::Index>(),
        shape in shape(),
    ) {
        // An opcode led, so that most inputs get past the first byte.
        let data: Vec<u8> = [op].into_iter().chain(data).collect();
        let cut = cut.index(data.len() + 1);
        let bytewise: Vec<&[u8]> = data.chunks(1).collect();
        let whole = requests(&[&data]);
        prop_assert_eq!(&whole, &requests(&[&data[..cut], &data[cut..]]));
        prop_assert_eq!(&whole, &requests(&bytewise));
        if let Ok(Decoded::Done(req, used)) = &whole {
            prop_assert_eq!(&encoded(req)[..], &data[..*used], "a request encodes back to its bytes");
        }
        let whole = replies(shape, &[&data]);
        prop_assert_eq!(&whole, &replies(shape, &[&data[..cut], &data[cut..]]));
        prop_assert_eq!(&whole, &replies(shape, &bytewise));
        if let Ok(Decoded::Done(resp, used)) = &whole {
            prop_assert_eq!(resp.shape(), shape);
            prop_assert_eq!(&written(resp)[..], &data[..*used], "a reply encodes back to its bytes");
        }
    }

    #[test]
    fn a_damaged_request_never_panics_and_stays_within_its_bytes(
        req in request(),
        at in any::<prop::sample::Index>(),
        xor in 1..=255u8,
        keep in any::<prop::sample::Index>(),
    ) {
        let mut b = encoded(&req);
        let at = at.index(b.len());
        b[at] ^= xor;
        b.truncate(keep.index(b.len() + 1));
        match requests(&[&b]) {
            Ok(Decoded::Done(r, used)) => prop_assert_eq!(&encoded(&r)[..], &b[..used]),
            Ok(Decoded::NeedMore(n)) => prop_assert!(n >= 1),
            Err(e) => prop_assert!(!e.detail.is_empty()),
        }
    }
}

/// A length or count field's bytes.
fn le8(v: u64) -> [u8; 8] {
    v.to_le_bytes()
}

#[test]
fn a_key_or_count_over_the_limit_is_refused_when_announced() {
    let announce = [&[GET][..], &le8(MAX_KEY as u64 + 1)].concat();
    let e = requests(&[&announce]).unwrap_err();
    assert!(e.limit && e.op == "GET" && e.key.is_none(), "{e:?}");
    assert_eq!(e.to_string(), "GET: a key of 8193 bytes, over the limit of 8192");
    let e = requests(&[&[&[WAIT][..], &le8(MAX_KEYS as u64 + 1)].concat()]).unwrap_err();
    assert!(e.limit && e.to_string() == "WAIT: 131073 keys in one request, over the limit of 131072", "{e}");
    let e = requests(&[&[&[MULTI_SET][..], &le8(u64::MAX)].concat()]).unwrap_err();
    assert!(e.limit && e.detail.contains("18446744073709551615 keys"), "{e}");
}

#[test]
fn a_value_over_the_limit_names_its_key_and_nothing_is_allocated_for_it_first() {
    let mut b = vec![SET];
    b.extend_from_slice(&le8(3));
    b.extend_from_slice(b"/k1");
    let mut over = b.clone();
    over.extend_from_slice(&le8(MAX_VALUE as u64 + 1));
    let e = requests(&[&over]).unwrap_err();
    assert!(e.limit && e.key.as_deref() == Some(&b"/k1"[..]), "{e:?}");
    assert_eq!(e.to_string(), "SET of key \"/k1\": a value of 8388609 bytes, over the limit of 8388608");
    // A value at the limit, of which 10 bytes came: the decoder holds those, not 8 MiB.
    b.extend_from_slice(&le8(MAX_VALUE as u64));
    b.extend_from_slice(&[7; 10]);
    let mut d = RequestDecoder::new();
    assert_eq!(d.decode(&b), Ok(Decoded::NeedMore(MAX_VALUE - 10)));
    assert_eq!(d.op(), Some(SET));
    let held = &d.reading.held;
    assert!(held.capacity() < 1024 && held[..] == b[..], "{} bytes held", held.capacity());
    // The next bytes are taken as they come, and no more than the value needs.
    let rest = vec![7; MAX_VALUE - 10];
    assert_eq!(d.decode(&rest[..5]), Ok(Decoded::NeedMore(MAX_VALUE - 15)));
    assert!(d.reading.held.capacity() < 1024);
    let mut more = rest[5..].to_vec();
    more.push(CANCEL_WAIT);
    match d.decode(&more) {
        Ok(Decoded::Done(Request::Set { key, value }, n)) => {
            assert!(key == b"/k1" && value.len() == MAX_VALUE && value.iter().all(|&x| x == 7) && n == more.len() - 1)
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(d.op(), None);
    assert_eq!(d.decode(&more[more.len() - 1..]), Ok(Decoded::Done(Request::CancelWait, 1)));
}

#[test]
fn a_request_over_its_total_is_refused_at_the_entry_that_crosses_it() {
    let mut d = RequestDecoder::with_limits(Limits { key: 4, value: 10, keys: 8, total: 20, message: "request" });
    let req = Request::MultiSet { pairs: vec![(b"a".to_vec(), vec![1; 9]), (b"b".to_vec(), vec![2; 9])] };
    let b = encoded(&req);
    assert!(matches!(d.decode(&b), Ok(Decoded::Done(r, n)) if r == req && n == b.len()), "20 bytes: at the limit");
    let req = Request::MultiSet { pairs: vec![(b"a".to_vec(), vec![1; 9]), (b"bc".to_vec(), vec![2; 9])] };
    let e = d.decode(&encoded(&req)).unwrap_err();
    assert!(e.limit && e.key.as_deref() == Some(&b"bc"[..]), "{e:?}");
    assert_eq!(e.detail, "a value of 9 bytes makes 21 bytes in one request, over the limit of 20");
}

#[test]
fn unknown_opcodes_and_bad_answers_are_protocol_errors() {
    for op in [14, 15, 16, 18, 255] {
        let e = requests(&[&[op]]).unwrap_err();
        assert!(!e.limit && e.detail.contains(&format!("unknown opcode {op}")), "{e}");
    }
    let e = replies(Shape::Wait, &[&[7]]).unwrap_err();
    assert_eq!(e.to_string(), "reply: 7 answers a WAIT (expected 0 or 1)");
    let e = replies(Shape::Check, &[&[2]]).unwrap_err();
    assert!(!e.limit && e.detail.contains("a CHECK"), "{e}");
    let e = replies(Shape::Value, &[&le8(MAX_REPLY as u64 + 1)]).unwrap_err();
    assert!(e.limit && e.detail == "a value of 67108865 bytes, over the limit of 67108864", "{e}");
    let e = replies(Shape::Keys, &[&le8(-1i64 as u64)]).unwrap_err();
    assert!(e.limit && e.detail.contains("keys in one reply"), "{e}");
}

#[test]
fn wire_bytes_are_pytorchs() {
    // As PyTorch's client sends them (torch/csrc/distributed/c10d/TCPStore.cpp).
    let set = Request::Set { key: &b"/k"[..], value: &b"v"[..] };
    let mut b = Vec::new();
    set.encode(&mut b);
    assert_eq!(b, [&[1][..], &le8(2), b"/k", &le8(1), b"v"].concat());
    let validate = encoded(&Request::Validate { magic: MAGIC });
    assert_eq!(validate, [0, 0xCE, 0xF7, 0x85, 0x3C]);
    assert_eq!(encoded(&Request::Add { key: vec![], delta: -2 }), [&[ADD][..], &le8(0), &le8(-2i64 as u64)].concat());
    assert_eq!(written(&Response::<Vec<u8>>::Keys(vec![b"x".to_vec()])), [&le8(1)[..], &le8(1), b"x"].concat());
    assert_eq!(
        written(&Response::<Vec<u8>>::Values(vec![vec![], b"y".to_vec()])),
        [&le8(0)[..], &le8(1), b"y"].concat()
    );
    assert_eq!(replies(Shape::Values(0), &[]), Ok(Decoded::Done(Response::Values(vec![]), 0)));
    assert_eq!(Request::<Vec<u8>>::Wait { keys: vec![] }.shape(), Some(Shape::Wait));
    assert_eq!(Request::<Vec<u8>>::Append { key: vec![], value: vec![] }.shape(), None);
    assert_eq!(Request::<Vec<u8>>::ListKeys.name(), "LIST_KEYS");
}

#[test]
fn every_request_and_reply_keeps_its_bytes() {
    // The bytes of 329d2e9, before the wire used the crate's codec (PyTorch's layout).
    let k = || b"k".to_vec();
    let key = [&le8(1)[..], b"k"].concat();
    let all_requests: [(Request, Vec<u8>); 15] = [
        (Request::Validate { magic: 7 }, vec![0, 7, 0, 0, 0]),
        (Request::Set { key: k(), value: b"vw".to_vec() }, [&[1][..], &key, &le8(2), b"vw"].concat()),
        (
            Request::CompareSet { key: k(), expected: vec![], desired: b"d".to_vec() },
            [&[2][..], &key, &le8(0), &le8(1), b"d"].concat(),
        ),
        (Request::Get { key: k() }, [&[3][..], &key].concat()),
        (Request::Add { key: k(), delta: 258 }, [&[4][..], &key, &[2, 1, 0, 0, 0, 0, 0, 0]].concat()),
        (Request::Check { keys: vec![k(), k()] }, [&[5][..], &le8(2), &key, &key].concat()),
        (Request::Wait { keys: vec![] }, [&[6][..], &le8(0)].concat()),
        (Request::GetNumKeys, vec![7]),
        (Request::DeleteKey { key: k() }, [&[8][..], &key].concat()),
        (Request::Append { key: k(), value: vec![] }, [&[9][..], &key, &le8(0)].concat()),
        (Request::MultiGet { keys: vec![k()] }, [&[10][..], &le8(1), &key].concat()),
        (Request::MultiSet { pairs: vec![(k(), b"x".to_vec())] }, [&[11][..], &le8(1), &key, &le8(1), b"x"].concat()),
        (Request::CancelWait, vec![12]),
        (Request::Ping { nonce: 0x0102_0304 }, vec![13, 4, 3, 2, 1]),
        (Request::ListKeys, vec![17]),
    ];
    for (req, want) in all_requests {
        assert_eq!(encoded(&req), want, "{req:?}");
        assert_eq!(requests(&[&want]), Ok(Decoded::Done(req, want.len())));
    }
    let all_replies: [(Response, Vec<u8>); 9] = [
        (Response::Pong(0x0102_0304), vec![4, 3, 2, 1]),
        (Response::Value(b"vw".to_vec()), [&le8(2)[..], b"vw"].concat()),
        (Response::Int(-1), vec![0xff; 8]),
        (Response::Check(true), vec![0]),
        (Response::Check(false), vec![1]),
        (Response::WaitDone, vec![0]),
        (Response::WaitCanceled, vec![1]),
        (Response::Values(vec![k(), vec![]]), [&key[..], &le8(0)].concat()),
        (Response::Keys(vec![k()]), [&le8(1)[..], &key].concat()),
    ];
    for (resp, want) in all_replies {
        assert_eq!(written(&resp), want, "{resp:?}");
        assert_eq!(replies(resp.shape(), &[&want]), Ok(Decoded::Done(resp, want.len())));
    }
}
