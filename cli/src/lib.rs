//! What the command-line tools of ferrogloo share.

pub mod bench;
pub mod run;

/// Sends library logs (a rank waiting for others, a server listening) to stderr: at `info`
/// unless `RUST_LOG` says otherwise, with colour codes only on a terminal.
pub fn init_logging() {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .try_init();
}
