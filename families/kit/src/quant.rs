//! MLX quantization as `config.json` states it: one `quantization: {bits, group_size}` for the model,
//! with per-module overrides (a module path mapped to its own spec, or `false` for unquantized).

use serde_json::Value;

/// Quantization of one linear module, from config's `quantization` (with per-module overrides).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QuantSpec {
    pub bits: usize,
    pub group_size: usize,
}

/// What config says about module `path` (e.g. `model.layers.0.mlp.down_proj`):
/// `Ok(None)` unquantized, `Ok(Some(spec))` quantized, `Err` for a mode this family cannot run.
pub fn module_quant(quant: Option<&Value>, path: &str) -> Result<Option<QuantSpec>, String> {
    let Some(q) = quant.filter(|q| q.is_object()) else { return Ok(None) };
    let spec_of = |v: &Value| -> Result<Option<QuantSpec>, String> {
        if v == &Value::Bool(false) {
            return Ok(None);
        }
        if let Some(mode) = v.get("mode").and_then(Value::as_str) {
            if mode != "affine" {
                return Err(format!(
                    "quantization mode `{mode}` (for {path}) is not supported yet; only MLX affine quantization is"
                ));
            }
        }
        let bits = v.get("bits").and_then(Value::as_u64).unwrap_or(4) as usize;
        let group_size = v.get("group_size").and_then(Value::as_u64).unwrap_or(64) as usize;
        Ok(Some(QuantSpec { bits, group_size }))
    };
    match q.get(path) {
        Some(v) => spec_of(v),
        None => spec_of(q),
    }
}

/// How a model is quantized, in words for `mlxcel inspect` (e.g. `affine 4-bit g32`, with ` (mixed)`
/// when config overrides some modules); empty when `spec` (a representative layer's) is `None`.
pub fn describe(spec: Option<QuantSpec>, config: Option<&Value>) -> String {
    match spec {
        Some(s) => {
            let mixed = config
                .is_some_and(|q| q.as_object().is_some_and(|o| o.values().any(|v| v.is_object() || v.is_boolean())));
            format!("affine {}-bit g{}{}", s.bits, s.group_size, if mixed { " (mixed)" } else { "" })
        }
        None => String::new(),
    }
}
