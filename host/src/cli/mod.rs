//! The `mlxcel` command line: argument definitions and one module per subcommand.

pub mod arch;
pub mod bench;
pub mod cache_type;
pub mod embed;
pub mod inspect;
pub mod run;
pub mod sampling_args;
pub mod store;
pub mod transcribe;

use std::path::PathBuf;

use clap::{Args, Parser, Subcommand};
use mlxcel_plugins::{Catalog, PluginSearch};

#[derive(Parser, Debug)]
#[command(name = "mlxcel", version, about = "Run Hugging Face / MLX safetensors checkpoints directly")]
pub struct Cli {
    #[command(flatten)]
    pub global: GlobalArgs,
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Args, Debug, Clone)]
pub struct GlobalArgs {
    /// Extra folder to load plugins from (repeatable; searched before MLXCEL_PLUGIN_PATH and the defaults).
    #[arg(long = "plugin-dir", global = true, value_name = "DIR", value_parser = existing_dir)]
    pub plugin_dirs: Vec<PathBuf>,
    /// More log output (-v info, -vv debug); RUST_LOG overrides.
    #[arg(short, long, global = true, action = clap::ArgAction::Count)]
    pub verbose: u8,
}

impl GlobalArgs {
    pub fn catalog(&self) -> Catalog {
        Catalog::load(&PluginSearch::from_env(&self.plugin_dirs))
    }
}

#[derive(Subcommand, Debug)]
pub enum Command {
    /// List the installed plugins: families with their architectures, backends with devices and scores.
    Arch(arch::ArchArgs),
    /// Chat with a model (a REPL), or answer one prompt with -p.
    Run(run::RunArgs),
    /// Answer one prompt and exit.
    Generate(run::RunArgs),
    /// The models on this machine (mlxcel store and Hugging Face cache).
    List(store::ListArgs),
    /// Download a model from the hub (owner/name, or a bare name for mlx-community/name).
    Download(store::DownloadArgs),
    /// Remove a model from the mlxcel store.
    Rm(store::RmArgs),
    /// Describe a model and whether it fits in memory, without loading it.
    Inspect(inspect::InspectArgs),
    /// Measure prompt processing (pp) and generation (tg) speed, like llama-bench.
    Bench(bench::BenchArgs),
    /// Embed texts with a sentence-embedding model; prints JSON.
    Embed(embed::EmbedArgs),
    /// Order documents by a cross-encoder's relevance to a query; prints JSON, best first.
    Rerank(embed::RerankArgs),
    /// Embeddings per second of an embedding model on sets of texts (`cargo xtask bench --embeddings`).
    BenchEmbed(embed::BenchEmbedArgs),
    /// Serve a model over HTTP (OpenAI, Anthropic, llama-server APIs); the same as `mlxcel-server`.
    #[command(version)]
    Serve(Box<crate::server::ServerArgs>),
    /// Speech to text with a Whisper model: print the transcript of each audio file.
    Transcribe(transcribe::TranscribeArgs),
}

/// A count flag that must be at least 1 (clap value parser).
pub fn at_least_one(s: &str) -> Result<u64, String> {
    match s.parse::<u64>() {
        Ok(0) => Err("must be at least 1".into()),
        Ok(n) => Ok(n),
        Err(e) => Err(e.to_string()),
    }
}

/// Most worker threads `-t` takes, as llama.cpp (`GGML_MAX_N_THREADS`): a step's threads spin
/// while it runs, so thousands would only take the cores from each other.
pub const MAX_THREADS: u32 = 512;

/// A `-t` value (clap value parser): 0 (one per core) to [`MAX_THREADS`].
pub fn thread_count(s: &str) -> Result<u32, String> {
    match s.parse::<u32>() {
        Ok(n) if n > MAX_THREADS => Err(format!("at most {MAX_THREADS} threads")),
        Ok(n) => Ok(n),
        Err(e) => Err(e.to_string()),
    }
}

/// A folder that exists (clap value parser): a mistyped `--plugin-dir` is an error, not a folder
/// silently searched in vain.
fn existing_dir(s: &str) -> Result<PathBuf, String> {
    let path = PathBuf::from(s);
    match std::fs::metadata(&path) {
        Ok(m) if m.is_dir() => Ok(path),
        Ok(_) => Err("not a folder".into()),
        Err(e) => Err(e.to_string()),
    }
}

/// The command line as text. An argument that is not UTF-8 ends the program with an error naming
/// it (`std::env::args` would panic).
pub fn args_or_exit() -> Vec<String> {
    std::env::args_os()
        .enumerate()
        .map(|(i, a)| {
            a.into_string().unwrap_or_else(|a| {
                eprintln!("error: argument {i} is not valid UTF-8: {}", a.to_string_lossy());
                std::process::exit(2)
            })
        })
        .collect()
}

/// llama.cpp's multi-letter short flags on the model commands (`run`, `generate`, `inspect`, `bench`…),
/// which clap would read as a one-letter flag and its value (`-ngl 99` as `-n gl`, `-fa` as `-f a`):
/// the ones mlxcel takes under a long name are rewritten to it, the others refused by name.
/// Arguments after `--` are left alone.
pub fn llama_cli_argv(args: impl IntoIterator<Item = String>) -> anyhow::Result<Vec<String>> {
    const ALIASES: &[(&str, &str)] = &[("-ctk", "--cache-type-k"), ("-ctv", "--cache-type-v"), ("-sys", "--system")];
    const REFUSED: &[&str] = &[
        "-ngl", "-ngld", "-fa", "-cnv", "-no-cnv", "-st", "-mli", "-sm", "-ts", "-mg", "-ot", "-cmoe", "-ncmoe",
        "-dev", "-devd", "-nkvo", "-np", "-cb", "-ub", "-to", "-md", "-cd", "-lv", "-hf", "-hfr", "-hff", "-hft",
        "-hfv", "-hfd", "-mm", "-mmu", "-jf", "-sp", "-lcs", "-lcd", "-cml", "-mmp", "-nopo", "-embd", "-pg", "-dio",
        "-sysf", "-tb", "-bs", "-gan", "-gaw", "-dt", "-ps", "-ctxcp",
    ];
    // Options whose value may itself start with a dash (a prompt, a stop string): never read as a flag.
    const TEXT_VALUED: &[&str] = &["-p", "--prompt", "--system", "-q", "--query", "-d", "--document", "--stop"];
    let mut out: Vec<String> = Vec::new();
    let mut rest = false;
    for a in args {
        rest |= a == "--";
        let name = a.split('=').next().unwrap_or(&a);
        let is_value = out.last().is_some_and(|prev| TEXT_VALUED.contains(&prev.as_str()));
        if !rest && !is_value {
            if let Some((_, long)) = ALIASES.iter().find(|(short, _)| *short == name) {
                out.push(match a.split_once('=') {
                    Some((_, v)) => format!("{long}={v}"),
                    None => long.to_string(),
                });
                continue;
            }
            if REFUSED.contains(&name) {
                anyhow::bail!(
                    "{name} is a llama.cpp flag mlxcel does not take (see --help; the backend plugin holds the \
                     whole model and picks its kernels)"
                );
            }
        }
        out.push(a);
    }
    Ok(out)
}

/// Where the subcommand's name is in `argv` (after the program and the global flags), if anywhere.
pub fn subcommand_index(argv: &[String]) -> Option<usize> {
    let mut i = 1;
    while i < argv.len() {
        match argv[i].as_str() {
            "--plugin-dir" => i += 2,
            a if a.starts_with('-') => i += 1,
            _ => return Some(i),
        }
    }
    None
}

/// Lets a closed stdout or stderr end the command quietly, as it ends `cat` or `ls` (`mlxcel arch |
/// head`): Rust ignores SIGPIPE, and every later print would panic. Not for the server, which must
/// outlive a client's closed socket.
pub fn die_on_closed_pipe() {
    #[cfg(unix)]
    // SAFETY: restores the default disposition of one signal before any thread starts.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn argv(s: &str) -> Vec<String> {
        s.split_whitespace().map(String::from).collect()
    }

    #[test]
    fn the_subcommand_is_the_first_word_after_the_global_flags() {
        assert_eq!(subcommand_index(&argv("mlxcel -v --plugin-dir serve run m -p serve")), Some(4));
        assert_eq!(subcommand_index(&argv("mlxcel serve -m m")), Some(1));
        assert_eq!(subcommand_index(&argv("mlxcel --help")), None);
    }

    #[test]
    fn llama_cpp_multi_letter_flags_are_rewritten_or_named() {
        let got = llama_cli_argv(argv("mlxcel run m -ctk f32 -ctv=bf16 -sys x -- -ngl")).unwrap();
        assert_eq!(got, argv("mlxcel run m --cache-type-k f32 --cache-type-v=bf16 --system x -- -ngl"));
        let e = llama_cli_argv(argv("mlxcel run m -ngl 99")).unwrap_err().to_string();
        assert!(e.starts_with("-ngl is a llama.cpp flag"), "{e}");
        // A prompt that looks like one is a prompt.
        let got = llama_cli_argv(argv("mlxcel run m -p -st --system -sys")).unwrap();
        assert_eq!(got, argv("mlxcel run m -p -st --system -sys"));
    }
}
