//! [`Algorithm`]: which algorithm a collective runs.

use std::fmt;

/// Which algorithm a collective uses. Each collective documents the ones it accepts; `Auto`
/// (the default) picks by message size and world size.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Hash)]
#[non_exhaustive]
pub enum Algorithm {
    /// Choose by message size and world size.
    #[default]
    Auto,
    /// Ring: reduce-scatter then allgather around the ring, pipelined in segments (allreduce,
    /// allgather, reduce-scatter).
    Ring,
    /// Recursive halving then doubling, with a pre/post step for world sizes that are not
    /// powers of two (allreduce).
    HalvingDoubling,
    /// Recursive doubling: exchanges with the ranks 1, 2, 4… away, the fewest steps (allreduce;
    /// allgather with a power-of-two world size).
    RecursiveDoubling,
    /// Binomial tree (broadcast, reduce).
    BinomialTree,
    /// A chain from the root, pipelined in segments (broadcast).
    Pipeline,
    /// Every block straight from its sender to its receiver (gather, scatter, alltoall).
    Direct,
    /// Dissemination: ⌈log₂ n⌉ rounds of one message each way (barrier).
    Dissemination,
    /// Through memory the ranks of one host share (allreduce, allgather, broadcast,
    /// reduce-scatter, barrier): every rank writes its part once, each reduces or reads the
    /// others' parts in place. Needs a shared-memory device and every rank of the context on
    /// one host; for a context over several hosts, allreduce runs it within each host and
    /// the host sums across hosts (hierarchically).
    SharedMemory,
}

impl Algorithm {
    /// Every algorithm, in wire-code order.
    pub const ALL: [Algorithm; 9] = [
        Algorithm::Auto,
        Algorithm::Ring,
        Algorithm::HalvingDoubling,
        Algorithm::RecursiveDoubling,
        Algorithm::BinomialTree,
        Algorithm::Pipeline,
        Algorithm::Direct,
        Algorithm::Dissemination,
        Algorithm::SharedMemory,
    ];

    /// The short name the benchmark prints and parses (`"ring"`, `"hd"`, `"rd"`, `"tree"`,
    /// `"pipeline"`, `"direct"`, `"dissemination"`, `"shm"`, `"auto"`).
    pub const fn name(self) -> &'static str {
        match self {
            Algorithm::Auto => "auto",
            Algorithm::Ring => "ring",
            Algorithm::HalvingDoubling => "hd",
            Algorithm::RecursiveDoubling => "rd",
            Algorithm::BinomialTree => "tree",
            Algorithm::Pipeline => "pipeline",
            Algorithm::Direct => "direct",
            Algorithm::Dissemination => "dissemination",
            Algorithm::SharedMemory => "shm",
        }
    }

    pub(super) fn long_name(code: u8) -> Option<&'static str> {
        Some(match Self::ALL.get(usize::from(code))? {
            Algorithm::Auto => "automatic",
            Algorithm::Ring => "ring",
            Algorithm::HalvingDoubling => "halving-doubling",
            Algorithm::RecursiveDoubling => "recursive-doubling",
            Algorithm::BinomialTree => "binomial-tree",
            Algorithm::Pipeline => "pipeline",
            Algorithm::Direct => "direct",
            Algorithm::Dissemination => "dissemination",
            Algorithm::SharedMemory => "shared-memory",
        })
    }

    /// The wire code (the position in [`Algorithm::ALL`]).
    pub(crate) fn code(self) -> u8 {
        Self::ALL.iter().position(|a| *a == self).map_or(0, |i| i as u8)
    }
}

impl fmt::Display for Algorithm {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for Algorithm {
    type Err = crate::Error;

    /// Parses a name as [`Algorithm::name`] writes it; also `halving-doubling` and
    /// `recursive-doubling`.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "halving-doubling" => return Ok(Algorithm::HalvingDoubling),
            "recursive-doubling" => return Ok(Algorithm::RecursiveDoubling),
            "shared-memory" => return Ok(Algorithm::SharedMemory),
            _ => {}
        }
        Self::ALL.into_iter().find(|a| a.name() == s).ok_or_else(|| {
            let names: Vec<&str> = Self::ALL.iter().map(|a| a.name()).collect();
            crate::Error::invalid(format!("unknown algorithm {s:?} (one of {})", names.join(", ")))
        })
    }
}
