//! `mlxcel`: the command line.

use clap::Parser;
use mlxcel::cli::{self, Cli, Command};

fn main() {
    let args = Cli::parse();
    mlxcel::logging::init(args.global.verbose);
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
    };
    if let Err(e) = result {
        eprintln!("error: {}", mlxcel::logging::one_line(&e));
        std::process::exit(1);
    }
}
