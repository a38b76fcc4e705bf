//! Golden tests: the whisper family on the staged backend against transformers' float32 logits for a
//! tiny random Whisper (see `fixtures/generate.py`): teacher-forced logits at every position in one pass
//! (encoder and decoder in the same step), the prompt with the encoder and then greedy decoding one
//! token at a time over the stored cross-attention keys, and two sequences encoded in one step.
//!
//! The encoder output is also checked directly, row by row, as the state it leaves for the decoder
//! (`encoder_output_matches_transformers`).
//! Tolerance 1e-4 absolute, as for the other families (f32 on both sides; summation order differs),
//! plus the shared allowance for `MLXCEL_TEST_CACHE_TYPE=f16|bf16` (self-attention's KV cache in that
//! type; the cache is f32 otherwise, like the reference's).

use std::path::PathBuf;

use mlxcel::checkpoint::Checkpoint;
use mlxcel::engine::{KvCacheTypes, Logits, ModelRunner, RunnerOptions, SeqBlocks, SeqChunk};
use mlxcel::testing::golden::{cache_type, cache_type_tolerance};
use mlxcel_plugin_api::Task;
use serde_json::Value;

const TOLERANCE: f32 = 1e-4;

struct Golden {
    /// `[frames, n_mels]`, the layout the encoder reads.
    features: Vec<f32>,
    /// `[positions][d_model]`, transformers' encoder `last_hidden_state`.
    encoder: Vec<Vec<f32>>,
    ids: Vec<u32>,
    logits: Vec<Vec<f32>>,
    prefix: Vec<u32>,
    greedy: Vec<u32>,
}

fn fixture() -> (PathBuf, Golden) {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/whisper-tiny-random");
    let v: Value = serde_json::from_str(&std::fs::read_to_string(dir.join("golden.json")).unwrap()).unwrap();
    let ids = |k: &str| v[k].as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect::<Vec<_>>();
    let rows = |k: &str| -> Vec<Vec<f32>> {
        v[k].as_array()
            .unwrap()
            .iter()
            .map(|r| r.as_array().unwrap().iter().map(|x| x.as_f64().unwrap() as f32).collect())
            .collect()
    };
    let mel = rows("input_features");
    let (n_mels, frames) = (mel.len(), mel[0].len());
    let features = (0..frames).flat_map(|t| (0..n_mels).map(|m| mel[m][t]).collect::<Vec<_>>()).collect();
    let g = Golden {
        features,
        encoder: rows("encoder_output"),
        ids: ids("decoder_input_ids"),
        logits: rows("logits"),
        prefix: ids("greedy_prefix"),
        greedy: ids("greedy"),
    };
    (dir, g)
}

fn load(dir: &std::path::Path) -> ModelRunner {
    let catalog = mlxcel::testing::staged_catalog();
    let backend = std::env::var("MLXCEL_TEST_BACKEND").ok().filter(|b| !b.is_empty());
    let t = cache_type();
    let cache_types = Some(KvCacheTypes { k: t, v: t });
    let opts = RunnerOptions { ctx_size: 64, threads: 2, backend, parallel: 2, cache_types, ..Default::default() };
    let want = opts.backend.clone();
    let ck = Checkpoint::open(dir).unwrap();
    let runner =
        ModelRunner::from_checkpoint_for(&catalog, ck, &opts, &[Task::Asr]).unwrap_or_else(|e| panic!("{e:#}"));
    if let Some(b) = want {
        assert_eq!(runner.backend_name, b, "MLXCEL_TEST_BACKEND asked for `{b}`");
    }
    runner
}

fn max_diff(what: &str, got: &[f32], want: &[f32]) -> f32 {
    assert_eq!(got.len(), want.len(), "{what}: vocabulary size");
    let d = got.iter().zip(want).map(|(a, b)| (a - b).abs()).fold(0.0, f32::max);
    let bound = TOLERANCE + cache_type_tolerance(cache_type());
    assert!(d <= bound, "{what}: max |logit diff| {d} > {bound}");
    d
}

const N_MELS: usize = 80;

#[test]
fn teacher_forced_logits_match_transformers_in_one_pass() {
    let (dir, g) = fixture();
    let mut runner = load(&dir);
    let v = runner.info.vocab_size;
    let mut seq = SeqBlocks::default();
    runner.pool.reserve(&mut seq, g.ids.len()).unwrap();
    let chunk = SeqChunk { blocks: &seq, tokens: &g.ids, start_pos: 0, logits: Logits::All };
    let out = runner.forward_with_features(&[chunk], &[&g.features], N_MELS).unwrap();
    let worst = (0..g.ids.len())
        .map(|i| max_diff(&format!("position {i}"), &out[i * v..(i + 1) * v], &g.logits[i]))
        .fold(0.0, f32::max);
    eprintln!("whisper-tiny-random: max |logit diff| vs transformers {worst:.2e}");
    runner.pool.release(&mut seq);
}

#[test]
fn greedy_decoding_over_stored_cross_attention_matches_transformers() {
    let (dir, g) = fixture();
    let mut runner = load(&dir);
    let mut seq = SeqBlocks::default();
    let mut tokens = g.prefix.clone();
    runner.pool.reserve(&mut seq, tokens.len()).unwrap();
    let chunk = SeqChunk { blocks: &seq, tokens: &tokens, start_pos: 0, logits: Logits::Last };
    let mut last = runner.forward_with_features(&[chunk], &[&g.features], N_MELS).unwrap();
    for step in 0..g.greedy.len() {
        let next = last.iter().enumerate().max_by(|a, b| a.1.total_cmp(b.1)).unwrap().0 as u32;
        assert_eq!(next, g.greedy[step], "greedy token {step}");
        tokens.push(next);
        let pos = tokens.len() - 1;
        runner.pool.reserve(&mut seq, tokens.len()).unwrap();
        let chunk = SeqChunk { blocks: &seq, tokens: &tokens[pos..], start_pos: pos, logits: Logits::Last };
        last = runner.forward(&[chunk]).unwrap();
    }
    runner.pool.release(&mut seq);
}

#[test]
fn two_sequences_encoded_in_one_step_match_each_alone() {
    let (dir, g) = fixture();
    let mut runner = load(&dir);
    let v = runner.info.vocab_size;
    let n = g.ids.len();
    let (mut a, mut b) = (SeqBlocks::default(), SeqBlocks::default());
    runner.pool.reserve(&mut a, n).unwrap();
    runner.pool.reserve(&mut b, 6).unwrap();
    let chunks = [
        SeqChunk { blocks: &a, tokens: &g.ids, start_pos: 0, logits: Logits::Last },
        SeqChunk { blocks: &b, tokens: &g.ids[..6], start_pos: 0, logits: Logits::Last },
    ];
    let out = runner.forward_with_features(&chunks, &[&g.features, &g.features], N_MELS).unwrap();
    max_diff("sequence A", &out[..v], &g.logits[n - 1]);
    max_diff("sequence B", &out[v..], &g.logits[5]);
    // Then B decodes on alone, over the cross keys its own state row kept.
    runner.pool.reserve(&mut b, 7).unwrap();
    let out =
        runner.forward(&[SeqChunk { blocks: &b, tokens: &g.ids[6..7], start_pos: 6, logits: Logits::Last }]).unwrap();
    max_diff("sequence B, later step", &out, &g.logits[6]);
}

/// A copy of the fixture whose every decoder layer projects the encoder output to cross-attention
/// keys and values through the identity (no value bias), so the rows each layer stores are the encoder
/// output itself.
fn identity_cross_kv_copy(dir: &std::path::Path) -> tempfile::TempDir {
    use safetensors::tensor::TensorView;
    let bytes = std::fs::read(dir.join("model.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let f32_bytes = |v: &[f32]| v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>();
    let mut owned: Vec<(String, Vec<usize>, Vec<u8>)> = Vec::new();
    let mut replaced = 0;
    for (name, t) in st.tensors() {
        let shape = t.shape().to_vec();
        let data = if name.contains(".encoder_attn.k_proj.weight") || name.contains(".encoder_attn.v_proj.weight") {
            replaced += 1;
            let d = shape[0];
            f32_bytes(&(0..d * d).map(|i| if i / d == i % d { 1.0 } else { 0.0 }).collect::<Vec<_>>())
        } else if name.contains(".encoder_attn.v_proj.bias") {
            replaced += 1;
            f32_bytes(&vec![0.0; shape[0]])
        } else {
            t.data().to_vec()
        };
        assert_eq!(t.dtype(), safetensors::Dtype::F32, "{name}");
        owned.push((name, shape, data));
    }
    assert_eq!(replaced, 6, "two decoder layers' cross-attention k/v weights and v bias");
    let views: Vec<(String, TensorView)> = owned
        .iter()
        .map(|(n, s, d)| (n.clone(), TensorView::new(safetensors::Dtype::F32, s.clone(), d).unwrap()))
        .collect();
    let tmp = tempfile::tempdir().unwrap();
    safetensors::serialize_to_file(views, &None, &tmp.path().join("model.safetensors")).unwrap();
    for f in std::fs::read_dir(dir).unwrap() {
        let f = f.unwrap().path();
        if f.file_name().unwrap() != "model.safetensors" {
            std::fs::copy(&f, tmp.path().join(f.file_name().unwrap())).unwrap();
        }
    }
    tmp
}

/// Runs the encoder on the fixture's features (with the prompt prefix) and returns, per decoder layer,
/// the rows the step stored for it: `(stored length, [rows][K then V])`.
fn stored_cross_rows(runner: &mut ModelRunner, g: &Golden) -> Vec<(usize, Vec<Vec<f32>>)> {
    let mut seq = SeqBlocks::default();
    runner.pool.reserve(&mut seq, g.prefix.len()).unwrap();
    let chunk = SeqChunk { blocks: &seq, tokens: &g.prefix, start_pos: 0, logits: Logits::Last };
    runner.forward_with_features(&[chunk], &[&g.features], N_MELS).unwrap();
    let slot = seq.state_slot().expect("a state row for the cross-attention keys");
    let cross: Vec<(usize, usize)> = (runner.info.kv_layers.iter().enumerate())
        .filter(|(_, l)| l.kind == mlxcel_plugin_api::KvKind::Recurrent)
        .map(|(i, l)| (i, l.n_kv_heads * l.head_dim))
        .collect();
    let out = cross
        .iter()
        .map(|&(layer, kv_row)| {
            let row = runner.read_state_row(layer, slot).unwrap();
            let n = row[0].to_bits() as usize;
            let body = &row[mlxcel_plugin_api::CROSS_KV_HEADER as usize..];
            (n, body.chunks_exact(2 * kv_row).take(n).map(|r| r.to_vec()).collect())
        })
        .collect();
    runner.pool.release(&mut seq);
    out
}

/// The encoder's output against transformers' `last_hidden_state`, position by position. It is no step
/// output: the encoder leaves it in the sequence's state as each decoder layer's cross-attention keys
/// and values, which on the identity-projection copy are the output itself (keys and values both).
/// The same through the MLX layout, whose encoder positions are computed sinusoids.
#[test]
fn encoder_output_matches_transformers() {
    let (dir, g) = fixture();
    let copy = identity_cross_kv_copy(&dir);
    let mlx = mlx_layout_copy(copy.path(), Quant::None);
    for (what, path) in [("Hugging Face layout", copy.path()), ("MLX layout", mlx.path())] {
        let mut runner = load(path);
        let layers = stored_cross_rows(&mut runner, &g);
        assert_eq!(layers.len(), 2, "{what}: one cross-attention state layer per decoder layer");
        let mut worst = 0f32;
        for (layer, (n, rows)) in layers.iter().enumerate() {
            assert_eq!(*n, g.encoder.len(), "{what}, layer {layer}: stored length");
            for (p, (row, want)) in rows.iter().zip(&g.encoder).enumerate() {
                let d = want.len();
                assert_eq!(row.len(), 2 * d);
                for (half, got) in [("keys", &row[..d]), ("values", &row[d..])] {
                    let diff = got.iter().zip(want).map(|(a, b)| (a - b).abs()).fold(0.0, f32::max);
                    assert!(diff <= TOLERANCE, "{what}, layer {layer} {half}, position {p}: max |diff| {diff}");
                    worst = worst.max(diff);
                }
            }
        }
        eprintln!("whisper-tiny-random ({what}): max |encoder output diff| vs transformers {worst:.2e}");
    }
}

/// Candidates of one window share its encoder pass: a sequence whose state rows were copied from an
/// encoded one (`copy_state_rows`) decodes from position 0 without features, beside the encoded one
/// in the same step, with the reference's logits; a later sequence in that row starts clean again.
#[test]
fn a_sequence_seeded_with_copied_cross_keys_matches_transformers() {
    let (dir, g) = fixture();
    let mut runner = load(&dir);
    let v = runner.info.vocab_size;
    let n = g.ids.len();
    let (mut a, mut b) = (SeqBlocks::default(), SeqBlocks::default());
    runner.pool.reserve(&mut a, n).unwrap();
    runner.pool.reserve(&mut b, n).unwrap();
    let chunk = SeqChunk { blocks: &a, tokens: &g.ids[..1], start_pos: 0, logits: Logits::Last };
    runner.forward_with_features(&[chunk], &[&g.features], N_MELS).unwrap();
    runner.copy_state_rows(&a, &b).unwrap();
    let chunks = [
        SeqChunk { blocks: &a, tokens: &g.ids[1..], start_pos: 1, logits: Logits::Last },
        SeqChunk { blocks: &b, tokens: &g.ids, start_pos: 0, logits: Logits::All },
    ];
    let out = runner.forward(&chunks).unwrap();
    max_diff("encoded sequence", &out[..v], &g.logits[n - 1]);
    for i in 0..n {
        max_diff(&format!("seeded sequence, position {i}"), &out[(1 + i) * v..(2 + i) * v], &g.logits[i]);
    }
    // The seeding held for that step only: B's row restarted at position 0 is cleared, so without
    // features its cross-attention sees nothing and the logits are no longer the reference's.
    let out = runner.forward(&[SeqChunk { blocks: &b, tokens: &g.ids, start_pos: 0, logits: Logits::Last }]).unwrap();
    let d = out.iter().zip(&g.logits[n - 1]).map(|(x, y)| (x - y).abs()).fold(0.0, f32::max);
    assert!(d > 1e-2, "a restarted sequence kept the copied keys (max |diff| {d})");
    runner.pool.release(&mut a);
    runner.pool.release(&mut b);
}

#[test]
fn a_text_runner_refuses_whisper_and_names_transcribe() {
    let (dir, _) = fixture();
    let catalog = mlxcel::testing::staged_catalog();
    let err = ModelRunner::load(&catalog, &dir, &RunnerOptions::default()).err().expect("refused");
    assert!(format!("{err:#}").contains("mlxcel transcribe"), "{err:#}");
}

/// The fixture rewritten as mlx-community stores Whisper: OpenAI's tensor names, conv weights
/// `[C_out, K, C_in]`, no encoder position tensor (computed as sinusoids, which the fixture keeps),
/// OpenAI's config names. It must give the same logits.
fn mlx_layout_copy(dir: &std::path::Path, quant: Quant) -> tempfile::TempDir {
    use safetensors::tensor::TensorView;
    let bytes = std::fs::read(dir.join("model.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let rename = |name: &str| -> Option<String> {
        let mut n = name.strip_prefix("model.").unwrap_or(name).to_string();
        if n == "encoder.embed_positions.weight" {
            return None;
        }
        for (a, b) in [
            (".layers.", ".blocks."),
            ("self_attn_layer_norm", "attn_ln"),
            ("encoder_attn_layer_norm", "cross_attn_ln"),
            ("final_layer_norm", "mlp_ln"),
            ("self_attn.", "attn."),
            ("encoder_attn.", "cross_attn."),
            ("q_proj", "query"),
            ("k_proj", "key"),
            ("v_proj", "value"),
            ("out_proj", "out"),
            (".fc1.", ".mlp1."),
            (".fc2.", ".mlp2."),
            ("decoder.embed_tokens", "decoder.token_embedding"),
            ("decoder.embed_positions.weight", "decoder.positional_embedding"),
            ("encoder.layer_norm", "encoder.ln_post"),
            ("decoder.layer_norm", "decoder.ln"),
        ] {
            n = n.replace(a, b);
        }
        Some(n)
    };
    let mut owned: Vec<(String, safetensors::Dtype, Vec<usize>, Vec<u8>)> = Vec::new();
    let f32_bytes = |v: &[f32]| v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>();
    for (name, t) in st.tensors() {
        let Some(new) = rename(&name) else { continue };
        let (shape, data) = (t.shape().to_vec(), t.data().to_vec());
        if name.contains(".conv") && name.ends_with(".weight") {
            // [C_out, C_in, K] f32 -> [C_out, K, C_in]
            let (co, ci, k) = (shape[0], shape[1], shape[2]);
            let f: Vec<f32> = data.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect();
            let mut out = vec![0f32; f.len()];
            for o in 0..co {
                for c in 0..ci {
                    for kk in 0..k {
                        out[(o * k + kk) * ci + c] = f[(o * ci + c) * k + kk];
                    }
                }
            }
            owned.push((new, safetensors::Dtype::F32, vec![co, k, ci], f32_bytes(&out)));
        } else if quant != Quant::None && is_linear(&new) {
            let f: Vec<f32> = data.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect();
            let q = quantize_4bit(&f, shape[1]);
            let module = new.trim_end_matches(".weight");
            if quant == Quant::Dequantized {
                owned.push((new, safetensors::Dtype::F32, shape, f32_bytes(&q.dequant)));
            } else {
                let packed: Vec<u8> = q.packed.iter().flat_map(|x| x.to_le_bytes()).collect();
                owned.push((new.clone(), safetensors::Dtype::U32, vec![shape[0], shape[1] / 8], packed));
                let groups = vec![shape[0], shape[1] / GROUP];
                owned.push((format!("{module}.scales"), safetensors::Dtype::F32, groups.clone(), f32_bytes(&q.scales)));
                owned.push((format!("{module}.biases"), safetensors::Dtype::F32, groups, f32_bytes(&q.biases)));
            }
        } else {
            owned.push((new, safetensors::Dtype::F32, shape, data));
        }
    }
    let views: Vec<(String, TensorView)> =
        owned.iter().map(|(n, t, s, d)| (n.clone(), TensorView::new(*t, s.clone(), d).unwrap())).collect();
    let tmp = tempfile::tempdir().unwrap();
    safetensors::serialize_to_file(views, &None, &tmp.path().join("model.safetensors")).unwrap();
    let cfg: Value = serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).unwrap()).unwrap();
    let mut mlx_cfg = serde_json::json!({
        "model_type": "whisper", "n_mels": cfg["num_mel_bins"], "n_audio_ctx": cfg["max_source_positions"],
        "n_audio_state": cfg["d_model"], "n_audio_head": cfg["encoder_attention_heads"],
        "n_audio_layer": cfg["encoder_layers"], "n_vocab": cfg["vocab_size"], "n_text_ctx": cfg["max_target_positions"],
        "n_text_state": cfg["d_model"], "n_text_head": cfg["decoder_attention_heads"], "n_text_layer": cfg["decoder_layers"],
        "encoder_ffn_dim": cfg["encoder_ffn_dim"], "decoder_ffn_dim": cfg["decoder_ffn_dim"],
    });
    if quant == Quant::Quantized {
        mlx_cfg["quantization"] = serde_json::json!({"group_size": GROUP, "bits": 4});
    }
    std::fs::write(tmp.path().join("config.json"), mlx_cfg.to_string()).unwrap();
    tmp
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Quant {
    /// Float weights as the fixture has them.
    None,
    /// Linear layers and the token embedding MLX affine 4-bit, group 32.
    Quantized,
    /// Those layers as the float values the 4-bit ones stand for.
    Dequantized,
}

const GROUP: usize = 32;

/// The weights nn.quantize turns into MLX affine packs in a Whisper model.
fn is_linear(name: &str) -> bool {
    [".query.weight", ".key.weight", ".value.weight", ".out.weight", ".mlp1.weight", ".mlp2.weight"]
        .iter()
        .any(|s| name.ends_with(s))
        || name == "decoder.token_embedding.weight"
}

struct Quantized4 {
    packed: Vec<u32>,
    scales: Vec<f32>,
    biases: Vec<f32>,
    dequant: Vec<f32>,
}

/// MLX affine 4-bit quantization of a row-major `[n, k]` matrix: per group of 32, `w ≈ scale · q + bias`
/// with `q` in 0..15, eight values per `u32`, the first in the low bits.
fn quantize_4bit(w: &[f32], k: usize) -> Quantized4 {
    let mut out =
        Quantized4 { packed: vec![0; w.len() / 8], scales: vec![], biases: vec![], dequant: vec![0.0; w.len()] };
    for (g, chunk) in w.chunks_exact(GROUP).enumerate() {
        let (lo, hi) = chunk.iter().fold((f32::MAX, f32::MIN), |(a, b), &x| (a.min(x), b.max(x)));
        let scale = ((hi - lo) / 15.0).max(1e-8);
        out.scales.push(scale);
        out.biases.push(lo);
        for (j, &x) in chunk.iter().enumerate() {
            let q = ((x - lo) / scale).round().clamp(0.0, 15.0) as u32;
            let i = g * GROUP + j;
            out.packed[i / 8] |= q << (4 * (i % 8));
            out.dequant[i] = scale * q as f32 + lo;
        }
    }
    assert_eq!(k % GROUP, 0);
    out
}

#[test]
fn mlx_layout_checkpoint_gives_the_same_logits() {
    let (dir, g) = fixture();
    let copy = mlx_layout_copy(&dir, Quant::None);
    let mut runner = load(copy.path());
    let v = runner.info.vocab_size;
    let mut seq = SeqBlocks::default();
    runner.pool.reserve(&mut seq, g.ids.len()).unwrap();
    let chunk = SeqChunk { blocks: &seq, tokens: &g.ids, start_pos: 0, logits: Logits::All };
    let out = runner.forward_with_features(&[chunk], &[&g.features], N_MELS).unwrap();
    for i in 0..g.ids.len() {
        max_diff(&format!("MLX layout, position {i}"), &out[i * v..(i + 1) * v], &g.logits[i]);
    }
}

/// 4-bit MLX weights (every linear and the token embedding) give the logits of the float weights they
/// stand for, within the CPU's int16 activation rounding (1e-3, as for the llama family's 4-bit golden).
#[test]
fn mlx_4bit_checkpoint_matches_its_dequantized_weights() {
    let (dir, g) = fixture();
    let logits = |quant: Quant| {
        let copy = mlx_layout_copy(&dir, quant);
        let mut runner = load(copy.path());
        assert_eq!(runner.info.quantization, if quant == Quant::Quantized { "affine 4-bit g32" } else { "" });
        let mut seq = SeqBlocks::default();
        runner.pool.reserve(&mut seq, g.ids.len()).unwrap();
        let chunk = SeqChunk { blocks: &seq, tokens: &g.ids, start_pos: 0, logits: Logits::All };
        runner.forward_with_features(&[chunk], &[&g.features], N_MELS).unwrap()
    };
    let (q, f) = (logits(Quant::Quantized), logits(Quant::Dequantized));
    let d = q.iter().zip(&f).map(|(a, b)| (a - b).abs()).fold(0.0, f32::max);
    // Both sides keep self-attention's KV in the type under test; its rounding can amplify the int16
    // differences, hence the same allowance as against the reference.
    let bound = 1e-3 + cache_type_tolerance(cache_type());
    assert!(d <= bound, "4-bit vs dequantized: max |logit diff| {d} > {bound}");
    // Quantization moved the logits away from the float fixture's: the packs were really used.
    let v = f.len() / g.ids.len();
    let moved = (0..g.ids.len())
        .flat_map(|i| f[i * v..(i + 1) * v].iter().zip(&g.logits[i]))
        .any(|(a, b)| (a - b).abs() > 1e-3);
    assert!(moved, "the 4-bit copy gave the float logits");
}
