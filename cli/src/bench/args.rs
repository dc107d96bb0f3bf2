//! `ferrogloo-bench`'s command line (clap) and what it asks for: the sizes, the algorithms.

use clap::Parser;
use ferrogloo::{Algorithm, Error, Result};
use std::path::PathBuf;

/// Bandwidth and latency of ferrogloo's collectives (nccl-tests style).
#[derive(Parser, Debug, Clone)]
#[command(version)]
pub(super) struct Args {
    /// Run N local ranks (processes of this program) meeting through a temporary FileStore.
    #[arg(long)]
    pub(super) np: Option<usize>,
    /// This process's rank, to join a job started elsewhere (with --size and --store).
    #[arg(long)]
    pub(super) rank: Option<usize>,
    /// Number of ranks of the job joined with --rank.
    #[arg(long)]
    pub(super) size: Option<usize>,
    /// Store URL of the job joined with --rank (file:DIR or http://HOST:PORT/SCOPE).
    #[arg(long)]
    pub(super) store: Option<String>,
    /// Collectives: allreduce, allgather, broadcast, reduce_scatter, reduce, alltoall, barrier,
    /// sendrecv, pingpong (ranks 0 and 1 bounce a message; the time is one way), agree (a
    /// fault-tolerant agreement), shrink (an agreement and the context of the live members)
    /// (comma-separated).
    #[arg(long, value_delimiter = ',', default_value = "allreduce")]
    pub(super) op: Vec<String>,
    /// Explicit sizes in bytes (K/M/G suffixes allowed); overrides -b/-e/-f.
    #[arg(long, value_delimiter = ',')]
    pub(super) sizes: Vec<String>,
    /// Smallest size of the sweep.
    #[arg(short = 'b', long = "minbytes", default_value = "8")]
    pub(super) minbytes: String,
    /// Largest size of the sweep.
    #[arg(short = 'e', long = "maxbytes", default_value = "32M")]
    pub(super) maxbytes: String,
    /// Factor between sizes of the sweep.
    #[arg(short = 'f', long = "stepfactor", default_value_t = 2)]
    pub(super) stepfactor: usize,
    /// Element type: f32 f64 f16 bf16 i8 i16 i32 i64 u8 u16 u32 u64.
    #[arg(long = "type", default_value = "f32")]
    pub(super) dtype: String,
    /// Reduction: sum, prod, min, max, average (floating-point types).
    #[arg(long, default_value = "sum")]
    pub(super) reduce: String,
    /// Algorithms (comma-separated; `all` = every one the collective has): auto, ring, hd, rd,
    /// tree, pipeline, shm. With `auto` the table and JSON say which one it picked.
    #[arg(long, value_delimiter = ',', default_value = "auto")]
    pub(super) algorithm: Vec<String>,
    /// Root of broadcast and reduce.
    #[arg(long, default_value_t = 0)]
    pub(super) root: usize,
    /// Timed seconds per cell: iterations run until they are spent (at least 5, at most
    /// 1,000,000, which the output says when it caps); overrides -n.
    #[arg(long)]
    pub(super) seconds: Option<f64>,
    /// Timed iterations per cell.
    #[arg(short = 'n', long = "iters", default_value_t = 20)]
    pub(super) iters: usize,
    /// Warm-up iterations per cell.
    #[arg(short = 'w', long = "warmup", default_value_t = 3)]
    pub(super) warmup: usize,
    /// Deadline of rendezvous and of every collective, in seconds (default: FERROGLOO_TIMEOUT
    /// when set, else 120).
    #[arg(long)]
    pub(super) timeout: Option<f64>,
    /// OSU-style columns: each rank's mean time per call, then its mean, least and greatest
    /// over the ranks (avg/min/max), beside p50 and p99 over the iterations of the slowest
    /// rank. The timing is the same either way: every call after a barrier.
    #[arg(long)]
    pub(super) osu: bool,
    /// Cache-cold: rotate each cell through buffers enough that twice the last-level cache
    /// (from sysfs) goes through between two uses of one (at most 64 buffers), instead of
    /// the same buffers every call.
    #[arg(long)]
    pub(super) cold: bool,
    /// Skip checking results.
    #[arg(long)]
    pub(super) no_check: bool,
    /// Network interface to listen on.
    #[arg(long)]
    pub(super) iface: Option<String>,
    /// Host name whose address to listen on.
    #[arg(long)]
    pub(super) hostname: Option<String>,
    /// Pipeline segment size of the pipelined algorithms, in bytes (K/M suffixes allowed).
    #[arg(long)]
    pub(super) segment_bytes: Option<String>,
    /// `SO_SNDBUF` and `SO_RCVBUF` of every connection, in bytes (K/M suffixes allowed).
    /// Default: a 512 KiB send buffer for connections between ranks on one host and the
    /// kernel's autotuning otherwise, and the kernel's autotuning for receive buffers.
    #[arg(long)]
    pub(super) socket_buffer: Option<String>,
    /// Busy-poll this many microseconds before sleeping in a wait (default: automatic).
    #[arg(long)]
    pub(super) busy_poll_us: Option<u64>,
    /// Where the buffers live: host, or cuda (GPU 0's memory, staged through pinned host
    /// buffers; built with the feature `cuda`; allreduce, allgather, reduce_scatter, broadcast
    /// and reduce).
    #[arg(long, default_value = "host")]
    pub(super) device: String,
    /// Transport between ranks: tcp, shm (shared memory), auto (shared memory on one host,
    /// TCP across hosts) or ibverbs (RDMA; built with the feature `ibverbs`, device from
    /// FERROGLOO_IB_DEVICE). Default: FERROGLOO_TRANSPORT when set, else auto.
    #[arg(long)]
    pub(super) transport: Option<String>,
    /// Append one JSON object per measured cell and line to this file (created if missing;
    /// earlier lines are kept).
    #[arg(long)]
    pub(super) json: Option<PathBuf>,
    /// Draw bus bandwidth against size, one line per collective and algorithm, as SVG.
    #[arg(long)]
    pub(super) plot: Option<PathBuf>,
}

pub(super) fn parse_size(s: &str) -> Result<usize> {
    let s = s.trim();
    let (num, mul) = match s.chars().last() {
        Some('K' | 'k') => (&s[..s.len() - 1], 1 << 10),
        Some('M' | 'm') => (&s[..s.len() - 1], 1 << 20),
        Some('G' | 'g') => (&s[..s.len() - 1], 1 << 30),
        _ => (s, 1),
    };
    num.parse::<usize>().map(|v| v * mul).map_err(|_| Error::invalid(format!("bad size {s:?}")))
}

/// A size as the plot's ticks and notes write it: 512, 4K, 64K, 1M, 16M, 1G.
pub(super) fn human(bytes: usize) -> String {
    let units = [(1usize << 30, "G"), (1 << 20, "M"), (1 << 10, "K")];
    for (u, suffix) in units {
        if bytes >= u && bytes.is_multiple_of(u) {
            return format!("{}{suffix}", bytes / u);
        }
    }
    bytes.to_string()
}

pub(super) fn sizes(args: &Args) -> Result<Vec<usize>> {
    if !args.sizes.is_empty() {
        return args.sizes.iter().map(|s| parse_size(s)).collect();
    }
    let (mut b, e) = (parse_size(&args.minbytes)?, parse_size(&args.maxbytes)?);
    if args.stepfactor < 2 {
        return Err(Error::invalid("-f must be at least 2"));
    }
    let mut out = Vec::new();
    while b <= e {
        out.push(b);
        b = b.saturating_mul(args.stepfactor).max(b + 1);
    }
    Ok(out)
}

/// The algorithms of `op` asked for in `wanted`; `shm` says whether the context can run the
/// shared-memory ones.
pub(super) fn algorithms(op: &str, wanted: &[String], shm: bool) -> Result<Vec<Algorithm>> {
    let mut has: Vec<Algorithm> = match op {
        "allreduce" => vec![Algorithm::Auto, Algorithm::Ring, Algorithm::HalvingDoubling, Algorithm::RecursiveDoubling],
        "broadcast" => vec![Algorithm::Auto, Algorithm::BinomialTree, Algorithm::Pipeline],
        "allgather" => vec![Algorithm::Auto, Algorithm::Ring, Algorithm::RecursiveDoubling],
        _ => vec![Algorithm::Auto],
    };
    if shm && matches!(op, "allreduce" | "broadcast" | "allgather") {
        has.push(Algorithm::SharedMemory);
    }
    let mut out = Vec::new();
    for w in wanted {
        let wanted: Vec<Algorithm> = if w == "all" { has.to_vec() } else { vec![w.parse()?] };
        for a in wanted {
            if has.contains(&a) && !out.contains(&a) {
                out.push(a);
            }
        }
    }
    Ok(out)
}
