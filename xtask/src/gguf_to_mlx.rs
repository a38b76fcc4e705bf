//! A llama-architecture GGUF to an MLX affine 4-bit checkpoint folder, byte for byte what the project's
//! reference converter writes (`../shared/models/gguf_llama_to_hf.py GGUF DIR --format mlx4 --dtype f16`):
//! config.json, generation_config.json, tokenizer.json, tokenizer_config.json, special_tokens_map.json
//! and model.safetensors with the Hugging Face tensor names.
//!
//! GGUF Q4_1 blocks (32 values, f16 `d` and `m`, w = d·q + m) are MLX affine 4-bit groups of 32
//! (scale = d, bias = m), so 4-bit linears move over bit-exactly; any other 2-D weight (SmolLM2's Q8_0
//! token embedding) is dequantized and re-quantized with the script's min/max rule.

use std::collections::HashMap;
use std::io::Write;
use std::path::Path;

use anyhow::{bail, ensure, Context, Result};
use half::f16;

use crate::gguf::{Gguf, MetaValue, TensorInfo, TensorType};
use crate::py_json::{dumps, object, Json, Style};

const GROUP: usize = 32;

/// A 4-bit matrix in MLX's layout: each row packs 8 values per u32 (value k in bits 4k..4k+4) and has one
/// f16 scale and bias per group of 32.
#[derive(Debug, Clone, PartialEq)]
pub struct Quantized {
    pub rows: usize,
    pub cols: usize,
    pub packed: Vec<u32>,
    /// f16 bits, `[rows, cols / 32]`.
    pub scales: Vec<u16>,
    pub biases: Vec<u16>,
}

/// Q4_1 blocks (row-major `[rows, cols / 32]`) as MLX groups: value i of a block is the low nibble of
/// byte i for i < 16 and the high nibble of byte i - 16 above.
pub fn q4_1_to_mlx(raw: &[u8], rows: usize, cols: usize) -> Quantized {
    let blocks = rows * cols / GROUP;
    assert_eq!(raw.len(), blocks * 20, "Q4_1 data of a {rows}x{cols} matrix");
    let mut q = Quantized {
        rows,
        cols,
        packed: Vec::with_capacity(blocks * 4),
        scales: Vec::with_capacity(blocks),
        biases: Vec::with_capacity(blocks),
    };
    for b in raw.chunks_exact(20) {
        q.scales.push(u16::from_le_bytes([b[0], b[1]]));
        q.biases.push(u16::from_le_bytes([b[2], b[3]]));
        let qs = &b[4..20];
        let word = |bytes: &[u8], shift: u32| {
            bytes.iter().enumerate().fold(0u32, |w, (k, &x)| w | (((x >> shift) & 0xF) as u32) << (4 * k))
        };
        q.packed.extend([word(&qs[..8], 0), word(&qs[8..], 0), word(&qs[..8], 4), word(&qs[8..], 4)]);
    }
    q
}

/// The script's `mlx_quantize_4bit`, in f32 as numpy computes it: per group of 32, bias = min,
/// scale = (max - min) / 15 (1e-8 when 0), q = clip(round_half_even((w - bias) / scale), 0, 15).
pub fn quantize_4bit(w: &[f32], rows: usize, cols: usize) -> Quantized {
    assert_eq!(w.len(), rows * cols);
    let groups = rows * cols / GROUP;
    let mut q = Quantized {
        rows,
        cols,
        packed: Vec::with_capacity(groups * 4),
        scales: Vec::with_capacity(groups),
        biases: Vec::with_capacity(groups),
    };
    for g in w.chunks_exact(GROUP) {
        let min = g.iter().copied().fold(f32::INFINITY, f32::min);
        let max = g.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let mut scale = (max - min) / 15.0;
        if scale == 0.0 {
            scale = 1e-8;
        }
        for eight in g.chunks_exact(8) {
            let word = eight.iter().enumerate().fold(0u32, |word, (k, &x)| {
                let v = ((x - min) / scale).round_ties_even().clamp(0.0, 15.0) as u32;
                word | v << (4 * k)
            });
            q.packed.push(word);
        }
        q.scales.push(f16::from_f32(scale).to_bits());
        q.biases.push(f16::from_f32(min).to_bits());
    }
    q
}

/// Undoes llama.cpp's rotary permutation of Q/K rows (`convert_hf_to_gguf.py`'s `permute`): within each
/// head, row `2a + b` of the GGUF becomes row `b * dim + a`, dim = head rows / 2.
pub fn unpermute_rows<T: Copy>(data: &[T], rows: usize, n_head: usize) -> Result<Vec<T>> {
    ensure!(n_head > 0 && rows.is_multiple_of(2 * n_head), "{rows} rows do not split into {n_head} heads of pairs");
    let width = data.len() / rows;
    let dim = rows / n_head / 2;
    let mut out = Vec::with_capacity(data.len());
    for h in 0..n_head {
        for b in 0..2 {
            for a in 0..dim {
                let old = h * 2 * dim + 2 * a + b;
                out.extend_from_slice(&data[old * width..(old + 1) * width]);
            }
        }
    }
    Ok(out)
}

impl Quantized {
    fn unpermute(self, n_head: usize) -> Result<Quantized> {
        Ok(Quantized {
            packed: unpermute_rows(&self.packed, self.rows, n_head)?,
            scales: unpermute_rows(&self.scales, self.rows, n_head)?,
            biases: unpermute_rows(&self.biases, self.rows, n_head)?,
            ..self
        })
    }
}

/// One tensor of model.safetensors.
struct Tensor {
    name: String,
    dtype: &'static str,
    shape: Vec<usize>,
    data: Vec<u8>,
}

fn le_bytes<T: Copy, const N: usize>(v: &[T], to: fn(T) -> [u8; N]) -> Vec<u8> {
    v.iter().flat_map(|&x| to(x)).collect()
}

/// Safetensors as the script writes it by hand: tensors sorted by name, header keys in that order with
/// `__metadata__` last, compact JSON padded with spaces to a multiple of 8 bytes.
fn write_safetensors(path: &Path, mut tensors: Vec<Tensor>, format: &str) -> Result<()> {
    tensors.sort_by(|a, b| a.name.cmp(&b.name));
    let mut header = Vec::new();
    let mut offset = 0usize;
    for t in &tensors {
        let shape = Json::Array(t.shape.iter().map(|&d| Json::Int(d as i64)).collect());
        let offsets = Json::Array(vec![Json::Int(offset as i64), Json::Int((offset + t.data.len()) as i64)]);
        header.push((t.name.clone(), object([("dtype", t.dtype.into()), ("shape", shape), ("data_offsets", offsets)])));
        offset += t.data.len();
    }
    header.push(("__metadata__".into(), object([("format", format.into())])));
    let mut hb = dumps(&Json::Object(header), Style::COMPACT).into_bytes();
    hb.resize(hb.len().div_ceil(8) * 8, b' ');
    let file = std::fs::File::create(path).with_context(|| format!("creating {}", path.display()))?;
    let mut f = std::io::BufWriter::new(file);
    f.write_all(&(hb.len() as u64).to_le_bytes())?;
    f.write_all(&hb)?;
    for t in &tensors {
        f.write_all(&t.data)?;
    }
    f.into_inner().map_err(|e| e.into_error())?.sync_all()?;
    Ok(())
}

fn meta_json(v: &MetaValue) -> Json {
    match v {
        MetaValue::Int(i) => Json::Int(*i),
        MetaValue::UInt(u) => i64::try_from(*u).map_or(Json::Float(*u as f64), Json::Int),
        MetaValue::Float(x) => Json::Float(*x),
        MetaValue::Bool(b) => Json::Bool(*b),
        MetaValue::Str(s) => Json::Str(s.clone()),
        MetaValue::Array(a) => Json::Array(a.iter().map(meta_json).collect()),
    }
}

struct Meta<'g, 'a>(&'g Gguf<'a>);

impl<'g> Meta<'g, '_> {
    fn int(&self, key: &str) -> Result<i64> {
        let v = self.0.get(key).with_context(|| format!("GGUF metadata `{key}` is missing"))?;
        v.as_i64().with_context(|| format!("GGUF metadata `{key}` is not an integer: {v:?}"))
    }

    fn int_or(&self, key: &str, default: i64) -> Result<i64> {
        if self.0.get(key).is_some() {
            self.int(key)
        } else {
            Ok(default)
        }
    }

    fn float_or(&self, key: &str, default: Option<f64>) -> Result<f64> {
        match self.0.get(key) {
            Some(v) => v.as_f64().with_context(|| format!("GGUF metadata `{key}` is not a number: {v:?}")),
            None => default.with_context(|| format!("GGUF metadata `{key}` is missing")),
        }
    }

    fn str(&self, key: &str) -> Option<&'g str> {
        self.0.get(key).and_then(MetaValue::as_str)
    }

    fn strings(&self, key: &str) -> Result<Vec<&'g str>> {
        let a = self.0.get(key).and_then(MetaValue::as_array);
        let a = a.with_context(|| format!("GGUF metadata `{key}` is missing or not an array"))?;
        a.iter().map(|v| v.as_str().with_context(|| format!("`{key}` holds a non-string"))).collect()
    }

    fn ints(&self, key: &str) -> Result<Vec<i64>> {
        let a = self.0.get(key).and_then(MetaValue::as_array);
        let a = a.with_context(|| format!("GGUF metadata `{key}` is missing or not an array"))?;
        a.iter().map(|v| v.as_i64().with_context(|| format!("`{key}` holds a non-integer"))).collect()
    }
}

fn write_json(dir: &Path, name: &str, value: &Json, style: Style) -> Result<()> {
    let path = dir.join(name);
    std::fs::write(&path, dumps(value, style)).with_context(|| format!("writing {}", path.display()))
}

/// The script's `build_tokenizer`: a byte-level BPE tokenizer.json and its tokenizer_config.json (with
/// the chat template) and special_tokens_map.json.
fn write_tokenizer(m: &Meta, dir: &Path) -> Result<()> {
    let tokens = m.strings("tokenizer.ggml.tokens")?;
    let types = m.ints("tokenizer.ggml.token_type")?;
    let merges = m.strings("tokenizer.ggml.merges")?;
    let model = m.str("tokenizer.ggml.model");
    if model != Some("gpt2") {
        bail!("tokenizer model {model:?} is not handled (only gpt2, byte-level BPE)");
    }
    // A Python dict comprehension: a repeated token keeps its first place and its last id.
    let mut vocab: Vec<(String, Json)> = Vec::with_capacity(tokens.len());
    let mut seen: HashMap<&str, usize> = HashMap::with_capacity(tokens.len());
    for (i, t) in tokens.iter().enumerate() {
        match seen.get(t) {
            Some(&at) => vocab[at].1 = Json::Int(i as i64),
            None => {
                seen.insert(t, vocab.len());
                vocab.push((t.to_string(), Json::Int(i as i64)));
            }
        }
    }
    // CONTROL (3) and USER_DEFINED (4) tokens are added tokens; CONTROL ones are special.
    let added: Vec<(usize, &str, bool)> = tokens
        .iter()
        .zip(&types)
        .enumerate()
        .filter(|(_, (_, ty))| matches!(ty, 3 | 4))
        .map(|(i, (t, ty))| (i, *t, *ty == 3))
        .collect();
    let added_fields = |content: &str, special: bool| {
        vec![
            ("content".to_string(), Json::from(content)),
            ("single_word".into(), false.into()),
            ("lstrip".into(), false.into()),
            ("rstrip".into(), false.into()),
            ("normalized".into(), false.into()),
            ("special".into(), special.into()),
        ]
    };
    let added_tokens = added.iter().map(|&(i, t, special)| {
        let mut fields = vec![("id".to_string(), Json::Int(i as i64))];
        fields.extend(added_fields(t, special));
        Json::Object(fields)
    });
    let byte_level = |add_prefix_space: bool, trim_offsets: bool| {
        object([
            ("type", "ByteLevel".into()),
            ("add_prefix_space", add_prefix_space.into()),
            ("trim_offsets", trim_offsets.into()),
            ("use_regex", true.into()),
        ])
    };
    let pre = m.str("tokenizer.ggml.pre");
    let pre_tokenizer = if matches!(pre, Some("smollm" | "starcoder" | "refact" | "qwen2" | "deepseek-coder")) {
        let digits = object([("type", "Digits".into()), ("individual_digits", true.into())]);
        object([("type", "Sequence".into()), ("pretokenizers", Json::Array(vec![digits, byte_level(false, true)]))])
    } else {
        byte_level(false, true)
    };
    let tokenizer = object([
        ("version", "1.0".into()),
        ("truncation", Json::Null),
        ("padding", Json::Null),
        ("added_tokens", Json::Array(added_tokens.collect())),
        ("normalizer", Json::Null),
        ("pre_tokenizer", pre_tokenizer),
        ("post_processor", byte_level(true, false)),
        ("decoder", byte_level(true, true)),
        (
            "model",
            object([
                ("type", "BPE".into()),
                ("dropout", Json::Null),
                ("unk_token", Json::Null),
                ("continuing_subword_prefix", Json::Null),
                ("end_of_word_suffix", Json::Null),
                ("fuse_unk", false.into()),
                ("byte_fallback", false.into()),
                ("ignore_merges", false.into()),
                ("vocab", Json::Object(vocab)),
                ("merges", Json::Array(merges.iter().map(|&s| s.into()).collect())),
            ]),
        ),
    ]);
    write_json(dir, "tokenizer.json", &tokenizer, Style::LINE_UTF8)?;

    let token = |key: &str| -> Result<Option<&str>> {
        if m.0.get(key).is_none() {
            return Ok(None);
        }
        let id = m.int(key)?;
        let t = usize::try_from(id).ok().and_then(|i| tokens.get(i));
        Ok(Some(*t.with_context(|| format!("`{key}` {id} is outside the vocabulary"))?))
    };
    let bos =
        token("tokenizer.ggml.bos_token_id")?.context("GGUF metadata `tokenizer.ggml.bos_token_id` is missing")?;
    let eos =
        token("tokenizer.ggml.eos_token_id")?.context("GGUF metadata `tokenizer.ggml.eos_token_id` is missing")?;
    let unk = Json::from(token("tokenizer.ggml.unknown_token_id")?);
    let pad = Json::from(token("tokenizer.ggml.padding_token_id")?);
    let additional = Json::Array(added.iter().filter(|a| a.0 != 0).map(|a| a.1.into()).collect());
    let decoder = added.iter().map(|&(i, t, special)| (i.to_string(), Json::Object(added_fields(t, special))));
    let mut config = vec![
        ("add_prefix_space".to_string(), false.into()),
        ("bos_token".into(), bos.into()),
        ("eos_token".into(), eos.into()),
        ("unk_token".into(), unk.clone()),
        ("pad_token".into(), pad.clone()),
        ("model_max_length".into(), Json::Int(m.int_or("llama.context_length", 2048)?)),
        ("tokenizer_class".into(), "GPT2Tokenizer".into()),
        ("clean_up_tokenization_spaces".into(), false.into()),
        ("additional_special_tokens".into(), additional.clone()),
        ("added_tokens_decoder".into(), Json::Object(decoder.collect())),
    ];
    if let Some(template) = m.str("tokenizer.chat_template").filter(|t| !t.is_empty()) {
        config.push(("chat_template".into(), template.into()));
    }
    write_json(dir, "tokenizer_config.json", &Json::Object(config), Style::INDENT2_UTF8)?;
    let special = object([
        ("bos_token", bos.into()),
        ("eos_token", eos.into()),
        ("unk_token", unk),
        ("pad_token", pad),
        ("additional_special_tokens", additional),
    ]);
    write_json(dir, "special_tokens_map.json", &special, Style::INDENT2)
}

/// The Hugging Face name of a GGUF tensor, or None for one the script skips.
fn hf_name(gguf_name: &str) -> Option<String> {
    let top = match gguf_name {
        "token_embd.weight" => Some("model.embed_tokens.weight"),
        "output_norm.weight" => Some("model.norm.weight"),
        "output.weight" => Some("lm_head.weight"),
        _ => None,
    };
    if let Some(n) = top {
        return Some(n.to_string());
    }
    let parts: Vec<&str> = gguf_name.split('.').collect();
    if parts.len() < 4 || parts[0] != "blk" {
        return None;
    }
    let sub = match parts[2] {
        "attn_norm" => "input_layernorm",
        "ffn_norm" => "post_attention_layernorm",
        "attn_q" => "self_attn.q_proj",
        "attn_k" => "self_attn.k_proj",
        "attn_v" => "self_attn.v_proj",
        "attn_output" => "self_attn.o_proj",
        "ffn_gate" => "mlp.gate_proj",
        "ffn_up" => "mlp.up_proj",
        "ffn_down" => "mlp.down_proj",
        _ => return None,
    };
    Some(format!("model.layers.{}.{sub}.{}", parts[1], parts[3]))
}

fn convert_tensor(gguf: &Gguf, t: &TensorInfo, hf: &str, n_head: Option<usize>) -> Result<Vec<Tensor>> {
    if let [cols, rows] = t.dims[..] {
        let (rows, cols) = (rows as usize, cols as usize);
        ensure!(cols % GROUP == 0, "`{}`: {cols} columns are not whole groups of {GROUP}", t.name);
        let base = hf.strip_suffix(".weight").unwrap_or(hf);
        let mut q = match t.ty {
            TensorType::Q4_1 => q4_1_to_mlx(gguf.data(t), rows, cols),
            _ => quantize_4bit(&gguf.dequantize(t), rows, cols),
        };
        if let Some(n) = n_head {
            q = q.unpermute(n).with_context(|| format!("`{}`", t.name))?;
        }
        return Ok(vec![
            Tensor {
                name: format!("{base}.weight"),
                dtype: "U32",
                shape: vec![rows, cols / 8],
                data: le_bytes(&q.packed, u32::to_le_bytes),
            },
            Tensor {
                name: format!("{base}.scales"),
                dtype: "F16",
                shape: vec![rows, cols / GROUP],
                data: le_bytes(&q.scales, u16::to_le_bytes),
            },
            Tensor {
                name: format!("{base}.biases"),
                dtype: "F16",
                shape: vec![rows, cols / GROUP],
                data: le_bytes(&q.biases, u16::to_le_bytes),
            },
        ]);
    }
    // Anything not 2-D is flattened, as the script does.
    let mut w = gguf.dequantize(t);
    if let Some(n) = n_head {
        w = unpermute_rows(&w, w.len(), n).with_context(|| format!("`{}`", t.name))?;
    }
    let data = w.iter().flat_map(|&x| f16::from_f32(x).to_bits().to_le_bytes()).collect();
    Ok(vec![Tensor { name: hf.to_string(), dtype: "F16", shape: vec![w.len()], data }])
}

/// Writes the MLX 4-bit folder for `gguf` into `out` (which must exist). `source_name` is the GGUF's file
/// name, recorded as `_converted_from`.
pub fn convert(gguf: &Gguf, source_name: &str, out: &Path) -> Result<()> {
    let m = Meta(gguf);
    let arch = m.str("general.architecture");
    if arch != Some("llama") {
        bail!("architecture {arch:?} is not handled (only llama)");
    }
    let n_layer = m.int("llama.block_count")?;
    let n_embd = m.int("llama.embedding_length")?;
    let n_head = m.int("llama.attention.head_count")?;
    let n_kv = m.int_or("llama.attention.head_count_kv", n_head)?;
    ensure!(n_head > 0 && n_kv > 0, "head counts {n_head}/{n_kv} must be positive");
    let tied = !gguf.tensors.iter().any(|t| t.name == "output.weight");
    let vocab = m.strings("tokenizer.ggml.tokens")?.len();
    let bos = m.int("tokenizer.ggml.bos_token_id")?;
    let eos = m.int("tokenizer.ggml.eos_token_id")?;
    let pad = gguf.get("tokenizer.ggml.padding_token_id").map_or(Json::Null, meta_json);
    let quant = || object([("group_size", Json::Int(GROUP as i64)), ("bits", Json::Int(4))]);
    let config = object([
        ("architectures", Json::Array(vec!["LlamaForCausalLM".into()])),
        ("model_type", "llama".into()),
        ("hidden_size", Json::Int(n_embd)),
        ("intermediate_size", Json::Int(m.int("llama.feed_forward_length")?)),
        ("num_hidden_layers", Json::Int(n_layer)),
        ("num_attention_heads", Json::Int(n_head)),
        ("num_key_value_heads", Json::Int(n_kv)),
        ("head_dim", Json::Int(n_embd.div_euclid(n_head))),
        ("max_position_embeddings", Json::Int(m.int("llama.context_length")?)),
        ("rms_norm_eps", Json::Float(m.float_or("llama.attention.layer_norm_rms_epsilon", None)?)),
        ("rope_theta", Json::Float(m.float_or("llama.rope.freq_base", Some(10000.0))?)),
        ("rope_scaling", Json::Null),
        ("hidden_act", "silu".into()),
        ("attention_bias", false.into()),
        ("mlp_bias", false.into()),
        ("tie_word_embeddings", tied.into()),
        ("vocab_size", Json::Int(vocab as i64)),
        ("bos_token_id", Json::Int(bos)),
        ("eos_token_id", Json::Int(eos)),
        ("pad_token_id", pad.clone()),
        ("torch_dtype", "float16".into()),
        ("_converted_from", source_name.into()),
        ("quantization", quant()),
        ("quantization_config", quant()),
    ]);
    write_json(out, "config.json", &config, Style::INDENT2)?;
    let generation =
        object([("bos_token_id", Json::Int(bos)), ("eos_token_id", Json::Int(eos)), ("pad_token_id", pad)]);
    write_json(out, "generation_config.json", &generation, Style::INDENT2)?;
    write_tokenizer(&m, out)?;

    let mut tensors = Vec::new();
    for t in &gguf.tensors {
        let Some(hf) = hf_name(&t.name) else {
            eprintln!("skipping {}", t.name);
            continue;
        };
        let kind = t.name.strip_prefix("blk.").and_then(|r| r.split('.').nth(1));
        let heads = match kind {
            Some("attn_q") => Some(n_head as usize),
            Some("attn_k") => Some(n_kv as usize),
            _ => None,
        };
        tensors.extend(convert_tensor(gguf, t, &hf, heads)?);
    }
    write_safetensors(&out.join("model.safetensors"), tensors, "mlx")
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::PathBuf;

    fn f16_bits(x: f32) -> u16 {
        f16::from_f32(x).to_bits()
    }

    /// MLX's dequantization of row `r`, column `c`.
    fn mlx_value(q: &Quantized, r: usize, c: usize) -> f32 {
        let word = q.packed[r * q.cols / 8 + c / 8];
        let v = (word >> (4 * (c % 8))) & 0xF;
        let g = r * q.cols / GROUP + c / GROUP;
        v as f32 * f16::from_bits(q.scales[g]).to_f32() + f16::from_bits(q.biases[g]).to_f32()
    }

    fn q4_1_block(d: f32, m: f32, values: &[u8; 32]) -> Vec<u8> {
        let mut b = f16_bits(d).to_le_bytes().to_vec();
        b.extend(f16_bits(m).to_le_bytes());
        b.extend((0..16).map(|i| values[i] | (values[i + 16] << 4)));
        b
    }

    #[test]
    fn q4_1_blocks_become_mlx_groups_bit_exactly() {
        let a: [u8; 32] = std::array::from_fn(|i| (i % 16) as u8);
        let b: [u8; 32] = std::array::from_fn(|i| (15 - (i * 7) % 16) as u8);
        // One row of two blocks, then a second row of one repeated block.
        let raw =
            [q4_1_block(0.5, -1.0, &a), q4_1_block(0.125, 2.0, &b), q4_1_block(1.0, 0.0, &b), q4_1_block(1.0, 0.0, &a)]
                .concat();
        let q = q4_1_to_mlx(&raw, 2, 64);
        assert_eq!(q.packed.len(), 2 * 64 / 8);
        assert_eq!(q.scales, [f16_bits(0.5), f16_bits(0.125), f16_bits(1.0), f16_bits(1.0)]);
        assert_eq!(q.biases, [f16_bits(-1.0), f16_bits(2.0), f16_bits(0.0), f16_bits(0.0)]);
        // Values 0..7 of block a packed low nibble first.
        assert_eq!(q.packed[0], 0x7654_3210);
        assert_eq!(q.packed[1], 0xFEDC_BA98);
        let want = crate::gguf::dequantize(&raw, TensorType::Q4_1);
        for r in 0..2 {
            for c in 0..64 {
                assert_eq!(mlx_value(&q, r, c), want[r * 64 + c], "row {r} col {c}");
            }
        }
    }

    #[test]
    fn requantizing_keeps_values_within_half_a_step() {
        let w: Vec<f32> = (0..64).map(|i| ((i * 37 % 64) as f32 - 20.0) * 0.03).collect();
        let q = quantize_4bit(&w, 2, 32);
        for r in 0..2 {
            let g = &w[r * 32..(r + 1) * 32];
            let (min, max) = g.iter().fold((f32::MAX, f32::MIN), |(a, b), &x| (a.min(x), b.max(x)));
            assert_eq!(q.biases[r], f16_bits(min), "bias is the group minimum");
            assert_eq!(q.scales[r], f16_bits((max - min) / 15.0));
            let step = (max - min) / 15.0;
            for (c, &x) in g.iter().enumerate() {
                assert!((mlx_value(&q, r, c) - x).abs() <= step / 2.0 + 1e-3, "row {r} col {c}");
            }
        }
        // A constant group gets the script's scale of 1e-8 (0 in f16) and all-zero codes.
        let flat = quantize_4bit(&[0.75; 32], 1, 32);
        assert_eq!((flat.scales[0], flat.biases[0]), (0, f16_bits(0.75)));
        assert!(flat.packed.iter().all(|&w| w == 0));
    }

    #[test]
    fn rounding_to_codes_is_half_to_even_as_numpy() {
        // Range 0..15 gives scale 1: 0.5 -> 0, 1.5 -> 2, 2.5 -> 2.
        let mut w = [0.0f32; 32];
        w[1] = 15.0;
        w[2] = 0.5;
        w[3] = 1.5;
        w[4] = 2.5;
        let q = quantize_4bit(&w, 1, 32);
        let codes: Vec<u32> = (0..5).map(|k| (q.packed[0] >> (4 * k)) & 0xF).collect();
        assert_eq!(codes, [0, 15, 0, 2, 2]);
    }

    #[test]
    fn rotary_rows_are_unpermuted_per_head() {
        // 2 heads of 4 rows: GGUF rows (0 1 2 3)(4 5 6 7) hold pairs interleaved; HF wants evens then odds.
        let rows: Vec<u32> = (0..8).flat_map(|r| [r * 10, r * 10 + 1]).collect();
        let out = unpermute_rows(&rows, 8, 2).unwrap();
        let order: Vec<u32> = out.chunks(2).map(|c| c[0] / 10).collect();
        assert_eq!(order, [0, 2, 1, 3, 4, 6, 5, 7]);
        assert!(unpermute_rows(&rows, 8, 3).is_err());
    }

    #[test]
    fn tensor_names_follow_the_script() {
        assert_eq!(hf_name("token_embd.weight").as_deref(), Some("model.embed_tokens.weight"));
        assert_eq!(hf_name("blk.7.attn_k.weight").as_deref(), Some("model.layers.7.self_attn.k_proj.weight"));
        assert_eq!(hf_name("blk.0.ffn_norm.weight").as_deref(), Some("model.layers.0.post_attention_layernorm.weight"));
        assert_eq!(hf_name("rope_freqs.weight"), None);
        assert_eq!(hf_name("blk.0.attn_rot_embd"), None);
    }

    /// A tiny llama GGUF (Q8_0 embedding, Q4_1 attention, f32 norms, a tensor the script skips) through
    /// the whole converter: names, dtypes, shapes, unpermuted Q rows, the JSON files' fields.
    #[test]
    fn a_tiny_llama_gguf_converts_into_a_complete_mlx_folder() {
        use crate::gguf::tests::{enc_str, enc_str_array, write_gguf};
        let u32v = |v: u32| v.to_le_bytes().to_vec();
        let f32v = |v: f32| v.to_le_bytes().to_vec();
        let mut types = 5u32.to_le_bytes().to_vec();
        types.extend(5u64.to_le_bytes());
        [3i32, 3, 1, 1, 1].iter().for_each(|t| types.extend(t.to_le_bytes()));
        let meta = vec![
            ("general.architecture", 8, enc_str("llama")),
            ("llama.block_count", 4, u32v(1)),
            ("llama.embedding_length", 4, u32v(64)),
            ("llama.feed_forward_length", 4, u32v(96)),
            ("llama.attention.head_count", 4, u32v(2)),
            ("llama.attention.head_count_kv", 4, u32v(1)),
            ("llama.context_length", 4, u32v(128)),
            ("llama.attention.layer_norm_rms_epsilon", 6, f32v(1e-5)),
            ("llama.rope.freq_base", 6, f32v(10000.0)),
            ("tokenizer.ggml.model", 8, enc_str("gpt2")),
            ("tokenizer.ggml.pre", 8, enc_str("smollm")),
            ("tokenizer.ggml.tokens", 9, enc_str_array(&["<|endoftext|>", "<|im_start|>", "a", "b", "ab"])),
            ("tokenizer.ggml.token_type", 9, types),
            ("tokenizer.ggml.merges", 9, enc_str_array(&["a b"])),
            ("tokenizer.ggml.bos_token_id", 4, u32v(1)),
            ("tokenizer.ggml.eos_token_id", 4, u32v(0)),
            ("tokenizer.chat_template", 8, enc_str("{{ messages }}\n")),
        ];
        let q8_row = |r: usize| -> Vec<u8> {
            let mut b = Vec::new();
            for half in 0..2 {
                b.extend(f16_bits(0.01).to_le_bytes());
                b.extend((0..32).map(|i| ((i * 5 + r * 3 + half * 7) % 255) as i8 as u8));
            }
            b
        };
        let embd: Vec<u8> = (0..5).flat_map(q8_row).collect();
        let q4_rows = |rows: usize| -> Vec<u8> {
            (0..rows)
                .flat_map(|r| {
                    let values: [u8; 32] = std::array::from_fn(|i| ((i + r) % 16) as u8);
                    [q4_1_block(0.5, r as f32, &values), q4_1_block(0.25, -(r as f32), &values)].concat()
                })
                .collect()
        };
        let norm: Vec<u8> = (0..64).flat_map(|i| (1.0 + i as f32 / 64.0).to_le_bytes()).collect();
        let (attn_q, attn_k) = (q4_rows(64), q4_rows(32));
        let file = write_gguf(
            &meta,
            &[
                ("token_embd.weight", &[64, 5], 8, embd),
                ("rope_freqs.weight", &[16], 0, vec![0; 64]),
                ("blk.0.attn_q.weight", &[64, 64], 3, attn_q.clone()),
                ("blk.0.attn_k.weight", &[64, 32], 3, attn_k),
                ("blk.0.attn_norm.weight", &[64], 0, norm),
            ],
            32,
        );
        let gguf = Gguf::parse(&file).unwrap();
        let out = tempfile::tempdir().unwrap();
        convert(&gguf, "tiny.gguf", out.path()).unwrap();

        let st = std::fs::read(out.path().join("model.safetensors")).unwrap();
        let st = safetensors::SafeTensors::deserialize(&st).unwrap();
        let mut names: Vec<(String, Vec<usize>)> =
            st.tensors().into_iter().map(|(n, t)| (n, t.shape().to_vec())).collect();
        names.sort();
        let shapes = |v: &[(&str, &[usize])]| -> Vec<(String, Vec<usize>)> {
            v.iter().map(|(n, s)| (n.to_string(), s.to_vec())).collect()
        };
        assert_eq!(
            names,
            shapes(&[
                ("model.embed_tokens.biases", &[5, 2]),
                ("model.embed_tokens.scales", &[5, 2]),
                ("model.embed_tokens.weight", &[5, 8]),
                ("model.layers.0.input_layernorm.weight", &[64]),
                ("model.layers.0.self_attn.k_proj.biases", &[32, 2]),
                ("model.layers.0.self_attn.k_proj.scales", &[32, 2]),
                ("model.layers.0.self_attn.k_proj.weight", &[32, 8]),
                ("model.layers.0.self_attn.q_proj.biases", &[64, 2]),
                ("model.layers.0.self_attn.q_proj.scales", &[64, 2]),
                ("model.layers.0.self_attn.q_proj.weight", &[64, 8]),
            ])
        );
        let q = st.tensor("model.layers.0.self_attn.q_proj.weight").unwrap();
        assert_eq!(q.dtype(), safetensors::Dtype::U32);
        let direct = q4_1_to_mlx(&attn_q, 64, 64);
        let want = unpermute_rows(&direct.packed, 64, 2).unwrap();
        assert_eq!(q.data(), le_bytes(&want, u32::to_le_bytes));
        // Head 0 of the output starts with the GGUF's even rows: output row 1 is GGUF row 2 (bias 2.0).
        let biases = st.tensor("model.layers.0.self_attn.q_proj.biases").unwrap();
        assert_eq!(biases.data()[4..6], f16_bits(2.0).to_le_bytes());
        let norm = st.tensor("model.layers.0.input_layernorm.weight").unwrap();
        assert_eq!(norm.dtype(), safetensors::Dtype::F16);
        assert_eq!(norm.data()[2..4], f16_bits(1.0 + 1.0 / 64.0).to_le_bytes());

        let read = |name: &str| -> serde_json::Value {
            serde_json::from_slice(&std::fs::read(out.path().join(name)).unwrap()).unwrap()
        };
        let config = read("config.json");
        assert_eq!(config["head_dim"], 32);
        assert_eq!(config["num_key_value_heads"], 1);
        assert_eq!(config["tie_word_embeddings"], true);
        assert_eq!(config["rms_norm_eps"], 1e-5f32 as f64);
        assert_eq!(config["pad_token_id"], serde_json::Value::Null);
        assert_eq!(config["quantization"], serde_json::json!({"group_size": 32, "bits": 4}));
        assert_eq!(config["_converted_from"], "tiny.gguf");
        let tokenizer = read("tokenizer.json");
        assert_eq!(tokenizer["model"]["vocab"]["ab"], 4);
        assert_eq!(tokenizer["model"]["merges"], serde_json::json!(["a b"]));
        assert_eq!(tokenizer["added_tokens"][1]["content"], "<|im_start|>");
        assert_eq!(tokenizer["pre_tokenizer"]["pretokenizers"][0]["type"], "Digits");
        let tc = read("tokenizer_config.json");
        assert_eq!((tc["bos_token"].as_str(), tc["eos_token"].as_str()), (Some("<|im_start|>"), Some("<|endoftext|>")));
        assert_eq!(tc["chat_template"], "{{ messages }}\n");
        assert_eq!(tc["model_max_length"], 128);
        assert_eq!(
            read("generation_config.json"),
            serde_json::json!({"bos_token_id": 1, "eos_token_id": 0, "pad_token_id": null})
        );
    }

    /// The converted SmolLM2 equals what `../shared/models/fetch.sh` made with the Python reference
    /// converter: the JSON files byte for byte, every tensor's dtype, shape and bytes, the whole file.
    #[test]
    fn smollm2_converts_exactly_as_the_reference_converter() {
        let Some(models) = std::env::var_os("MLXCEL_TEST_MODELS").map(PathBuf::from).filter(|p| p.is_dir()) else {
            assert!(
                std::env::var_os("MLXCEL_REQUIRE_TEST_MODELS").is_none(),
                "MLXCEL_REQUIRE_TEST_MODELS is set but MLXCEL_TEST_MODELS does not name a folder of test models"
            );
            eprintln!("skipping: needs MLXCEL_TEST_MODELS (the folder ../shared/models/fetch.sh prints)");
            return;
        };
        let model = crate::fetch::known("smollm2-135m-instruct").unwrap();
        let bytes = std::fs::read(models.join("smollm2-135m-instruct-q4_1.gguf")).unwrap();
        use sha2::Digest;
        let sha: String = sha2::Sha256::digest(&bytes).iter().map(|b| format!("{b:02x}")).collect();
        assert_eq!(sha, model.gguf_sha256);
        let gguf = Gguf::parse(&bytes).unwrap();
        let out = tempfile::tempdir().unwrap();
        convert(&gguf, crate::fetch::gguf_file_name(model), out.path()).unwrap();
        let reference = models.join("smollm2-135m-instruct-mlx-4bit");

        for name in [
            "config.json",
            "generation_config.json",
            "tokenizer.json",
            "tokenizer_config.json",
            "special_tokens_map.json",
        ] {
            let (ours, theirs) =
                (std::fs::read(out.path().join(name)).unwrap(), std::fs::read(reference.join(name)).unwrap());
            if ours != theirs {
                let at = ours.iter().zip(&theirs).position(|(a, b)| a != b).unwrap_or(ours.len().min(theirs.len()));
                let near =
                    |b: &[u8]| String::from_utf8_lossy(&b[at.saturating_sub(60)..(at + 60).min(b.len())]).into_owned();
                panic!("{name} differs at byte {at}:\n ours: {}\n ref:  {}", near(&ours), near(&theirs));
            }
        }
        let ours = std::fs::read(out.path().join("model.safetensors")).unwrap();
        let theirs = std::fs::read(reference.join("model.safetensors")).unwrap();
        let (a, b) = (
            safetensors::SafeTensors::deserialize(&ours).unwrap(),
            safetensors::SafeTensors::deserialize(&theirs).unwrap(),
        );
        let mut names = a.names();
        names.sort();
        let mut ref_names = b.names();
        ref_names.sort();
        assert_eq!(names, ref_names);
        assert_eq!(names.len(), 30 * 7 * 3 + 30 * 2 + 3 + 1);
        for name in names {
            let (x, y) = (a.tensor(name).unwrap(), b.tensor(name).unwrap());
            assert_eq!((x.dtype(), x.shape()), (y.dtype(), y.shape()), "{name}");
            let differing = x.data().iter().zip(y.data()).filter(|(p, q)| p != q).count();
            assert_eq!(differing, 0, "{name}: {differing} of {} bytes differ", x.data().len());
        }
        assert!(ours == theirs, "model.safetensors: same tensors but the file's bytes differ (header or order)");
    }
}
