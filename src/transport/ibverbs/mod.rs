//! The ibverbs (RDMA) transport: not written yet, so this stub answers every request with
//! [`Error::Unsupported`]. When the backend lands it comes behind the cargo feature `ibverbs`,
//! and this file is the one place that chooses between it and the stub.

use crate::error::{Error, Result};
use crate::transport::Backend;
use std::sync::Arc;

/// The ibverbs backend on RDMA device `name` (the first one found for `None`).
pub(crate) fn open(name: Option<&str>) -> Result<Arc<dyn Backend>> {
    let device = name.map_or_else(String::new, |n| format!(" on device {n:?}"));
    Err(Error::unsupported(
        format!(
            "the ibverbs (RDMA) transport{device} (not written yet; it is planned behind a cargo feature `ibverbs`)"
        ),
        None,
    ))
}
