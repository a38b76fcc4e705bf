//! The family side of the ABI: recognise a checkpoint, describe it, build its graphs.

use std::ffi::c_void;

use crate::ffi::{ErrorBuf, Status, StrRef, Versioned};
use crate::graph::{GraphRef, WeightInfo};

/// What a model does.
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Task {
    Text = 1,
    Embed = 2,
    Rerank = 3,
    Asr = 4,
    Tts = 5,
}

impl Task {
    pub fn from_raw(v: u32) -> Option<Task> {
        Some(match v {
            1 => Task::Text,
            2 => Task::Embed,
            3 => Task::Rerank,
            4 => Task::Asr,
            5 => Task::Tts,
            _ => return None,
        })
    }
    pub fn name(self) -> &'static str {
        match self {
            Task::Text => "text",
            Task::Embed => "embed",
            Task::Rerank => "rerank",
            Task::Asr => "asr",
            Task::Tts => "tts",
        }
    }
}

/// How one layer keeps state between steps.
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KvKind {
    /// Keys and values for every position.
    Full = 0,
    /// Keys and values for the last `window` positions only.
    SlidingWindow = 1,
    /// A fixed-size state per sequence (`state_elems` f32), independent of length, zeroed when the
    /// sequence starts: a recurrent or convolution state ([`crate::conv_state_elems`]), or an encoder's
    /// keys and values for cross-attention ([`crate::cross_kv_state_elems`]).
    Recurrent = 2,
    /// No state (e.g. an encoder layer).
    None = 3,
}

/// The state layout of one layer (an array element: the stride is its `size`).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct KvLayerDesc {
    pub size: usize,
    /// [`KvKind`] as a raw number.
    pub kind: u32,
    pub n_kv_heads: u32,
    pub head_dim: u32,
    /// Positions a sliding-window layer attends to (the current one included).
    pub window: u32,
    /// f32 values of recurrent state per sequence (`Recurrent` layers).
    pub state_elems: u64,
}

// SAFETY: repr(C), `size` first, plain data.
unsafe impl Versioned for KvLayerDesc {}

/// What a model's graph outputs per requested row.
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OutputKind {
    /// Next-token logits, `output_dim` = vocabulary size.
    Logits = 0,
    /// A vector per row (pooled embeddings), `output_dim` = its width.
    Embeddings = 1,
    /// Classifier scores per row (rerankers), `output_dim` = number of labels.
    Scores = 2,
}

/// What a loaded model is. Pointers are owned by the model and live until `model_destroy`.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct ModelDesc {
    /// Set by the caller to its `size_of::<ModelDesc>()`; see [`crate::write_versioned`].
    pub size: usize,
    /// [`Task`] as a raw number.
    pub task: u32,
    /// The `model_type` this model was matched as.
    pub architecture: StrRef,
    pub vocab_size: u64,
    pub hidden_size: u64,
    pub n_layers: u32,
    /// Longest context the config allows.
    pub max_positions: u64,
    /// One entry per stateful layer slot, index = the layer parameter of `Attention` (and other
    /// stateful) nodes.
    pub kv_layers: *const KvLayerDesc,
    pub n_kv_layers: usize,
    /// Indices (into the weight table given to `model_create`) the graphs read; others need no upload.
    pub used_weights: *const u32,
    pub n_used_weights: usize,
    /// Estimated activation bytes per token in flight (for the memory pre-flight).
    pub activation_bytes_per_token: u64,
    /// Quantization in words (e.g. `affine 4-bit g32`), or empty.
    pub quantization: StrRef,
    /// [`OutputKind`] as a raw number.
    pub output_kind: u32,
    /// Floats per output row (vocabulary size for logits).
    pub output_dim: u64,
}

// SAFETY: repr(C), `size` first, plain data.
unsafe impl Versioned for ModelDesc {}

/// The shape of one forward step, as the family needs it to build the graph.
///
/// Tokens of one sequence are contiguous and in position order. Anything a family derives per sequence
/// (dynamic RoPE frequencies, say) it derives from that sequence's own entries, never from the step as
/// a whole, so a sequence's result does not depend on its batch-mates.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct StepDesc {
    pub size: usize,
    /// Tokens in the step, all sequences together.
    pub n_tokens: u32,
    /// Sequences in the step.
    pub n_seqs: u32,
    /// Rows for which the graph must output (the `INPUT_OUTPUT_ROWS` input lists them).
    pub n_output_rows: u32,
    /// `[n_seqs]` tokens each sequence has in this step.
    pub seq_n_tokens: *const u32,
    /// `[n_seqs]` each sequence's context length after this step (last position + 1).
    pub seq_context: *const u32,
}

// SAFETY: repr(C), `size` first, plain data.
unsafe impl Versioned for StepDesc {}

impl StepDesc {
    /// # Safety
    /// The arrays are valid for `n_seqs` elements.
    pub unsafe fn seq_n_tokens(&self) -> &[u32] {
        // SAFETY: caller's contract.
        unsafe { crate::ffi::slice_from(self.seq_n_tokens, self.n_seqs as usize) }
    }
    /// # Safety
    /// As for [`StepDesc::seq_n_tokens`].
    pub unsafe fn seq_context(&self) -> &[u32] {
        // SAFETY: caller's contract.
        unsafe { crate::ffi::slice_from(self.seq_context, self.n_seqs as usize) }
    }
}

/// The function table a family plugin exports.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct FamilyVTable {
    /// `size_of::<FamilyVTable>()` in the plugin; fields beyond it are absent.
    pub size: usize,
    /// The `model_type` values this family handles; static array.
    pub architectures: unsafe extern "C" fn(out_len: *mut usize) -> *const StrRef,
    /// How well this family matches a `config.json` (0 = not at all). Never fails.
    pub match_config: unsafe extern "C" fn(config_json: StrRef) -> u32,
    /// Validates the config and the checkpoint's weight table and creates a model.
    pub model_create: unsafe extern "C" fn(
        config_json: StrRef,
        weights: *const WeightInfo,
        n_weights: usize,
        out: *mut *mut c_void,
        err: *mut ErrorBuf,
    ) -> Status,
    /// Writes a [`ModelDesc`] (the caller sets its `size` first).
    pub model_describe: unsafe extern "C" fn(model: *mut c_void, out: *mut ModelDesc) -> Status,
    /// Builds the graph of one step. The graph is owned by the model and stays valid until the next
    /// `build_graph` on the same model or `model_destroy`.
    pub build_graph: unsafe extern "C" fn(
        model: *mut c_void,
        step: *const StepDesc,
        out: *mut GraphRef,
        err: *mut ErrorBuf,
    ) -> Status,
    pub model_destroy: unsafe extern "C" fn(model: *mut c_void),
}

impl FamilyVTable {
    /// The size of the table of ABI 2.0, the smallest a major-2 host accepts.
    pub const MIN_SIZE: usize = std::mem::size_of::<FamilyVTable>();
}
