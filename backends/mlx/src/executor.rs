//! Runs one graph as one lazy MLX graph: every node becomes MLX array operations, the outputs and the
//! updated KV caches are evaluated together once, and the outputs are copied to the host. Shapes,
//! token ids and the step's block tables are checked here first, so a bad graph is an error naming the
//! node, never a crash inside MLX.

use std::collections::HashMap;
use std::ffi::c_int;

use mlxcel_plugin_api::op_spec::{
    AttentionSpec, Conv1dSpec, CrossAttentionSpec, GatherSpec, Heads, StepAttentionSpec, TopKSpec, WeightedSumSpec,
};
use mlxcel_plugin_api::{
    read_versioned, read_versioned_array, slice_from, ComputeArgs, DType, HostTensor, KvBinding, KvGroupTables, Node,
    OpCode, PluginError, StepBatch, CONV_CAUSAL_STATE, CONV_WEIGHT_MLX, CONV_WEIGHT_TORCH, CONV_WHOLE, CROSS_KV_HEADER,
    MAX_SRC, NO_BLOCK, POOL_FIRST, POOL_LAST, POOL_MEAN,
};

use crate::array::{make, Array};
use crate::ffi;
use crate::present::MlxBuffer;

/// Ops and dtypes this backend executes.
pub fn supports(node: &Node) -> bool {
    let Some(op) = node.opcode() else { return false };
    match op {
        OpCode::Input | OpCode::Weight => {
            matches!(node.dtype(), DType::F32 | DType::F16 | DType::BF16 | DType::I32 | DType::U32)
        }
        OpCode::Constant => matches!(node.dtype(), DType::F32 | DType::I32),
        OpCode::QuantMatMul | OpCode::QuantEmbedding | OpCode::GatherQuantMatMul => {
            matches!(node.iparams[0], 2 | 3 | 4 | 5 | 6 | 8) && matches!(node.iparams[1], 32 | 64 | 128)
        }
        OpCode::SegmentPool => {
            node.dtype() == DType::F32 && matches!(node.iparams[0], POOL_MEAN | POOL_FIRST | POOL_LAST)
        }
        OpCode::Conv1d => {
            node.dtype() == DType::F32
                && matches!(node.iparams[0], CONV_WHOLE | CONV_CAUSAL_STATE)
                && matches!(node.iparams[5], CONV_WEIGHT_MLX | CONV_WEIGHT_TORCH)
        }
        // The ops `compute` implements, in f32.
        OpCode::Embedding
        | OpCode::GetRows
        | OpCode::MatMul
        | OpCode::Add
        | OpCode::Mul
        | OpCode::SiluMul
        | OpCode::GeluTanhMul
        | OpCode::Scale
        | OpCode::Silu
        | OpCode::Gelu
        | OpCode::GeluTanh
        | OpCode::Relu
        | OpCode::Softcap
        | OpCode::RmsNorm
        | OpCode::LayerNorm
        | OpCode::Rope
        | OpCode::Attention
        | OpCode::Slice
        | OpCode::Softmax
        | OpCode::L2Normalize
        | OpCode::Sigmoid
        | OpCode::StepAttention
        | OpCode::StoreCrossKv
        | OpCode::CrossAttention
        | OpCode::TopK
        | OpCode::GatherMatMul
        | OpCode::WeightedSum => node.dtype() == DType::F32,
    }
}

fn bad(i: usize, node: &Node, msg: impl std::fmt::Display) -> PluginError {
    let op = node.opcode().map_or_else(|| format!("op {}", node.op), |o| format!("{o:?}"));
    PluginError::invalid(format!("node {i} ({op}): {msg}"))
}

fn shape_of(node: &Node) -> Vec<i64> {
    node.dims().iter().map(|&d| d as i64).collect()
}

fn is_float(d: DType) -> bool {
    matches!(d, DType::F32 | DType::F16 | DType::BF16)
}

/// One layer's caches as this step leaves them.
struct LayerCache {
    k: Array,
    v: Array,
    /// The buffers they go back to after the evaluation.
    k_buf: *mut MlxBuffer,
    v_buf: *mut MlxBuffer,
}

/// Checks the host's bookkeeping for one attention layer: every token's sequence, position and slot in
/// range, and every block it reads (those inside its window) held and in range.
fn validate_layout(
    token_seq: &[u32],
    positions: &[i32],
    slot_mapping: &[i64],
    tables: &[u32],
    group: &KvGroupTables,
    n_seqs: usize,
    window: usize,
) -> Result<(), String> {
    let (bs, mb) = (group.block_size as usize, group.max_blocks_per_seq as usize);
    let slots = group.num_blocks as usize * bs;
    for ti in 0..token_seq.len() {
        let s = token_seq[ti] as usize;
        let (p, slot) = (positions[ti], slot_mapping[ti]);
        if s >= n_seqs || p < 0 || slot < 0 || slot as usize >= slots {
            return Err(format!("token {ti}: bad sequence/position/slot"));
        }
        let p = p as usize;
        if p / bs >= mb {
            return Err(format!("token {ti}: position {p} beyond its block table"));
        }
        let first = if window > 0 { (p + 1).saturating_sub(window) / bs } else { 0 };
        for b in first..=p / bs {
            let id = tables[s * mb + b];
            if id == NO_BLOCK || id >= group.num_blocks {
                return Err(format!("sequence {s}: block {b} (needed by position {p}) is not held or out of range"));
            }
        }
    }
    Ok(())
}

/// A graph whose evaluation was scheduled: its outputs and where they go.
pub struct Launched {
    outputs: Vec<(Array, HostTensor)>,
}

// SAFETY: the arrays are reference-counted MLX handles used under `mlx_lock`; the destinations are
// host memory the host keeps valid until the step is waited for (ABI contract of `submit`).
unsafe impl Send for Launched {}

impl Launched {
    /// Waits for the evaluation and copies the outputs to the host.
    pub fn finish(self) -> Result<(), PluginError> {
        let arrays: Vec<&Array> = self.outputs.iter().map(|(a, _)| a).collect();
        Array::eval(&arrays).map_err(PluginError::failed)?;
        for (a, dst) in &self.outputs {
            copy_out(a, dst)?;
        }
        Ok(())
    }
}

/// Executes `args.graph` and waits for it.
///
/// # Safety
/// As for [`launch`].
pub unsafe fn compute(args: &ComputeArgs) -> Result<(), PluginError> {
    // SAFETY: the caller's contract.
    unsafe { launch(args) }?.finish()
}

/// Builds `args.graph` as one lazy MLX graph and schedules its evaluation (outputs and the updated
/// caches together) without waiting: [`Launched::finish`] waits and copies the outputs out. Later
/// graphs may build on the caches at once, as mlx-lm's generation loop does.
///
/// # Safety
/// Every pointer in `args` is valid for the sizes the graph implies until the launch is finished (ABI
/// contract); buffer handles are this plugin's `MlxBuffer`s, used by this thread only for the call.
pub unsafe fn launch(args: &ComputeArgs) -> Result<Launched, PluginError> {
    // SAFETY: the host guarantees every pointer of `args` for the sizes it states (ABI contract).
    let (nodes, constants, outputs, inputs, weights, kv, outs, batch) = unsafe {
        (
            args.graph.nodes(),
            args.graph.constants(),
            args.graph.outputs(),
            slice_from(args.inputs, args.n_inputs),
            slice_from(args.weights, args.n_weights),
            read_versioned_array::<KvBinding>(args.kv, args.n_kv),
            slice_from(args.outputs, args.n_outputs),
            read_versioned::<StepBatch>(args.batch),
        )
    };
    let nodes: &[Node] = &nodes;
    let groups: Vec<KvGroupTables> = match &batch {
        // SAFETY: the batch's group array holds `n_groups` elements (ABI contract).
        Some(b) => unsafe { read_versioned_array(b.groups, b.n_groups as usize) },
        None => Vec::new(),
    };

    if outs.len() != outputs.len() {
        return Err(PluginError::invalid(format!(
            "graph has {} outputs but {} destinations were given",
            outputs.len(),
            outs.len()
        )));
    }
    for (i, n) in nodes.iter().enumerate() {
        if n.opcode().is_none() {
            return Err(PluginError::invalid(format!("node {i}: unknown op code {}", n.op)));
        }
        if !supports(n) {
            return Err(bad(i, n, format!("not supported by the mlx backend (dtype {})", n.dtype().name())));
        }
        if let Some(&s) = n.sources().iter().find(|&&s| s as usize >= i) {
            return Err(bad(i, n, format!("source {s} is not an earlier node")));
        }
    }
    if let Some(&o) = outputs.iter().find(|&&o| o as usize >= nodes.len()) {
        return Err(PluginError::invalid(format!("output {o} is not a node")));
    }

    let mut vals: Vec<Option<Array>> = (0..nodes.len()).map(|_| None).collect();
    // Host copies of integer inputs and constants (token ids, rows, sequence indices) so indices are
    // checked, and per-sequence work is planned, before MLX reads them.
    let mut host_ints: Vec<Option<Vec<i32>>> = vec![None; nodes.len()];
    let mut caches: HashMap<usize, LayerCache> = HashMap::new();
    let mut states: HashMap<usize, StateCache> = HashMap::new();

    for (i, node) in nodes.iter().enumerate() {
        let op = node.opcode().unwrap();
        let src = node.sources();
        let e = |m: String| bad(i, node, m);
        let need = |n: usize| -> Result<(), PluginError> {
            if src.len() < n {
                Err(bad(i, node, format!("needs {n} sources, has {}", src.len())))
            } else {
                Ok(())
            }
        };
        let sn = |j: usize| &nodes[src[j] as usize];
        // The sources' nodes, for the shared op specs.
        let src_nodes: [&Node; MAX_SRC] = std::array::from_fn(|j| &nodes[src.get(j).map_or(0, |&s| s as usize)]);
        let srcs = &src_nodes[..src.len()];
        let v = |j: usize| -> Result<&Array, PluginError> {
            vals[src[j] as usize].as_ref().ok_or_else(|| bad(i, node, format!("source {} has no value", src[j])))
        };
        let expect_bytes = node.numel() * node.dtype().size();
        let source = matches!(op, OpCode::Input | OpCode::Weight | OpCode::Constant);
        if node.numel() == 0 && !source && !matches!(op, OpCode::Attention | OpCode::StoreCrossKv | OpCode::Conv1d) {
            // No rows (a prefill chunk that asks for no logits): nothing to compute, and MLX reshapes
            // of empty arrays cannot infer their dimensions.
            vals[i] = Some(Array::zeros(DType::F32, &shape_of(node)).map_err(e)?);
            continue;
        }
        let val = match op {
            OpCode::Input => {
                let slot = node.iparams[0] as usize;
                let t = inputs.get(slot).ok_or_else(|| e(format!("input slot {slot} not bound")))?;
                if t.len != expect_bytes {
                    return Err(e(format!("input slot {slot} has {} bytes, expected {expect_bytes}", t.len)));
                }
                // SAFETY: the host's input is readable for `len` bytes during the call.
                let bytes: &[u8] = if t.len == 0 { &[] } else { unsafe { std::slice::from_raw_parts(t.ptr, t.len) } };
                if node.dtype() == DType::I32 {
                    host_ints[i] = Some(words(bytes, i32::from_le_bytes));
                }
                Array::from_host(bytes, node.dtype(), &shape_of(node)).map_err(e)?
            }
            OpCode::Weight => {
                let idx = node.iparams[0] as usize;
                let h = *weights.get(idx).ok_or_else(|| e(format!("weight {idx} not bound")))?;
                // SAFETY: a handle of this plugin, used by this thread only.
                let buf =
                    unsafe { (h as *mut MlxBuffer).as_mut() }.ok_or_else(|| e(format!("weight {idx} is null")))?;
                let shape = shape_of(node);
                let (first, stored_rows) = (node.iparams[1], node.iparams[2]);
                if stored_rows == 0 {
                    if buf.byte_len() != expect_bytes {
                        return Err(e(format!("weight {idx} has {} bytes, expected {expect_bytes}", buf.byte_len())));
                    }
                    buf.typed(node.dtype(), &shape).map_err(e)?
                } else {
                    // A row view: rows `first..first + rows` of a stored `[stored_rows, cols]` tensor.
                    let rows = shape[0];
                    if shape.len() != 2 || first < 0 || first + rows > stored_rows {
                        return Err(e(format!(
                            "row view {first}+{rows} outside the {stored_rows} rows of weight {idx}"
                        )));
                    }
                    let stored_bytes = expect_bytes / rows.max(1) as usize * stored_rows as usize;
                    if buf.byte_len() != stored_bytes {
                        return Err(e(format!("weight {idx} has {} bytes, expected {stored_bytes}", buf.byte_len())));
                    }
                    let whole = buf.typed(node.dtype(), &[stored_rows, shape[1]]).map_err(e)?;
                    // SAFETY: a live handle.
                    make(|o| unsafe { ffi::mlxb_slice_rows(whole.raw(), first, first + rows, o) }).map_err(e)?
                }
            }
            OpCode::Constant => {
                let (off, len) = (node.iparams[0] as usize, node.iparams[1] as usize);
                if off.checked_add(len).is_none_or(|end| end > constants.len()) || len != expect_bytes {
                    return Err(e("constant out of the graph's constant blob".into()));
                }
                let bytes = &constants[off..off + len];
                if node.dtype() == DType::I32 {
                    host_ints[i] = Some(words(bytes, i32::from_le_bytes));
                }
                Array::from_host(bytes, node.dtype(), &shape_of(node)).map_err(e)?
            }
            OpCode::Embedding | OpCode::QuantEmbedding | OpCode::GetRows => {
                need(if op == OpCode::QuantEmbedding { 4 } else { 2 })?;
                let (ids_j, table_j) = if op == OpCode::GetRows { (1, 0) } else { (0, 1) };
                let ids_node = sn(ids_j);
                if ids_node.dtype() != DType::I32 {
                    return Err(e("indices must be i32".into()));
                }
                let n_ids = ids_node.numel();
                let d = node.cols();
                if node.numel() != n_ids * d {
                    return Err(e(format!("output must be [{n_ids}, {d}]")));
                }
                let table = sn(table_j);
                let rows = table.rows();
                if op == OpCode::QuantEmbedding {
                    check_quant(node, &[sn(1), sn(2), sn(3)], d).map_err(e)?;
                } else {
                    if table.cols() != d {
                        return Err(e(format!("table has {} columns, output {d}", table.cols())));
                    }
                    if !is_float(table.dtype()) {
                        return Err(e(format!("table has dtype {}, expected a float", table.dtype().name())));
                    }
                }
                // Indices are only trusted once seen: MLX does not bound-check gathers.
                let ids = host_ints[src[ids_j] as usize]
                    .as_deref()
                    .ok_or_else(|| e("indices must come from the step's inputs".into()))?;
                if let Some(&id) = ids.iter().find(|&&id| id < 0 || id as usize >= rows) {
                    return Err(e(format!("index {id} out of range for {rows} rows")));
                }
                let (ids_a, table_a) = (v(ids_j)?, v(table_j)?);
                if op == OpCode::QuantEmbedding {
                    let (bits, group) = (node.iparams[0] as c_int, node.iparams[1] as c_int);
                    let (s, b) = (v(2)?, v(3)?);
                    // SAFETY: live handles.
                    make(|o| unsafe {
                        ffi::mlxb_quant_embedding(ids_a.raw(), table_a.raw(), s.raw(), b.raw(), bits, group, o)
                    })
                    .map_err(e)?
                } else {
                    // SAFETY: live handles.
                    make(|o| unsafe { ffi::mlxb_take_rows(table_a.raw(), ids_a.raw(), o) }).map_err(e)?
                }
            }
            OpCode::MatMul | OpCode::QuantMatMul => {
                need(if op == OpCode::MatMul { 2 } else { 4 })?;
                let (t, k) = (sn(0).rows(), sn(0).cols());
                let n = node.cols();
                if node.rows() != t {
                    return Err(e(format!("output has {} rows, x has {t}", node.rows())));
                }
                let x = v(0)?;
                if op == OpCode::MatMul {
                    if sn(1).cols() != k || sn(1).rows() != n || !is_float(sn(1).dtype()) {
                        return Err(e(format!(
                            "w is [{}, {}] {}, expected [{n}, {k}] float",
                            sn(1).rows(),
                            sn(1).cols(),
                            sn(1).dtype().name()
                        )));
                    }
                    let w = v(1)?;
                    // SAFETY: live handles.
                    make(|o| unsafe { ffi::mlxb_matmul(x.raw(), w.raw(), o) }).map_err(e)?
                } else {
                    check_quant(node, &[sn(1), sn(2), sn(3)], k).map_err(e)?;
                    if sn(1).rows() != n {
                        return Err(e(format!("packed weight has {} rows, output {n} columns", sn(1).rows())));
                    }
                    let (bits, group) = (node.iparams[0] as c_int, node.iparams[1] as c_int);
                    let (w, s, b) = (v(1)?, v(2)?, v(3)?);
                    // SAFETY: live handles.
                    make(|o| unsafe { ffi::mlxb_quant_matmul(x.raw(), w.raw(), s.raw(), b.raw(), bits, group, o) })
                        .map_err(e)?
                }
            }
            OpCode::Add | OpCode::Mul | OpCode::SiluMul | OpCode::GeluTanhMul => {
                need(2)?;
                let (a, b) = (sn(0), sn(1));
                let gated = matches!(op, OpCode::SiluMul | OpCode::GeluTanhMul);
                let ok = a.numel() == node.numel()
                    && node.cols() == a.cols()
                    && is_float(b.dtype())
                    && (b.numel() == a.numel() || (!gated && b.numel() == node.cols()));
                if !ok {
                    return Err(e(format!("cannot combine {} and {} elements", a.numel(), b.numel())));
                }
                let kind = match op {
                    OpCode::Add => ffi::BIN_ADD,
                    OpCode::Mul => ffi::BIN_MUL,
                    OpCode::SiluMul => ffi::BIN_SILU_MUL,
                    _ => ffi::BIN_GELU_TANH_MUL,
                };
                // Both as [rows, cols] (or b as a row) so MLX broadcasts rows as the op says.
                let rows = (node.numel() / node.cols().max(1)) as i64;
                let cols = node.cols() as i64;
                let a2 = v(0)?.view_f32_2d(sn(0).dtype(), rows, cols).map_err(e)?;
                let b_rows = if b.numel() == a.numel() { rows } else { 1 };
                let b2 = v(1)?.view_f32_2d(b.dtype(), b_rows, cols).map_err(e)?;
                // SAFETY: live handles.
                make(|o| unsafe { ffi::mlxb_binary(kind, a2.raw(), b2.raw(), o) }).map_err(e)?
            }
            OpCode::Scale
            | OpCode::Silu
            | OpCode::Gelu
            | OpCode::GeluTanh
            | OpCode::Relu
            | OpCode::Softcap
            | OpCode::Sigmoid => {
                need(1)?;
                if sn(0).numel() != node.numel() || !is_float(sn(0).dtype()) {
                    return Err(e("output must have the input's shape".into()));
                }
                let p = node.fparams[0];
                if op == OpCode::Softcap && p <= 0.0 {
                    return Err(e("soft-cap must be positive".into()));
                }
                let kind = match op {
                    OpCode::Scale => ffi::UN_SCALE,
                    OpCode::Silu => ffi::UN_SILU,
                    OpCode::Gelu => ffi::UN_GELU,
                    OpCode::GeluTanh => ffi::UN_GELU_TANH,
                    OpCode::Relu => ffi::UN_RELU,
                    OpCode::Sigmoid => ffi::UN_SIGMOID,
                    _ => ffi::UN_SOFTCAP,
                };
                let x = v(0)?.f32().map_err(e)?;
                // SAFETY: a live handle.
                make(|o| unsafe { ffi::mlxb_unary(kind, x.raw(), p, o) }).map_err(e)?
            }
            OpCode::RmsNorm | OpCode::LayerNorm => {
                need(if op == OpCode::RmsNorm { 2 } else { 3 })?;
                let c = sn(0).cols();
                let d = sn(1).numel();
                if d == 0 || c % d != 0 || sn(0).numel() != node.numel() || !is_float(sn(1).dtype()) {
                    return Err(e(format!("weight of {d} does not divide {c} columns")));
                }
                let (x, w) = (v(0)?, v(1)?);
                let eps = node.fparams[0];
                if op == OpCode::RmsNorm {
                    let unit = (node.iparams[0] == 1) as c_int;
                    // SAFETY: live handles.
                    make(|o| unsafe { ffi::mlxb_rms_norm(x.raw(), w.raw(), eps, unit, o) }).map_err(e)?
                } else {
                    if d != c || sn(2).numel() != c || !is_float(sn(2).dtype()) {
                        return Err(e("layer norm weight and bias must span the columns".into()));
                    }
                    let b = v(2)?;
                    // SAFETY: live handles.
                    make(|o| unsafe { ffi::mlxb_layer_norm(x.raw(), w.raw(), b.raw(), eps, o) }).map_err(e)?
                }
            }
            OpCode::Rope => {
                need(3)?;
                let (hd, rot) = (node.iparams[0] as usize, node.iparams[1] as usize);
                let c = sn(0).cols();
                let f = sn(2);
                if hd == 0 || c % hd != 0 || rot > hd || rot == 0 || rot % 2 != 0 || f.cols() != rot / 2 {
                    return Err(e(format!(
                        "bad rope shape: cols {c}, head_dim {hd}, rotary {rot}, {} frequencies",
                        f.cols()
                    )));
                }
                let rows = sn(0).rows();
                if sn(1).numel() != rows || sn(1).dtype() != DType::I32 {
                    return Err(e("one i32 position per row required".into()));
                }
                if f.rows() != 1 && f.rows() != rows {
                    return Err(e(format!("inv_freq must have 1 or {rows} rows, has {}", f.rows())));
                }
                let trad = (node.iparams[2] == 1) as c_int;
                let ms = if node.fparams[0] == 0.0 { 1.0 } else { node.fparams[0] };
                let x = v(0)?.view_f32_2d(sn(0).dtype(), rows as i64, c as i64).map_err(e)?;
                let (p, fr) = (v(1)?, v(2)?);
                // SAFETY: live handles.
                make(|o| unsafe { ffi::mlxb_rope(x.raw(), p.raw(), fr.raw(), hd as c_int, rot as c_int, trad, ms, o) })
                    .map_err(e)?
            }
            OpCode::Attention => {
                need(3)?;
                let batch = batch.as_ref().ok_or_else(|| e("no step batch given".into()))?;
                attention(i, node, nodes, &vals, batch, &groups, &kv, &mut caches)?
            }
            OpCode::Slice => {
                need(1)?;
                let (rows, c, c0, c1) = (sn(0).rows(), sn(0).cols(), node.iparams[0], node.iparams[1]);
                if c0 < 0 || c1 <= c0 || c1 as usize > c {
                    return Err(e(format!("column range {c0}..{c1} outside 0..{c}")));
                }
                if node.cols() != (c1 - c0) as usize || node.rows() != rows {
                    return Err(e(format!("output must be [{rows}, {}]", c1 - c0)));
                }
                let x = v(0)?.view_f32_2d(sn(0).dtype(), rows as i64, c as i64).map_err(e)?;
                // SAFETY: a live handle.
                make(|o| unsafe { ffi::mlxb_slice_cols(x.raw(), c0, c1, o) }).map_err(e)?
            }
            OpCode::Softmax | OpCode::L2Normalize => {
                need(1)?;
                let (rows, c) = (sn(0).rows(), sn(0).cols());
                if sn(0).numel() != node.numel() || node.cols() != c {
                    return Err(e("output must have the input's shape".into()));
                }
                let x = v(0)?.view_f32_2d(sn(0).dtype(), rows as i64, c as i64).map_err(e)?;
                if op == OpCode::Softmax {
                    let d = if node.iparams[0] == 0 { c } else { node.iparams[0].max(0) as usize };
                    if d == 0 || c % d != 0 {
                        return Err(e(format!("group width {d} does not divide {c} columns")));
                    }
                    // SAFETY: a live handle.
                    make(|o| unsafe { ffi::mlxb_softmax_groups(x.raw(), d as i64, o) }).map_err(e)?
                } else {
                    let eps = if node.fparams[0] > 0.0 { node.fparams[0] } else { 1e-12 };
                    // SAFETY: a live handle.
                    make(|o| unsafe { ffi::mlxb_l2_normalize(x.raw(), eps, o) }).map_err(e)?
                }
            }
            OpCode::SegmentPool => {
                need(2)?;
                let (t, c, n) = (sn(0).rows(), sn(0).cols(), node.rows());
                let seq = host_ints[src[1] as usize]
                    .as_deref()
                    .ok_or_else(|| e("sequence indices must come from the step's inputs or constants".into()))?;
                if seq.len() != t || node.cols() != c {
                    return Err(e(format!("x [{t}, {c}] with {} sequence indices", seq.len())));
                }
                if let Some(&s) = seq.iter().find(|&&s| s < 0 || s as usize >= n) {
                    return Err(e(format!("sequence index {s} out of range for {n} output rows")));
                }
                let pool = node.iparams[0];
                if !matches!(pool, POOL_MEAN | POOL_FIRST | POOL_LAST) {
                    return Err(e(format!("unknown pooling {pool}")));
                }
                if t == 0 {
                    Array::zeros(DType::F32, &[n as i64, c as i64]).map_err(e)?
                } else {
                    let x = v(0)?.view_f32_2d(sn(0).dtype(), t as i64, c as i64).map_err(e)?;
                    if pool == POOL_MEAN {
                        let mut count = vec![0usize; n];
                        seq.iter().for_each(|&s| count[s as usize] += 1);
                        let mut w = vec![0f32; n * t];
                        for (r, &s) in seq.iter().enumerate() {
                            w[s as usize * t + r] = 1.0 / count[s as usize] as f32;
                        }
                        let w = Array::from_f32(&w, &[n as i64, t as i64]).map_err(e)?;
                        // SAFETY: live handles.
                        make(|o| unsafe { ffi::mlxb_pool_mean(x.raw(), w.raw(), o) }).map_err(e)?
                    } else {
                        let mut pick = vec![-1i32; n];
                        for (r, &s) in seq.iter().enumerate() {
                            let p = &mut pick[s as usize];
                            if pool == POOL_LAST || *p < 0 {
                                *p = r as i32;
                            }
                        }
                        let present: Vec<f32> = pick.iter().map(|&p| if p >= 0 { 1.0 } else { 0.0 }).collect();
                        let rows: Vec<i32> = pick.iter().map(|&p| p.max(0)).collect();
                        let rows = Array::from_i32(&rows, &[n as i64]).map_err(e)?;
                        let present = Array::from_f32(&present, &[n as i64]).map_err(e)?;
                        // SAFETY: live handles.
                        make(|o| unsafe { ffi::mlxb_pool_pick(x.raw(), rows.raw(), present.raw(), o) }).map_err(e)?
                    }
                }
            }
            OpCode::StepAttention => {
                need(4)?;
                let spec = StepAttentionSpec::decode(node, srcs).map_err(e)?;
                let (Heads { hq, hkv, dh }, t) = (spec.heads, spec.t);
                let kv_row = hkv * dh;
                let seq = host_ints[src[3] as usize]
                    .as_deref()
                    .ok_or_else(|| e("sequence indices must come from the step's inputs or constants".into()))?;
                let segs = segments(seq, t).map_err(e)?;
                let (causal, window) = (node.iparams[3] == 1, node.iparams[4].max(0) as usize);
                let q = v(0)?.view_f32_2d(sn(0).dtype(), t as i64, (hq * dh) as i64).map_err(e)?;
                let k = v(1)?.view_f32_2d(sn(1).dtype(), t as i64, kv_row as i64).map_err(e)?;
                let vv = v(2)?.view_f32_2d(sn(2).dtype(), t as i64, kv_row as i64).map_err(e)?;
                let mut parts = Vec::with_capacity(segs.len());
                for seg in &segs {
                    let rows = |a: &Array| {
                        // SAFETY: a live handle.
                        make(|o| unsafe { ffi::mlxb_slice_rows(a.raw(), seg.start as i64, seg.end as i64, o) })
                    };
                    let (qs, ks, vs) = (rows(&q).map_err(e)?, rows(&k).map_err(e)?, rows(&vv).map_err(e)?);
                    let len = seg.end - seg.start;
                    let mask = if causal || window > 0 {
                        let mut m = vec![f32::NEG_INFINITY; len * len];
                        for r in 0..len {
                            let (lo, hi) = visible(causal, window, r, len);
                            m[r * len + lo..r * len + hi].fill(0.0);
                        }
                        Some(Array::from_f32(&m, &[len as i64, len as i64]).map_err(e)?)
                    } else {
                        None
                    };
                    let m = mask.as_ref().map_or(std::ptr::null(), |m| m.raw());
                    let (scale, softcap) = (node.fparams[0], node.fparams[1]);
                    // SAFETY: live handles (the mask may be null).
                    let part = make(|o| unsafe {
                        ffi::mlxb_attend(
                            qs.raw(),
                            ks.raw(),
                            vs.raw(),
                            m,
                            hq as c_int,
                            hkv as c_int,
                            dh as c_int,
                            scale,
                            softcap,
                            o,
                        )
                    })
                    .map_err(e)?;
                    parts.push(part);
                }
                concat_rows(&parts).map_err(e)?
            }
            OpCode::StoreCrossKv => {
                need(3)?;
                let layer = node.iparams[0] as usize;
                let (hkv, dh, max_len) =
                    (node.iparams[1] as usize, node.iparams[2] as usize, node.iparams[3].max(0) as usize);
                let kv_row = hkv * dh;
                let seq = host_ints[src[2] as usize]
                    .as_deref()
                    .ok_or_else(|| e("sequence indices must come from the step's inputs or constants".into()))?;
                let rows_in = seq.len();
                if kv_row == 0 || sn(0).numel() != rows_in * kv_row || sn(1).numel() != rows_in * kv_row {
                    return Err(e(format!("k/v must be [{rows_in}, {hkv} x {dh}]")));
                }
                let n_seqs = batch.as_ref().map_or(0, |b| b.n_seqs as usize);
                let segs = segments(seq, n_seqs).map_err(e)?;
                if let Some(s) = segs.iter().find(|s| s.end - s.start > max_len) {
                    return Err(e(format!("sequence {} has {} rows, more than {max_len}", s.seq, s.end - s.start)));
                }
                let re = HEADER + max_len * 2 * kv_row;
                let state_rows = state_rows(batch.as_ref(), &segs, re, &kv, layer, &mut states).map_err(e)?;
                if !segs.is_empty() {
                    let k = v(0)?.view_f32_2d(sn(0).dtype(), rows_in as i64, kv_row as i64).map_err(e)?;
                    let vv = v(1)?.view_f32_2d(sn(1).dtype(), rows_in as i64, kv_row as i64).map_err(e)?;
                    let st = states.get_mut(&layer).unwrap();
                    for (seg, &row) in segs.iter().zip(&state_rows) {
                        let header =
                            Array::from_f32(&[f32::from_bits((seg.end - seg.start) as u32)], &[1]).map_err(e)?;
                        let rows = |a: &Array| {
                            // SAFETY: a live handle.
                            make(|o| unsafe { ffi::mlxb_slice_rows(a.raw(), seg.start as i64, seg.end as i64, o) })
                        };
                        let (ks, vs) = (rows(&k).map_err(e)?, rows(&vv).map_err(e)?);
                        // SAFETY: live handles.
                        let kv_rows = make(|o| unsafe { ffi::mlxb_concat_cols(ks.raw(), vs.raw(), o) }).map_err(e)?;
                        st.write((row * re) as i64, &header).map_err(e)?;
                        st.write((row * re + HEADER) as i64, &kv_rows).map_err(e)?;
                    }
                }
                Array::zeros(DType::F32, &shape_of(node)).map_err(e)?
            }
            OpCode::CrossAttention => {
                need(2)?;
                let spec = CrossAttentionSpec::decode(node, srcs).map_err(e)?;
                let (layer, max_len, t) = (spec.layer, spec.max_len, spec.t);
                let Heads { hq, hkv, dh } = spec.heads;
                let seq = host_ints[src[1] as usize]
                    .as_deref()
                    .ok_or_else(|| e("sequence indices must come from the step's inputs or constants".into()))?;
                let n_seqs = batch.as_ref().map_or(0, |b| b.n_seqs as usize);
                let segs = segments(seq, n_seqs).map_err(e)?;
                let kv_row = hkv * dh;
                let re = HEADER + max_len * 2 * kv_row;
                let state_rows = state_rows(batch.as_ref(), &segs, re, &kv, layer, &mut states).map_err(e)?;
                let q = v(0)?.view_f32_2d(sn(0).dtype(), t as i64, (hq * dh) as i64).map_err(e)?;
                let st = states.get(&layer);
                let mut parts = Vec::with_capacity(segs.len());
                for (seg, &row) in segs.iter().zip(&state_rows) {
                    let st = st.unwrap();
                    // SAFETY: a live handle.
                    let qs = make(|o| unsafe { ffi::mlxb_slice_rows(q.raw(), seg.start as i64, seg.end as i64, o) })
                        .map_err(e)?;
                    let (scale, softcap) = (node.fparams[0], node.fparams[1]);
                    // SAFETY: live handles.
                    let part = make(|o| unsafe {
                        ffi::mlxb_cross_attend(
                            qs.raw(),
                            st.array.raw(),
                            (row * re) as i64,
                            max_len as c_int,
                            HEADER as c_int,
                            hq as c_int,
                            hkv as c_int,
                            dh as c_int,
                            scale,
                            softcap,
                            o,
                        )
                    })
                    .map_err(e)?;
                    parts.push(part);
                }
                concat_rows(&parts).map_err(e)?
            }
            OpCode::Conv1d => {
                need(3)?;
                let spec = Conv1dSpec::decode(node, srcs).map_err(e)?;
                let Conv1dSpec { t, c_in, c_out, kernel, stride, pad, groups, causal, torch_layout: torch, .. } = spec;
                if !is_float(sn(1).dtype()) || (spec.has_bias && !is_float(sn(3).dtype())) {
                    return Err(e("the kernel and bias must be floats".into()));
                }
                let seq = host_ints[src[2] as usize]
                    .as_deref()
                    .ok_or_else(|| e("sequence indices must come from the step's inputs or constants".into()))?;
                let bias = if spec.has_bias {
                    Some(v(3)?.view_f32_2d(sn(3).dtype(), 1, c_out as i64).map_err(e)?)
                } else {
                    None
                };
                let n_seqs = if causal { batch.as_ref().map_or(0, |b| b.n_seqs as usize) } else { t };
                let segs = segments(seq, n_seqs).map_err(e)?;
                let n_out: usize = segs.iter().map(|s| spec.out_rows(s.end - s.start)).sum();
                if n_out != node.rows() {
                    return Err(e(format!("output has {} rows, the sequences give {n_out}", node.rows())));
                }
                let carry = spec.carried();
                let state_rows = if causal && carry > 0 {
                    state_rows(batch.as_ref(), &segs, carry, &kv, spec.state_layer, &mut states).map_err(e)?
                } else {
                    Vec::new()
                };
                let x = if t == 0 {
                    None
                } else {
                    Some(v(0)?.view_f32_2d(sn(0).dtype(), t as i64, c_in as i64).map_err(e)?)
                };
                let w = v(1)?;
                let b = bias.as_ref().map_or(std::ptr::null(), |b| b.raw());
                let mut parts = Vec::with_capacity(segs.len());
                for (si, seg) in segs.iter().enumerate() {
                    let x = x.as_ref().unwrap();
                    // SAFETY: a live handle.
                    let mut xs =
                        make(|o| unsafe { ffi::mlxb_slice_rows(x.raw(), seg.start as i64, seg.end as i64, o) })
                            .map_err(e)?;
                    if causal && carry > 0 {
                        let st = states.get_mut(&spec.state_layer).unwrap();
                        let off = (state_rows[si] * carry) as i64;
                        let prev = st.read(off, carry as i64).map_err(e)?;
                        let prev = prev.view(DType::F32, &[(kernel - 1) as i64, c_in as i64]).map_err(e)?;
                        xs = concat_rows(&[prev, xs]).map_err(e)?;
                        let n_in = (kernel - 1 + seg.end - seg.start) as i64;
                        // SAFETY: a live handle.
                        let last =
                            make(|o| unsafe { ffi::mlxb_slice_rows(xs.raw(), n_in - (kernel - 1) as i64, n_in, o) })
                                .map_err(e)?;
                        st.write(off, &last).map_err(e)?;
                    }
                    if spec.out_rows(seg.end - seg.start) == 0 {
                        continue;
                    }
                    let p = if causal { 0 } else { pad as c_int };
                    // SAFETY: live handles (the bias may be null).
                    let part = make(|o| unsafe {
                        ffi::mlxb_conv1d(xs.raw(), w.raw(), b, stride as c_int, p, groups as c_int, torch as c_int, o)
                    })
                    .map_err(e)?;
                    parts.push(part);
                }
                if parts.is_empty() {
                    Array::zeros(DType::F32, &[0, c_out as i64]).map_err(e)?
                } else {
                    concat_rows(&parts).map_err(e)?
                }
            }
            OpCode::TopK => {
                need(1)?;
                let spec = TopKSpec::decode(node, sn(0)).map_err(e)?;
                let (rows, cols, k) = (spec.rows, spec.cols, spec.k);
                let x = v(0)?.view_f32_2d(sn(0).dtype(), rows as i64, cols as i64).map_err(e)?;
                let (idx, sm, renorm) = (spec.indices as c_int, spec.softmax as c_int, spec.renormalize as c_int);
                // SAFETY: a live handle.
                make(|o| unsafe { ffi::mlxb_topk(x.raw(), k as c_int, idx, sm, renorm, o) }).map_err(e)?
            }
            OpCode::GatherMatMul | OpCode::GatherQuantMatMul => {
                need(if op == OpCode::GatherMatMul { 3 } else { 5 })?;
                let GatherSpec { t, k, kdim, n, x_per_token } = GatherSpec::decode(node, sn(0), sn(1)).map_err(e)?;
                let x = v(0)?.view_f32_2d(sn(0).dtype(), sn(0).rows() as i64, kdim as i64).map_err(e)?;
                let indices = v(1)?.view_f32_2d(sn(1).dtype(), t as i64, k as i64).map_err(e)?;
                let (total, val) = if op == OpCode::GatherMatMul {
                    let mut held = 0usize;
                    for j in 2..src.len() {
                        let d = sn(j).dims();
                        let (count, rows, cols) = match *d {
                            [count, rows, cols] => (count as usize, rows as usize, cols as usize),
                            [rows, cols] => (1, rows as usize, cols as usize),
                            _ => return Err(e(format!("expert weight {j} has shape {d:?}"))),
                        };
                        if rows != n || cols != kdim || !is_float(sn(j).dtype()) {
                            return Err(e(format!("expert weight {j} is {d:?}, expected [·, {n}, {kdim}] float")));
                        }
                        held += count;
                    }
                    let first = node.iparams[0].max(0);
                    let total = if node.iparams[1] > 0 { node.iparams[1] as usize } else { first as usize + held };
                    let ws: Vec<*mut ffi::RawArray> =
                        (2..src.len()).map(|j| v(j).map(|a| a.raw() as *mut _)).collect::<Result<_, _>>()?;
                    // SAFETY: live handles.
                    let val = make(|o| unsafe {
                        ffi::mlxb_gather_mm(
                            x.raw(),
                            indices.raw(),
                            ws.as_ptr(),
                            ws.len(),
                            first,
                            x_per_token as c_int,
                            o,
                        )
                    })
                    .map_err(e)?;
                    (total, val)
                } else {
                    let p = sn(2);
                    check_quant(node, &[p, sn(3), sn(4)], kdim).map_err(e)?;
                    let experts = p.dims().first().copied().unwrap_or(0) as usize;
                    if p.dims().len() != 3 || p.rows() != experts * n {
                        return Err(e(format!("packed experts are {:?}, expected [E, {n}, ·]", p.dims())));
                    }
                    let (bits, group) = (node.iparams[0] as c_int, node.iparams[1] as c_int);
                    let (w, sc, b) = (v(2)?, v(3)?, v(4)?);
                    // SAFETY: live handles.
                    let val = make(|o| unsafe {
                        ffi::mlxb_gather_qmm(
                            x.raw(),
                            indices.raw(),
                            w.raw(),
                            sc.raw(),
                            b.raw(),
                            bits,
                            group,
                            x_per_token as c_int,
                            o,
                        )
                    })
                    .map_err(e)?;
                    (experts, val)
                };
                // Expert ids the host gave are checked here; ids computed in this graph (a TopK) are
                // in range by construction (MLX clamps the gather either way).
                let host_ids = match (sn(1).opcode(), inputs.get(sn(1).iparams[0] as usize)) {
                    (Some(OpCode::Input), Some(h)) if h.len > 0 && sn(1).dtype() == DType::F32 => {
                        // SAFETY: the host's input is readable for `len` bytes during the call (its size
                        // was checked against the node when it was bound).
                        Some(words(unsafe { std::slice::from_raw_parts(h.ptr, h.len) }, f32::from_le_bytes))
                    }
                    _ => None,
                };
                if let Some(ids) = host_ids {
                    if let Some((at, &id)) = ids
                        .iter()
                        .enumerate()
                        .find(|(_, &id)| !(id >= 0.0 && id.fract() == 0.0 && (id as usize) < total))
                    {
                        return Err(e(format!(
                            "expert index {id} (token {}, slot {}) is not an expert id below {total}",
                            at / k.max(1),
                            at % k.max(1)
                        )));
                    }
                }
                val
            }
            OpCode::WeightedSum => {
                need(2)?;
                let WeightedSumSpec { t, k, n } = WeightedSumSpec::decode(node, sn(0), sn(1)).map_err(e)?;
                let y = v(0)?.view_f32_2d(sn(0).dtype(), (t * k) as i64, n as i64).map_err(e)?;
                let w = v(1)?.view_f32_2d(sn(1).dtype(), t as i64, k as i64).map_err(e)?;
                // SAFETY: live handles.
                make(|o| unsafe { ffi::mlxb_weighted_sum(y.raw(), w.raw(), t as c_int, k as c_int, o) }).map_err(e)?
            }
        };
        vals[i] = Some(val);
    }

    // Outputs as f32 in row-major order; then one evaluation of everything this step produced.
    let mut out_arrays = Vec::with_capacity(outputs.len());
    for (&o, dst) in outputs.iter().zip(outs) {
        let node = &nodes[o as usize];
        if dst.len != node.numel() * 4 {
            return Err(PluginError::invalid(format!(
                "output node {o} has {} f32 values but the destination holds {} bytes",
                node.numel(),
                dst.len
            )));
        }
        let a = vals[o as usize].as_ref().ok_or_else(|| PluginError::invalid(format!("output {o} has no value")))?;
        out_arrays.push(a.f32().map_err(PluginError::failed)?);
    }
    // The caches' old arrays are dropped before evaluating, so MLX may update them in place (an array
    // nothing else holds can donate its memory to the scatter that writes this step's keys).
    let mut to_eval: Vec<&Array> = out_arrays.iter().collect();
    for c in caches.values() {
        // SAFETY: buffers of this plugin, used by this thread only for the call.
        unsafe {
            for b in [c.k_buf, c.v_buf] {
                if let Some(MlxBuffer::Device { array, .. }) = b.as_mut() {
                    *array = Array::placeholder();
                }
            }
        }
        to_eval.push(&c.k);
        to_eval.push(&c.v);
    }
    for st in states.values() {
        // SAFETY: as above.
        unsafe {
            if let Some(MlxBuffer::Device { array, .. }) = st.buf.as_mut() {
                *array = Array::placeholder();
            }
        }
        to_eval.push(&st.array);
    }
    drop(vals);
    let evaluated = Array::async_eval(&to_eval).map_err(PluginError::failed);
    for (_, c) in caches.drain() {
        // SAFETY: as above.
        unsafe {
            if let Some(MlxBuffer::Device { array, .. }) = c.k_buf.as_mut() {
                *array = c.k;
            }
            if let Some(MlxBuffer::Device { array, .. }) = c.v_buf.as_mut() {
                *array = c.v;
            }
        }
    }
    for (_, st) in states.drain() {
        // SAFETY: as above.
        unsafe {
            if let Some(MlxBuffer::Device { array, .. }) = st.buf.as_mut() {
                *array = st.array;
            }
        }
    }
    evaluated?;
    Ok(Launched { outputs: out_arrays.into_iter().zip(outs.iter().copied()).collect() })
}

/// f32 elements before a cross-attention state row's first key row.
const HEADER: usize = CROSS_KV_HEADER as usize;

/// Little-endian 4-byte values of `bytes` (a copy: host inputs need not be aligned).
fn words<T>(bytes: &[u8], from: fn([u8; 4]) -> T) -> Vec<T> {
    bytes.chunks_exact(4).map(|c| from([c[0], c[1], c[2], c[3]])).collect()
}

/// One sequence's rows `start..end` of a step.
struct Segment {
    seq: usize,
    start: usize,
    end: usize,
}

/// Each sequence's rows from a per-row sequence index: contiguous, every index below `n_seqs`.
fn segments(seq: &[i32], n_seqs: usize) -> Result<Vec<Segment>, String> {
    let mut out: Vec<Segment> = Vec::new();
    let mut seen = vec![false; n_seqs];
    for (t, &s) in seq.iter().enumerate() {
        if s < 0 || s as usize >= n_seqs {
            return Err(format!("row {t}: sequence index {s} out of range for {n_seqs} sequences"));
        }
        let s = s as usize;
        match out.last_mut() {
            Some(g) if g.seq == s => g.end = t + 1,
            _ => {
                if std::mem::replace(&mut seen[s], true) {
                    return Err(format!("row {t}: the rows of sequence {s} are not contiguous"));
                }
                out.push(Segment { seq: s, start: t, end: t + 1 });
            }
        }
    }
    Ok(out)
}

/// Keys `lo..hi` that row `i` of a sequence of `len` rows sees (`StepAttention`'s mask).
fn visible(causal: bool, window: usize, i: usize, len: usize) -> (usize, usize) {
    match (causal, window) {
        (true, 0) => (0, i + 1),
        (true, w) => ((i + 1).saturating_sub(w), i + 1),
        (false, 0) => (0, len),
        (false, w) => (i.saturating_sub(w), (i + w + 1).min(len)),
    }
}

fn concat_rows(parts: &[Array]) -> Result<Array, String> {
    let raw: Vec<_> = parts.iter().map(|p| p.raw() as *mut ffi::RawArray).collect();
    // SAFETY: live handles.
    make(|o| unsafe { ffi::mlxb_concat_rows(raw.as_ptr(), raw.len(), o) })
}

/// One layer's recurrent state (flat f32) as this step leaves it, and the buffer it goes back to.
struct StateCache {
    array: Array,
    buf: *mut MlxBuffer,
}

impl StateCache {
    fn read(&self, offset: i64, len: i64) -> Result<Array, String> {
        // SAFETY: a live handle.
        make(|o| unsafe { ffi::mlxb_flat_read(self.array.raw(), offset, len, o) })
    }

    fn write(&mut self, offset: i64, data: &Array) -> Result<(), String> {
        // SAFETY: live handles.
        self.array = make(|o| unsafe { ffi::mlxb_flat_write(self.array.raw(), offset, data.raw(), o) })?;
        Ok(())
    }
}

/// The state row of each segment's sequence (`StepBatch::seq_state_slots`), checked to fit layer
/// `layer`'s state buffer in rows of `row_elems` f32; binds that buffer into `states` first.
fn state_rows(
    batch: Option<&StepBatch>,
    segs: &[Segment],
    row_elems: usize,
    kv: &[KvBinding],
    layer: usize,
    states: &mut HashMap<usize, StateCache>,
) -> Result<Vec<usize>, String> {
    if let std::collections::hash_map::Entry::Vacant(slot) = states.entry(layer) {
        let b = kv.get(layer).ok_or_else(|| format!("state layer {layer} not bound"))?;
        // SAFETY: a handle the host bound for this layer, used by this thread only for the call.
        let buf =
            unsafe { (b.state as *mut MlxBuffer).as_mut() }.ok_or_else(|| format!("layer {layer} has no state"))?;
        if !matches!(buf, MlxBuffer::Device { .. }) || buf.byte_len() % 4 != 0 {
            return Err("state must be an allocated buffer of f32".into());
        }
        let array = buf.typed(DType::F32, &[(buf.byte_len() / 4) as i64])?;
        slot.insert(StateCache { array, buf });
    }
    let len = states[&layer].array.nbytes() / 4;
    let b = batch.ok_or("no step batch given")?;
    // SAFETY: the host guarantees the batch's arrays for the sizes it states.
    let slots = unsafe { slice_from(b.seq_state_slots, b.n_seqs as usize) };
    segs.iter()
        .map(|s| {
            let slot = *slots.get(s.seq).ok_or_else(|| format!("sequence {} has no state slot", s.seq))? as usize;
            if (slot + 1) * row_elems > len {
                return Err(format!("state row {slot} of {row_elems} values lies beyond the buffer ({len} values)"));
            }
            Ok(slot)
        })
        .collect()
}

fn copy_out(a: &Array, dst: &HostTensor) -> Result<(), PluginError> {
    if dst.len == 0 {
        return Ok(());
    }
    // SAFETY: the host's destination is writable for `len` bytes.
    let d = unsafe { std::slice::from_raw_parts_mut(dst.ptr, dst.len) };
    a.read(0, d).map_err(PluginError::failed)
}

/// Checks an MLX affine-quantized matrix `[packed, scales, biases]` whose logical inner size is `k`.
fn check_quant(node: &Node, q: &[&Node; 3], k: usize) -> Result<(), String> {
    let (bits, group) = (node.iparams[0] as usize, node.iparams[1] as usize);
    if !matches!(bits, 2 | 3 | 4 | 5 | 6 | 8) || !matches!(group, 32 | 64 | 128) {
        return Err(format!("unsupported quantization bits={bits} group={group}"));
    }
    let [p, s, b] = *q;
    let n = p.rows();
    if p.dtype() != DType::U32 || !k.is_multiple_of(group) || p.cols() * 32 != k * bits {
        return Err(format!(
            "packed weight is [{n}, {}] {} but {k} columns at {bits} bits need {} u32 words per row",
            p.cols(),
            p.dtype().name(),
            k * bits / 32
        ));
    }
    if s.rows() != n || s.cols() != k / group || b.rows() != n || b.cols() != k / group {
        return Err(format!("scales/biases must be [{n}, {}]", k / group));
    }
    if !is_float(s.dtype()) || !is_float(b.dtype()) {
        return Err("scales/biases must be floats".into());
    }
    Ok(())
}

/// Attention over the paged cache: this step's K/V written into their slots, then each sequence's
/// queries against the keys of its context, gathered through its block table.
#[allow(clippy::too_many_arguments)]
fn attention(
    i: usize,
    node: &Node,
    nodes: &[Node],
    vals: &[Option<Array>],
    batch: &StepBatch,
    groups: &[KvGroupTables],
    kv: &[KvBinding],
    caches: &mut HashMap<usize, LayerCache>,
) -> Result<Array, PluginError> {
    let e = |m: String| bad(i, node, m);
    let src = node.sources();
    let t = batch.n_tokens as usize;
    let n_seqs = batch.n_seqs as usize;
    let (qn, kn, vn) = (&nodes[src[0] as usize], &nodes[src[1] as usize], &nodes[src[2] as usize]);
    let spec = AttentionSpec::decode(node, &[qn, kn, vn], t).map_err(e)?;
    let (layer, window) = (spec.layer, spec.window);
    let Heads { hq, hkv, dh } = spec.heads;
    let kv_row = hkv * dh;
    let binding = kv.get(layer).ok_or_else(|| e(format!("KV cache layer {layer} not bound")))?;
    let group = groups
        .get(binding.group as usize)
        .ok_or_else(|| e(format!("layer {layer}: KV group {} not given", binding.group)))?;
    if group.block_size == 0 {
        return Err(e("block size 0".into()));
    }
    // SAFETY: the host guarantees the batch's arrays for the sizes it states.
    let (token_seq, positions, slot_mapping, tables) = unsafe {
        (
            slice_from(batch.token_seq, t),
            slice_from(batch.positions, t),
            slice_from(group.slot_mapping, t),
            slice_from(group.block_tables, n_seqs * group.max_blocks_per_seq as usize),
        )
    };
    validate_layout(token_seq, positions, slot_mapping, tables, group, n_seqs, window).map_err(e)?;
    let bs = group.block_size as usize;
    let mb = group.max_blocks_per_seq as usize;
    let slots = group.num_blocks as usize * bs;

    // This layer's caches: the ones an earlier node of this step left, else the buffers' arrays.
    if let std::collections::hash_map::Entry::Vacant(slot) = caches.entry(layer) {
        let (k_type, v_type) = (binding.key_dtype(), binding.value_dtype());
        for dtype in [k_type, v_type] {
            if !matches!(dtype, DType::F32 | DType::F16 | DType::BF16) {
                return Err(e(format!("KV cache dtype {} is not one the mlx backend keeps", dtype.name())));
            }
        }
        // SAFETY: handles the host bound for this layer; used by this thread only.
        let (kb, vb) = unsafe { ((binding.k as *mut MlxBuffer).as_mut(), (binding.v as *mut MlxBuffer).as_mut()) };
        let (Some(kb), Some(vb)) = (kb, vb) else { return Err(e("null KV buffer".into())) };
        let bind = |b: &mut MlxBuffer, dtype: DType| -> Result<Array, PluginError> {
            if !matches!(b, MlxBuffer::Device { .. }) {
                return Err(e("KV cache must be an allocated buffer".into()));
            }
            let row_bytes = kv_row * dtype.size();
            let have = b.byte_len() / row_bytes;
            if have < slots || have * row_bytes != b.byte_len() {
                return Err(e(format!("KV cache layer {layer} is not {slots} slots of {kv_row} values")));
            }
            b.typed(dtype, &[have as i64, kv_row as i64]).map_err(e)
        };
        let (k, v) = (bind(kb, k_type)?, bind(vb, v_type)?);
        slot.insert(LayerCache { k, v, k_buf: kb, v_buf: vb });
    }
    let cache = caches.get_mut(&layer).unwrap();
    let val = |j: usize| vals[src[j] as usize].as_ref().ok_or_else(|| e(format!("source {} has no value", src[j])));
    let q = val(0)?.view_f32_2d(qn.dtype(), t as i64, (hq * dh) as i64).map_err(e)?;
    let k = val(1)?.view_f32_2d(kn.dtype(), t as i64, kv_row as i64).map_err(e)?;
    let v = val(2)?.view_f32_2d(vn.dtype(), t as i64, kv_row as i64).map_err(e)?;
    let slot_idx: Vec<i32> = slot_mapping.iter().map(|&s| s as i32).collect();
    let slot_idx = Array::from_i32(&slot_idx, &[t as i64]).map_err(e)?;
    let (mut k_new, mut v_new) = (std::ptr::null_mut(), std::ptr::null_mut());
    // SAFETY: live handles; two output slots.
    crate::array::status(unsafe {
        ffi::mlxb_kv_write(cache.k.raw(), cache.v.raw(), k.raw(), v.raw(), slot_idx.raw(), &mut k_new, &mut v_new)
    })
    .map_err(e)?;
    cache.k = Array::from_raw(k_new);
    cache.v = Array::from_raw(v_new);

    // Each run of one sequence's tokens against its context.
    let mut parts = Vec::new();
    let mut t0 = 0;
    while t0 < t {
        let s = token_seq[t0] as usize;
        let mut t1 = t0 + 1;
        while t1 < t && token_seq[t1] as usize == s {
            t1 += 1;
        }
        let first = positions[t0] as usize;
        let last = positions[t0..t1].iter().copied().max().unwrap_or(0) as usize;
        let start = if window > 0 { (first + 1).saturating_sub(window) } else { 0 };
        let len = last + 1 - start;
        let key_slots: Vec<i32> = (start..=last)
            .map(|p| {
                let id = tables[s * mb + p / bs];
                if id == NO_BLOCK {
                    0 // masked: outside every token's window
                } else {
                    (id as usize * bs + p % bs) as i32
                }
            })
            .collect();
        let mut mask = vec![f32::NEG_INFINITY; (t1 - t0) * len];
        for (r, &pos) in positions[t0..t1].iter().enumerate() {
            let pos = pos as usize;
            let lo = if window > 0 { (pos + 1).saturating_sub(window) } else { 0 };
            for p in lo.max(start)..=pos {
                mask[r * len + p - start] = 0.0;
            }
        }
        let ks = Array::from_i32(&key_slots, &[len as i64]).map_err(e)?;
        let m = Array::from_f32(&mask, &[(t1 - t0) as i64, len as i64]).map_err(e)?;
        let (scale, softcap) = (node.fparams[0], node.fparams[1]);
        // SAFETY: live handles.
        let part = make(|o| unsafe {
            ffi::mlxb_attention_seq(
                q.raw(),
                t0 as c_int,
                (t1 - t0) as c_int,
                cache.k.raw(),
                cache.v.raw(),
                ks.raw(),
                m.raw(),
                hq as c_int,
                hkv as c_int,
                dh as c_int,
                scale,
                softcap,
                o,
            )
        })
        .map_err(e)?;
        parts.push(part);
        t0 = t1;
    }
    if parts.is_empty() {
        return Array::zeros(DType::F32, &[0, (hq * dh) as i64]).map_err(e);
    }
    let raw: Vec<_> = parts.iter().map(|p| p.raw() as *mut ffi::RawArray).collect();
    // SAFETY: live handles.
    make(|o| unsafe { ffi::mlxb_concat_rows(raw.as_ptr(), raw.len(), o) }).map_err(e)
}
