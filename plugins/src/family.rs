//! Safe wrappers over a family plugin's vtable.

use std::ffi::c_void;

use mlxcel_plugin_api::{
    read_versioned_array, ErrorMessage, FamilyVTable, GraphRef, KvKind, KvLayerDesc, ModelDesc, OutputKind, Status,
    StepDesc, StrRef, Task, Versioned, WeightInfo,
};

use crate::{check, CallError, PluginMeta};

/// A loaded family plugin.
#[derive(Clone)]
pub struct FamilyPlugin {
    pub meta: PluginMeta,
    vt: &'static FamilyVTable,
}

impl std::fmt::Debug for FamilyPlugin {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FamilyPlugin").field("name", &self.meta.name).field("path", &self.meta.path).finish()
    }
}

impl FamilyPlugin {
    pub(crate) fn new(meta: PluginMeta, vt: &'static FamilyVTable) -> Self {
        FamilyPlugin { meta, vt }
    }

    pub fn name(&self) -> &str {
        &self.meta.name
    }

    /// The `model_type` values this family handles.
    pub fn architectures(&self) -> Vec<String> {
        let mut n = 0usize;
        // SAFETY: the list and its strings are static in the plugin.
        let ptr = unsafe { (self.vt.architectures)(&mut n) };
        // SAFETY: as above: `n` static `StrRef`s of static strings.
        let refs = unsafe { mlxcel_plugin_api::slice_from(ptr, n) };
        // SAFETY: as above.
        refs.iter().map(|s| unsafe { s.as_str() }.to_string()).collect()
    }

    /// How well this family matches a `config.json` text (0 = not at all).
    pub fn match_config(&self, config_json: &str) -> u32 {
        // SAFETY: the string outlives the call.
        unsafe { (self.vt.match_config)(StrRef::new(config_json)) }
    }

    /// Creates a model from a config and the checkpoint's weight table (names, dtypes, shapes).
    pub fn create_model(&self, config_json: &str, weights: &[WeightInfo]) -> Result<FamilyModel, CallError> {
        let mut model: *mut c_void = std::ptr::null_mut();
        let mut err = ErrorMessage::new();
        // SAFETY: the config and weight table outlive the call; valid output slots.
        let status = unsafe {
            (self.vt.model_create)(StrRef::new(config_json), weights.as_ptr(), weights.len(), &mut model, err.as_ptr())
        };
        check(&self.meta.name, status, &err)?;
        let mut m = FamilyModel { plugin: self.meta.name.clone(), vt: self.vt, model, info: None, poisoned: false };
        m.info = Some(m.read_info()?);
        Ok(m)
    }
}

/// What a model is, copied out of the plugin.
#[derive(Debug, Clone)]
pub struct ModelInfo {
    pub task: Task,
    pub architecture: String,
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub n_layers: usize,
    pub max_positions: usize,
    pub kv_layers: Vec<KvLayer>,
    pub used_weights: Vec<u32>,
    pub activation_bytes_per_token: u64,
    pub quantization: String,
    pub output_kind: OutputKind,
    /// Floats per output row (the vocabulary for logits).
    pub output_dim: usize,
}

/// The KV layout of one layer.
#[derive(Debug, Clone, Copy)]
pub struct KvLayer {
    pub kind: KvKind,
    pub n_kv_heads: usize,
    pub head_dim: usize,
    pub window: usize,
    /// f32 values of recurrent state per sequence.
    pub state_elems: usize,
}

impl From<&KvLayerDesc> for KvLayer {
    fn from(d: &KvLayerDesc) -> Self {
        let kind = match d.kind {
            0 => KvKind::Full,
            1 => KvKind::SlidingWindow,
            2 => KvKind::Recurrent,
            _ => KvKind::None,
        };
        KvLayer {
            kind,
            n_kv_heads: d.n_kv_heads as usize,
            head_dim: d.head_dim as usize,
            window: d.window as usize,
            state_elems: d.state_elems as usize,
        }
    }
}

/// A model inside a family plugin; destroyed on drop.
pub struct FamilyModel {
    plugin: String,
    vt: &'static FamilyVTable,
    model: *mut c_void,
    info: Option<ModelInfo>,
    /// Set when a call panicked inside the plugin: the model may be half-updated.
    poisoned: bool,
}

// SAFETY: the model is used by one thread at a time (`build_graph` takes `&mut self`; not `Sync`).
unsafe impl Send for FamilyModel {}

impl FamilyModel {
    fn read_info(&self) -> Result<ModelInfo, CallError> {
        let fail = |message: String| CallError { plugin: self.plugin.clone(), status: 1, message };
        let mut d = ModelDesc::zeroed();
        // SAFETY: a live model and a zeroed description with its size set.
        let status = unsafe { (self.vt.model_describe)(self.model, &mut d) };
        if !status.is_ok() {
            return Err(fail("describe failed".into()));
        }
        let task = Task::from_raw(d.task).ok_or_else(|| fail(format!("unknown task {}", d.task)))?;
        let output_kind = match d.output_kind {
            0 => OutputKind::Logits,
            1 => OutputKind::Embeddings,
            2 => OutputKind::Scores,
            k => return Err(fail(format!("unknown output kind {k}"))),
        };
        // SAFETY: the description's pointers live until `model_destroy` (ABI contract).
        let (kv_layers, used_weights, architecture, quantization) = unsafe {
            (
                read_versioned_array::<KvLayerDesc>(d.kv_layers, d.n_kv_layers),
                mlxcel_plugin_api::slice_from(d.used_weights, d.n_used_weights).to_vec(),
                d.architecture.as_str().to_string(),
                d.quantization.as_str().to_string(),
            )
        };
        Ok(ModelInfo {
            task,
            architecture,
            vocab_size: d.vocab_size as usize,
            hidden_size: d.hidden_size as usize,
            n_layers: d.n_layers as usize,
            max_positions: d.max_positions as usize,
            kv_layers: kv_layers.iter().map(KvLayer::from).collect(),
            used_weights,
            activation_bytes_per_token: d.activation_bytes_per_token,
            quantization,
            output_kind,
            output_dim: d.output_dim as usize,
        })
    }

    pub fn info(&self) -> &ModelInfo {
        self.info.as_ref().expect("model info is read at creation")
    }

    /// Builds one step's graph; the graph lives until the next call.
    pub fn build_graph(&mut self, step: &StepDesc) -> Result<GraphRef, CallError> {
        if self.poisoned {
            return Err(CallError {
                plugin: self.plugin.clone(),
                status: Status::PANIC.0,
                message: "this model is unusable after an earlier panic in the plugin; load it again".into(),
            });
        }
        let mut out = GraphRef::empty();
        let mut err = ErrorMessage::new();
        // SAFETY: a live model, a valid step and output slot.
        let status = unsafe { (self.vt.build_graph)(self.model, step, &mut out, err.as_ptr()) };
        if status == Status::PANIC {
            self.poisoned = true;
        }
        check(&self.plugin, status, &err)?;
        Ok(out)
    }
}

impl Drop for FamilyModel {
    fn drop(&mut self) {
        // SAFETY: a live model, destroyed once.
        unsafe { (self.vt.model_destroy)(self.model) };
    }
}
