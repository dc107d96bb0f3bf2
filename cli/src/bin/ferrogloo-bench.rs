//! `ferrogloo-bench`: bandwidth and latency of ferrogloo's collectives, in the style of
//! nccl-tests. The benchmark lives in the library, in `ferrogloo_cli::bench`.

fn main() {
    ferrogloo_cli::bench::main();
}
