//! Golden tests: the phi family against mlx-lm's logits and greedy tokens for tiny
//! random checkpoints (see `fixtures/generate.py`), through the shared harness
//! (`mlxcel::testing::golden`): one-shot prefill, chunked prefill and decode, two sequences sharing
//! steps, greedy tokens; f32 and 4-bit.
//!
//! What the fixtures exercise: fused `qkv_proj` / `gate_up_proj` read as row views (float and 4-bit),
//! GQA, partial rotary (half of each head; three quarters with LongRoPE), an untied head (phi3) and a
//! tied one (phi3-longrope), and LongRoPE's long factors and rotated-dims scale over a 66-token
//! sequence, past its `original_max_position_embeddings` of 32.

use std::path::PathBuf;

use mlxcel::testing::golden::run_case;

fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures")
}

#[test]
fn phi3_matches_mlx_lm() {
    run_case(&fixtures(), "phi3");
}

#[test]
fn phi3_with_longrope_matches_mlx_lm() {
    run_case(&fixtures(), "phi3-longrope");
}

/// `mlxcel arch` lists what the staged plugins report: this plugin and its architectures.
#[test]
fn the_phi_plugin_lists_its_architectures() {
    let catalog = mlxcel::testing::staged_catalog();
    let family = catalog.families.iter().find(|f| f.meta.name == "phi").expect("the phi plugin is staged");
    assert_eq!(family.architectures(), ["phi3"]);
}
