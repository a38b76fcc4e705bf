//! The gated MLP most decoders share: `down(act(gate(x)) · up(x))` (SwiGLU, GeGLU), with the gate and up
//! projections stored apart or fused in one `gate_up_proj`.

use mlxcel_plugin_api::{OpCode, TensorId};
use serde_json::Value;

use crate::weights::{GraphWriter, Linear, WeightTable, Weights};

/// The activation of the gate.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GateActivation {
    /// `silu(gate) · up` (one fused `SiluMul` node).
    Silu,
    /// `gelu_tanh(gate) · up` (one fused `GeluTanhMul` node).
    GeluTanh,
    /// The exact (erf) `gelu(gate) · up` (`Gelu`, then `Mul`).
    Gelu,
}

/// `down(act(gate(x)) · up(x))`.
pub struct GatedMlp {
    pub gate: Linear,
    pub up: Linear,
    pub down: Linear,
    pub activation: GateActivation,
}

impl GatedMlp {
    /// Resolves `{path}.gate_proj`, `{path}.up_proj` and `{path}.down_proj` for a model of width
    /// `hidden` and an MLP of width `width`.
    pub fn load(
        table: &WeightTable,
        quant: Option<&Value>,
        path: &str,
        hidden: usize,
        width: usize,
        bias: bool,
        activation: GateActivation,
    ) -> Result<GatedMlp, String> {
        let lin = |name: &str, i: usize, o: usize| Linear::load(table, quant, &format!("{path}.{name}"), i, o, bias);
        Ok(GatedMlp {
            gate: lin("gate_proj", hidden, width)?,
            up: lin("up_proj", hidden, width)?,
            down: lin("down_proj", width, hidden)?,
            activation,
        })
    }

    /// Resolves a fused `{path}.gate_up_proj` (the gate's rows, then the up rows, read as row views of
    /// the one tensor) and `{path}.down_proj`.
    pub fn fused(
        table: &WeightTable,
        quant: Option<&Value>,
        path: &str,
        hidden: usize,
        width: usize,
        activation: GateActivation,
    ) -> Result<GatedMlp, String> {
        let gate_up = Linear::load(table, quant, &format!("{path}.gate_up_proj"), hidden, 2 * width, false)?;
        Ok(GatedMlp {
            gate: gate_up.rows(0, width as u64)?,
            up: gate_up.rows(width as u64, width as u64)?,
            down: Linear::load(table, quant, &format!("{path}.down_proj"), width, hidden, false)?,
            activation,
        })
    }

    /// `down(act(gate(x)) · up(x))` for `t` rows of `x`.
    pub fn forward(&self, w: &mut GraphWriter, x: TensorId, t: u64) -> TensorId {
        let shape = [t, self.gate.out_features];
        let gate = w.linear(x, t, &self.gate);
        let up = w.linear(x, t, &self.up);
        let m = match self.activation {
            GateActivation::Silu => w.g.op(OpCode::SiluMul, &shape, &[gate, up]),
            GateActivation::GeluTanh => w.g.op(OpCode::GeluTanhMul, &shape, &[gate, up]),
            GateActivation::Gelu => {
                let g = w.g.op(OpCode::Gelu, &shape, &[gate]);
                w.g.op(OpCode::Mul, &shape, &[g, up])
            }
        };
        w.linear(m, t, &self.down)
    }
}

impl Weights for GatedMlp {
    fn indices(&self) -> Vec<u32> {
        [&self.gate, &self.up, &self.down].iter().flat_map(|l| l.indices()).collect()
    }
}
