//! `mlxcel-server`: the HTTP server (OpenAI, Anthropic and llama-server dialects). `mlxcel serve` is
//! the same program.

use clap::{CommandFactory, FromArgMatches, Parser};
use mlxcel::cli::GlobalArgs;
use mlxcel::server::ServerArgs;

#[derive(Parser, Debug)]
#[command(
    name = "mlxcel-server",
    version,
    about = "Serve a model over the OpenAI, Anthropic and llama-server HTTP APIs (llama-server's flags)"
)]
struct Cli {
    #[command(flatten)]
    global: GlobalArgs,
    #[command(flatten)]
    server: ServerArgs,
}

fn main() {
    let result = mlxcel::server::args::preprocess_argv(mlxcel::cli::args_or_exit()).and_then(|argv| {
        let matches = Cli::command().try_get_matches_from(argv).unwrap_or_else(|e| e.exit());
        let mut cli = Cli::from_arg_matches(&matches).unwrap_or_else(|e| e.exit());
        cli.server.note_given(&matches);
        mlxcel::logging::init_server(cli.global.verbose);
        mlxcel::logging::quiet_panics();
        mlxcel::server::run(cli.server.config(&cli.global.plugin_dirs)?)
    });
    if let Err(e) = result {
        eprintln!("error: {}", mlxcel::logging::one_line(&e));
        std::process::exit(1);
    }
}
