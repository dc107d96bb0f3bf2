//! `ferrogloo-run`: starts a job's ranks on this machine and on other hosts over ssh, serves
//! their rendezvous store, tags and saves their output, and ends the job as a whole. The
//! launcher lives in the library, in `ferrogloo_cli::run`.

fn main() {
    ferrogloo_cli::run::main();
}
