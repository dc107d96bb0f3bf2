//! The TCP backend: a mio event loop per device, framed non-blocking sockets, the one handshake
//! ([`crate::transport::handshake`]) that keeps strangers out.

pub(crate) mod device;
pub(crate) mod frame;
mod mesh;
pub(crate) mod pair;
mod parking;
mod progress;
