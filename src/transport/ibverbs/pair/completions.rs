//! Completions of a pair's queue pair: receives re-posted and their immediates handed on, send
//! requests counted and the waiting ones posted, read parts counted, and failed requests put in
//! words.

use super::super::verbs::{Wc, WcStatus};
use super::{Link, SQ_DEPTH, State, WrKind, wr_kind};
use crate::error::Error;
use crate::sync::lock;

/// Words for a failed work request.
pub(super) fn status_words(status: &WcStatus) -> String {
    match status {
        WcStatus::Success => "success".into(),
        WcStatus::RemoteAccess => {
            "remote access error (the peer refused the access: a wrong remote key or an address outside its \
             registered memory)"
                .into()
        }
        WcStatus::Flushed => "flushed (the queue pair went to the error state: a request of the peer was refused, \
                               or the link failed)"
            .into(),
        WcStatus::RetryExceeded => "transport retry count exceeded (the peer does not answer: it is gone, or its \
                                     queue pair is in the error state)"
            .into(),
        WcStatus::Other(s) => s.clone(),
    }
}

impl Link {
    /// A completion of this pair's queue pair.
    pub(crate) fn completed(&self, wc: &Wc) {
        let mut st = lock(&self.state);
        let kind = wr_kind(wc.wr_id);
        if kind == Some(WrKind::Recv) {
            if wc.status != WcStatus::Success {
                let err = self.wc_error(&st, "receive", &wc.status);
                self.fail_request(&mut st, &wc.status, err);
                return;
            }
            if st.failed.is_none()
                && let Err(e) = self.qp.post_recv(wc.wr_id)
            {
                let err = self.io_error(&format!("posting a receive request for rank {}", self.peer), &e.to_string());
                self.fail(&mut st, err);
                return;
            }
            self.arrived(&mut st, wc.imm);
        } else {
            st.outstanding = st.outstanding.saturating_sub(1);
            let is_read = kind == Some(WrKind::Read);
            let ok = wc.status == WcStatus::Success;
            let err = (!ok).then(|| self.wc_error(&st, if is_read { "RDMA read" } else { "RDMA write" }, &wc.status));
            // A read whose last part this was.
            let mut read = None;
            if is_read {
                let id = wc.wr_id as u32;
                if let Some(r) = st.reads.get_mut(&id) {
                    r.parts = r.parts.saturating_sub(1);
                    if let Some(e) = &err {
                        r.error.get_or_insert_with(|| e.clone());
                    }
                    if r.parts == 0 {
                        read = st.reads.remove(&id);
                    }
                }
            }
            if let Some(err) = err {
                self.fail_request(&mut st, &wc.status, err);
                if let Some(mut r) = read {
                    let err = st.failed.clone().or(r.error.take()).unwrap_or_else(err_or_flushed);
                    self.finish_read(&mut st, r, Some(err));
                }
                return;
            }
            if let Some(mut r) = read {
                let err = r.error.take();
                self.finish_read(&mut st, r, err);
            }
            while st.outstanding < SQ_DEPTH && st.failed.is_none() {
                let Some(wr) = st.backlog.pop_front() else { break };
                self.post_now(&mut st, wr);
            }
            if st.outstanding == 0 {
                self.read_done.notify_all(); // a closing side may wait for this
            }
        }
        self.report(&mut st);
    }

    /// The error a failed request of kind `what` means (the first failure, when this one is
    /// only its flush).
    pub(super) fn wc_error(&self, st: &State, what: &str, status: &WcStatus) -> Error {
        if let (WcStatus::Flushed, Some(e)) = (status, &st.failed) {
            return e.clone();
        }
        self.io_error(&format!("{what} on the RDMA connection to rank {} failed", self.peer), &status_words(status))
    }
}

/// The error of a request flushed without a recorded cause (not reached: failing records one).
pub(super) fn err_or_flushed() -> Error {
    Error::io("an RDMA request", std::io::Error::other(status_words(&WcStatus::Flushed)))
}
