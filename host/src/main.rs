//! `mlxcel`: the command line.

use clap::{CommandFactory, FromArgMatches};
use mlxcel::cli::{self, Cli, Command};

fn main() {
    // `serve` takes llama-server's command line: its two-letter short flags are rewritten and the flags
    // mlxcel does not implement are refused by name before clap sees them.
    let argv = cli::args_or_exit();
    // The model commands read llama.cpp's multi-letter short flags the same way.
    let preprocessed = match cli::subcommand_index(&argv).filter(|&i| argv[i] == "serve") {
        Some(i) => mlxcel::server::args::preprocess_argv(argv[i + 1..].iter().cloned())
            .map(|tail| argv[..=i].iter().cloned().chain(tail).collect()),
        None => cli::llama_cli_argv(argv),
    };
    let argv = preprocessed.unwrap_or_else(|e| {
        eprintln!("error: {}", mlxcel::logging::one_line(&e));
        std::process::exit(1);
    });
    let matches = Cli::command().get_matches_from(argv);
    let mut args = Cli::from_arg_matches(&matches).unwrap_or_else(|e| e.exit());
    if let (Command::Serve(a), Some(("serve", m))) = (&mut args.command, matches.subcommand()) {
        a.note_given(m);
    }
    if !matches!(args.command, Command::Serve(_)) {
        cli::die_on_closed_pipe();
    }
    match &args.command {
        Command::Serve(_) => mlxcel::logging::init_server(args.global.verbose),
        _ => mlxcel::logging::init(args.global.verbose),
    }
    mlxcel::logging::quiet_panics();
    let result = match &args.command {
        Command::Arch(a) => cli::arch::run(&args.global, a),
        Command::Run(a) => cli::run::run(&args.global, a, false),
        Command::Generate(a) => cli::run::run(&args.global, a, true),
        Command::Bench(a) => cli::bench::run(&args.global, a),
        Command::Inspect(a) => cli::inspect::run(&args.global, a),
        Command::List(a) => cli::store::list(a),
        Command::Download(a) => cli::store::download(a),
        Command::Rm(a) => cli::store::rm(a),
        Command::Transcribe(a) => cli::transcribe::run(&args.global, a),
        Command::Embed(a) => cli::embed::embed(&args.global, a),
        Command::Rerank(a) => cli::embed::rerank(&args.global, a),
        Command::BenchEmbed(a) => cli::embed::bench(&args.global, a),
        Command::Serve(a) => a.config(&args.global.plugin_dirs).and_then(mlxcel::server::run),
    };
    if let Err(e) = result {
        eprintln!("error: {}", mlxcel::logging::one_line(&e));
        std::process::exit(1);
    }
}
