//! Golden tests: the glm family against mlx-lm's logits and greedy tokens for tiny
//! random checkpoints (see `fixtures/generate.py`), through the shared harness
//! (`mlxcel::testing::golden`): one-shot prefill, chunked prefill and decode, two sequences sharing
//! steps, greedy tokens; f32 and 4-bit.
//!
//! What the fixture exercises: explicit head_dim ≠ hidden/heads, GQA, q/k/v biases, partial rotary
//! (half of each head) with interleaved pairs, the four norms per layer, and the fused gate-up tensor
//! read as row views (float and 4-bit).

use std::path::PathBuf;

use mlxcel::testing::golden::run_case;

fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures")
}

#[test]
fn glm4_matches_mlx_lm() {
    run_case(&fixtures(), "glm4");
}

/// `mlxcel arch` lists what the staged plugins report: this plugin and its architectures.
#[test]
fn the_glm_plugin_lists_its_architectures() {
    let catalog = mlxcel::testing::staged_catalog();
    let family = catalog.families.iter().find(|f| f.meta.name == "glm").expect("the glm plugin is staged");
    assert_eq!(family.architectures(), ["glm4"]);
}
