//! A single-producer single-consumer ring of records, in memory two processes share.
//!
//! The producer appends records (a length-and-kind word, then its bytes, padded to
//! [`RingMem::ALIGN`]) and publishes its write position `tail` with a release store after the
//! bytes; the consumer loads `tail` with acquire, reads records in place, and publishes its read
//! position `head` with a release store only after it is done with the bytes, so the producer
//! never overwrites what is being read. Publishing `head` is lazy (every quarter of the ring),
//! so the line it lives on does not bounce per message; a producer that finds the ring full sets
//! `producer_waiting`, and the consumer then publishes at once and wakes it. A consumer about to
//! sleep sets `consumer_sleeping` and the producer wakes it after its next publish. Both
//! hand-offs are store, SeqCst fence, load on each side (Dekker): one of the two always sees the
//! other. No ordering is assumed beyond these atomics and fences (nothing of x86's).
//!
//! A record never wraps: one that does not fit before the end of the ring is preceded by a
//! padding record to the end. Records are at most half the ring, so one always fits once the
//! ring is empty.
//!
//! The protocol is written against [`RingMem`], implemented by shared memory
//! ([`super::segment`]) and, in the tests, by loom's model, which checks it under every
//! interleaving.

use std::sync::atomic::Ordering;

/// A word of the ring's control block.
pub(crate) trait Word {
    fn load(&self, o: Ordering) -> u64;
    fn store(&self, v: u64, o: Ordering);
}

/// What a ring is made of: its control words and its data bytes.
pub(crate) trait RingMem {
    /// Records start at multiples of this many bytes (at least 8: a record's first word).
    const ALIGN: usize;
    type W: Word;
    /// The producer's published write position (total bytes written).
    fn tail(&self) -> &Self::W;
    /// The consumer's published read position (total bytes consumed).
    fn head(&self) -> &Self::W;
    /// Set by a producer that found the ring full (it waits for `head`).
    fn producer_waiting(&self) -> &Self::W;
    /// Set by a consumer that is about to sleep (it waits for `tail`).
    fn consumer_sleeping(&self) -> &Self::W;
    /// Bytes of data (a multiple of `ALIGN`).
    fn capacity(&self) -> usize;
    /// Writes `bytes` at `off` (`off + bytes.len() <= capacity`).
    fn write(&self, off: usize, bytes: &[u8]);
    /// Reads `out.len()` bytes at `off`.
    fn read(&self, off: usize, out: &mut [u8]);
    /// A full fence.
    fn fence(&self);
}

impl Word for std::sync::atomic::AtomicU64 {
    fn load(&self, o: Ordering) -> u64 {
        std::sync::atomic::AtomicU64::load(self, o)
    }
    fn store(&self, v: u64, o: Ordering) {
        std::sync::atomic::AtomicU64::store(self, v, o)
    }
}

/// Kind of a padding record (skipped by the consumer).
pub(crate) const PAD: u32 = 0;
/// Kind [`Consumer::peek`] gives a record no producer can have written (a length out of
/// bounds or misaligned).
pub(crate) const CORRUPT: u32 = u32::MAX;
/// Bytes of a record's first word: length (including it and padding) and kind.
pub(crate) const WORD: usize = 8;

fn align<M: RingMem>(n: usize) -> usize {
    n.div_ceil(M::ALIGN) * M::ALIGN
}

fn word(len: usize, kind: u32) -> [u8; WORD] {
    let mut w = [0u8; WORD];
    w[..4].copy_from_slice(&(len as u32).to_le_bytes());
    w[4..].copy_from_slice(&kind.to_le_bytes());
    w
}

/// The producer's side.
pub(crate) struct Producer<M: RingMem> {
    mem: M,
    /// Write position (published after each record).
    tail: u64,
    /// The consumer's position as last read.
    head: u64,
}

/// What [`Producer::push`] did.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Pushed {
    /// Written; wake the consumer (it sleeps).
    Wake,
    /// Written.
    Done,
    /// No room: try again once the consumer has read (it will wake this producer).
    Full,
}

impl<M: RingMem> Producer<M> {
    /// A producer starting at the ring's published positions.
    pub(crate) fn new(mem: M) -> Self {
        let tail = mem.tail().load(Ordering::Acquire);
        let head = mem.head().load(Ordering::Acquire);
        Producer { mem, tail, head }
    }

    /// The largest record this ring takes, bytes after the first word.
    /// Bytes written into the ring since it began (moves as records go in).
    pub(crate) fn written(&self) -> u64 {
        self.tail
    }

    pub(crate) fn max_body(&self) -> usize {
        self.mem.capacity() / 2 - WORD
    }

    /// Free bytes after re-reading the consumer's position.
    fn free(&mut self) -> usize {
        self.mem.capacity() - (self.tail - self.head) as usize
    }

    /// Appends a record of `kind` whose body is `parts` concatenated (at most
    /// [`Producer::max_body`] bytes).
    pub(crate) fn push(&mut self, kind: u32, parts: &[&[u8]]) -> Pushed {
        let body: usize = parts.iter().map(|p| p.len()).sum();
        debug_assert!(body <= self.max_body(), "record of {body} bytes");
        let cap = self.mem.capacity();
        let need = align::<M>(WORD + body);
        let pos = (self.tail % cap as u64) as usize;
        let pad = if pos + need > cap { cap - pos } else { 0 };
        if self.free() < pad + need {
            self.head = self.mem.head().load(Ordering::Acquire);
            if self.free() < pad + need {
                // Ask the consumer to publish and wake us; look once more in case it just did.
                self.mem.producer_waiting().store(1, Ordering::SeqCst);
                self.mem.fence();
                self.head = self.mem.head().load(Ordering::Acquire);
                if self.free() < pad + need {
                    return Pushed::Full;
                }
                self.mem.producer_waiting().store(0, Ordering::Relaxed);
            }
        }
        let mut at = pos;
        if pad > 0 {
            self.mem.write(pos, &word(pad, PAD));
            at = 0;
        }
        self.mem.write(at, &word(need, kind));
        let mut off = at + WORD;
        for p in parts {
            self.mem.write(off, p);
            off += p.len();
        }
        // The release store of the tail publishes the record's bytes.
        self.tail += (pad + need) as u64;
        self.mem.tail().store(self.tail, Ordering::Release);
        self.mem.fence();
        if self.mem.consumer_sleeping().load(Ordering::SeqCst) != 0 { Pushed::Wake } else { Pushed::Done }
    }
}

/// A record the consumer is looking at: its kind and where its body is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Record {
    pub(crate) kind: u32,
    /// Offset of the body in the ring's data.
    pub(crate) off: usize,
    /// Bytes of body the record has room for (its length less the first word; the body's own
    /// length is whatever the producer wrote there).
    pub(crate) room: usize,
    /// The record's whole length in the ring.
    len: usize,
}

/// The consumer's side.
pub(crate) struct Consumer<M: RingMem> {
    mem: M,
    /// Read position (published lazily).
    head: u64,
    /// The position last published.
    published: u64,
    /// The producer's position as last read.
    tail: u64,
}

/// What the consumer's publishing asks of its caller.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Published {
    /// Nothing to do.
    Quiet,
    /// The producer waited for room: wake it.
    WakeProducer,
}

impl<M: RingMem> Consumer<M> {
    pub(crate) fn new(mem: M) -> Self {
        let head = mem.head().load(Ordering::Acquire);
        let tail = mem.tail().load(Ordering::Acquire);
        Consumer { mem, head, published: head, tail }
    }

    /// Bytes read from the ring since it began (moves as records are consumed).
    pub(crate) fn read(&self) -> u64 {
        self.head
    }

    pub(crate) fn mem(&self) -> &M {
        &self.mem
    }

    /// The next record, if the producer has published one. Padding is skipped.
    pub(crate) fn peek(&mut self) -> Option<Record> {
        loop {
            if self.head == self.tail {
                self.tail = self.mem.tail().load(Ordering::Acquire);
                if self.head == self.tail {
                    return None;
                }
            }
            let cap = self.mem.capacity();
            let off = (self.head % cap as u64) as usize;
            let mut w = [0u8; WORD];
            self.mem.read(off, &mut w);
            let [len, kind] = bytemuck::cast::<[u8; WORD], [[u8; 4]; 2]>(w).map(u32::from_le_bytes);
            let len = len as usize;
            // A record the producer cannot have written (the peer's memory is not trusted):
            // reported as one of kind CORRUPT, which the reader turns into an error.
            if len < WORD || !len.is_multiple_of(M::ALIGN) || len > cap - off || (kind == PAD && len != cap - off) {
                return Some(Record { kind: CORRUPT, off, room: 0, len: 0 });
            }
            if kind == PAD {
                self.head += len as u64;
                continue;
            }
            return Some(Record { kind, off: off + WORD, room: len - WORD, len });
        }
    }

    /// Done with `r` (the one [`Consumer::peek`] gave): its bytes may be overwritten once
    /// published.
    pub(crate) fn consume(&mut self, r: Record) {
        self.head += r.len as u64;
    }

    /// Publishes the read position if a quarter of the ring was read since the last time, or
    /// the ring is empty, or the producer waits; says whether to wake the producer.
    pub(crate) fn publish(&mut self) -> Published {
        let cap = self.mem.capacity() as u64;
        let empty = self.head == self.tail;
        if self.head != self.published && (empty || self.head - self.published >= cap / 4) {
            self.published = self.head;
            self.mem.head().store(self.head, Ordering::Release);
        }
        self.mem.fence();
        if self.mem.producer_waiting().load(Ordering::SeqCst) == 0 {
            return Published::Quiet;
        }
        if self.published != self.head {
            self.published = self.head;
            self.mem.head().store(self.head, Ordering::Release);
            self.mem.fence();
        }
        self.mem.producer_waiting().store(0, Ordering::SeqCst);
        Published::WakeProducer
    }

    /// About to sleep until the producer writes: returns false (do not sleep) when a record came
    /// in meanwhile.
    pub(crate) fn prepare_sleep(&mut self) -> bool {
        self.mem.consumer_sleeping().store(1, Ordering::SeqCst);
        self.mem.fence();
        self.tail = self.mem.tail().load(Ordering::Acquire);
        if self.head != self.tail {
            self.mem.consumer_sleeping().store(0, Ordering::Relaxed);
            return false;
        }
        true
    }

    /// Awake again.
    pub(crate) fn woke(&mut self) {
        self.mem.consumer_sleeping().store(0, Ordering::Relaxed);
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use std::cell::UnsafeCell;
    use std::sync::atomic::AtomicU64;

    /// A ring on ordinary memory, for single-threaded tests.
    pub(crate) struct Plain {
        ctl: [AtomicU64; 4],
        data: UnsafeCell<Vec<u8>>,
    }

    impl Plain {
        pub(crate) fn new(cap: usize) -> std::rc::Rc<Self> {
            std::rc::Rc::new(Plain { ctl: Default::default(), data: UnsafeCell::new(vec![0; cap]) })
        }
    }

    impl RingMem for std::rc::Rc<Plain> {
        const ALIGN: usize = 8;
        type W = AtomicU64;
        fn tail(&self) -> &AtomicU64 {
            &self.ctl[0]
        }
        fn head(&self) -> &AtomicU64 {
            &self.ctl[1]
        }
        fn producer_waiting(&self) -> &AtomicU64 {
            &self.ctl[2]
        }
        fn consumer_sleeping(&self) -> &AtomicU64 {
            &self.ctl[3]
        }
        fn capacity(&self) -> usize {
            // SAFETY: single-threaded test memory; the Vec is never resized.
            unsafe { (&*self.data.get()).len() }
        }
        fn write(&self, off: usize, bytes: &[u8]) {
            // SAFETY: as above.
            unsafe { (&mut *self.data.get())[off..off + bytes.len()].copy_from_slice(bytes) }
        }
        fn read(&self, off: usize, out: &mut [u8]) {
            // SAFETY: as above.
            unsafe { out.copy_from_slice(&(&*self.data.get())[off..off + out.len()]) }
        }
        fn fence(&self) {
            std::sync::atomic::fence(Ordering::SeqCst);
        }
    }

    fn body(c: &Consumer<std::rc::Rc<Plain>>, r: Record, len: usize) -> Vec<u8> {
        let mut out = vec![0; len];
        c.mem().read(r.off, &mut out);
        out
    }

    #[test]
    fn a_record_no_producer_can_write_is_reported_corrupt_not_followed() {
        // Lengths below a word, misaligned, past the ring's end, and padding that does not
        // reach the end: the peer's memory is not trusted.
        for bad in [(0usize, 1u32), (3, 1), (WORD + 1, 1), (512, 1), (64, PAD)] {
            let mem = Plain::new(256);
            let (mut p, mut c) = (Producer::new(mem.clone()), Consumer::new(mem.clone()));
            assert!(!matches!(p.push(1, &[b"hello"]), Pushed::Full));
            mem.write(0, &word(bad.0, bad.1));
            let r = c.peek().expect("a record");
            assert_eq!(r.kind, CORRUPT, "{bad:?}");
        }
    }

    #[test]
    fn records_come_out_in_order_across_wraps_and_a_full_ring_says_so() {
        let mem = Plain::new(256);
        let (mut p, mut c) = (Producer::new(mem.clone()), Consumer::new(mem));
        let mut sent = std::collections::VecDeque::new();
        for i in 0..200u32 {
            let len = (i as usize * 7) % 50;
            let payload: Vec<u8> = (0..len).map(|j| (i as usize + j) as u8).collect();
            while let Pushed::Full = p.push(1 + i % 5, &[&(len as u32).to_le_bytes(), &payload]) {
                // Drain one record, publish, try again.
                let r = c.peek().expect("a full ring has a record");
                let (k, want): (u32, Vec<u8>) = sent.pop_front().expect("sent");
                assert_eq!(r.kind, k);
                let n = u32::from_le_bytes(body(&c, r, 4).try_into().unwrap()) as usize;
                assert_eq!(body(&c, r, 4 + n)[4..], want[..]);
                c.consume(r);
                c.publish();
            }
            sent.push_back((1 + i % 5, payload));
        }
        while let Some(r) = c.peek() {
            let (k, want) = sent.pop_front().expect("sent");
            assert_eq!(r.kind, k);
            let n = u32::from_le_bytes(body(&c, r, 4).try_into().unwrap()) as usize;
            assert_eq!(body(&c, r, 4 + n)[4..], want[..]);
            c.consume(r);
        }
        assert!(sent.is_empty());
    }

    #[test]
    fn a_waiting_producer_is_woken_and_a_sleeping_consumer_too() {
        let mem = Plain::new(128);
        let (mut p, mut c) = (Producer::new(mem.clone()), Consumer::new(mem));
        assert!(c.prepare_sleep(), "empty: the consumer may sleep");
        assert_eq!(p.push(1, &[&[0u8; 40]]), Pushed::Wake);
        c.woke();
        assert_eq!(p.push(1, &[&[0u8; 40]]), Pushed::Done);
        assert_eq!(p.push(1, &[&[0u8; 40]]), Pushed::Full);
        let r = c.peek().unwrap();
        c.consume(r);
        assert_eq!(c.publish(), Published::WakeProducer, "the producer waits for room");
        assert_eq!(p.push(1, &[&[0u8; 40]]), Pushed::Done);
    }
}

/// The ring under loom's model checker: every interleaving of a producer and a consumer thread
/// (and the waiting and sleeping hand-offs) delivers every record whole and in order, and no
/// byte is read while written.
#[cfg(test)]
mod model {
    use super::*;
    use loom::cell::UnsafeCell;
    use loom::sync::Arc;
    use loom::sync::atomic::{AtomicU64, fence};

    /// Eight bytes per cell, so loom tracks who touches which part of the ring.
    struct Model {
        ctl: [AtomicU64; 4],
        cells: Vec<UnsafeCell<[u8; 8]>>,
    }

    impl Word for AtomicU64 {
        fn load(&self, o: Ordering) -> u64 {
            AtomicU64::load(self, o)
        }
        fn store(&self, v: u64, o: Ordering) {
            AtomicU64::store(self, v, o)
        }
    }

    impl RingMem for Arc<Model> {
        const ALIGN: usize = 8;
        type W = AtomicU64;
        fn tail(&self) -> &AtomicU64 {
            &self.ctl[0]
        }
        fn head(&self) -> &AtomicU64 {
            &self.ctl[1]
        }
        fn producer_waiting(&self) -> &AtomicU64 {
            &self.ctl[2]
        }
        fn consumer_sleeping(&self) -> &AtomicU64 {
            &self.ctl[3]
        }
        fn capacity(&self) -> usize {
            self.cells.len() * 8
        }
        fn write(&self, off: usize, bytes: &[u8]) {
            for (i, b) in bytes.iter().enumerate() {
                let at = off + i;
                // SAFETY: loom hands out the cell's pointer for this access only.
                self.cells[at / 8].with_mut(|c| unsafe { (&mut *c)[at % 8] = *b });
            }
        }
        fn read(&self, off: usize, out: &mut [u8]) {
            for (i, b) in out.iter_mut().enumerate() {
                let at = off + i;
                // SAFETY: as in `write`.
                *b = self.cells[at / 8].with(|c| unsafe { (&*c)[at % 8] });
            }
        }
        fn fence(&self) {
            fence(Ordering::SeqCst);
        }
    }

    /// A "doorbell": a wake-up the other side can wait for, like an eventfd.
    struct Bell(loom::sync::Mutex<bool>, loom::sync::Condvar);

    impl Bell {
        fn ring(&self) {
            *self.0.lock().unwrap() = true;
            self.1.notify_one();
        }
        fn wait(&self) {
            let mut rung = self.0.lock().unwrap();
            while !*rung {
                rung = self.1.wait(rung).unwrap();
            }
            *rung = false;
        }
    }

    #[test]
    fn every_interleaving_delivers_every_record_whole_and_in_order() {
        let mut builder = loom::model::Builder::new();
        builder.preemption_bound = Some(3);
        builder.check(|| {
            // 32 bytes: records of 8 and 16 bytes wrap, fill the ring and make both sides wait.
            let mem =
                Arc::new(Model { ctl: Default::default(), cells: (0..4).map(|_| UnsafeCell::new([0; 8])).collect() });
            let (to_consumer, to_producer) = (
                Arc::new(Bell(Default::default(), Default::default())),
                Arc::new(Bell(Default::default(), Default::default())),
            );
            let producer = {
                let (mem, to_consumer, to_producer) = (mem.clone(), to_consumer.clone(), to_producer.clone());
                loom::thread::spawn(move || {
                    let mut p = Producer::new(mem);
                    for i in 0..3u8 {
                        let body = [i; 8];
                        let parts: &[&[u8]] = if i == 1 { &[&body] } else { &[] };
                        loop {
                            match p.push(1 + u32::from(i), parts) {
                                Pushed::Full => to_producer.wait(),
                                Pushed::Wake => {
                                    to_consumer.ring();
                                    break;
                                }
                                Pushed::Done => break,
                            }
                        }
                    }
                })
            };
            let mut c = Consumer::new(mem);
            for i in 0..3u8 {
                let r = loop {
                    if let Some(r) = c.peek() {
                        break r;
                    }
                    if c.prepare_sleep() {
                        to_consumer.wait();
                        c.woke();
                    }
                };
                assert_eq!(r.kind, 1 + u32::from(i));
                if i == 1 {
                    let mut b = [0u8; 8];
                    c.mem().read(r.off, &mut b);
                    assert_eq!(b, [1; 8]);
                }
                c.consume(r);
                if c.publish() == Published::WakeProducer {
                    to_producer.ring();
                }
            }
            producer.join().unwrap();
        });
    }
}
