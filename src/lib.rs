//! ferrogloo: collective communication in pure Rust.
#![deny(unsafe_op_in_unsafe_fn)]
#![warn(missing_docs)]

pub mod error;
pub mod rendezvous;

pub use error::{Error, Result};
