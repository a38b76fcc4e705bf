//! `mlxcel-server`: the HTTP server (OpenAI, Anthropic and llama-server dialects) is not built yet.

fn main() {
    eprintln!(
        "mlxcel-server {}: the HTTP server is not built yet in this version; use `mlxcel run MODEL` for now",
        env!("CARGO_PKG_VERSION")
    );
    std::process::exit(2);
}
