//! Checkpoint tensors as graph building blocks: find a weight by name and check its shape, resolve a
//! linear layer (float or MLX affine-quantized, with the bits derived from the packed shape and checked
//! against config), and emit its nodes. Nothing here is specific to one architecture.

use std::collections::HashMap;

use mlxcel_plugin_api::{DType, Graph, OpCode, TensorId, WeightInfo};
use serde_json::Value;

use crate::quant::{module_quant, QuantSpec};

/// One checkpoint tensor as the graph refers to it, or a range of its rows.
#[derive(Debug, Clone)]
pub struct WeightRef {
    pub index: u32,
    pub name: String,
    pub dtype: DType,
    /// The shape the graph sees (a row view's has its row count first).
    pub shape: Vec<u64>,
    /// For a row view: the first row it starts at and the rows of the stored tensor.
    pub view: Option<RowView>,
}

/// Rows `first ..` of a stored 2-D tensor of `stored_rows` rows (see `OpCode::Weight`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct RowView {
    pub first: u64,
    pub stored_rows: u64,
}

impl WeightRef {
    /// Rows `first .. first + count` of this 2-D tensor (of this view): how a fused checkpoint tensor
    /// (`qkv_proj`, `gate_up_proj`) is read as its parts without repacking.
    pub fn rows(&self, first: u64, count: u64) -> Result<WeightRef, String> {
        let [n, _] = self.shape[..] else {
            return Err(format!("tensor `{}`: a row view needs a 2-D tensor, not {:?}", self.name, self.shape));
        };
        if count == 0 || first + count > n {
            return Err(format!("tensor `{}`: rows {first}..{} of its {n} rows", self.name, first + count));
        }
        let view = match self.view {
            Some(v) => RowView { first: v.first + first, stored_rows: v.stored_rows },
            None => RowView { first, stored_rows: n },
        };
        Ok(WeightRef { shape: vec![count, self.shape[1]], view: Some(view), ..self.clone() })
    }
}

/// The checkpoint's tensors by name.
pub struct WeightTable {
    by_name: HashMap<String, WeightRef>,
}

impl WeightTable {
    pub fn new(infos: &[WeightInfo]) -> WeightTable {
        let by_name = infos
            .iter()
            .enumerate()
            .map(|(i, w)| {
                let name = unsafe { w.name.as_str() }.to_string();
                let shape = w.shape[..(w.ndim as usize).min(4)].to_vec();
                let dtype = DType::from_raw(w.dtype);
                (name.clone(), WeightRef { index: i as u32, name, dtype, shape, view: None })
            })
            .collect();
        WeightTable { by_name }
    }

    pub fn get(&self, name: &str) -> Option<&WeightRef> {
        self.by_name.get(name)
    }

    pub fn require(&self, name: &str) -> Result<WeightRef, String> {
        self.get(name).cloned().ok_or_else(|| format!("checkpoint is missing tensor `{name}`"))
    }

    /// A float tensor of exactly `shape`.
    pub fn float(&self, name: &str, shape: &[u64]) -> Result<WeightRef, String> {
        let w = self.require(name)?;
        if !matches!(w.dtype, DType::F32 | DType::F16 | DType::BF16) {
            return Err(format!("tensor `{name}` has dtype {}, expected f32, f16 or bf16", w.dtype.name()));
        }
        if w.shape != shape {
            return Err(format!("tensor `{name}` has shape {:?}, config implies {:?}", w.shape, shape));
        }
        Ok(w)
    }
}

/// The weights of a linear map `[out, in]`.
#[derive(Debug, Clone)]
pub enum LinearWeights {
    Float(WeightRef),
    Quantized { packed: WeightRef, scales: WeightRef, biases: WeightRef, spec: QuantSpec },
}

/// A linear layer (or an embedding table, which has the same weights).
#[derive(Debug, Clone)]
pub struct Linear {
    pub weights: LinearWeights,
    pub bias: Option<WeightRef>,
    pub in_features: u64,
    pub out_features: u64,
}

impl Linear {
    /// Resolves module `path` (`{path}.weight`, and `.scales`/`.biases` when quantized).
    pub fn load(
        table: &WeightTable,
        quant: Option<&Value>,
        path: &str,
        in_features: usize,
        out_features: usize,
        bias: bool,
    ) -> Result<Linear, String> {
        let (inf, outf) = (in_features as u64, out_features as u64);
        let wname = format!("{path}.weight");
        let w = table.require(&wname)?;
        let configured = module_quant(quant, path)?;
        let weights = if let Some(scales) = table.get(&format!("{path}.scales")) {
            let spec = configured.ok_or_else(|| {
                format!("tensor `{wname}` is quantized (has `{path}.scales`) but config.json has no `quantization`")
            })?;
            if w.dtype != DType::U32 || w.shape.len() != 2 || w.shape[0] != outf {
                return Err(format!(
                    "tensor `{wname}` should be packed u32 [{outf}, …], found {} {:?}",
                    w.dtype.name(),
                    w.shape
                ));
            }
            let packed_bits = w.shape[1] * 32;
            if packed_bits % inf != 0 {
                return Err(format!(
                    "tensor `{wname}`: {} packed words per row do not hold {inf} values of any bit width",
                    w.shape[1]
                ));
            }
            let bits = (packed_bits / inf) as usize;
            if bits != spec.bits {
                return Err(format!(
                    "tensor `{wname}` is packed at {bits} bits but config.json says {} bits",
                    spec.bits
                ));
            }
            if scales.shape.len() != 2 || scales.shape[0] != outf || scales.shape[1] == 0 || inf % scales.shape[1] != 0
            {
                return Err(format!(
                    "tensor `{path}.scales` has shape {:?} for a [{outf}, {inf}] weight",
                    scales.shape
                ));
            }
            let group = (inf / scales.shape[1]) as usize;
            if group != spec.group_size {
                return Err(format!(
                    "tensor `{path}.scales` implies group size {group} but config.json says {}",
                    spec.group_size
                ));
            }
            if !matches!(bits, 2 | 3 | 4 | 5 | 6 | 8) || !matches!(group, 32 | 64 | 128) {
                return Err(format!("tensor `{wname}`: {bits}-bit group {group} quantization is not supported"));
            }
            let biases = table.require(&format!("{path}.biases"))?;
            if biases.shape != scales.shape {
                return Err(format!(
                    "tensor `{path}.biases` has shape {:?}, expected {:?}",
                    biases.shape, scales.shape
                ));
            }
            for t in [scales, &biases] {
                if !matches!(t.dtype, DType::F32 | DType::F16 | DType::BF16) {
                    return Err(format!("tensor `{}` has dtype {}, expected a float", t.name, t.dtype.name()));
                }
            }
            LinearWeights::Quantized {
                packed: w,
                scales: scales.clone(),
                biases,
                spec: QuantSpec { bits, group_size: group },
            }
        } else {
            if configured.is_some() && w.dtype == DType::U32 {
                return Err(format!("tensor `{wname}` is packed but `{path}.scales` is missing"));
            }
            LinearWeights::Float(table.float(&wname, &[outf, inf])?)
        };
        let bias = if bias { Some(table.float(&format!("{path}.bias"), &[outf])?) } else { None };
        Ok(Linear { weights, bias, in_features: inf, out_features: outf })
    }

    /// Output rows `first .. first + count` of this layer: one part of a fused projection, reading the
    /// same checkpoint tensors (packed words, scales and biases alike). Views are 2-D, so a layer with a
    /// bias vector is refused.
    pub fn rows(&self, first: u64, count: u64) -> Result<Linear, String> {
        let weights = match &self.weights {
            LinearWeights::Float(w) => LinearWeights::Float(w.rows(first, count)?),
            LinearWeights::Quantized { packed, scales, biases, spec } => LinearWeights::Quantized {
                packed: packed.rows(first, count)?,
                scales: scales.rows(first, count)?,
                biases: biases.rows(first, count)?,
                spec: *spec,
            },
        };
        let bias = self.bias.as_ref().map(|b| b.rows(first, count)).transpose()?;
        Ok(Linear { weights, bias, in_features: self.in_features, out_features: count })
    }

    /// The dtype MLX computes this layer's output in: the weight's, or the scales' when quantized
    /// (families that round a constant "in the activation dtype" as mlx-lm does ask this).
    pub fn compute_dtype(&self) -> DType {
        match &self.weights {
            LinearWeights::Float(w) => w.dtype,
            LinearWeights::Quantized { scales, .. } => scales.dtype,
        }
    }

    pub fn describe_quant(&self) -> Option<QuantSpec> {
        match &self.weights {
            LinearWeights::Quantized { spec, .. } => Some(*spec),
            LinearWeights::Float(_) => None,
        }
    }
}

/// A part of a model that reads checkpoint tensors: a weight, a layer, a block, or one that may be absent.
pub trait Weights {
    /// The weight-table index of every tensor it reads.
    fn indices(&self) -> Vec<u32>;
}

impl Weights for WeightRef {
    fn indices(&self) -> Vec<u32> {
        vec![self.index]
    }
}

impl Weights for Linear {
    fn indices(&self) -> Vec<u32> {
        let mut v = match &self.weights {
            LinearWeights::Float(w) => vec![w.index],
            LinearWeights::Quantized { packed, scales, biases, .. } => vec![packed.index, scales.index, biases.index],
        };
        v.extend(self.bias.as_ref().map(|b| b.index));
        v
    }
}

impl<T: Weights> Weights for Option<T> {
    fn indices(&self) -> Vec<u32> {
        self.as_ref().map_or_else(Vec::new, T::indices)
    }
}

/// The tensors a model reads (`ModelDescription::used_weights`): collected part by part, reported
/// sorted and each once.
#[derive(Debug, Default)]
pub struct UsedWeights(Vec<u32>);

impl UsedWeights {
    pub fn add(&mut self, part: &impl Weights) -> &mut Self {
        self.0.extend(part.indices());
        self
    }

    pub fn finish(mut self) -> Vec<u32> {
        self.0.sort_unstable();
        self.0.dedup();
        self.0
    }
}

/// Emits nodes into a graph, creating each weight's source node once.
pub struct GraphWriter<'g> {
    pub g: &'g mut Graph,
    /// Source nodes made so far, by tensor index and row view.
    seen: HashMap<(u32, Option<RowView>), TensorId>,
}

impl<'g> GraphWriter<'g> {
    pub fn new(g: &'g mut Graph) -> Self {
        GraphWriter { g, seen: HashMap::new() }
    }

    pub fn weight(&mut self, w: &WeightRef) -> TensorId {
        let key = (w.index, w.view);
        if let Some(&id) = self.seen.get(&key) {
            return id;
        }
        let id = match w.view {
            Some(v) => self.g.weight_rows(w.index, w.dtype, v.stored_rows, v.first, w.shape[0], w.shape[1]),
            None => self.g.weight(w.index, w.dtype, &w.shape),
        };
        self.seen.insert(key, id);
        id
    }

    /// `x [rows, in] -> [rows, out]`, plus bias.
    pub fn linear(&mut self, x: TensorId, rows: u64, l: &Linear) -> TensorId {
        let shape = [rows, l.out_features];
        let y = match &l.weights {
            LinearWeights::Float(w) => {
                let w = self.weight(w);
                self.g.op(OpCode::MatMul, &shape, &[x, w])
            }
            LinearWeights::Quantized { packed, scales, biases, spec } => {
                let (p, s, b) = (self.weight(packed), self.weight(scales), self.weight(biases));
                self.g.op_with(
                    OpCode::QuantMatMul,
                    &shape,
                    &[x, p, s, b],
                    &[spec.bits as i64, spec.group_size as i64],
                    &[],
                )
            }
        };
        match &l.bias {
            Some(b) => {
                let b = self.weight(b);
                self.g.op(OpCode::Add, &shape, &[y, b])
            }
            None => y,
        }
    }

    /// Rows `ids` of an embedding table stored like a linear `[vocab, dim]`.
    pub fn embedding(&mut self, ids: TensorId, n: u64, table: &Linear) -> TensorId {
        let shape = [n, table.in_features];
        match &table.weights {
            LinearWeights::Float(w) => {
                let w = self.weight(w);
                self.g.op(OpCode::Embedding, &shape, &[ids, w])
            }
            LinearWeights::Quantized { packed, scales, biases, spec } => {
                let (p, s, b) = (self.weight(packed), self.weight(scales), self.weight(biases));
                self.g.op_with(
                    OpCode::QuantEmbedding,
                    &shape,
                    &[ids, p, s, b],
                    &[spec.bits as i64, spec.group_size as i64],
                    &[],
                )
            }
        }
    }

    pub fn rms_norm(&mut self, x: TensorId, shape: &[u64], w: &WeightRef, eps: f32) -> TensorId {
        let w = self.weight(w);
        self.g.op_with(OpCode::RmsNorm, shape, &[x, w], &[0], &[eps])
    }

    /// RMS norm scaled by `(1 + w)`: the checkpoint stores the offset from one (Gemma).
    pub fn rms_norm_plus_one(&mut self, x: TensorId, shape: &[u64], w: &WeightRef, eps: f32) -> TensorId {
        let w = self.weight(w);
        self.g.op_with(OpCode::RmsNorm, shape, &[x, w], &[1], &[eps])
    }
}
