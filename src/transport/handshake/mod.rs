//! The one handshake of every backend, and the one codec of every wire type.

pub(crate) mod codec;
