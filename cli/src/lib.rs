//! What the command-line tools of ferrogloo share.

pub mod bench;
pub mod run;

/// Sends library logs (a rank waiting for others, a server listening) to stderr: at `info`
/// unless `RUST_LOG` says otherwise (`target=level` directives, comma-separated, such as
/// `ferrogloo=debug,info`), with colour codes only on a terminal. A `RUST_LOG` that does not
/// parse is said once on stderr and `info` is used.
pub fn init_logging() {
    use tracing_subscriber::filter::{LevelFilter, Targets};
    use tracing_subscriber::layer::SubscriberExt;
    use tracing_subscriber::util::SubscriberInitExt;
    let info = || Targets::new().with_default(LevelFilter::INFO);
    let filter = match std::env::var("RUST_LOG") {
        Ok(v) if !v.trim().is_empty() => v.parse::<Targets>().unwrap_or_else(|e| {
            eprintln!("RUST_LOG={v:?} is not a list of target=level directives ({e}); logging at info");
            info()
        }),
        _ => info(),
    };
    // fmt() caps events at info by itself: the cap goes to trace, and `filter` decides.
    let _ = tracing_subscriber::fmt()
        .with_max_level(tracing_subscriber::filter::LevelFilter::TRACE)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .finish()
        .with(filter)
        .try_init();
}
