//! What every rank must agree on for one name: the collective, element type, shape, reduction
//! and options.

use super::tensor::{Compression, fmt_shape};
use crate::types::{DType, Reduction};

/// The collectives the engine runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum Kind {
    Allreduce = 1,
    Allgather = 2,
    Broadcast = 3,
    Alltoall = 4,
    ReduceScatter = 5,
    Barrier = 6,
    Join = 7,
}

impl Kind {
    pub(crate) fn name(self) -> &'static str {
        match self {
            Kind::Allreduce => "allreduce",
            Kind::Allgather => "allgather",
            Kind::Broadcast => "broadcast",
            Kind::Alltoall => "alltoall",
            Kind::ReduceScatter => "reduce_scatter",
            Kind::Barrier => "barrier",
            Kind::Join => "join",
        }
    }

    pub(crate) fn from_code(c: u8) -> Option<Self> {
        [
            Kind::Allreduce,
            Kind::Allgather,
            Kind::Broadcast,
            Kind::Alltoall,
            Kind::ReduceScatter,
            Kind::Barrier,
            Kind::Join,
        ]
        .into_iter()
        .find(|k| *k as u8 == c)
    }

    /// Whether a negotiated name of this kind may be kept in the response cache.
    pub(crate) fn cacheable(self) -> bool {
        matches!(self, Kind::Allreduce | Kind::Broadcast | Kind::Alltoall | Kind::ReduceScatter)
    }
}

/// What every rank must agree on for one name.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Meta {
    pub(crate) kind: Kind,
    pub(crate) dtype: DType,
    pub(crate) shape: Vec<u64>,
    pub(crate) op: Reduction,
    pub(crate) root: u32,
    pub(crate) prescale: f64,
    pub(crate) postscale: f64,
    pub(crate) compression: Compression,
    /// Group id (0: none) and the number of tensors in the group.
    pub(crate) group: u64,
    pub(crate) group_size: u32,
}

impl Meta {
    pub(crate) fn elements(&self) -> u64 {
        self.shape.iter().product()
    }

    /// Whether two ranks' submissions of one name agree (an allgather's first dimension may
    /// differ).
    pub(crate) fn agrees(&self, o: &Meta) -> bool {
        let shapes = if self.kind == Kind::Allgather && o.kind == Kind::Allgather {
            self.shape.get(1..) == o.shape.get(1..) && !self.shape.is_empty() && !o.shape.is_empty()
        } else {
            self.shape == o.shape
        };
        shapes
            && self.kind == o.kind
            && self.dtype == o.dtype
            && self.op == o.op
            && self.root == o.root
            && self.prescale.to_bits() == o.prescale.to_bits()
            && self.postscale.to_bits() == o.postscale.to_bits()
            && self.compression == o.compression
            && self.group == o.group
            && self.group_size == o.group_size
    }

    /// This submission in words, with the fields where it differs from `other`: "f16 [64, 3]",
    /// "f32 [8] op average".
    pub(crate) fn describe(&self, other: &Meta) -> String {
        let shape: Vec<usize> = self.shape.iter().map(|&d| d as usize).collect();
        let mut s = String::new();
        if self.kind != other.kind {
            s.push_str(self.kind.name());
            s.push(' ');
        }
        s.push_str(&format!("{} {}", self.dtype, fmt_shape(&shape)));
        if self.op != other.op {
            s.push_str(&format!(" op {}", self.op.name()));
        }
        if self.root != other.root {
            s.push_str(&format!(" root {}", self.root));
        }
        if self.prescale.to_bits() != other.prescale.to_bits() {
            s.push_str(&format!(" prescale {}", self.prescale));
        }
        if self.postscale.to_bits() != other.postscale.to_bits() {
            s.push_str(&format!(" postscale {}", self.postscale));
        }
        if self.compression != other.compression {
            s.push_str(&format!(" compression {:?}", self.compression));
        }
        if self.group != other.group || self.group_size != other.group_size {
            s.push_str(&format!(" group {:#x} of {}", self.group, self.group_size));
        }
        s
    }
}
