//! Quiet-by-default logs, one-line errors, and no backtraces for users.

/// `tracing` to stderr: warnings by default, `-v` info, `-vv` debug; `RUST_LOG` overrides.
pub fn init(verbose: u8) {
    init_with(verbose, "warn");
}

/// A server logs its requests (info) by default; `-v` debug; `RUST_LOG` overrides.
pub fn init_server(verbose: u8) {
    init_with(verbose + 1, "info");
}

fn init_with(verbose: u8, quiet: &str) {
    let default = match verbose {
        0 => quiet,
        1 => "info",
        _ => "debug",
    };
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_target(false)
        .try_init();
}

/// A panic is a bug: say so in one line instead of a backtrace.
pub fn quiet_panics() {
    if std::env::var_os("RUST_BACKTRACE").is_some() {
        return;
    }
    std::panic::set_hook(Box::new(|info| {
        let msg = info
            .payload()
            .downcast_ref::<&str>()
            .map(|s| s.to_string())
            .or_else(|| info.payload().downcast_ref::<String>().cloned())
            .unwrap_or_default();
        let at = info.location().map(|l| format!(" at {}:{}", l.file(), l.line())).unwrap_or_default();
        eprintln!("error: internal error: {msg}{at} (please report this; RUST_BACKTRACE=1 shows more)");
    }));
}

/// An error chain as one line: `outer: inner: root`.
pub fn one_line(e: &anyhow::Error) -> String {
    let mut parts: Vec<String> = Vec::new();
    for cause in e.chain() {
        let s = cause.to_string();
        if !parts.iter().any(|p| p.contains(&s)) {
            parts.push(s);
        }
    }
    parts.join(": ").replace('\n', " ")
}
