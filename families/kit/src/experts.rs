//! Mixture-of-experts layers: the experts of one projection (mlx-lm's `SwitchLinear`) as the checkpoint
//! stores them, and the nodes that route tokens to them.
//!
//! mlx-lm stores an expert projection stacked, `{path}.switch_mlp.{proj}.weight` `[E, out, in]` (float),
//! or MLX-quantized as `[E, out, in*bits/32]` `u32` with `.scales`/`.biases` `[E, out, in/group]` (each
//! expert quantized like a linear of its own). Hugging Face checkpoints store one float tensor per
//! expert, `{path}.experts.{e}.{proj}.weight` `[out, in]`, which mlx-lm stacks on load; here they stay
//! separate and are split over several gathered matmuls (a node has at most [`MAX_SRC`] sources).

use mlxcel_plugin_api::{DType, OpCode, TensorId, MAX_SRC, TOPK_INDICES, TOPK_VALUES};
use serde_json::Value;

use crate::quant::{module_quant, QuantSpec};
use crate::weights::{GraphWriter, WeightRef, WeightTable, Weights};

/// How one projection's experts are stored.
#[derive(Debug, Clone)]
pub enum ExpertWeights {
    /// One float stack `[E, out, in]`.
    Stacked(WeightRef),
    /// One float `[out, in]` tensor per expert.
    Separate(Vec<WeightRef>),
    /// One MLX-quantized stack.
    Quantized { packed: WeightRef, scales: WeightRef, biases: WeightRef, spec: QuantSpec },
}

/// The experts of one projection: `n_experts` linear maps `[out, in]`.
#[derive(Debug, Clone)]
pub struct Experts {
    pub weights: ExpertWeights,
    pub n_experts: u64,
    pub in_features: u64,
    pub out_features: u64,
}

impl Experts {
    /// Resolves projection `proj` (e.g. `gate_proj`) of the experts under module `path` (e.g.
    /// `model.layers.0.mlp`): `{path}.switch_mlp.{proj}`, or `{path}.experts.{e}.{proj}`.
    pub fn load(
        table: &WeightTable,
        quant: Option<&Value>,
        path: &str,
        proj: &str,
        n_experts: usize,
        in_features: usize,
        out_features: usize,
    ) -> Result<Experts, String> {
        let (e, inf, outf) = (n_experts as u64, in_features as u64, out_features as u64);
        let module = format!("{path}.switch_mlp.{proj}");
        let wname = format!("{module}.weight");
        let weights = if let Some(w) = table.get(&wname) {
            if let Some(scales) = table.get(&format!("{module}.scales")) {
                let spec = module_quant(quant, &module)?.ok_or_else(|| {
                    format!(
                        "tensor `{wname}` is quantized (has `{module}.scales`) but config.json has no `quantization`"
                    )
                })?;
                let bad = |what: &str| format!("tensor `{wname}`: {what}");
                if w.dtype != DType::U32 || w.shape.len() != 3 || w.shape[0] != e || w.shape[1] != outf {
                    return Err(bad(&format!(
                        "should be packed u32 [{e}, {outf}, …], found {} {:?}",
                        w.dtype.name(),
                        w.shape
                    )));
                }
                if (w.shape[2] * 32) % inf != 0 || (w.shape[2] * 32 / inf) as usize != spec.bits {
                    return Err(bad(&format!(
                        "{} words per row do not hold {inf} values at {} bits",
                        w.shape[2], spec.bits
                    )));
                }
                let groups = inf / spec.group_size as u64;
                if scales.shape != [e, outf, groups] {
                    return Err(format!(
                        "tensor `{module}.scales` has shape {:?}, expected [{e}, {outf}, {groups}] (group size {})",
                        scales.shape, spec.group_size
                    ));
                }
                if !matches!(spec.bits, 2 | 3 | 4 | 5 | 6 | 8) || !matches!(spec.group_size, 32 | 64 | 128) {
                    return Err(bad(&format!(
                        "{}-bit group {} quantization is not supported",
                        spec.bits, spec.group_size
                    )));
                }
                let biases = table.require(&format!("{module}.biases"))?;
                if biases.shape != scales.shape {
                    return Err(format!(
                        "tensor `{module}.biases` has shape {:?}, expected {:?}",
                        biases.shape, scales.shape
                    ));
                }
                for t in [scales, &biases] {
                    if !matches!(t.dtype, DType::F32 | DType::F16 | DType::BF16) {
                        return Err(format!("tensor `{}` has dtype {}, expected a float", t.name, t.dtype.name()));
                    }
                }
                ExpertWeights::Quantized { packed: w.clone(), scales: scales.clone(), biases, spec }
            } else {
                ExpertWeights::Stacked(table.float(&wname, &[e, outf, inf])?)
            }
        } else if table.get(&format!("{path}.experts.0.{proj}.weight")).is_some() {
            if table.get(&format!("{path}.experts.0.{proj}.scales")).is_some() {
                return Err(format!(
                    "`{path}.experts.*.{proj}` are quantized one tensor per expert; convert the checkpoint with \
                     mlx_lm.convert, which stacks them into `{module}`"
                ));
            }
            let each = (0..n_experts)
                .map(|i| table.float(&format!("{path}.experts.{i}.{proj}.weight"), &[outf, inf]))
                .collect::<Result<Vec<_>, _>>()?;
            ExpertWeights::Separate(each)
        } else {
            return Err(format!("checkpoint is missing tensor `{wname}` (or `{path}.experts.0.{proj}.weight`)"));
        };
        Ok(Experts { weights, n_experts: e, in_features: inf, out_features: outf })
    }

    pub fn describe_quant(&self) -> Option<QuantSpec> {
        match &self.weights {
            ExpertWeights::Quantized { spec, .. } => Some(*spec),
            _ => None,
        }
    }
}

impl Weights for Experts {
    fn indices(&self) -> Vec<u32> {
        match &self.weights {
            ExpertWeights::Stacked(w) => vec![w.index],
            ExpertWeights::Separate(ws) => ws.iter().map(|w| w.index).collect(),
            ExpertWeights::Quantized { packed, scales, biases, .. } => vec![packed.index, scales.index, biases.index],
        }
    }
}

/// A router's choice for each token: `[T, k]` expert ids and their weights.
#[derive(Debug, Clone, Copy)]
pub struct Routes {
    pub indices: TensorId,
    pub weights: TensorId,
    pub k: u64,
}

impl GraphWriter<'_> {
    /// The top `k` of `logits [rows, E]`: softmax over all experts first, then the `k` largest
    /// probabilities, divided by their sum when `renormalize` (`norm_topk_prob`).
    pub fn route(&mut self, logits: TensorId, rows: u64, k: u64, renormalize: bool) -> Routes {
        let shape = [rows, k];
        let params = |what| [k as i64, what, 1, renormalize as i64];
        let indices = self.g.op_with(OpCode::TopK, &shape, &[logits], &params(TOPK_INDICES), &[]);
        let weights = self.g.op_with(OpCode::TopK, &shape, &[logits], &params(TOPK_VALUES), &[]);
        Routes { indices, weights, k }
    }

    /// Each row of `x` through the experts `routes` chose: `x` is `[rows, in]` (a token's row feeds all
    /// its experts) or `[rows·k, in]` (one row per choice). Out `[rows, k, out]`.
    pub fn experts(&mut self, x: TensorId, rows: u64, routes: Routes, e: &Experts) -> TensorId {
        let shape = [rows, routes.k, e.out_features];
        match &e.weights {
            ExpertWeights::Stacked(w) => {
                let w = self.weight(w);
                self.g.op_with(OpCode::GatherMatMul, &shape, &[x, routes.indices, w], &[0, e.n_experts as i64], &[])
            }
            ExpertWeights::Quantized { packed, scales, biases, spec } => {
                let (p, s, b) = (self.weight(packed), self.weight(scales), self.weight(biases));
                self.g.op_with(
                    OpCode::GatherQuantMatMul,
                    &shape,
                    &[x, routes.indices, p, s, b],
                    &[spec.bits as i64, spec.group_size as i64],
                    &[],
                )
            }
            ExpertWeights::Separate(ws) => {
                // Up to MAX_SRC - 2 experts per node; each leaves zeros where the others' experts were
                // chosen, so the sum of the nodes is exact.
                let mut sum: Option<TensorId> = None;
                for (c, chunk) in ws.chunks(MAX_SRC - 2).enumerate() {
                    let mut src = vec![x, routes.indices];
                    src.extend(chunk.iter().map(|w| self.weight(w)));
                    let first = (c * (MAX_SRC - 2)) as i64;
                    let part = self.g.op_with(OpCode::GatherMatMul, &shape, &src, &[first, e.n_experts as i64], &[]);
                    sum = Some(match sum {
                        Some(s) => self.g.op(OpCode::Add, &shape, &[s, part]),
                        None => part,
                    });
                }
                sum.expect("at least one expert")
            }
        }
    }

    /// `out[t] = Σ_j weights[t, j] · y[t, j]`: `y [rows, k, n]` combined into `[rows, n]`.
    pub fn combine(&mut self, y: TensorId, weights: TensorId, rows: u64, n: u64) -> TensorId {
        self.g.op(OpCode::WeightedSum, &[rows, n], &[y, weights])
    }
}
