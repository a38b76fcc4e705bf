//! The chat REPL through a pseudo-terminal (driven by `repl_pty.py`): two turns, the second sees the
//! first; Ctrl-C stops an answer but not the program; `/clear` forgets; a conversation over the
//! context leaves out its oldest exchanges.

use std::process::Command;

/// What the terminal showed after each of `lines`, typed into `mlxcel run` on SmolLM2 with `flags`
/// after `--temp 0`; None without the real models.
fn chat(lines: &[&str], flags: &str) -> Option<Vec<String>> {
    let models = mlxcel::testing::test_models()?;
    mlxcel::testing::staged_plugin_dir();
    let script = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/repl_pty.py");
    let out = Command::new("python3")
        .arg(script)
        .arg(env!("CARGO_BIN_EXE_mlxcel"))
        .arg(models.join("smollm2-135m-instruct-mlx-4bit"))
        .args(lines)
        .env("REPL_ARGS", flags)
        .env_remove("MLXCEL_PLUGIN_PATH")
        .output()
        .expect("python3 is needed to drive the pseudo-terminal");
    assert!(out.status.success(), "driver failed: {}", String::from_utf8_lossy(&out.stderr));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["exit"], 0);
    Some(v["turns"].as_array().unwrap().iter().map(|t| t.as_str().unwrap().to_string()).collect())
}

#[test]
fn repl_second_turn_sees_the_first() {
    let lines =
        ["Hi, my name is Tom.", "What is my name?", "!ctrlc:Tell me a very long story about dragons.", "/clear"];
    let Some(turns) = chat(&lines, "-n 200") else { return };
    // The second answer uses the name given only in the first turn, and the first turn's tokens
    // were reused from the KV cache rather than recomputed.
    assert!(turns[1].contains("Tom"), "second turn: {}", turns[1]);
    assert!(turns[1].contains("cached)"), "second turn should reuse the first turn's KV: {}", turns[1]);
    // Ctrl-C ends the answer early and the prompt comes back.
    assert!(turns[2].contains("interrupted"), "third turn: {}", turns[2]);
    assert!(turns[3].contains("conversation cleared"), "{}", turns[3]);
}

/// A conversation that outgrows the context (`-c 128`) leaves out its oldest exchanges and goes on,
/// where it used to end every later turn with a prompt-too-long error.
#[test]
fn repl_leaves_out_the_oldest_exchanges_when_the_context_fills() {
    let questions = [
        "What is the capital of France?",
        "What is the capital of Germany?",
        "What is the capital of Italy?",
        "What is the capital of Spain?",
        "What is the capital of Japan?",
    ];
    // A message longer than the whole context is refused, and nothing is left out for it.
    let long = "Tell me about rivers and lakes. ".repeat(40);
    let lines: Vec<&str> = questions.iter().copied().chain([long.as_str()]).collect();
    let Some(turns) = chat(&lines, "-c 128 -n 24") else { return };
    assert!(turns[..5].iter().all(|t| !t.contains("error")), "{turns:#?}");
    assert!(turns[..5].iter().any(|t| t.contains("full: the oldest")), "{turns:#?}");
    assert!(turns[4].contains("Tokyo"), "{turns:#?}");
    assert!(turns[5].contains("the context size is 128") && !turns[5].contains("left out"), "{turns:#?}");
}
