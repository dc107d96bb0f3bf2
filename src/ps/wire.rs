//! Parameter-server messages: `kind u8 | dtype u8 | cmd i32 | timestamp u64 | shard u32 | key count u32 |
//! keys u64… | length count u32 | lengths u64… | padding to 8 bytes | values (the rest)`,
//! little-endian, written and read with the crate's codec ([`crate::codec`]); a malformed
//! message is [`Error::Protocol`] naming the sender.

use crate::codec::{BufMutExt, DecodeError, Decoded, Reader};
use crate::error::{Error, Result};
use smallvec::SmallVec;

/// Longest message a node receives.
pub(crate) const MAX_MESSAGE: usize = 1 << 30;

/// Most runs of values a message is sent from where they are (see [`Message::parts`]): each
/// is an iovec of a TCP send and a slice walked per fragment of a shared-memory one.
pub(crate) const GATHER_MOST: usize = 64;

/// Answers with at least this many bytes of values send them as a message of their own after
/// the head ([`Kind::ReplyHead`]): a worker waiting for them with its buffer receives them
/// there, not into a buffer of the message's that it copies from. Below, the second message
/// costs more than the copy it saves.
pub(crate) const SPLIT_MIN: usize = 64 << 10;

/// A push (or push-pull) with at least this many bytes of values for one server, over a pair
/// that hands received bytes over where they arrive (shared memory, in-process), sends its head,
/// then the values as a message of their own ([`Kind::PushHead`]), which the transport holds
/// until the server, having read the head, receives them: the server sums them into its store
/// straight from the transport (one pass, no buffer of the push's size) instead of receiving
/// the whole message and summing it after. Below, the second message costs more than the pass
/// it saves.
pub(crate) const PUSH_SPLIT_MIN: usize = 256 << 10;

/// In place of the count of a message's lengths: every key has the length of the one word
/// that follows (no count of a real list comes near it: a message holds at most
/// [`MAX_MESSAGE`] bytes).
const UNIFORM: u32 = u32::MAX;

/// Lengths are sent as one word ([`UNIFORM`]) when at least this many keys share one: below,
/// the list is short anyway (and small messages keep the layout they always had).
const UNIFORM_MIN: usize = 64;

/// The length of a message with `keys` keys, `lens` lengths and `payload` bytes of values
/// (`None`: more than a `usize` holds).
pub(crate) fn encoded_len(keys: usize, lens: usize, payload: usize) -> Option<usize> {
    // kind, dtype, cmd, timestamp, shard: 18 bytes; two counts of 4; 8 per key and length;
    // padded so that the values start 8-byte aligned.
    let words = keys.checked_add(lens)?.checked_mul(8)?;
    words.checked_add(26)?.checked_next_multiple_of(8)?.checked_add(payload)
}

/// `None` when a message with `keys` keys, `lens` lengths and `payload` bytes of values fits
/// [`MAX_MESSAGE`]; otherwise its size in words, for an error ("1073741872 bytes").
pub(crate) fn oversize(keys: usize, lens: usize, payload: Option<usize>) -> Option<String> {
    match payload.and_then(|p| encoded_len(keys, lens, p)) {
        Some(n) if n <= MAX_MESSAGE => None,
        Some(n) => Some(format!("{n} bytes")),
        None => Some("more than usize::MAX bytes".to_string()),
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Kind {
    Push = 1,
    Pull = 2,
    PushPull = 3,
    Reply = 4,
    Error = 5,
    Bye = 6,
    Heartbeat = 7,
    /// An answer whose values follow as a message of their own (on the values tag), so that
    /// a worker can receive them straight into its caller's buffer.
    ReplyHead = 8,
    /// A push whose values follow as a message of their own (on the values tag): the server
    /// receives them next, summing them into its store as they arrive.
    PushHead = 9,
    /// The same for a push-pull.
    PushPullHead = 10,
}

impl Kind {
    fn from_code(c: u8) -> Option<Kind> {
        [
            Kind::Push,
            Kind::Pull,
            Kind::PushPull,
            Kind::Reply,
            Kind::Error,
            Kind::Bye,
            Kind::Heartbeat,
            Kind::ReplyHead,
            Kind::PushHead,
            Kind::PushPullHead,
        ]
        .into_iter()
        .find(|k| *k as u8 == c)
    }

    /// The kind of a request's head when its values follow on their own
    /// ([`PUSH_SPLIT_MIN`]); the request's own kind when it has no such head.
    pub(crate) fn head(self) -> Kind {
        match self {
            Kind::Push => Kind::PushHead,
            Kind::PushPull => Kind::PushPullHead,
            other => other,
        }
    }
}

#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Message {
    pub(crate) kind: Kind,
    pub(crate) dtype: u8,
    pub(crate) cmd: i32,
    pub(crate) ts: u64,
    /// The server whose keys these are (a backup answers for its primary's shard).
    pub(crate) shard: u32,
    pub(crate) keys: Vec<u64>,
    pub(crate) lens: Vec<usize>,
    /// The values' bytes start at `at` (a received message keeps its whole buffer).
    pub(crate) values: Vec<u8>,
    pub(crate) at: usize,
}

impl Message {
    /// A message with no keys or values.
    pub(crate) fn control(kind: Kind) -> Message {
        Message {
            kind,
            dtype: 0,
            cmd: 0,
            ts: 0,
            shard: 0,
            keys: Vec::new(),
            lens: Vec::new(),
            values: Vec::new(),
            at: 0,
        }
    }

    /// The values' bytes.
    pub(crate) fn payload(&self) -> &[u8] {
        self.values.get(self.at..).unwrap_or(&[])
    }

    pub(crate) fn encode(&self) -> Vec<u8> {
        let mut b = self.encode_head(self.payload().len());
        b.extend_from_slice(self.payload());
        b
    }

    /// Everything but the values (padded so that they start 8-byte aligned), with room for
    /// `extra` bytes of them.
    pub(crate) fn encode_head(&self, extra: usize) -> Vec<u8> {
        let mut b = Vec::new();
        self.encode_head_into(&mut b, extra);
        b
    }

    /// The parts a message with this head (encoded into `head`) and the values `runs` (one
    /// after the other) is sent from: the head, then the runs read from where they are. Many
    /// runs (small keys one by one) are copied after the head instead, into one part.
    pub(crate) fn parts<'a>(head: &'a mut Vec<u8>, runs: &[&'a [u8]]) -> SmallVec<[&'a [u8]; 8]> {
        if runs.len() > GATHER_MOST {
            for r in runs {
                head.extend_from_slice(r);
            }
            return smallvec::smallvec![&head[..]];
        }
        let head: &'a Vec<u8> = head;
        std::iter::once(&head[..]).chain(runs.iter().copied()).collect()
    }

    /// [`encode_head`](Self::encode_head) into `b` (cleared; its memory is reused).
    pub(crate) fn encode_head_into(&self, b: &mut Vec<u8>, extra: usize) {
        b.clear();
        b.reserve(40 + 8 * (self.keys.len() + self.lens.len()) + extra);
        b.write(self.kind as u8);
        b.write(self.dtype);
        b.write(self.cmd);
        b.write(self.ts);
        b.write(self.shard);
        b.write_words(self.keys.iter().copied());
        match self.lens.split_first() {
            // Many keys of one length (a sparse model's): their length once.
            Some((&first, rest)) if self.lens.len() >= UNIFORM_MIN && rest.iter().all(|&l| l == first) => {
                b.write(UNIFORM);
                b.write(first as u64);
            }
            _ => b.write_words(self.lens.iter().map(|&l| l as u64)),
        }
        b.resize(b.len().next_multiple_of(8), 0);
    }

    pub(crate) fn decode(buf: Vec<u8>, peer: usize) -> Result<Message> {
        let bad = |what: &str| Error::Protocol {
            peer: Some(peer),
            detail: format!("parameter-server message of {} bytes from rank {peer}: {what}", buf.len()),
        };
        let mut r = Reader::new(&buf);
        let mut m = Self::decode_head(&mut r).map_err(|e| match e {
            DecodeError::Short(_) => bad("cut short"),
            DecodeError::Malformed(what) => bad(&what),
        })?;
        m.at = buf.len() - r.remaining();
        m.values = buf;
        Ok(m)
    }

    /// Everything but the values, and the padding before them: a message without values.
    fn decode_head(r: &mut Reader<'_>) -> Decoded<Message> {
        r.require(18)?;
        let kind = Kind::from_code(r.get()?).ok_or_else(|| DecodeError::malformed("an unknown kind"))?;
        let (dtype, cmd, ts, shard) = (r.get()?, r.get()?, r.get()?, r.get()?);
        let keys = r.counted_words()?;
        let too_large = |_| DecodeError::malformed("a length too large");
        let (lens, words) = if r.clone().get::<u32>().ok() == Some(UNIFORM) {
            // Every key has the same length: one word for them all.
            r.get::<u32>()?;
            let len = usize::try_from(r.get::<u64>()?).map_err(too_large)?;
            (vec![len; keys.len()], 1)
        } else {
            let lens = r.counted_words()?.into_iter().map(usize::try_from).collect::<std::result::Result<Vec<_>, _>>();
            let lens = lens.map_err(too_large)?;
            let n = lens.len();
            (lens, n)
        };
        let at = 18 + 8 + 8 * (keys.len() + words);
        r.bytes(at.next_multiple_of(8) - at)?;
        Ok(Message { kind, dtype, cmd, ts, shard, keys, lens, values: Vec::new(), at: 0 })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn round_trip() {
        let m = Message {
            kind: Kind::PushPull,
            dtype: 1,
            cmd: -7,
            ts: 99,
            shard: 3,
            keys: vec![1, 5],
            lens: vec![2, 0],
            values: vec![1, 2, 3, 4],
            at: 0,
        };
        let d = Message::decode(m.encode(), 3).expect("decodes");
        assert_eq!(
            (d.kind, d.cmd, d.ts, d.shard, &d.keys, &d.lens, d.payload()),
            (m.kind, m.cmd, m.ts, m.shard, &m.keys, &m.lens, m.payload())
        );
        assert_eq!(d.at % 8, 0);
        assert_eq!(encoded_len(2, 2, 4), Some(m.encode().len()));
        assert_eq!(encoded_len(0, 0, 0), Some(Message::control(Kind::Bye).encode().len()));
        assert_eq!(encoded_len(usize::MAX / 8, 1, 0), None);
        assert_eq!(oversize(1, 1, Some(MAX_MESSAGE - 64)), None);
        assert_eq!(oversize(1, 1, Some(MAX_MESSAGE)).as_deref(), Some("1073741872 bytes"));
        assert_eq!(oversize(1, 1, None).as_deref(), Some("more than usize::MAX bytes"));
        assert_eq!(Message::decode(Message::control(Kind::Bye).encode(), 0).ok().map(|m| m.kind), Some(Kind::Bye));
    }

    /// Bytes from hex, spaces ignored.
    fn hex(s: &str) -> Vec<u8> {
        let s: String = s.split_whitespace().collect();
        (0..s.len()).step_by(2).map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap()).collect()
    }

    #[test]
    fn many_keys_of_one_length_send_it_once_and_read_back_whole() {
        let message = |lens: Vec<usize>| Message {
            kind: Kind::PushPull,
            dtype: 1,
            cmd: 2,
            ts: 3,
            shard: 0,
            keys: (0..lens.len() as u64).collect(),
            values: vec![0; 4 * lens.iter().sum::<usize>()],
            lens,
            at: 0,
        };
        for (lens, uniform) in [
            (vec![1; UNIFORM_MIN], true),
            (vec![3; 1000], true),
            (vec![1; UNIFORM_MIN - 1], false),
            ((0..100).map(|i| 1 + i % 2).collect(), false),
        ] {
            let m = message(lens.clone());
            let mut head = Vec::new();
            m.encode_head_into(&mut head, 0);
            let list = 18 + 8 + 8 * (2 * lens.len());
            assert_eq!(head.len() < list.next_multiple_of(8), uniform, "{} keys: {} bytes", lens.len(), head.len());
            let mut bytes = head;
            bytes.extend_from_slice(&m.values);
            let back = Message::decode(bytes, 0).expect("decodes");
            assert_eq!((&back.keys, &back.lens, back.payload().len()), (&m.keys, &lens, m.values.len()));
        }
    }

    #[test]
    fn message_bytes_are_unchanged() {
        // The encoding of 329d2e9, before the parameter server used the crate's codec.
        let m = Message {
            kind: Kind::PushPull,
            dtype: 1,
            cmd: -7,
            ts: 99,
            shard: 3,
            keys: vec![1, 5],
            lens: vec![2, 0],
            values: vec![9, 1, 2, 3, 4],
            at: 1,
        };
        let want = hex("03 01 f9ffffff 6300000000000000 03000000 02000000 0100000000000000 0500000000000000
             02000000 0200000000000000 0000000000000000 000000000000 01020304");
        assert_eq!(m.encode(), want);
        let mut head = vec![7; 3];
        m.encode_head_into(&mut head, 4);
        assert_eq!(head, want[..64]);
        assert_eq!(
            Message::control(Kind::Bye).encode(),
            hex("06 00 00000000 0000000000000000 00000000 00000000 00000000 000000000000")
        );
    }

    #[test]
    fn malformed_messages_say_what() {
        let text = |b: &[u8]| match Message::decode(b.to_vec(), 4) {
            Err(Error::Protocol { peer: Some(4), detail }) => detail,
            other => panic!("{other:?}"),
        };
        assert_eq!(text(&[3; 5]), "parameter-server message of 5 bytes from rank 4: cut short");
        assert_eq!(text(&[0; 18]), "parameter-server message of 18 bytes from rank 4: an unknown kind");
        assert_eq!(text(&[1; 21]), "parameter-server message of 21 bytes from rank 4: cut short");
        let mut counts = Message::control(Kind::Pull).encode();
        counts[18] = 1;
        assert_eq!(text(&counts[..30]), "parameter-server message of 30 bytes from rank 4: cut short");
        let bye = Message::control(Kind::Bye).encode();
        assert_eq!(text(&bye[..26]), "parameter-server message of 26 bytes from rank 4: cut short");
        assert!(Message::decode(bye[..32].to_vec(), 4).is_ok());
    }

    proptest! {
        #[test]
        fn garbage_is_a_protocol_error_naming_the_sender(data in proptest::collection::vec(any::<u8>(), 0..120)) {
            if let Err(e) = Message::decode(data, 4) {
                prop_assert!(matches!(e, Error::Protocol { peer: Some(4), .. }), "{e}");
            }
        }
    }
}
