//! The op graph: the only language families and backends share.
//!
//! A graph is a flat, topologically ordered list of [`Node`]s. Every node defines one tensor, named by
//! its index. Source nodes ([`OpCode::Input`], [`OpCode::Weight`], [`OpCode::Constant`]) bind data from
//! outside; every other node computes from earlier nodes (`src`). Activations are row-major and seen as
//! 2-D `[rows, cols]` (rows = product of all but the last dimension); they are always `F32` in this
//! minor version. Weights keep their checkpoint dtype, including MLX affine-quantized packs.

use crate::ffi::StrRef;

/// Element type of a tensor.
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DType {
    F32 = 0,
    F16 = 1,
    BF16 = 2,
    I32 = 3,
    /// Packed quantized weights (MLX affine: `bits` values per element group, little-endian in `u32`).
    U32 = 4,
    U8 = 5,
    I64 = 6,
    F64 = 7,
    /// Anything the ABI does not name (e.g. F8); families refuse it with a message.
    Other = 255,
}

impl DType {
    pub fn from_raw(v: u32) -> DType {
        match v {
            0 => DType::F32,
            1 => DType::F16,
            2 => DType::BF16,
            3 => DType::I32,
            4 => DType::U32,
            5 => DType::U8,
            6 => DType::I64,
            7 => DType::F64,
            _ => DType::Other,
        }
    }

    /// Bytes per element (0 for `Other`).
    pub fn size(self) -> usize {
        match self {
            DType::F32 | DType::I32 | DType::U32 => 4,
            DType::F16 | DType::BF16 => 2,
            DType::U8 => 1,
            DType::I64 | DType::F64 => 8,
            DType::Other => 0,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            DType::F32 => "f32",
            DType::F16 => "f16",
            DType::BF16 => "bf16",
            DType::I32 => "i32",
            DType::U32 => "u32",
            DType::U8 => "u8",
            DType::I64 => "i64",
            DType::F64 => "f64",
            DType::Other => "other",
        }
    }
}

/// The operation a node performs. Parameters live in [`Node::iparams`] / [`Node::fparams`]; the
/// meaning of each slot is listed per op. `x` means `src[0]`, and so on.
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum OpCode {
    /// Host data for this step. `iparams[0]` = input slot (see [`INPUT_TOKENS`] etc.).
    Input = 0,
    /// A model weight. `iparams[0]` = index into the weight table the family received.
    /// A row-range view of a 2-D weight (one part of a fused projection, such as Phi-3's `qkv_proj`,
    /// bound without a copy; float or each of a quantized weight's packed/scales/biases): `iparams[2]`
    /// = rows of the stored tensor (0 = the node is the whole tensor), `iparams[1]` = the view's first
    /// row; the node's shape is the view's `[rows, cols]`, with the stored tensor's `cols`.
    Weight = 1,
    /// Data carried in the graph's constant blob (little-endian, `F32` or `I32`). `iparams[0]` = byte
    /// offset, `iparams[1]` = byte length. An `I32` constant can give per-row sequence indices for rows
    /// that are not the step's tokens (after a strided [`OpCode::Conv1d`]).
    Constant = 2,

    /// `out[t, :] = table[ids[t], :]`. src: ids `I32 [T]`, table `[V, D]` float.
    Embedding = 10,
    /// Embedding from an MLX affine-quantized table. src: ids, packed `U32 [V, D*bits/32]`,
    /// scales `[V, D/group]`, biases `[V, D/group]`. `iparams[0]` = bits, `iparams[1]` = group size.
    QuantEmbedding = 11,
    /// `out = x · wᵀ` (linear layer). src: x `[T, K]`, w `[N, K]` float (f32/f16/bf16). out `[T, N]`.
    MatMul = 12,
    /// `out = x · dequant(w)ᵀ` with MLX affine weights (`w = scales * q + biases` per group).
    /// src: x `[T, K]`, packed `U32 [N, K*bits/32]`, scales `[N, K/group]`, biases `[N, K/group]`.
    /// `iparams[0]` = bits (2,3,4,5,6,8), `iparams[1]` = group size (32, 64, 128).
    QuantMatMul = 13,
    /// Select rows: src x `[T, C]`, rows `I32 [R]`. out `[R, C]`.
    GetRows = 14,
    /// A column range: src x `[T, C]`. out `[T, c1 - c0]` = `x[:, c0..c1]`. `iparams[0]` = c0,
    /// `iparams[1]` = c1 (`c0 < c1 ≤ C`). Splits fused projections (Phi-3 `qkv_proj` / `gate_up_proj`,
    /// LFM2's `in_proj`): one matmul, then a slice per part.
    Slice = 15,

    /// `a + b`; b is `[T, C]` like a or a row `[C]` broadcast over rows.
    Add = 20,
    /// `a * b`; broadcasting as for `Add`.
    Mul = 21,
    /// `x * fparams[0]`.
    Scale = 22,
    /// `silu(x)`.
    Silu = 23,
    /// `gelu(x)` with the exact erf form.
    Gelu = 24,
    /// `gelu(x)` with the tanh approximation.
    GeluTanh = 25,
    /// `max(x, 0)`.
    Relu = 26,
    /// `silu(a) * b` (the SwiGLU gate).
    SiluMul = 27,
    /// `cap * tanh(x / cap)`, `fparams[0]` = cap.
    Softcap = 28,
    /// `gelu_tanh(a) * b` (GeGLU gate).
    GeluTanhMul = 29,

    /// RMS norm over groups of `D` = len(w) columns (D may divide C: per-head norm).
    /// src: x `[T, C]`, w `[D]`. `fparams[0]` = eps, `iparams[0]` = 1 to scale by `(1 + w)`.
    RmsNorm = 30,
    /// Layer norm over the last dim. src: x, w `[C]`, b `[C]`. `fparams[0]` = eps.
    LayerNorm = 31,
    /// Softmax over groups of `D` columns: src x `[T, C]`, out `[T, C]`, `out[t, g*D + j] =
    /// e^x[t, g*D + j] / Σ_i e^x[t, g*D + i]`. `iparams[0]` = D (0 = the whole row; must divide C).
    Softmax = 32,
    /// `x / max(‖x‖₂, eps)` per row (sentence-embedding normalisation, as torch's `F.normalize`).
    /// src: x `[T, C]`, out `[T, C]`. `fparams[0]` = eps (0 = 1e-12).
    L2Normalize = 33,

    /// Rotary embedding on `x [T, H*Dh]`. src: x, positions `I32 [T]`, inv_freq `F32 [rot/2]`.
    /// `iparams[0]` = head_dim, `iparams[1]` = rotary dims (≤ head_dim, rest passes through),
    /// `iparams[2]` = 1 for the interleaved ("traditional") pairing, 0 for the half-split (NeoX) one.
    /// `fparams[0]` = scale applied to cos and sin (YaRN attention factor; 1 otherwise).
    Rope = 40,

    /// Causal attention over the paged KV cache, writing this step's K/V first.
    /// src: q `[T, Hq*Dh]`, k `[T, Hkv*Dh]`, v `[T, Hkv*Dh]`. out `[T, Hq*Dh]`.
    /// `iparams[0]` = KV cache layer, `[1]` = Hq, `[2]` = Hkv, `[3]` = Dh, `[4]` = sliding window
    /// (0 = full). `fparams[0]` = score scale, `fparams[1]` = score soft-cap (0 = none).
    /// Which sequence each token belongs to and where its keys live come from [`StepBatch`].
    Attention = 50,
    /// Attention among the step's own tokens, without the cache (encoders: BERT, the Whisper
    /// encoder; or a whole-prompt causal pass that keeps no KV). Varlen: each token attends only to
    /// the tokens of its own sequence in this step, no padding.
    /// src: q `[T, Hq*Dh]`, k `[T, Hkv*Dh]`, v `[T, Hkv*Dh]`, seq `I32 [T]` (each row's sequence,
    /// normally the [`INPUT_TOKEN_SEQ`] input; rows of one sequence contiguous). out `[T, Hq*Dh]`.
    /// `iparams[0]` = Hq, `[1]` = Hkv (divides Hq), `[2]` = Dh, `[3]` = 1 causal / 0 bidirectional,
    /// `[4]` = window (0 = none): with row `i` and key `j` counted within their sequence, causal sees
    /// `i − window < j ≤ i`, bidirectional `|i − j| ≤ window` (ModernBERT's local attention: its
    /// `local_attention / 2`). `fparams[0]` = score scale, `fparams[1]` = score soft-cap (0 = none).
    StepAttention = 51,
    /// Stores an encoder's keys and values once per sequence for [`OpCode::CrossAttention`].
    /// src: k `[S, Hkv*Dh]`, v `[S, Hkv*Dh]`, seq `I32 [S]` (each row's sequence index in the step,
    /// rows of one sequence contiguous). out `[1]` (no data; a later `CrossAttention` may name this node
    /// as a source to order itself after the store). `iparams[0]` = state layer (its
    /// [`crate::KvBinding::state`] holds the rows), `[1]` = Hkv, `[2]` = Dh, `[3]` = max_source_len.
    /// The rows of sequence `s` become rows `0..n` of state row [`StepBatch::seq_state_slots`]`[s]`
    /// and `n` its stored length, replacing what was there; `n ≤ max_source_len`. The state row
    /// layout is [`CROSS_KV_HEADER`] f32 (element 0: stored length as `u32` bits), then
    /// `max_source_len` rows of K `[Hkv*Dh]` followed by V `[Hkv*Dh]`; the family declares the layer as
    /// [`crate::KvKind::Recurrent`] with [`cross_kv_state_elems`] elements. Runs even if nothing reads it.
    StoreCrossKv = 52,
    /// Attention of decoder queries over the keys and values [`OpCode::StoreCrossKv`] stored for each
    /// query's sequence (bidirectional over all stored rows; a sequence with none stored gets zeros).
    /// src: q `[T, Hq*Dh]`, seq `I32 [T]`, optionally the `StoreCrossKv` node of this graph (read for
    /// ordering only). out `[T, Hq*Dh]`. `iparams[0]` = state layer, `[1]` = Hq, `[2]` = Hkv (divides
    /// Hq), `[3]` = Dh, `[4]` = max_source_len (as stored). `fparams[0]` = score scale, `fparams[1]` =
    /// soft-cap (0 = none).
    CrossAttention = 53,

    /// 1-D convolution over rows, channels last. src: x `[T, C_in]`, w `[C_out, K, C_in/groups]` (MLX's
    /// conv1d layout, as mlx-lm checkpoints store it: PyTorch's `[C_out, C_in/groups, K]` transposed),
    /// seq `I32 [T]` (each row's sequence index in the step, rows of one sequence contiguous), optional
    /// bias `[C_out]`. `out[t, o] = bias[o] + Σ_k Σ_c w[o, k, c] · in[t·stride + k, g·C_in/groups + c]`
    /// with `g = o / (C_out/groups)`, per sequence over its padded input `in`:
    /// - `iparams[0]` = 0, whole sequence: `in` is the sequence's rows with `padding` zero rows on
    ///   each side; a sequence of `L` rows gives `(L + 2·padding − K) / stride + 1` output rows (none if
    ///   negative), sequences in order (Whisper's conv1/conv2).
    /// - `iparams[0]` = 1, causal with carried state: `in` is the sequence's last `K − 1` input rows of
    ///   earlier steps (zeros at its start) followed by this step's rows; `L` output rows; the last
    ///   `K − 1` rows of `in` are stored back, so chunked prefill and decode continue exactly (LFM2's
    ///   short conv). The state row of layer `iparams[4]` at [`StepBatch::seq_state_slots`]`[s]` is
    ///   `[K − 1, C_in]` f32 ([`conv_state_elems`]); stride must be 1 and padding 0.
    ///
    /// `iparams[1]` = stride (≥ 1), `[2]` = padding, `[3]` = groups (divides C_in and C_out; 0 = 1),
    /// `[4]` = state layer (mode 1). Dilation is 1.
    Conv1d = 60,

    /// Pools each sequence's rows into one: src x `[T, C]`, seq `I32 [T]` (each row's sequence index,
    /// `< N`). out `[N, C]`, row `s` from the rows of sequence `s` (zeros if it has none).
    /// `iparams[0]` = pool: 0 mean, 1 first row (CLS), 2 last row (decoder embeddings).
    SegmentPool = 70,

    /// The `k` largest values of each row, or their column indices: src x `[T, C]`, out `[T, k]`, in
    /// descending order of value (equal values: the lower column first). One node gives one of the two
    /// results, so a router is two `TopK` nodes on the same input with the same parameters, one per
    /// output (they select the same columns in the same order).
    /// `iparams[0]` = k (1 ≤ k ≤ C); `[1]` = output: 0 the values, 1 the column indices as exact f32
    /// integers (what [`OpCode::GatherMatMul`] reads); `[2]` = 1 to take the softmax over the whole row
    /// first (values become probabilities; mixture-of-experts routers: softmax over all experts, then
    /// top-k); `[3]` = 1 to divide the k values by their sum (`norm_topk_prob`).
    TopK = 80,
    /// Expert (gathered) matmul with float weights: each row `(t, j)` multiplies by the expert
    /// `indices[t, j]` chose, and only by that one (experts compute only the rows routed to them).
    /// src: x `[T, K]` (token `t`'s row feeds all its `k` experts) or `[T·k, K]` (row `t·k + j` feeds its
    /// `j`-th expert), indices `[T, k]` (expert ids as exact f32 integers: [`OpCode::TopK`]'s indices),
    /// then one or more weights holding consecutive experts from `iparams[0]` on: each `[E_i, N, K]` (a
    /// stack, as mlx-lm's `switch_mlp` stores them) or `[N, K]` (one expert, as Hugging Face checkpoints
    /// store them), f32/f16/bf16. out `[T, k, N]`, row `t·k + j` = `x_row · W[indices[t, j]]ᵀ`, or zeros
    /// where the expert is not among this node's (a model with more experts than sources splits them
    /// over several nodes and adds the results). `iparams[0]` = first expert held (0 usually),
    /// `iparams[1]` = experts in the model (0: those held); every index must be an integer below it.
    /// A row's result must not depend on the rows of other sequences routed to the same expert (batch
    /// invariance, as for every op): a backend that groups an expert's rows chooses its kernel from
    /// each sequence's rows alone.
    GatherMatMul = 81,
    /// [`OpCode::GatherMatMul`] with MLX affine-quantized stacked experts (`switch_mlp`, each expert
    /// quantized like a linear of its own). src: x `[T, K]` or `[T·k, K]`, indices `[T, k]`, packed
    /// `U32 [E, N, K*bits/32]`, scales `[E, N, K/group]`, biases `[E, N, K/group]`. out `[T, k, N]`.
    /// `iparams[0]` = bits (2,3,4,5,6,8), `iparams[1]` = group size (32, 64, 128); every index `< E`.
    GatherQuantMatMul = 82,
    /// Weighted sum of each token's `k` rows (combining expert outputs): src y `[T·k, N]` (e.g. `[T, k,
    /// N]`), w `[T, k]`. out `[T, N]`, `out[t] = Σ_j w[t, j] · y[t·k + j]`, summed in order of `j`. With
    /// `k = 1` it scales each row by its own factor (a shared expert's sigmoid gate).
    WeightedSum = 83,
    /// `1 / (1 + e^-x)`.
    Sigmoid = 84,
}

impl OpCode {
    pub fn from_raw(v: u32) -> Option<OpCode> {
        use OpCode::*;
        Some(match v {
            0 => Input,
            1 => Weight,
            2 => Constant,
            10 => Embedding,
            11 => QuantEmbedding,
            12 => MatMul,
            13 => QuantMatMul,
            14 => GetRows,
            20 => Add,
            21 => Mul,
            22 => Scale,
            23 => Silu,
            24 => Gelu,
            25 => GeluTanh,
            26 => Relu,
            27 => SiluMul,
            28 => Softcap,
            29 => GeluTanhMul,
            30 => RmsNorm,
            31 => LayerNorm,
            15 => Slice,
            32 => Softmax,
            33 => L2Normalize,
            40 => Rope,
            50 => Attention,
            51 => StepAttention,
            52 => StoreCrossKv,
            53 => CrossAttention,
            60 => Conv1d,
            70 => SegmentPool,
            80 => TopK,
            81 => GatherMatMul,
            82 => GatherQuantMatMul,
            83 => WeightedSum,
            84 => Sigmoid,
            _ => return None,
        })
    }

    /// Every op of this ABI version (for catalogues and the conformance suite).
    pub const ALL: &'static [OpCode] = &[
        OpCode::Input,
        OpCode::Weight,
        OpCode::Constant,
        OpCode::Embedding,
        OpCode::QuantEmbedding,
        OpCode::MatMul,
        OpCode::QuantMatMul,
        OpCode::GetRows,
        OpCode::Add,
        OpCode::Mul,
        OpCode::Scale,
        OpCode::Silu,
        OpCode::Gelu,
        OpCode::GeluTanh,
        OpCode::Relu,
        OpCode::SiluMul,
        OpCode::Softcap,
        OpCode::GeluTanhMul,
        OpCode::RmsNorm,
        OpCode::LayerNorm,
        OpCode::Rope,
        OpCode::Attention,
        OpCode::Slice,
        OpCode::Softmax,
        OpCode::L2Normalize,
        OpCode::StepAttention,
        OpCode::StoreCrossKv,
        OpCode::CrossAttention,
        OpCode::Conv1d,
        OpCode::SegmentPool,
        OpCode::TopK,
        OpCode::GatherMatMul,
        OpCode::GatherQuantMatMul,
        OpCode::WeightedSum,
        OpCode::Sigmoid,
    ];
}

/// [`OpCode::SegmentPool`]'s `iparams[0]`: the mean of a sequence's rows.
pub const POOL_MEAN: i64 = 0;
/// [`OpCode::SegmentPool`]'s `iparams[0]`: a sequence's first row (BERT's CLS token).
pub const POOL_FIRST: i64 = 1;
/// [`OpCode::SegmentPool`]'s `iparams[0]`: a sequence's last row (decoder embedding models).
pub const POOL_LAST: i64 = 2;

/// [`OpCode::Conv1d`]'s `iparams[0]`: each sequence whole, zero-padded on both sides.
pub const CONV_WHOLE: i64 = 0;
/// [`OpCode::Conv1d`]'s `iparams[0]`: causal, the last `K − 1` input rows carried in state.
pub const CONV_CAUSAL_STATE: i64 = 1;

/// f32 elements before the first key row of a [`OpCode::StoreCrossKv`] state row (element 0 holds
/// the stored length as `u32` bits; the rest is padding so rows start 64 bytes in).
pub const CROSS_KV_HEADER: u64 = 16;

/// `state_elems` of a layer whose state holds [`OpCode::StoreCrossKv`] rows.
pub const fn cross_kv_state_elems(max_source_len: u64, n_kv_heads: u64, head_dim: u64) -> u64 {
    CROSS_KV_HEADER + max_source_len * 2 * n_kv_heads * head_dim
}

/// `state_elems` of a layer whose state carries [`OpCode::Conv1d`]'s causal window.
pub const fn conv_state_elems(kernel: u64, c_in: u64) -> u64 {
    kernel.saturating_sub(1) * c_in
}

/// [`OpCode::TopK`]'s `iparams[1]`: output the selected values.
pub const TOPK_VALUES: i64 = 0;
/// [`OpCode::TopK`]'s `iparams[1]`: output the selected columns' indices (as exact f32 integers).
pub const TOPK_INDICES: i64 = 1;

/// Input slot for the step's token ids (`I32 [T]`).
pub const INPUT_TOKENS: i64 = 0;
/// Input slot for the step's positions (`I32 [T]`), position of each token within its sequence.
pub const INPUT_POSITIONS: i64 = 1;
/// Input slot for the rows whose outputs (logits, embeddings, scores) are wanted (`I32 [R]`).
pub const INPUT_OUTPUT_ROWS: i64 = 2;
/// Input slot for each token's sequence index in the step (`I32 [T]`), for ops that work per sequence.
pub const INPUT_TOKEN_SEQ: i64 = 3;
/// Input slot for token-type (segment) ids (`I32 [T]`), for encoders that embed them (BERT's
/// `token_type_ids`: an [`OpCode::Embedding`] of this input added to the word embeddings). Bound like
/// every input, by slot; a family that reads it needs a host that fills it.
pub const INPUT_TOKEN_TYPES: i64 = 4;

/// Maximum number of dimensions of a tensor.
pub const MAX_DIMS: usize = 4;
/// Maximum number of sources of a node.
pub const MAX_SRC: usize = 8;
/// Integer parameters per node.
pub const MAX_IPARAMS: usize = 8;
/// Float parameters per node.
pub const MAX_FPARAMS: usize = 4;

/// One node of the graph; defines the tensor with the node's index.
///
/// Nodes are an array whose element size travels in [`GraphRef::node_size`]: a newer minor may append
/// fields, and a reader of an older minor reads the prefix it knows (the rest are zero to a newer one).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct Node {
    /// [`OpCode`] as a raw number.
    pub op: u32,
    /// [`DType`] of the output as a raw number.
    pub dtype: u32,
    pub ndim: u32,
    pub n_src: u32,
    pub shape: [u64; MAX_DIMS],
    /// Indices of earlier nodes this one reads.
    pub src: [u32; MAX_SRC],
    pub iparams: [i64; MAX_IPARAMS],
    pub fparams: [f32; MAX_FPARAMS],
}

impl Node {
    pub fn new(op: OpCode, dtype: DType, shape: &[u64], src: &[u32]) -> Node {
        assert!(shape.len() <= MAX_DIMS && src.len() <= MAX_SRC);
        let mut s = [1u64; MAX_DIMS];
        s[..shape.len()].copy_from_slice(shape);
        let mut sr = [0u32; MAX_SRC];
        sr[..src.len()].copy_from_slice(src);
        Node {
            op: op as u32,
            dtype: dtype as u32,
            ndim: shape.len() as u32,
            n_src: src.len() as u32,
            shape: s,
            src: sr,
            iparams: [0; MAX_IPARAMS],
            fparams: [0.0; MAX_FPARAMS],
        }
    }

    pub fn opcode(&self) -> Option<OpCode> {
        OpCode::from_raw(self.op)
    }

    pub fn dtype(&self) -> DType {
        DType::from_raw(self.dtype)
    }

    pub fn dims(&self) -> &[u64] {
        &self.shape[..(self.ndim as usize).min(MAX_DIMS)]
    }

    pub fn sources(&self) -> &[u32] {
        &self.src[..(self.n_src as usize).min(MAX_SRC)]
    }

    /// Number of elements.
    pub fn numel(&self) -> usize {
        self.dims().iter().product::<u64>() as usize
    }

    /// Last dimension (columns of the 2-D view).
    pub fn cols(&self) -> usize {
        self.dims().last().copied().unwrap_or(1) as usize
    }

    /// Product of all but the last dimension (rows of the 2-D view).
    pub fn rows(&self) -> usize {
        let d = self.dims();
        if d.is_empty() {
            1
        } else {
            d[..d.len() - 1].iter().product::<u64>() as usize
        }
    }
}

/// A borrowed graph. The family that built it owns the memory (see [`crate::FamilyVTable::build_graph`]).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct GraphRef {
    /// `n_nodes` elements of `node_size` bytes each (the writer's `size_of::<Node>()`).
    pub nodes: *const Node,
    pub n_nodes: usize,
    pub node_size: usize,
    /// Bytes referenced by [`OpCode::Constant`] nodes.
    pub constants: *const u8,
    pub n_constant_bytes: usize,
    /// Nodes whose values the caller reads back, in order.
    pub outputs: *const u32,
    pub n_outputs: usize,
}

impl GraphRef {
    pub const fn empty() -> Self {
        GraphRef {
            nodes: std::ptr::null(),
            n_nodes: 0,
            node_size: std::mem::size_of::<Node>(),
            constants: std::ptr::null(),
            n_constant_bytes: 0,
            outputs: std::ptr::null(),
            n_outputs: 0,
        }
    }

    /// The nodes as this build's [`Node`]s: borrowed when the writer's layout is ours, else each
    /// node's known prefix copied and the rest zero-filled.
    ///
    /// # Safety
    /// The pointers must be valid for their lengths.
    pub unsafe fn nodes(&self) -> std::borrow::Cow<'_, [Node]> {
        if self.node_size == std::mem::size_of::<Node>() || self.nodes.is_null() {
            // SAFETY: same layout; valid for `n_nodes` elements (caller's contract).
            std::borrow::Cow::Borrowed(unsafe { crate::ffi::slice_from(self.nodes, self.n_nodes) })
        } else {
            let base = self.nodes as *const u8;
            // SAFETY: `n_nodes` elements of `node_size` bytes (caller's contract).
            std::borrow::Cow::Owned(
                (0..self.n_nodes).map(|i| unsafe { crate::ffi::read_element(base, self.node_size, i) }).collect(),
            )
        }
    }
    /// # Safety
    /// As for [`GraphRef::nodes`].
    pub unsafe fn constants(&self) -> &[u8] {
        // SAFETY: caller's contract.
        unsafe { crate::ffi::slice_from(self.constants, self.n_constant_bytes) }
    }
    /// # Safety
    /// As for [`GraphRef::nodes`].
    pub unsafe fn outputs(&self) -> &[u32] {
        // SAFETY: caller's contract.
        unsafe { crate::ffi::slice_from(self.outputs, self.n_outputs) }
    }
}

/// An owned graph under construction; families build with it and hand out [`Graph::as_ref`].
#[derive(Default, Debug, Clone)]
pub struct Graph {
    pub nodes: Vec<Node>,
    pub constants: Vec<u8>,
    pub outputs: Vec<u32>,
}

/// Index of a node in a [`Graph`].
pub type TensorId = u32;

impl Graph {
    pub fn new() -> Self {
        Self::default()
    }

    pub fn push(&mut self, node: Node) -> TensorId {
        self.nodes.push(node);
        (self.nodes.len() - 1) as TensorId
    }

    pub fn node(&self, id: TensorId) -> &Node {
        &self.nodes[id as usize]
    }

    /// A host input bound at compute time.
    pub fn input(&mut self, slot: i64, dtype: DType, shape: &[u64]) -> TensorId {
        let mut n = Node::new(OpCode::Input, dtype, shape, &[]);
        n.iparams[0] = slot;
        self.push(n)
    }

    /// A model weight by index in the weight table.
    pub fn weight(&mut self, index: u32, dtype: DType, shape: &[u64]) -> TensorId {
        let mut n = Node::new(OpCode::Weight, dtype, shape, &[]);
        n.iparams[0] = index as i64;
        self.push(n)
    }

    /// Rows `first_row..first_row + rows` of a 2-D weight `[stored_rows, cols]` (see [`OpCode::Weight`]).
    pub fn weight_rows(
        &mut self,
        index: u32,
        dtype: DType,
        stored_rows: u64,
        first_row: u64,
        rows: u64,
        cols: u64,
    ) -> TensorId {
        let mut n = Node::new(OpCode::Weight, dtype, &[rows, cols], &[]);
        n.iparams[0] = index as i64;
        n.iparams[1] = first_row as i64;
        n.iparams[2] = stored_rows as i64;
        self.push(n)
    }

    /// An `F32` constant stored in the graph.
    pub fn constant_f32(&mut self, values: &[f32], shape: &[u64]) -> TensorId {
        self.constant_words(values.iter().map(|v| v.to_le_bytes()), DType::F32, shape)
    }

    /// An `I32` constant stored in the graph (e.g. the sequence index of each row of a strided
    /// convolution's output).
    pub fn constant_i32(&mut self, values: &[i32], shape: &[u64]) -> TensorId {
        self.constant_words(values.iter().map(|v| v.to_le_bytes()), DType::I32, shape)
    }

    /// A constant of 4-byte values, kept 4-byte aligned relative to the blob start.
    fn constant_words(&mut self, words: impl Iterator<Item = [u8; 4]>, dtype: DType, shape: &[u64]) -> TensorId {
        self.constants.resize(self.constants.len().next_multiple_of(4), 0);
        let off = self.constants.len();
        self.constants.extend(words.flatten());
        let mut n = Node::new(OpCode::Constant, dtype, shape, &[]);
        n.iparams[0] = off as i64;
        n.iparams[1] = (self.constants.len() - off) as i64;
        self.push(n)
    }

    /// A computed `F32` node.
    pub fn op(&mut self, op: OpCode, shape: &[u64], src: &[TensorId]) -> TensorId {
        self.push(Node::new(op, DType::F32, shape, src))
    }

    /// A computed node with parameters.
    pub fn op_with(
        &mut self,
        op: OpCode,
        shape: &[u64],
        src: &[TensorId],
        iparams: &[i64],
        fparams: &[f32],
    ) -> TensorId {
        let mut n = Node::new(op, DType::F32, shape, src);
        n.iparams[..iparams.len()].copy_from_slice(iparams);
        n.fparams[..fparams.len()].copy_from_slice(fparams);
        self.push(n)
    }

    pub fn mark_output(&mut self, id: TensorId) {
        self.outputs.push(id);
    }

    pub fn as_ref(&self) -> GraphRef {
        GraphRef {
            nodes: self.nodes.as_ptr(),
            n_nodes: self.nodes.len(),
            node_size: std::mem::size_of::<Node>(),
            constants: self.constants.as_ptr(),
            n_constant_bytes: self.constants.len(),
            outputs: self.outputs.as_ptr(),
            n_outputs: self.outputs.len(),
        }
    }
}

/// Where each token of a step belongs and where its keys, values and recurrent state live.
///
/// Tokens of one sequence are contiguous and in position order; sequences follow each other.
///
/// Layers are grouped by how they keep state ([`KvGroupTables`]): all full-attention layers share one
/// group, sliding-window layers of one window size another, so each group has its own block table and
/// a window group can release pages that fell out of its window. The cache of one layer is
/// `num_blocks × block_size` slots (the byte layout of a slot is the backend's). The key of position `p`
/// of sequence `s` in group `g` lives in slot `block_tables[s * max_blocks_per_seq + p / block_size] *
/// block_size + p % block_size` of that group; a block id of [`NO_BLOCK`] marks a page that was
/// released (a sliding-window layer never reads it). Token `t` attends to positions `0..=positions[t]`
/// of its sequence (less with a sliding window); its own K/V are written to `slot_mapping[t]` first.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct StepBatch {
    /// `size_of::<StepBatch>()` of the writer.
    pub size: usize,
    pub n_tokens: u32,
    pub n_seqs: u32,
    /// `[n_tokens]` sequence index of each token.
    pub token_seq: *const u32,
    /// `[n_tokens]` position of each token in its sequence.
    pub positions: *const i32,
    /// `[n_seqs]` the row of each sequence in every recurrent state buffer.
    pub seq_state_slots: *const u32,
    /// `[n_groups]` block tables, indexed by [`crate::KvBinding::group`].
    pub groups: *const KvGroupTables,
    pub n_groups: u32,
    /// `[n_seqs]` tokens each sequence has in this step (so kernels can pick paths per sequence).
    pub seq_n_tokens: *const u32,
}

// SAFETY: plain data (pointers are only read under the documented lifetimes).
unsafe impl crate::ffi::Versioned for StepBatch {}

/// A page that is not held (released by a sliding-window group, or never needed).
pub const NO_BLOCK: u32 = u32::MAX;

/// The block tables of one KV group for one step (an array element: the stride is its `size`).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct KvGroupTables {
    pub size: usize,
    /// `[n_tokens]` cache slot (`block * block_size + offset`) each token's K/V are written to.
    pub slot_mapping: *const i64,
    /// `[n_seqs * max_blocks_per_seq]` block ids ([`NO_BLOCK`] for released pages).
    pub block_tables: *const u32,
    pub max_blocks_per_seq: u32,
    pub block_size: u32,
    pub num_blocks: u32,
}

// SAFETY: repr(C), `size` first, plain data.
unsafe impl crate::ffi::Versioned for KvGroupTables {}

/// A name and a tensor description, as the host finds it in a checkpoint.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct WeightInfo {
    /// Tensor name, owned by the host for the duration of the call.
    pub name: StrRef,
    /// [`DType`] as a raw number.
    pub dtype: u32,
    pub ndim: u32,
    pub shape: [u64; MAX_DIMS],
}
