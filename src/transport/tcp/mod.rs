//! The TCP backend: a mio event loop per device, framed non-blocking sockets, a handshake that
//! keeps strangers out.

pub(crate) mod device;
pub(crate) mod frame;
pub(crate) mod handshake;
mod mesh;
pub(crate) mod pair;
mod parking;
mod progress;
