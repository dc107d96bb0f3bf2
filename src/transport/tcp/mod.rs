//! The TCP backend: a mio event loop per device, framed non-blocking sockets, a handshake that
//! keeps strangers out.

pub(crate) mod device;
pub(crate) mod frame;
pub(crate) mod handshake;
pub(crate) mod pair;
pub(crate) mod progress;
pub(crate) mod wake;
