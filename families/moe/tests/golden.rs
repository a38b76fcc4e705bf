//! Golden tests: mlxcel's mixture-of-experts family against mlx-lm's logits and greedy tokens for tiny
//! random checkpoints (see `fixtures/generate.py`: qwen2_moe with a shared expert and experts stored
//! one tensor each in f32, qwen3_moe with a dense layer, top-3 of 8 and renormalised router
//! probabilities; 4-bit with stacked `switch_mlp` experts and an 8-bit router), through the shared
//! harness (`mlxcel::testing::golden`), plus batch invariance when sequences share experts.

use std::path::PathBuf;

use mlxcel::engine::{Logits, ModelRunner, SeqBlocks, SeqChunk};
use mlxcel::testing::golden::{forward_alone, load_runner, run_case};

fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures")
}

#[test]
fn qwen2_moe_matches_mlx_lm() {
    run_case(&fixtures(), "qwen2_moe");
}

#[test]
fn qwen3_moe_matches_mlx_lm() {
    run_case(&fixtures(), "qwen3_moe");
}

/// Batch invariance: a sequence's logits are bit for bit the same alone and inside mixed batches whose
/// other sequence routes tokens to the same experts: one decoding while another prefills a long prompt
/// (other kernel paths), and two short prefills (the same paths, so their tokens share each expert's
/// rows), in either order.
#[test]
fn a_sequence_gives_the_same_logits_alone_and_in_mixed_batches() {
    for fixture_name in ["qwen3_moe-q4", "qwen2_moe-q4", "qwen3_moe-f32"] {
        let mut runner = load_runner(&fixtures().join(fixture_name));
        let v = runner.info.vocab_size;
        let vocab = v as u32;
        let prompt_a: Vec<u32> = (0..30).map(|i| (i * 7 + 3) % vocab).collect();
        let decode_a: Vec<u32> = (0..3).map(|i| (i * 11 + 5) % vocab).collect();
        let prompt_b: Vec<u32> = (0..80).map(|i| (i * 13 + 1) % vocab).collect();
        let short_c: Vec<u32> = (0..6).map(|i| (i * 5 + 2) % vocab).collect();
        let short_d: Vec<u32> = (0..9).map(|i| (i * 3 + 7) % vocab).collect();

        let alone = |runner: &mut ModelRunner, tokens: &[u32]| forward_alone(runner, tokens, Logits::All);
        // Alone: A's prompt, then its decode steps; B's long prompt; C's and D's short prompts.
        let mut sa = SeqBlocks::default();
        runner.pool.reserve(&mut sa, prompt_a.len()).unwrap();
        runner.forward(&[SeqChunk { blocks: &sa, tokens: &prompt_a, start_pos: 0, logits: Logits::Last }]).unwrap();
        sa.len = prompt_a.len();
        let mut alone_a = Vec::new();
        for &tok in &decode_a {
            let next = sa.len + 1;
            runner.pool.reserve(&mut sa, next).unwrap();
            let out = runner
                .forward(&[SeqChunk { blocks: &sa, tokens: &[tok], start_pos: sa.len, logits: Logits::Last }])
                .unwrap();
            alone_a.push(out);
            sa.len += 1;
        }
        runner.pool.release(&mut sa);
        let alone_b = alone(&mut runner, &prompt_b);
        let alone_c = alone(&mut runner, &short_c);
        let alone_d = alone(&mut runner, &short_d);

        // Mixed: A decodes while B prefills (B first on odd steps).
        let mut sa = SeqBlocks::default();
        runner.pool.reserve(&mut sa, prompt_a.len()).unwrap();
        runner.forward(&[SeqChunk { blocks: &sa, tokens: &prompt_a, start_pos: 0, logits: Logits::Last }]).unwrap();
        sa.len = prompt_a.len();
        for (step, &tok) in decode_a.iter().enumerate() {
            let next = sa.len + 1;
            runner.pool.reserve(&mut sa, next).unwrap();
            let mut sb = SeqBlocks::default();
            runner.pool.reserve(&mut sb, prompt_b.len()).unwrap();
            let a_chunk =
                SeqChunk { blocks: &sa, tokens: std::slice::from_ref(&tok), start_pos: sa.len, logits: Logits::Last };
            let b_chunk = SeqChunk { blocks: &sb, tokens: &prompt_b, start_pos: 0, logits: Logits::All };
            let nb = prompt_b.len() * v;
            let (a_row, b_rows) = if step % 2 == 0 {
                let out = runner.forward(&[a_chunk, b_chunk]).unwrap();
                (out[..v].to_vec(), out[v..].to_vec())
            } else {
                let out = runner.forward(&[b_chunk, a_chunk]).unwrap();
                (out[nb..].to_vec(), out[..nb].to_vec())
            };
            assert_eq!(a_row, alone_a[step], "{fixture_name}: decode step {step} of A changed in a mixed batch");
            assert_eq!(b_rows, alone_b, "{fixture_name}: B's prompt logits changed in a mixed batch (step {step})");
            runner.pool.release(&mut sb);
            sa.len += 1;
        }
        runner.pool.release(&mut sa);

        // Two short prompts in one step, in both orders.
        let (mut sc, mut sd) = (SeqBlocks::default(), SeqBlocks::default());
        runner.pool.reserve(&mut sc, short_c.len()).unwrap();
        runner.pool.reserve(&mut sd, short_d.len()).unwrap();
        let c_chunk = SeqChunk { blocks: &sc, tokens: &short_c, start_pos: 0, logits: Logits::All };
        let d_chunk = SeqChunk { blocks: &sd, tokens: &short_d, start_pos: 0, logits: Logits::All };
        let nc = short_c.len() * v;
        let out = runner.forward(&[c_chunk, d_chunk]).unwrap();
        assert_eq!(out[..nc], alone_c[..], "{fixture_name}: C's logits changed beside D");
        assert_eq!(out[nc..], alone_d[..], "{fixture_name}: D's logits changed after C");
        let c_chunk = SeqChunk { blocks: &sc, tokens: &short_c, start_pos: 0, logits: Logits::All };
        let d_chunk = SeqChunk { blocks: &sd, tokens: &short_d, start_pos: 0, logits: Logits::All };
        let out = runner.forward(&[d_chunk, c_chunk]).unwrap();
        let nd = short_d.len() * v;
        assert_eq!(out[..nd], alone_d[..], "{fixture_name}: D's logits changed beside C");
        assert_eq!(out[nd..], alone_c[..], "{fixture_name}: C's logits changed after D");
        runner.pool.release(&mut sc);
        runner.pool.release(&mut sd);
    }
}
