//! One `.safetensors` file, memory-mapped and validated, with its tensors as borrowed byte ranges.

use std::path::{Path, PathBuf};

use memmap2::Mmap;
use mlxcel_plugin_api::DType;
use safetensors::{Dtype, SafeTensorError, SafeTensors};

use super::CheckpointError;

/// A tensor's place in a mapped file.
#[derive(Debug, Clone)]
pub struct TensorEntry {
    pub name: String,
    pub dtype: DType,
    /// The dtype as the file names it (for messages about unsupported ones).
    pub file_dtype: String,
    pub shape: Vec<u64>,
    /// Byte range within the mapping.
    pub start: usize,
    pub end: usize,
    /// Index of the file in the checkpoint.
    pub file: usize,
}

/// A mapped file.
pub struct MappedFile {
    pub path: PathBuf,
    pub map: Mmap,
}

fn dtype_of(d: Dtype) -> DType {
    match d {
        Dtype::F32 => DType::F32,
        Dtype::F16 => DType::F16,
        Dtype::BF16 => DType::BF16,
        Dtype::I32 => DType::I32,
        Dtype::U32 => DType::U32,
        Dtype::U8 => DType::U8,
        Dtype::I64 => DType::I64,
        Dtype::F64 => DType::F64,
        _ => DType::Other,
    }
}

/// The file size a (parseable) header implies: 8 + header + the largest data offset.
fn described_size(map: &[u8]) -> Option<u64> {
    let n = u64::from_le_bytes(map.get(..8)?.try_into().ok()?) as usize;
    let header: serde_json::Value = serde_json::from_slice(map.get(8..8 + n)?).ok()?;
    let end = header
        .as_object()?
        .iter()
        .filter(|(k, _)| *k != "__metadata__")
        .filter_map(|(_, v)| v.get("data_offsets")?.get(1)?.as_u64())
        .max()
        .unwrap_or(0);
    Some(8 + n as u64 + end)
}

/// Maps and validates `path`, returning its tensors. Header problems become one clear message.
pub fn open(path: &Path, file_index: usize) -> Result<(MappedFile, Vec<TensorEntry>), CheckpointError> {
    let bad = |reason: String| CheckpointError::Safetensors { path: path.to_path_buf(), reason };
    let file = std::fs::File::open(path).map_err(|e| bad(format!("cannot open: {e}")))?;
    // SAFETY: the checkpoint is treated as read-only; a file changed underneath is outside our contract.
    let map = unsafe { Mmap::map(&file) }.map_err(|e| bad(format!("cannot map: {e}")))?;
    let len = map.len();
    let (header_len, meta) = SafeTensors::read_metadata(&map).map_err(|e| {
        let declared = if len >= 8 { u64::from_le_bytes(map[..8].try_into().unwrap()) } else { 0 };
        bad(match e {
            SafeTensorError::HeaderTooSmall => format!("file is {len} bytes, too short for a safetensors header"),
            SafeTensorError::HeaderTooLarge | SafeTensorError::InvalidHeaderLength => format!(
                "header claims {declared} bytes but the file has {len}: the file is truncated or not safetensors"
            ),
            SafeTensorError::InvalidHeader | SafeTensorError::InvalidHeaderStart => {
                "header is not valid UTF-8 JSON: the file is corrupt or not safetensors".to_string()
            }
            SafeTensorError::InvalidHeaderDeserialization => {
                "header is not valid safetensors JSON: the file is corrupt".to_string()
            }
            SafeTensorError::MetadataIncompleteBuffer => match described_size(&map) {
                Some(want) if want > len as u64 => {
                    format!("file has {len} bytes but its header describes {want}: the file is truncated")
                }
                Some(want) => format!("file has {len} bytes but its header describes {want}: the file is corrupt"),
                None => {
                    format!("file has {len} bytes, which does not match its header: the file is truncated or corrupt")
                }
            },
            SafeTensorError::InvalidOffset(name) => {
                format!("tensor `{name}` has inconsistent data offsets: the file is corrupt")
            }
            other => format!("invalid safetensors: {other:?}"),
        })
    })?;
    let base = 8 + header_len;
    let mut entries: Vec<TensorEntry> = meta
        .tensors()
        .into_iter()
        .map(|(name, info)| TensorEntry {
            name,
            dtype: dtype_of(info.dtype),
            file_dtype: format!("{:?}", info.dtype),
            shape: info.shape.iter().map(|&s| s as u64).collect(),
            start: base + info.data_offsets.0,
            end: base + info.data_offsets.1,
            file: file_index,
        })
        .collect();
    entries.sort_by(|a, b| a.name.cmp(&b.name));
    Ok((MappedFile { path: path.to_path_buf(), map }, entries))
}
