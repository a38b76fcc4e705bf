//! A model folder on disk: `config.json`, `generation_config.json`, the safetensors weights (single or
//! sharded with `model.safetensors.index.json`) mapped into memory, and the tokenizer files.

mod safetensors_file;
pub mod sentence_transformers;

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use mlxcel_plugin_api::{DType, StrRef, WeightInfo, MAX_DIMS};
use serde_json::Value;

pub use safetensors_file::{MappedFile, TensorEntry};

#[derive(Debug, thiserror::Error)]
pub enum CheckpointError {
    #[error("model folder {0} does not exist")]
    NoFolder(PathBuf),
    #[error("{0} is not a model folder: it has no config.json")]
    NoConfig(PathBuf),
    #[error("{path}: {reason}")]
    BadJson { path: PathBuf, reason: String },
    #[error("{0} has no *.safetensors weights")]
    NoWeights(PathBuf),
    #[error("{path}: {reason}")]
    Safetensors { path: PathBuf, reason: String },
    #[error("{0}")]
    Other(String),
}

/// A model folder with its weights mapped.
pub struct Checkpoint {
    pub dir: PathBuf,
    /// `config.json` as text (families parse it themselves), with the sentence-transformers metadata
    /// added when the folder has it (see [`sentence_transformers`]).
    pub config_text: String,
    pub config: Value,
    pub generation_config: Option<Value>,
    pub files: Vec<MappedFile>,
    pub tensors: Vec<TensorEntry>,
}

fn read_json(path: &Path) -> Result<Value, CheckpointError> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| CheckpointError::BadJson { path: path.to_path_buf(), reason: e.to_string() })?;
    serde_json::from_str(&text)
        .map_err(|e| CheckpointError::BadJson { path: path.to_path_buf(), reason: format!("invalid JSON: {e}") })
}

impl Checkpoint {
    /// Reads the configs and maps and validates every weight file.
    pub fn open(dir: &Path) -> Result<Checkpoint, CheckpointError> {
        if !dir.is_dir() {
            return Err(CheckpointError::NoFolder(dir.to_path_buf()));
        }
        let config_path = dir.join("config.json");
        if !config_path.is_file() {
            return Err(CheckpointError::NoConfig(dir.to_path_buf()));
        }
        let mut config_text = std::fs::read_to_string(&config_path)
            .map_err(|e| CheckpointError::BadJson { path: config_path.clone(), reason: e.to_string() })?;
        let mut config: Value = serde_json::from_str(&config_text).map_err(|e| CheckpointError::BadJson {
            path: config_path.clone(),
            reason: format!("invalid JSON: {e}"),
        })?;
        // sentence-transformers' pooling and normalisation are part of what the model computes.
        if let (Some(st), Some(obj)) = (sentence_transformers::read(dir)?, config.as_object_mut()) {
            obj.insert(sentence_transformers::CONFIG_KEY.into(), st);
            config_text = config.to_string();
        }
        let gen_path = dir.join("generation_config.json");
        let generation_config = if gen_path.is_file() { Some(read_json(&gen_path)?) } else { None };

        let mut files = Vec::new();
        let mut tensors = Vec::new();
        for (i, path) in weight_files(dir)?.iter().enumerate() {
            let (file, entries) = safetensors_file::open(path, i)?;
            files.push(file);
            tensors.extend(entries);
        }
        let mut seen = BTreeSet::new();
        for t in &tensors {
            if !seen.insert(t.name.as_str()) {
                return Err(CheckpointError::Other(format!(
                    "tensor `{}` appears in more than one weight file",
                    t.name
                )));
            }
        }
        Ok(Checkpoint { dir: dir.to_path_buf(), config_text, config, generation_config, files, tensors })
    }

    /// Serves the model as an embedding model whatever its files say (see
    /// [`sentence_transformers::serve_as_embedding`]); the families read the changed config.
    pub fn serve_as_embedding(&mut self, pooling: Option<sentence_transformers::PoolingFlag>) {
        sentence_transformers::serve_as_embedding(&mut self.config, pooling);
        self.config_text = self.config.to_string();
    }

    /// `model_type`, looking inside `text_config` for wrapper configs.
    pub fn model_type(&self) -> Option<&str> {
        self.config
            .get("text_config")
            .and_then(|t| t.get("model_type"))
            .or_else(|| self.config.get("model_type"))
            .and_then(Value::as_str)
    }

    pub fn bytes(&self, t: &TensorEntry) -> &[u8] {
        &self.files[t.file].map[t.start..t.end]
    }

    /// Total bytes of tensor data (what the weights cost in memory).
    pub fn weight_bytes(&self) -> u64 {
        self.tensors.iter().map(|t| (t.end - t.start) as u64).sum()
    }

    /// The weight table handed to a family plugin (names borrow `self`).
    pub fn weight_infos(&self) -> Result<Vec<WeightInfo>, CheckpointError> {
        self.tensors
            .iter()
            .map(|t| {
                if t.shape.len() > MAX_DIMS {
                    return Err(CheckpointError::Other(format!(
                        "tensor `{}` has {} dimensions; at most {MAX_DIMS} are supported",
                        t.name,
                        t.shape.len()
                    )));
                }
                let mut shape = [1u64; MAX_DIMS];
                shape[..t.shape.len()].copy_from_slice(&t.shape);
                let dtype = if t.dtype == DType::Other { DType::Other } else { t.dtype };
                Ok(WeightInfo { name: StrRef::new(&t.name), dtype: dtype as u32, ndim: t.shape.len() as u32, shape })
            })
            .collect()
    }
}

/// The weight files: those named by `model.safetensors.index.json`, else every `*.safetensors`.
fn weight_files(dir: &Path) -> Result<Vec<PathBuf>, CheckpointError> {
    let index = dir.join("model.safetensors.index.json");
    if index.is_file() {
        let v = read_json(&index)?;
        let map = v
            .get("weight_map")
            .and_then(Value::as_object)
            .ok_or_else(|| CheckpointError::BadJson { path: index.clone(), reason: "no `weight_map` object".into() })?;
        let names: BTreeSet<&str> = map.values().filter_map(Value::as_str).collect();
        let mut out = Vec::new();
        for n in names {
            let p = dir.join(n);
            if !p.is_file() {
                return Err(CheckpointError::Other(format!(
                    "{} names shard `{n}`, which is missing from {}",
                    index.display(),
                    dir.display()
                )));
            }
            out.push(p);
        }
        return Ok(out);
    }
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .map_err(|e| CheckpointError::Other(format!("cannot read {}: {e}", dir.display())))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|e| e == "safetensors"))
        .collect();
    files.sort();
    if files.is_empty() {
        return Err(CheckpointError::NoWeights(dir.to_path_buf()));
    }
    Ok(files)
}
