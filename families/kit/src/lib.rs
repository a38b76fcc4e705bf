//! The family kit: what every family plugin shares, so that a family crate is its config, its blocks and
//! its wiring (see `docs/adding-a-family.md`).
//!
//! - [`weights`]: the checkpoint's weight table, float and MLX-quantized linear layers (and row views of
//!   fused ones), the tensors a model reads ([`Weights`], [`UsedWeights`]), and a [`GraphWriter`] that
//!   emits their nodes (linear, embedding, RMS norm, `1 + w` RMS norm);
//! - [`quant`]: quantization specs from `config.json`, with per-module overrides, and their one-line
//!   description;
//! - [`rope`]: rotary frequencies for every scaling type mlx-lm knows, and per-sequence frequencies for
//!   the context-dependent ones ([`rope::step_inv_freq`]);
//! - [`attention`]: the grouped-query self-attention block (q/k/v, q/k norm, RoPE, paged attention with
//!   window, scale and soft-cap, o) and the KV layer it needs;
//! - [`mlp`]: the gated MLP, `down(act(gate(x)) · up(x))`, with separate or fused gate and up;
//! - [`decoder`]: a text decoder's `FamilyModel` around the family's `forward` ([`Decoder`]), its
//!   step inputs and logit rows, and the facts its description reports (a decoder run as an embedding
//!   model among them);
//! - [`embedding`]: sentence-transformers pooling and normalisation ([`EmbeddingHead`]) and causal
//!   attention among a step's own tokens, for models that output sentence vectors;
//! - [`config`]: reading `model_type` (top level or `text_config`);
//! - [`experts`]: mixture-of-experts projections (stacked, quantized or one tensor per expert) and the
//!   router, expert matmul and combine nodes.
//!
//! The plugin's C entry points come from `mlxcel_plugin_api::export_family!` over the
//! [`mlxcel_plugin_api::Family`] trait.

pub mod attention;
pub mod config;
pub mod decoder;
pub mod embedding;
pub mod experts;
pub mod mlp;
pub mod quant;
pub mod rope;
pub mod weights;

pub use attention::{AttentionShape, RopeInputs, SelfAttention};
pub use decoder::{Decoder, StepInputs, TextDecoder, TextModelFacts};
pub use embedding::{EmbeddingHead, Pooling};
pub use experts::{ExpertWeights, Experts, Routes};
pub use mlp::{GateActivation, GatedMlp};
pub use quant::{module_quant, QuantSpec};
pub use rope::{rope_freqs, RopeFreqs};
pub use weights::{GraphWriter, Linear, LinearWeights, RowView, UsedWeights, WeightRef, WeightTable, Weights};
