//! What the examples whose ranks are threads of one process share.

use ferrogloo::device::{Device, ShmAttr, TcpAttr};
use ferrogloo::{Error, Result};

/// A device of `transport` for one rank.
pub fn device(transport: &str) -> Result<Device> {
    match transport {
        "memory" => Ok(Device::in_process()),
        "shm" => Ok(Device::shared_memory(&ShmAttr::default())),
        "tcp" => Device::tcp(&TcpAttr::loopback()),
        other => Err(Error::invalid(format!("--transport {other:?}: memory, shm or tcp"))),
    }
}
