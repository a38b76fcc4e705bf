//! What the parameters and shapes of a node mean, read and checked once for every backend: an executor
//! asks for an op's spec (from the node and its sources' nodes) and gets the numbers its kernels need,
//! or the message that says what is wrong with the graph. So a new backend does not write the checks
//! again, and every backend refuses the same malformed graphs with the same words.

use crate::graph::{
    Node, CONV_CAUSAL_STATE, CONV_WEIGHT_MLX, CONV_WEIGHT_TORCH, CONV_WHOLE, TOPK_INDICES, TOPK_VALUES,
};

/// Query heads, key/value heads and head size of an attention op.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Heads {
    pub hq: usize,
    pub hkv: usize,
    pub dh: usize,
}

impl Heads {
    /// From three integer parameters `[hq, hkv, dh]`: each non-zero and `hkv` dividing `hq`.
    pub fn from_params(p: &[i64]) -> Result<Heads, String> {
        let [hq, hkv, dh] = [p[0], p[1], p[2]].map(|v| v.max(0) as usize);
        if hq == 0 || hkv == 0 || dh == 0 || !hq.is_multiple_of(hkv) {
            return Err(format!("bad head counts {hq}/{hkv} x {dh}"));
        }
        Ok(Heads { hq, hkv, dh })
    }

    /// q, k and v hold `t` rows of their heads (`what` names the rows: tokens, rows).
    pub fn check_qkv(&self, t: usize, q: &Node, k: &Node, v: &Node, what: &str) -> Result<(), String> {
        let Heads { hq, hkv, dh } = *self;
        if q.numel() != t * hq * dh || k.numel() != t * hkv * dh || v.numel() != t * hkv * dh {
            return Err(format!("q/k/v shapes do not match {t} {what} of {hq}/{hkv} heads x {dh}"));
        }
        Ok(())
    }
}

/// [`crate::OpCode::Attention`]: paged attention over the step's tokens.
#[derive(Clone, Copy, Debug)]
pub struct AttentionSpec {
    pub layer: usize,
    pub heads: Heads,
    /// Sliding window in keys (0 = none).
    pub window: usize,
}

impl AttentionSpec {
    /// For a step of `t` tokens; `src` = q, k, v.
    pub fn decode(node: &Node, src: &[&Node], t: usize) -> Result<AttentionSpec, String> {
        let heads = Heads::from_params(&node.iparams[1..4])?;
        heads.check_qkv(t, src[0], src[1], src[2], "tokens")?;
        if node.numel() != src[0].numel() {
            return Err("output must have q's shape".into());
        }
        Ok(AttentionSpec { layer: node.iparams[0].max(0) as usize, heads, window: node.iparams[4].max(0) as usize })
    }
}

/// [`crate::OpCode::StepAttention`]: attention among a step's own rows, per sequence.
#[derive(Clone, Copy, Debug)]
pub struct StepAttentionSpec {
    pub heads: Heads,
    /// Rows (the sequence-index source's length).
    pub t: usize,
}

impl StepAttentionSpec {
    /// `src` = q, k, v, seq.
    pub fn decode(node: &Node, src: &[&Node]) -> Result<StepAttentionSpec, String> {
        let heads = Heads::from_params(&node.iparams[0..3])?;
        let t = src[3].numel();
        heads.check_qkv(t, src[0], src[1], src[2], "rows")?;
        if node.numel() != src[0].numel() {
            return Err("output must have q's shape".into());
        }
        Ok(StepAttentionSpec { heads, t })
    }
}

/// [`crate::OpCode::CrossAttention`]: attention over the keys and values a sequence's state row holds.
#[derive(Clone, Copy, Debug)]
pub struct CrossAttentionSpec {
    pub layer: usize,
    pub heads: Heads,
    /// Longest stored source the state rows have room for.
    pub max_len: usize,
    /// Rows (the sequence-index source's length).
    pub t: usize,
}

impl CrossAttentionSpec {
    /// `src` = q, seq.
    pub fn decode(node: &Node, src: &[&Node]) -> Result<CrossAttentionSpec, String> {
        let heads = Heads::from_params(&node.iparams[1..4])?;
        let t = src[1].numel();
        if src[0].numel() != t * heads.hq * heads.dh || node.numel() != src[0].numel() {
            return Err(format!("q and the output must be [{t}, {} x {}]", heads.hq, heads.dh));
        }
        Ok(CrossAttentionSpec {
            layer: node.iparams[0].max(0) as usize,
            heads,
            max_len: node.iparams[4].max(0) as usize,
            t,
        })
    }
}

/// [`crate::OpCode::Conv1d`]: shapes, stride, padding, groups, mode and weight layout.
#[derive(Clone, Copy, Debug)]
pub struct Conv1dSpec {
    /// Input rows and channels.
    pub t: usize,
    pub c_in: usize,
    pub c_out: usize,
    pub kernel: usize,
    pub stride: usize,
    /// Zero rows on each side of a sequence (whole mode).
    pub pad: usize,
    pub groups: usize,
    /// Causal with the window carried in a state row (else each sequence whole, zero-padded).
    pub causal: bool,
    /// The weight is PyTorch's `[C_out, C_in/groups, K]` (else MLX's `[C_out, K, C_in/groups]`).
    pub torch_layout: bool,
    /// The KV layer whose state rows carry the window (causal mode).
    pub state_layer: usize,
    pub has_bias: bool,
}

impl Conv1dSpec {
    /// `src` = x, w, seq, and an optional bias.
    pub fn decode(node: &Node, src: &[&Node]) -> Result<Conv1dSpec, String> {
        let (x, w, seq) = (src[0], src[1], src[2]);
        let (t, c_in) = (x.rows(), x.cols());
        let p = &node.iparams;
        let groups = if p[3] == 0 { 1 } else { p[3].max(0) as usize };
        let c_out = node.cols();
        let (stride, pad) = (p[1].max(0) as usize, p[2].max(0) as usize);
        let causal = match p[0] {
            CONV_WHOLE => false,
            CONV_CAUSAL_STATE => true,
            m => return Err(format!("unknown convolution mode {m}")),
        };
        let wd = w.dims();
        if wd.len() != 3 || groups == 0 || !c_in.is_multiple_of(groups) || !c_out.is_multiple_of(groups) {
            return Err(format!("w must be [C_out, K, C_in/groups] with groups dividing {c_in} and {c_out}"));
        }
        let torch_layout = match p[5] {
            CONV_WEIGHT_MLX => false,
            CONV_WEIGHT_TORCH => true,
            l => return Err(format!("unknown convolution weight layout {l}")),
        };
        let (kernel, w_cin) = if torch_layout { (wd[2], wd[1]) } else { (wd[1], wd[2]) };
        let kernel = kernel as usize;
        if wd[0] as usize != c_out || w_cin as usize != c_in / groups || kernel == 0 {
            let want = if torch_layout { "[C_out, C_in/groups, K]" } else { "[C_out, K, C_in/groups]" };
            return Err(format!("w is {wd:?}, expected {want} with C_out {c_out}, C_in/groups {}", c_in / groups));
        }
        if stride == 0 || seq.numel() != t {
            return Err(format!("stride {stride}, {} sequence indices for {t} rows", seq.numel()));
        }
        if causal && (stride != 1 || pad != 0) {
            return Err("a causal convolution with state has stride 1 and no padding".into());
        }
        let has_bias = src.len() > 3;
        if has_bias && src[3].numel() != c_out {
            return Err(format!("bias has {} values, expected {c_out}", src[3].numel()));
        }
        Ok(Conv1dSpec {
            t,
            c_in,
            c_out,
            kernel,
            stride,
            pad,
            groups,
            causal,
            torch_layout,
            state_layer: p[4].max(0) as usize,
            has_bias,
        })
    }

    /// Output rows of one sequence of `len` input rows.
    pub fn out_rows(&self, len: usize) -> usize {
        let (before, after) = if self.causal { (self.kernel - 1, 0) } else { (self.pad, self.pad) };
        let padded = before + len + after;
        if padded < self.kernel {
            0
        } else {
            (padded - self.kernel) / self.stride + 1
        }
    }

    /// Values of the window a causal convolution carries per sequence: its last `kernel - 1` rows.
    pub fn carried(&self) -> usize {
        (self.kernel - 1) * self.c_in
    }
}

/// [`crate::OpCode::TopK`].
#[derive(Clone, Copy, Debug)]
pub struct TopKSpec {
    pub rows: usize,
    pub cols: usize,
    pub k: usize,
    /// Output the columns' indices (else the values).
    pub indices: bool,
    /// Softmax over the whole row first.
    pub softmax: bool,
    /// Divide the k values by their sum.
    pub renormalize: bool,
}

impl TopKSpec {
    /// `x` = the source.
    pub fn decode(node: &Node, x: &Node) -> Result<TopKSpec, String> {
        let (rows, cols) = (x.rows(), x.cols());
        let k = node.iparams[0];
        if k < 1 || k as usize > cols {
            return Err(format!("k = {k} must be between 1 and the {cols} columns"));
        }
        let k = k as usize;
        if node.rows() != rows || node.cols() != k {
            return Err(format!("output must be [{rows}, {k}]"));
        }
        let indices = match node.iparams[1] {
            TOPK_VALUES => false,
            TOPK_INDICES => true,
            o => return Err(format!("unknown top-k output {o}")),
        };
        Ok(TopKSpec { rows, cols, k, indices, softmax: node.iparams[2] == 1, renormalize: node.iparams[3] == 1 })
    }
}

/// [`crate::OpCode::GatherMatMul`] / [`crate::OpCode::GatherQuantMatMul`]: rows routed to experts.
#[derive(Clone, Copy, Debug)]
pub struct GatherSpec {
    /// Tokens and experts per token (the indices' shape).
    pub t: usize,
    pub k: usize,
    /// Input width and output width.
    pub kdim: usize,
    pub n: usize,
    /// One input row per token (fed to all its experts), else one per (token, expert).
    pub x_per_token: bool,
}

impl GatherSpec {
    /// `x` and `indices` = the first two sources.
    pub fn decode(node: &Node, x: &Node, indices: &Node) -> Result<GatherSpec, String> {
        let (t, k) = (indices.rows(), indices.cols());
        let x_per_token = x.rows() == t;
        if !x_per_token && x.rows() != t * k {
            return Err(format!("x has {} rows for {t} tokens of {k} experts", x.rows()));
        }
        if node.rows() != t * k {
            return Err(format!("output has {} rows, expected {t}·{k}", node.rows()));
        }
        Ok(GatherSpec { t, k, kdim: x.cols(), n: node.cols(), x_per_token })
    }
}

/// [`crate::OpCode::WeightedSum`]: `k` rows per token combined by the token's `k` weights.
#[derive(Clone, Copy, Debug)]
pub struct WeightedSumSpec {
    pub t: usize,
    pub k: usize,
    pub n: usize,
}

impl WeightedSumSpec {
    /// `y` and `weights` = the sources.
    pub fn decode(node: &Node, y: &Node, weights: &Node) -> Result<WeightedSumSpec, String> {
        let (t, k) = (weights.rows(), weights.cols());
        let n = node.cols();
        if y.rows() != t * k || y.cols() != n || node.rows() != t {
            return Err(format!(
                "y [{}, {}] and weights [{t}, {k}] do not make [{}, {n}]",
                y.rows(),
                y.cols(),
                node.rows()
            ));
        }
        Ok(WeightedSumSpec { t, k, n })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::graph::{DType, OpCode};

    fn node(op: OpCode, shape: &[u64], params: &[i64]) -> Node {
        let mut n = Node::new(op, DType::F32, shape, &[]);
        n.iparams[..params.len()].copy_from_slice(params);
        n
    }

    #[test]
    fn conv1d_spec_reads_both_weight_layouts_and_refuses_bad_ones() {
        let x = node(OpCode::Input, &[10, 4], &[]);
        let seq = node(OpCode::Input, &[10], &[]);
        let mlx_w = node(OpCode::Weight, &[6, 3, 4], &[]);
        let conv = node(OpCode::Conv1d, &[5, 6], &[CONV_WHOLE, 2, 1, 1, 0, CONV_WEIGHT_MLX]);
        let s = Conv1dSpec::decode(&conv, &[&x, &mlx_w, &seq]).unwrap();
        assert_eq!((s.kernel, s.c_in, s.c_out, s.stride, s.pad), (3, 4, 6, 2, 1));
        assert_eq!(s.out_rows(10), 5);
        let torch_w = node(OpCode::Weight, &[6, 4, 3], &[]);
        let mut torch = conv;
        torch.iparams[5] = CONV_WEIGHT_TORCH;
        assert_eq!(Conv1dSpec::decode(&torch, &[&x, &torch_w, &seq]).unwrap().kernel, 3);
        assert!(Conv1dSpec::decode(&torch, &[&x, &mlx_w, &seq])
            .unwrap_err()
            .contains("expected [C_out, C_in/groups, K]"));
        let mut causal = conv;
        causal.iparams[0] = CONV_CAUSAL_STATE;
        assert!(Conv1dSpec::decode(&causal, &[&x, &mlx_w, &seq]).unwrap_err().contains("stride 1 and no padding"));
        let bias = node(OpCode::Weight, &[5], &[]);
        assert!(Conv1dSpec::decode(&conv, &[&x, &mlx_w, &seq, &bias]).unwrap_err().contains("bias has 5 values"));
    }

    #[test]
    fn top_k_and_expert_specs_check_their_shapes() {
        let x = node(OpCode::Input, &[3, 8], &[]);
        assert_eq!(TopKSpec::decode(&node(OpCode::TopK, &[3, 2], &[2, TOPK_INDICES]), &x).unwrap().k, 2);
        assert!(TopKSpec::decode(&node(OpCode::TopK, &[3, 9], &[9]), &x).is_err());
        assert!(TopKSpec::decode(&node(OpCode::TopK, &[3, 2], &[2, 7]), &x).unwrap_err().contains("top-k output"));
        let idx = node(OpCode::Input, &[3, 2], &[]);
        let g = GatherSpec::decode(&node(OpCode::GatherMatMul, &[6, 5], &[]), &x, &idx).unwrap();
        assert!(g.x_per_token && g.kdim == 8 && g.n == 5);
        assert!(GatherSpec::decode(&node(OpCode::GatherMatMul, &[3, 5], &[]), &x, &idx).is_err());
        let y = node(OpCode::Input, &[6, 5], &[]);
        assert_eq!(WeightedSumSpec::decode(&node(OpCode::WeightedSum, &[3, 5], &[]), &y, &idx).unwrap().k, 2);
        assert!(Heads::from_params(&[6, 4, 8]).is_err());
    }
}
