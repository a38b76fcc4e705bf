//! The family side of the ABI: recognise a checkpoint, describe it, build its graphs.

use std::ffi::c_void;

use crate::ffi::{ErrorBuf, Status, StrRef};
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
    /// A fixed-size recurrent state (`state_bytes`), independent of length.
    Recurrent = 2,
    /// No state (e.g. an encoder layer).
    None = 3,
}

/// The KV layout of one layer.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct KvLayerDesc {
    /// [`KvKind`] as a raw number.
    pub kind: u32,
    pub n_kv_heads: u32,
    pub head_dim: u32,
    pub window: u32,
    pub state_bytes: u64,
}

/// What a loaded model is. Pointers are owned by the model and live until `model_destroy`.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct ModelDesc {
    /// [`Task`] as a raw number.
    pub task: u32,
    /// The `model_type` this model was matched as.
    pub architecture: StrRef,
    pub vocab_size: u64,
    pub hidden_size: u64,
    pub n_layers: u32,
    /// Longest context the config allows.
    pub max_positions: u64,
    /// One entry per layer, index = the `Attention` node's layer parameter.
    pub kv_layers: *const crate::family::KvLayerDesc,
    pub n_kv_layers: usize,
    /// Indices (into the weight table given to `model_create`) the graphs read; others need no upload.
    pub used_weights: *const u32,
    pub n_used_weights: usize,
    /// Estimated activation bytes per token in flight (for the memory pre-flight).
    pub activation_bytes_per_token: u64,
    /// Quantization in words (e.g. `affine 4-bit g32`), or empty.
    pub quantization: StrRef,
}

/// The shape of one forward step.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct StepShape {
    /// Tokens in the step, all sequences together.
    pub n_tokens: u32,
    /// Sequences in the step.
    pub n_seqs: u32,
    /// Rows for which the graph must output logits (the `INPUT_LOGIT_ROWS` input lists them).
    pub n_logit_rows: u32,
    /// Longest context (last position + 1) of any sequence after this step.
    pub max_context: u32,
}

/// The function table a family plugin exports.
#[repr(C)]
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
    pub model_describe: unsafe extern "C" fn(model: *mut c_void, out: *mut ModelDesc) -> Status,
    /// Builds the graph of one step. The graph is owned by the model and stays valid until the next
    /// `build_graph` on the same model or `model_destroy`.
    pub build_graph: unsafe extern "C" fn(
        model: *mut c_void,
        step: *const StepShape,
        out: *mut GraphRef,
        err: *mut ErrorBuf,
    ) -> Status,
    pub model_destroy: unsafe extern "C" fn(model: *mut c_void),
}
