//! The llama family plugin: Llama, Mistral, Qwen2 and Qwen3 checkpoints as op graphs.
//!
//! [`config`] reads `config.json`, [`layers`] turns checkpoint tensors into linear layers, [`rope`]
//! computes rotary frequencies, [`model`] is the architecture. This file is only the C ABI glue.

pub mod config;
pub mod layers;
pub mod model;
pub mod rope;

use std::ffi::c_void;

use mlxcel_plugin_api::*;

use config::{LlamaConfig, ARCHITECTURES};
use layers::WeightTable;
use model::LlamaModel;

static ARCH_REFS: [StrRef; 4] = [
    StrRef::from_static("llama"),
    StrRef::from_static("mistral"),
    StrRef::from_static("qwen2"),
    StrRef::from_static("qwen3"),
];

unsafe extern "C" fn init(err: *mut ErrorBuf) -> Status {
    guard(err, || Ok(()))
}

unsafe extern "C" fn architectures(out_len: *mut usize) -> *const StrRef {
    debug_assert_eq!(ARCH_REFS.len(), ARCHITECTURES.len());
    if let Some(n) = out_len.as_mut() {
        *n = ARCH_REFS.len();
    }
    ARCH_REFS.as_ptr()
}

/// The `model_type` of a config (or of its nested `text_config`).
fn model_type(json: &str) -> Option<String> {
    let v: serde_json::Value = serde_json::from_str(json).ok()?;
    v.get("text_config")
        .and_then(|t| t.get("model_type"))
        .or_else(|| v.get("model_type"))
        .and_then(|m| m.as_str())
        .map(str::to_string)
}

unsafe extern "C" fn match_config(config_json: StrRef) -> u32 {
    guard_value(0, || match model_type(config_json.as_str()) {
        Some(t) if ARCHITECTURES.contains(&t.as_str()) => 100,
        _ => 0,
    })
}

/// A model handle plus the description the ABI hands out (pointers into `model`).
struct Handle {
    model: LlamaModel,
}

unsafe extern "C" fn model_create(
    config_json: StrRef,
    weights: *const WeightInfo,
    n_weights: usize,
    out: *mut *mut c_void,
    err: *mut ErrorBuf,
) -> Status {
    guard(err, || {
        let cfg = LlamaConfig::parse(config_json.as_str()).map_err(PluginError::invalid)?;
        let table = WeightTable::new(slice_from(weights, n_weights));
        let model = LlamaModel::new(cfg, &table).map_err(PluginError::invalid)?;
        *out = Box::into_raw(Box::new(Handle { model })) as *mut c_void;
        Ok(())
    })
}

unsafe extern "C" fn model_describe(model: *mut c_void, out: *mut ModelDesc) -> Status {
    guard(std::ptr::null_mut(), || {
        let h = (model as *const Handle).as_ref().ok_or_else(|| PluginError::invalid("null model"))?;
        let m = &h.model;
        let desc = ModelDesc {
            task: Task::Text as u32,
            architecture: StrRef::new(&m.cfg.model_type),
            vocab_size: m.cfg.vocab_size as u64,
            hidden_size: m.cfg.hidden_size as u64,
            n_layers: m.cfg.num_hidden_layers as u32,
            max_positions: m.cfg.max_position_embeddings.unwrap_or(4096) as u64,
            kv_layers: m.kv_layers.as_ptr(),
            n_kv_layers: m.kv_layers.len(),
            used_weights: m.used_weights.as_ptr(),
            n_used_weights: m.used_weights.len(),
            activation_bytes_per_token: m.activation_bytes_per_token(),
            quantization: StrRef::new(&m.quantization),
        };
        *out.as_mut().ok_or_else(|| PluginError::invalid("null output"))? = desc;
        Ok(())
    })
}

unsafe extern "C" fn build_graph(
    model: *mut c_void,
    step: *const StepShape,
    out: *mut GraphRef,
    err: *mut ErrorBuf,
) -> Status {
    guard(err, || {
        let h = (model as *mut Handle).as_mut().ok_or_else(|| PluginError::invalid("null model"))?;
        let step = step.as_ref().ok_or_else(|| PluginError::invalid("null step"))?;
        h.model.build_graph(step).map_err(PluginError::invalid)?;
        *out = h.model.graph.as_ref();
        Ok(())
    })
}

unsafe extern "C" fn model_destroy(model: *mut c_void) {
    guard_value((), || {
        if !model.is_null() {
            drop(Box::from_raw(model as *mut Handle));
        }
    })
}

static VTABLE: FamilyVTable = FamilyVTable {
    size: std::mem::size_of::<FamilyVTable>(),
    architectures,
    match_config,
    model_create,
    model_describe,
    build_graph,
    model_destroy,
};

static ROOT: PluginRoot = PluginRoot {
    abi_major: ABI_MAJOR,
    abi_minor: ABI_MINOR,
    kind: PluginKind::Family as u32,
    name: StrRef::from_static("llama"),
    version: StrRef::from_static(env!("CARGO_PKG_VERSION")),
    description: StrRef::from_static("Llama-style decoders: Llama, Mistral, Qwen2, Qwen3 (q/k norm)"),
    init,
    backend: std::ptr::null(),
    family: &VTABLE,
};

export_plugin!(ROOT);
