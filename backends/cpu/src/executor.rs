//! Runs one graph: binds sources (inputs, weights, constants), evaluates nodes in order with the
//! kernels, recycles intermediate storage as soon as its last reader has run, and copies the outputs
//! out. Every shape mismatch is an error naming the node, never a panic.

use std::borrow::Cow;
use std::time::Instant;

use crate::pool::{self, ThreadPool};
use crate::profile::OpProfile;
use half::{bf16, f16};
use mlxcel_plugin_api::op_spec::{
    AttentionSpec, Conv1dSpec, CrossAttentionSpec, GatherSpec, Heads, StepAttentionSpec, TopKSpec, WeightedSumSpec,
};
use mlxcel_plugin_api::{
    read_versioned, read_versioned_array, slice_from, BufferHandle, ComputeArgs, DType, HostTensor, KvBinding,
    KvGroupTables, Node, OpCode, PluginError, StepBatch, CONV_CAUSAL_STATE, CONV_WEIGHT_MLX, CONV_WEIGHT_TORCH,
    CONV_WHOLE, MAX_SRC, NO_BLOCK, POOL_FIRST, POOL_LAST, POOL_MEAN,
};

use crate::buffer::{as_f32, as_i32, as_u16, as_u32, Buffer};
use crate::isa::Isa;
use crate::kernels::attention::{AttentionScratch, AttentionShape, CachedStep, PagedLayout};
use crate::kernels::attention_step::{self, Mask};
use crate::kernels::conv1d::{self, ConvShape, Padding};
use crate::kernels::cross_attention;
use crate::kernels::elementwise::{self as ew, binary, unary};
use crate::kernels::int_dot::IntActs;
use crate::kernels::kv_elem::elem_bytes;
use crate::kernels::panel_pack::Panels;
use crate::kernels::pooling::{segment_pool, Pool};
use crate::kernels::quantized::{self, QuantMatrix, QuantPath};
use crate::kernels::rope::RopeTable;
use crate::kernels::{experts, matmul, norm, rope, segments, softmax, Floats, Segment};

/// A backend context: worker pool, kernel path, and recycled scratch.
pub struct CpuContext {
    pub pool: ThreadPool,
    state: ExecState,
}

/// The mutable part of a context, used on the pool's threads during one compute.
pub struct ExecState {
    pub isa: Isa,
    pub threads: usize,
    /// int16 activations for 4/8-bit matmuls (`MLXCEL_CPU_INT16=0` turns them off).
    pub int_activations: bool,
    int_scratch: IntActs,
    attention_scratch: AttentionScratch,
    scratch: Vec<Vec<f32>>,
    /// Time per op kind (`MLXCEL_CPU_PROFILE=1`).
    profile: Option<OpProfile>,
    /// The last rope call's rotations (the next layer's q and k reuse them).
    rope_table: RopeTable,
}

impl CpuContext {
    pub fn new(threads: usize, isa: Isa) -> Result<CpuContext, String> {
        let pool = ThreadPool::new(threads)?;
        let int_activations = std::env::var("MLXCEL_CPU_INT16").map_or(true, |v| v != "0");
        let int_scratch = IntActs::default();
        Ok(CpuContext {
            pool,
            state: ExecState {
                isa,
                threads,
                int_activations,
                int_scratch,
                attention_scratch: AttentionScratch::default(),
                scratch: Vec::new(),
                profile: OpProfile::from_env(),
                rope_table: RopeTable::default(),
            },
        })
    }

    pub fn isa(&self) -> Isa {
        self.state.isa
    }
}

/// Which sequence each row of a node belongs to, when known: the step's tokens, or the rows a
/// `GetRows` node selected from them. Kernel paths are chosen per sequence from this.
#[derive(Clone, Copy, PartialEq, Eq)]
enum RowOwners {
    Tokens,
    Selected(usize),
    Unknown,
}

/// The step's sequence bookkeeping, when the caller gave a batch.
struct Sequences<'a> {
    token_seq: &'a [u32],
    seq_n_tokens: &'a [u32],
}

/// Executes `args.graph` on this thread, with the pool's workers spinning for the kernels' fan-outs
/// until it is done (no sleep and wake-up between ops; see `pool.rs`).
pub fn compute(ctx: &mut CpuContext, args: &ComputeArgs) -> Result<(), PluginError> {
    let state = &mut ctx.state;
    ctx.pool.install(|| compute_in_pool(state, args))
}

impl ExecState {
    /// A zeroed buffer of `n` values (recycled where one is big enough).
    fn take(&mut self, n: usize) -> Vec<f32> {
        let mut v = self.recycled(n);
        v.clear();
        v.resize(n, 0.0);
        v
    }

    /// A buffer of `n` values for an op that writes every one of them: recycled memory keeps what it
    /// held (never read), so a large output — an 8-sequence step's logits are 1.5 MB — is not
    /// cleared first.
    fn take_for_overwrite(&mut self, n: usize) -> Vec<f32> {
        let mut v = self.recycled(n);
        if v.len() >= n {
            v.truncate(n);
        } else {
            v.resize(n, 0.0);
        }
        v
    }

    /// The smallest recycled buffer with room for `n` values, or a new one.
    fn recycled(&mut self, n: usize) -> Vec<f32> {
        let best = self
            .scratch
            .iter()
            .enumerate()
            .filter(|(_, v)| v.capacity() >= n)
            .min_by_key(|(_, v)| v.capacity())
            .map(|(i, _)| i);
        match best {
            Some(i) => self.scratch.swap_remove(i),
            None => Vec::with_capacity(n),
        }
    }

    fn give(&mut self, v: Vec<f32>) {
        if self.scratch.len() < 64 {
            self.scratch.push(v);
        }
    }
}

enum Val<'a> {
    /// Not evaluated yet.
    Pending,
    Act(Vec<f32>),
    /// An `I32` constant, decoded (the constant blob has no alignment promise).
    Ints(Vec<i32>),
    Raw(&'a [u8], DType),
    Freed,
}

fn bad(i: usize, node: &Node, msg: impl std::fmt::Display) -> PluginError {
    let op = node.opcode().map_or_else(|| format!("op {}", node.op), |o| format!("{o:?}"));
    PluginError::invalid(format!("node {i} ({op}): {msg}"))
}

fn floats<'a>(v: &'a Val, what: &str) -> Result<Floats<'a>, String> {
    match v {
        Val::Act(a) => Ok(Floats::F32(a)),
        Val::Raw(b, DType::F32) => Ok(Floats::F32(as_f32(b))),
        Val::Raw(b, DType::F16) => Ok(Floats::F16(as_u16(b))),
        Val::Raw(b, DType::BF16) => Ok(Floats::BF16(as_u16(b))),
        Val::Raw(_, d) => Err(format!("{what} has dtype {}, expected a float", d.name())),
        Val::Ints(_) => Err(format!("{what} has dtype i32, expected a float")),
        Val::Freed => Err(format!("{what} was read after its last use")),
        Val::Pending => Err(format!("{what} was read before it was computed")),
    }
}

fn f32s<'a>(v: &'a Val, what: &str) -> Result<Cow<'a, [f32]>, String> {
    Ok(match floats(v, what)? {
        Floats::F32(s) => Cow::Borrowed(s),
        other => {
            let mut out = vec![0f32; other.len()];
            other.to_f32(0, &mut out);
            Cow::Owned(out)
        }
    })
}

fn ints<'a>(v: &'a Val, what: &str) -> Result<&'a [i32], String> {
    match v {
        Val::Raw(b, DType::I32) => Ok(as_i32(b)),
        Val::Ints(v) => Ok(v),
        _ => Err(format!("{what} must be i32")),
    }
}

fn words<'a>(v: &'a Val, what: &str) -> Result<&'a [u32], String> {
    match v {
        Val::Raw(b, DType::U32) => Ok(as_u32(b)),
        _ => Err(format!("{what} must be packed u32")),
    }
}

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
        _ => node.dtype() == DType::F32,
    }
}

/// A quantized matmul's group size as the int16 path's choice sees it: 0 where its scales and biases
/// are stored in different types, which the panel kernel does not read (so that its long steps keep
/// the float tiles rather than the portable per-row loop).
fn panel_group(node: &Node, nodes: &[Node]) -> usize {
    let first = if node.opcode() == Some(OpCode::GatherQuantMatMul) { 3 } else { 2 };
    let dtype = |i: usize| node.sources().get(i).and_then(|&s| nodes.get(s as usize)).map(|n| n.dtype());
    if dtype(first).is_some() && dtype(first) == dtype(first + 1) {
        node.iparams[1] as usize
    } else {
        0
    }
}

/// Builds the quantized view from `src[1..4]` (packed, scales, biases; `src[2..5]` for the gathered
/// matmul) for an op whose logical inner size is `k`, with its panel-ordered copy where `panels`
/// (the step's ISA and weights) asks for one and the panel kernel will read it.
fn quant_matrix<'a>(
    vals: &'a [Val<'a>],
    nodes: &'a [Node],
    node: &Node,
    k: usize,
    panels: Option<PanelRequest<'a>>,
) -> Result<(QuantMatrix<'a>, usize), String> {
    let (bits, group) = (node.iparams[0] as usize, node.iparams[1] as usize);
    if !matches!(bits, 2 | 3 | 4 | 5 | 6 | 8) || !matches!(group, 32 | 64 | 128) {
        return Err(format!("unsupported quantization bits={bits} group={group}"));
    }
    let first = if node.opcode() == Some(OpCode::GatherQuantMatMul) { 2 } else { 1 };
    let [p, sc, b] = match node.sources().get(first..first + 3) {
        Some(&[p, sc, b]) => [p as usize, sc as usize, b as usize],
        _ => return Err("needs packed weights, scales and biases".into()),
    };
    let (pn, sn, bn) = (&nodes[p], &nodes[sc], &nodes[b]);
    let n = pn.rows();
    if !k.is_multiple_of(group) || pn.cols() * 32 != k * bits {
        return Err(format!(
            "packed weight is [{n}, {}] u32 but {k} columns at {bits} bits need {} words per row",
            pn.cols(),
            k * bits / 32
        ));
    }
    if sn.rows() != n || sn.cols() != k / group || bn.rows() != n || bn.cols() != k / group {
        return Err(format!("scales/biases must be [{n}, {}]", k / group));
    }
    let mut q = QuantMatrix {
        packed: words(&vals[p], "packed weight")?,
        scales: floats(&vals[sc], "scales")?,
        biases: floats(&vals[b], "biases")?,
        bits,
        group,
        k,
        panels: None,
    };
    if let Some(request) = panels {
        q.panels = panels_of(request, &q, n, [pn, sn, bn]);
    }
    Ok((q, n))
}

/// What [`quant_matrix`] needs to find a matrix's panel-ordered copy: the step's ISA and weights,
/// and whether to build the copy where there is none yet.
#[derive(Clone, Copy)]
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))] // no panel kernel there
struct PanelRequest<'a> {
    isa: Isa,
    weights: &'a [BufferHandle],
    build: bool,
}

/// `q`'s panel-ordered copy for the panel kernel on the request's ISA, where that ISA runs the kernel
/// for `q` and its weights, scales and biases are whole weight tensors or row views of them that
/// start at a panel boundary (a fused `qkv_proj`'s parts). Built from the whole tensors by the first
/// step that asks (when the request may build), it then serves every reader of those tensors — the
/// panel kernel (every step size: see `int_path_applies`), embedding rows — so the row layout's
/// pages are read once and released ([`Buffer::derived_in_place_of_bytes`]).
#[cfg(target_arch = "x86_64")]
fn panels_of<'a>(
    PanelRequest { isa, weights, build }: PanelRequest<'a>,
    q: &QuantMatrix<'a>,
    n: usize,
    [packed, scales, biases]: [&Node; 3],
) -> Option<Panels<'a>> {
    use crate::kernels::int_dot::ActOrder;
    use crate::kernels::panel::applies;
    use crate::kernels::panel_pack::{PanelFactors, PanelWeights};

    // The kernel takes scales and biases of one type; an empty matrix needs no copy.
    let same_types = matches!(
        (q.scales, q.biases),
        (Floats::F16(_), Floats::F16(_)) | (Floats::BF16(_), Floats::BF16(_)) | (Floats::F32(_), Floats::F32(_))
    );
    if !applies(isa, q.bits, q.group, ActOrder::for_weights(isa, q.bits, q.group)) || !same_types || q.k == 0 || n == 0
    {
        return None;
    }
    // A weight node's buffer, the first row it reads and the rows its buffer holds.
    let source = |node: &Node| -> Option<(&'a Buffer, usize, usize)> {
        if node.opcode() != Some(OpCode::Weight) {
            return None;
        }
        let h = *weights.get(node.iparams[0] as usize)?;
        // SAFETY: weight handles are this backend's buffers, alive for the compute (as in `bind_source`).
        let buf = unsafe { (h as *const Buffer).as_ref() }?;
        Some(match node.iparams[2] {
            0 => (buf, 0, node.rows()),
            stored => (buf, usize::try_from(node.iparams[1]).ok()?, usize::try_from(stored).ok()?),
        })
    };
    let ((pb, first, rows), (sb, sf, sr), (bb, bf, br)) = (source(packed)?, source(scales)?, source(biases)?);
    if (sf, sr) != (first, rows) || (bf, br) != (first, rows) || !first.is_multiple_of(16) {
        return None;
    }
    // Build nothing (and release no pages) unless all three copies can be had.
    let free_or = |buf: &Buffer, has: bool| has || !buf.has_derived();
    let ready = free_or(pb, pb.derived_if_built::<PanelWeights>().is_some())
        && free_or(sb, sb.derived_if_built::<PanelFactors>().is_some())
        && free_or(bb, bb.derived_if_built::<PanelFactors>().is_some());
    if !ready {
        return None;
    }
    fn copy<T: std::any::Any + Send + Sync>(buf: &Buffer, build: Option<impl FnOnce(&[u8]) -> T>) -> Option<&T> {
        match build {
            Some(make) => buf.derived_in_place_of_bytes(make),
            None => buf.derived_if_built(),
        }
    }
    // Built from the whole tensors as their buffers hold them (`bind_source` checked their sizes),
    // in the types of `q`'s factors.
    fn floats_like<'b>(bytes: &'b [u8], like: Floats) -> Floats<'b> {
        match like {
            Floats::F32(_) => Floats::F32(as_f32(bytes)),
            Floats::F16(_) => Floats::F16(as_u16(bytes)),
            Floats::BF16(_) => Floats::BF16(as_u16(bytes)),
        }
    }
    let (k, groups, like_s, like_b) = (q.k, q.groups_per_row(), q.scales, q.biases);
    let words = |b: &[u8]| PanelWeights::new(as_u32(b), rows, k);
    let panels = Panels {
        weights: copy(pb, build.then_some(words))?,
        scales: copy(sb, build.then_some(|b: &[u8]| PanelFactors::new(floats_like(b, like_s), rows, groups)))?,
        biases: copy(bb, build.then_some(|b: &[u8]| PanelFactors::new(floats_like(b, like_b), rows, groups)))?,
        first,
    };
    panels.fit(q, n).then_some(panels)
}

/// No panel kernel off x86.
#[cfg(not(target_arch = "x86_64"))]
fn panels_of<'a>(_: PanelRequest<'a>, _: &QuantMatrix<'a>, _: usize, _: [&Node; 3]) -> Option<Panels<'a>> {
    None
}

/// The value of a source node (input, weight, constant): a view of the caller's memory, or the
/// constant decoded. Shared by the main loop and by matmul fusion, which binds a later matmul's
/// weights early.
fn bind_source<'a>(
    ctx: &mut ExecState,
    i: usize,
    node: &Node,
    inputs: &'a [HostTensor],
    weights: &'a [BufferHandle],
    constants: &'a [u8],
) -> Result<Val<'a>, PluginError> {
    let e = |m: String| bad(i, node, m);
    let expect_bytes = node.numel() * node.dtype().size();
    Ok(match node.opcode().unwrap() {
        OpCode::Input => {
            let slot = node.iparams[0] as usize;
            let t = inputs.get(slot).ok_or_else(|| e(format!("input slot {slot} not bound")))?;
            if t.len != expect_bytes {
                return Err(e(format!("input slot {slot} has {} bytes, expected {expect_bytes}", t.len)));
            }
            let bytes: &[u8] = if t.len == 0 { &[] } else { unsafe { std::slice::from_raw_parts(t.ptr, t.len) } };
            Val::Raw(bytes, node.dtype())
        }
        OpCode::Weight => {
            let idx = node.iparams[0] as usize;
            let h = *weights.get(idx).ok_or_else(|| e(format!("weight {idx} not bound")))?;
            let buf = unsafe { (h as *const Buffer).as_ref() }.ok_or_else(|| e(format!("weight {idx} is null")))?;
            let bytes = buf.bytes();
            let (first, stored_rows) = (node.iparams[1], node.iparams[2]);
            if stored_rows == 0 {
                if bytes.len() != expect_bytes {
                    return Err(e(format!("weight {idx} has {} bytes, expected {expect_bytes}", bytes.len())));
                }
                Val::Raw(bytes, node.dtype())
            } else {
                // A row-range view: rows first..first+rows of a [stored_rows, cols] tensor.
                let row_bytes = node.cols() * node.dtype().size();
                let rows = node.rows();
                if first < 0
                    || stored_rows < 0
                    || (first as usize).checked_add(rows).is_none_or(|end| end > stored_rows as usize)
                {
                    return Err(e(format!("rows {first}..+{rows} outside the weight's {stored_rows} rows")));
                }
                if (stored_rows as usize).checked_mul(row_bytes) != Some(bytes.len()) {
                    return Err(e(format!(
                        "weight {idx} has {} bytes, not {stored_rows} rows of {row_bytes}",
                        bytes.len()
                    )));
                }
                let start = first as usize * row_bytes;
                Val::Raw(&bytes[start..start + expect_bytes], node.dtype())
            }
        }
        OpCode::Constant => {
            let (off, len) = (node.iparams[0] as usize, node.iparams[1] as usize);
            if off.checked_add(len).is_none_or(|end| end > constants.len()) || len != expect_bytes {
                return Err(e("constant out of the graph's constant blob".into()));
            }
            let words = constants[off..off + len].chunks_exact(4).map(|c| [c[0], c[1], c[2], c[3]]);
            if node.dtype() == DType::I32 {
                Val::Ints(words.map(i32::from_le_bytes).collect())
            } else {
                let mut v = ctx.take(len / 4);
                for (d, w) in v.iter_mut().zip(words) {
                    *d = f32::from_le_bytes(w);
                }
                Val::Act(v)
            }
        }
        _ => return Err(e("not a source node".into())),
    })
}

/// Recycles the storage of `node`'s sources whose last reader it is.
fn free_last_uses(ctx: &mut ExecState, vals: &mut [Val], last_use: &[usize], node: usize, src: &[u32]) {
    for &s in src {
        if last_use[s as usize] == node {
            if let Val::Act(v) = std::mem::replace(&mut vals[s as usize], Val::Freed) {
                ctx.give(v);
            }
        }
    }
}

/// Checks the host's bookkeeping before any memory is touched: every token's sequence, position and
/// slot in range, and every block it will read (those inside its window) held and in range.
fn validate_layout(
    layout: &PagedLayout,
    n_seqs: usize,
    slots: usize,
    num_blocks: usize,
    window: usize,
) -> Result<(), String> {
    for ti in 0..layout.token_seq.len() {
        let s = layout.token_seq[ti] as usize;
        let p = layout.positions[ti];
        let slot = layout.slot_mapping[ti];
        if s >= n_seqs || p < 0 || slot < 0 || slot as usize >= slots {
            return Err(format!("token {ti}: bad sequence/position/slot"));
        }
        let p = p as usize;
        let last = p / layout.block_size;
        if last >= layout.max_blocks_per_seq {
            return Err(format!("token {ti}: position {p} beyond its block table"));
        }
        let first = if window > 0 { (p + 1).saturating_sub(window) / layout.block_size } else { 0 };
        for b in first..=last {
            let id = layout.block_tables[s * layout.max_blocks_per_seq + b];
            if id == NO_BLOCK || id as usize >= num_blocks {
                return Err(format!("sequence {s}: block {b} (needed by position {p}) is not held or out of range"));
            }
        }
    }
    Ok(())
}

/// The sequence of each row of a node whose rows are owned as `owner` says, when known.
fn row_sequences<'s>(
    owner: RowOwners,
    seqs: &'s Option<Sequences>,
    selected: &'s [Option<Vec<u32>>],
) -> Option<&'s [u32]> {
    match (owner, seqs) {
        (RowOwners::Tokens, Some(s)) => Some(s.token_seq),
        (RowOwners::Selected(g), Some(_)) => selected[g].as_deref(),
        _ => None,
    }
}

/// The ends of the runs of equal entries of `row_seq` (each sequence's rows), ascending.
fn sequence_ends(row_seq: &[u32]) -> Vec<usize> {
    let mut ends: Vec<usize> = (1..row_seq.len()).filter(|&r| row_seq[r] != row_seq[r - 1]).collect();
    ends.push(row_seq.len());
    ends
}

/// `ends` restricted to rows `r0..r1` and counted from `r0` (the last is `r1 - r0`); empty if `ends` is.
fn ends_within(ends: &[usize], r0: usize, r1: usize) -> Vec<usize> {
    if ends.is_empty() {
        return Vec::new();
    }
    let mut v: Vec<usize> = ends.iter().filter(|&&e| e > r0 && e < r1).map(|&e| e - r0).collect();
    v.push(r1 - r0);
    v
}

/// Splits runs of the gemm-tiles path at sequence ends: gemm's result for a row depends on how many
/// rows it multiplies at once, and a sequence's own row count does not depend on its batch-mates.
fn split_tiles_runs(runs: Vec<(usize, usize, QuantPath)>, ends: &[usize]) -> Vec<(usize, usize, QuantPath)> {
    let mut out = Vec::with_capacity(runs.len());
    for (r0, r1, path) in runs {
        if path != QuantPath::Tiles {
            out.push((r0, r1, path));
            continue;
        }
        let mut start = r0;
        for &e in ends.iter().filter(|&&e| e > r0 && e < r1) {
            out.push((start, e, path));
            start = e;
        }
        out.push((start, r1, path));
    }
    out
}

/// Splits rows `0..row_seq.len()` into maximal runs that take the same kernel path.
fn path_runs(row_seq: &[u32], path_of: impl Fn(u32) -> QuantPath) -> Vec<(usize, usize, QuantPath)> {
    let mut runs: Vec<(usize, usize, QuantPath)> = Vec::new();
    for (r, &q) in row_seq.iter().enumerate() {
        let p = path_of(q);
        match runs.last_mut() {
            Some(last) if last.2 == p => last.1 = r + 1,
            _ => runs.push((r, r + 1, p)),
        }
    }
    if runs.is_empty() {
        runs.push((0, 0, QuantPath::RowDot));
    }
    runs
}

/// Up to this many matmuls of one input run as one parallel loop (q/k/v; gate/up).
const MAX_FUSED: usize = 4;

/// The matmuls after `i` that read the same input with the same quantization, take the int16 path,
/// and follow it with only source nodes in between (q/k/v, gate/up): they can run together. Binds
/// the weights they need that come after `i`. Returns how many were found.
#[allow(clippy::too_many_arguments)]
fn fusable_after<'a>(
    ctx: &mut ExecState,
    nodes: &[Node],
    i: usize,
    vals: &mut [Val<'a>],
    inputs: &'a [HostTensor],
    weights: &'a [BufferHandle],
    constants: &'a [u8],
    found: &mut [usize; MAX_FUSED - 1],
) -> Result<usize, PluginError> {
    let node = &nodes[i];
    if node.sources().len() != 4 {
        return Ok(0); // malformed: the op's own checks report it
    }
    let x = node.sources()[0] as usize;
    let t = nodes[x].rows();
    let (bits, group) = (node.iparams[0] as usize, panel_group(node, nodes));
    if !quantized::int_path_applies(ctx.isa, bits, group, t, ctx.int_activations) {
        return Ok(0);
    }
    // A later matmul's weights must already exist or be source nodes that can be bound now.
    let bindable = |s: u32| {
        let s = s as usize;
        s < i || matches!(nodes[s].opcode(), Some(OpCode::Input | OpCode::Weight | OpCode::Constant))
    };
    let mut n = 0;
    let mut j = i + 1;
    while j < nodes.len() && n < found.len() {
        let nj = &nodes[j];
        match nj.opcode() {
            Some(OpCode::Input | OpCode::Weight | OpCode::Constant) => {}
            Some(OpCode::QuantMatMul)
                if nj.sources().len() == 4
                    && nj.sources()[0] as usize == x
                    && nj.iparams[..2] == node.iparams[..2]
                    && nj.rows() == t
                    && nj.sources()[1..].iter().all(|&s| bindable(s)) =>
            {
                found[n] = j;
                n += 1;
            }
            _ => break,
        }
        j += 1;
    }
    for &m in &found[..n] {
        for &s in &nodes[m].sources()[1..] {
            let s = s as usize;
            if matches!(vals[s], Val::Pending) {
                vals[s] = bind_source(ctx, s, &nodes[s], inputs, weights, constants)?;
            }
        }
    }
    Ok(n)
}

/// Attention parameters from a node's heads and its score scale / soft-cap (`fparams[0..2]`).
fn attention_shape(hq: usize, hkv: usize, dh: usize, node: &Node) -> AttentionShape {
    AttentionShape {
        n_heads: hq,
        n_kv_heads: hkv,
        head_dim: dh,
        window: 0,
        scale: node.fparams[0],
        softcap: node.fparams[1],
    }
}

/// Layer `layer`'s recurrent-state buffer as f32.
fn state_buffer<'a>(kv: &[KvBinding], layer: usize) -> Result<&'a mut [f32], String> {
    let b = kv.get(layer).ok_or_else(|| format!("state layer {layer} not bound"))?;
    // SAFETY: a handle the host bound for this layer, alive for the call; only this op touches it now.
    let buf = unsafe { (b.state as *mut Buffer).as_mut() }.ok_or_else(|| format!("layer {layer} has no state"))?;
    let bytes = buf.bytes_mut().ok_or_else(|| "state must be an allocated buffer".to_string())?;
    Ok(crate::buffer::as_f32_mut(bytes))
}

/// The state row of each segment's sequence (`StepBatch::seq_state_slots`), checked to fit a buffer of
/// `len` f32 in rows of `row_elems`.
fn state_rows(batch: Option<&StepBatch>, segs: &[Segment], row_elems: usize, len: usize) -> Result<Vec<usize>, String> {
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

fn compute_in_pool(ctx: &mut ExecState, args: &ComputeArgs) -> Result<(), PluginError> {
    let setup_start = Instant::now();
    // Quantized activations are keyed by node id, which only means something within one graph run.
    ctx.int_scratch.key = None;
    // SAFETY (this block): the host guarantees every pointer of `args` for the sizes it states.
    let nodes = unsafe { args.graph.nodes() };
    let nodes: &[Node] = &nodes;
    let constants = unsafe { args.graph.constants() };
    let outputs = unsafe { args.graph.outputs() };
    let inputs = unsafe { slice_from(args.inputs, args.n_inputs) };
    let weights = unsafe { slice_from(args.weights, args.n_weights) };
    let kv: Vec<KvBinding> = unsafe { read_versioned_array(args.kv, args.n_kv) };
    let outs = unsafe { slice_from(args.outputs, args.n_outputs) };
    let batch: Option<StepBatch> = unsafe { read_versioned(args.batch) };
    let groups: Vec<KvGroupTables> =
        batch.as_ref().map_or_else(Vec::new, |b| unsafe { read_versioned_array(b.groups, b.n_groups as usize) });
    let seqs = batch.as_ref().map(|b| unsafe {
        Sequences {
            token_seq: slice_from(b.token_seq, b.n_tokens as usize),
            seq_n_tokens: slice_from(b.seq_n_tokens, b.n_seqs as usize),
        }
    });
    if let Some(s) = &seqs {
        if s.token_seq.iter().any(|&q| q as usize >= s.seq_n_tokens.len()) {
            return Err(PluginError::invalid("a token's sequence index is out of range".to_string()));
        }
    }
    if outs.len() != outputs.len() {
        return Err(PluginError::invalid(format!(
            "graph has {} outputs but {} destinations were given",
            outputs.len(),
            outs.len()
        )));
    }

    // Last reader of each node, so storage is recycled early.
    let mut last_use = vec![0usize; nodes.len()];
    let n_tokens = batch.as_ref().map_or(usize::MAX, |b| b.n_tokens as usize);
    let mut owners = vec![RowOwners::Unknown; nodes.len()];
    for (i, n) in nodes.iter().enumerate() {
        owners[i] = match (n.opcode(), n.sources().first()) {
            (Some(OpCode::GetRows), Some(&x)) if (x as usize) < i && owners[x as usize] == RowOwners::Tokens => {
                RowOwners::Selected(i)
            }
            // Rows that are no longer one per token, whatever their count.
            (Some(OpCode::SegmentPool | OpCode::StoreCrossKv), _) => RowOwners::Unknown,
            (Some(OpCode::Conv1d), _) if n.iparams[1] != 1 => RowOwners::Unknown,
            (Some(op), Some(&x))
                if !matches!(op, OpCode::GetRows) && (x as usize) < i && nodes[x as usize].rows() == n.rows() =>
            {
                owners[x as usize]
            }
            _ if n.rows() == n_tokens && !matches!(n.opcode(), Some(OpCode::Weight | OpCode::Constant)) => {
                RowOwners::Tokens
            }
            _ => RowOwners::Unknown,
        };
        if n.opcode().is_none() {
            return Err(PluginError::invalid(format!("node {i}: unknown op code {}", n.op)));
        }
        if !supports(n) {
            return Err(bad(i, n, format!("not supported by the cpu backend (dtype {})", n.dtype().name())));
        }
        for &s in n.sources() {
            if s as usize >= i {
                return Err(bad(i, n, format!("source {s} is not an earlier node")));
            }
            last_use[s as usize] = i;
        }
    }
    for &o in outputs {
        if o as usize >= nodes.len() {
            return Err(PluginError::invalid(format!("output {o} is not a node")));
        }
        last_use[o as usize] = usize::MAX;
    }

    let isa = ctx.isa;
    let threads = ctx.threads;
    let mut vals: Vec<Val> = (0..nodes.len()).map(|_| Val::Pending).collect();
    if let Some(p) = &mut ctx.profile {
        p.run();
        p.setup(setup_start);
    }
    // The sequence of each row a `GetRows` node selected, kept for the kernels that read its rows.
    let mut selected: Vec<Option<Vec<u32>>> = vec![None; nodes.len()];
    for (i, node) in nodes.iter().enumerate() {
        let op = node.opcode().unwrap();
        let src = node.sources();
        let e = |m: String| bad(i, node, m);
        if !matches!(vals[i], Val::Pending) {
            // Computed ahead of its turn (a source bound early, or a fused matmul).
            free_last_uses(ctx, &mut vals, &last_use, i, src);
            continue;
        }
        let op_start = ctx.profile.is_some().then(Instant::now);
        // Matmuls after this one that share its input run with it (results stored below).
        let mut fused_ids = [0usize; MAX_FUSED - 1];
        // Kernel paths for a matmul's rows, chosen per sequence (batch invariance).
        let (bits, group) = (node.iparams[0] as usize, panel_group(node, nodes));
        let int_enabled = ctx.int_activations;
        let path = move |n: usize| {
            if matches!(op, OpCode::MatMul | OpCode::GatherMatMul) {
                if n <= matmul::ROW_DOT_MAX_TOKENS {
                    QuantPath::RowDot
                } else {
                    QuantPath::Tiles
                }
            } else {
                QuantPath::for_sequence(isa, bits, group, n, int_enabled)
            }
        };
        // And where each sequence's rows end (kernels that group rows never group across them).
        let (paths, seq_ends) = if matches!(op, OpCode::QuantMatMul | OpCode::MatMul) && !src.is_empty() {
            let x = src[0] as usize;
            let t = nodes[x].rows();
            match (row_sequences(owners[x], &seqs, &selected), &seqs) {
                (Some(rs), Some(s)) if rs.len() == t => {
                    let ends = sequence_ends(rs);
                    (split_tiles_runs(path_runs(rs, |q| path(s.seq_n_tokens[q as usize] as usize)), &ends), ends)
                }
                _ => (vec![(0, t, path(t))], Vec::new()),
            }
        } else {
            (Vec::new(), Vec::new())
        };
        // Expert matmuls: each token's sequence (its indices row), when known.
        let token_seq: &[u32] = if matches!(op, OpCode::GatherMatMul | OpCode::GatherQuantMatMul) && src.len() >= 2 {
            let ix = src[1] as usize;
            match row_sequences(owners[ix], &seqs, &selected) {
                Some(rs) if rs.len() == nodes[ix].rows() => rs,
                _ => &[],
            }
        } else {
            &[]
        };
        let n_fused = if op == OpCode::QuantMatMul && paths.len() == 1 && paths[0].2 == QuantPath::Int {
            fusable_after(ctx, nodes, i, &mut vals, inputs, weights, constants, &mut fused_ids)?
        } else {
            0
        };
        let mut fused: [(usize, Vec<f32>); MAX_FUSED - 1] = Default::default();
        let val = match op {
            OpCode::Input | OpCode::Weight | OpCode::Constant => bind_source(ctx, i, node, inputs, weights, constants)?,
            _ => {
                // Quantized matmuls write every value of their output (each path covers all rows).
                let mut out = if op == OpCode::QuantMatMul {
                    ctx.take_for_overwrite(node.numel())
                } else {
                    ctx.take(node.numel())
                };
                let v = |j: usize| &vals[src[j] as usize];
                let sn = |j: usize| &nodes[src[j] as usize];
                // The sources' nodes, for the shared op specs.
                let src_nodes: [&Node; MAX_SRC] =
                    std::array::from_fn(|j| &nodes[src.get(j).map_or(0, |&s| s as usize)]);
                let srcs = &src_nodes[..src.len()];
                let need = |n: usize| -> Result<(), PluginError> {
                    if src.len() < n {
                        Err(bad(i, node, format!("needs {n} sources, has {}", src.len())))
                    } else {
                        Ok(())
                    }
                };
                match op {
                    OpCode::Embedding | OpCode::QuantEmbedding => {
                        let ids = ints(v(0), "ids").map_err(e)?;
                        let d = node.cols();
                        if node.numel() != ids.len() * d {
                            return Err(e("output must be [n_ids, dim]".into()));
                        }
                        if op == OpCode::Embedding {
                            need(2)?;
                            let table = floats(v(1), "table").map_err(e)?;
                            let vocab = sn(1).rows();
                            if sn(1).cols() != d {
                                return Err(e(format!("table has {} columns, output {d}", sn(1).cols())));
                            }
                            for (t, &id) in ids.iter().enumerate() {
                                if id < 0 || id as usize >= vocab {
                                    return Err(e(format!("token id {id} out of range for vocabulary {vocab}")));
                                }
                                table.to_f32(id as usize * d, &mut out[t * d..(t + 1) * d]);
                            }
                        } else {
                            need(4)?;
                            // Rows from the panel-ordered copy where the matrix has one (a tied lm_head's).
                            let panels = PanelRequest { isa, weights, build: false };
                            let (q, vocab) = quant_matrix(&vals, nodes, node, d, Some(panels)).map_err(e)?;
                            if let Some(&id) = ids.iter().find(|&&id| id < 0 || id as usize >= vocab) {
                                return Err(e(format!("token id {id} out of range for vocabulary {vocab}")));
                            }
                            quantized::qembedding(isa, ids, q, &mut out);
                        }
                    }
                    OpCode::MatMul | OpCode::QuantMatMul => {
                        need(if op == OpCode::MatMul { 2 } else { 4 })?;
                        let x = f32s(v(0), "x").map_err(e)?;
                        let (t, k) = (sn(0).rows(), sn(0).cols());
                        let n = node.cols();
                        if node.rows() != t {
                            return Err(e(format!("output has {} rows, x has {t}", node.rows())));
                        }
                        if op == OpCode::MatMul {
                            let w = floats(v(1), "w").map_err(e)?;
                            if sn(1).cols() != k || sn(1).rows() != n {
                                return Err(e(format!(
                                    "w is [{}, {}], expected [{n}, {k}]",
                                    sn(1).rows(),
                                    sn(1).cols()
                                )));
                            }
                            for &(r0, r1, path) in &paths {
                                let (xr, or) = (&x[r0 * k..r1 * k], &mut out[r0 * n..r1 * n]);
                                matmul::matmul(isa, threads, xr, r1 - r0, k, w, n, or, path == QuantPath::RowDot);
                            }
                        } else {
                            // With integer activations on, every path reads the panel-ordered copy where
                            // the ISA has one (the panel kernel, which then takes steps of every
                            // size), so the row layout's pages are read once, to build it; the exact
                            // f32 paths (`MLXCEL_CPU_INT16=0`) read the row layout.
                            let panels = int_enabled.then_some(PanelRequest { isa, weights, build: true });
                            let (q, rows) = quant_matrix(&vals, nodes, node, k, panels).map_err(e)?;
                            if rows != n {
                                return Err(e(format!("packed weight has {rows} rows, output {n} columns")));
                            }
                            if n_fused > 0 {
                                for (f, &m) in fused.iter_mut().zip(&fused_ids[..n_fused]) {
                                    *f = (m, ctx.take_for_overwrite(nodes[m].numel()));
                                }
                                let mut parts: [Option<quantized::QuantPart>; MAX_FUSED] = Default::default();
                                parts[0] = Some(quantized::QuantPart { w: q, n, out: &mut out });
                                for (slot, (m, buf)) in parts[1..].iter_mut().zip(fused.iter_mut().take(n_fused)) {
                                    let nm = &nodes[*m];
                                    let (qm, rows) =
                                        quant_matrix(&vals, nodes, nm, k, panels).map_err(|msg| bad(*m, nm, msg))?;
                                    if rows != nm.cols() || qm.k != k {
                                        return Err(bad(
                                            *m,
                                            nm,
                                            format!("packed weight has {rows} rows, output {} columns", nm.cols()),
                                        ));
                                    }
                                    *slot = Some(quantized::QuantPart { w: qm, n: rows, out: buf });
                                }
                                quantized::qmatmul_shared_input(
                                    isa,
                                    &x,
                                    src[0] as usize,
                                    t,
                                    &seq_ends,
                                    parts.into_iter().flatten(),
                                    &mut ctx.int_scratch,
                                );
                            } else {
                                for &(r0, r1, path) in &paths {
                                    // Each run quantizes its own rows: forget activations of another run.
                                    if paths.len() > 1 {
                                        ctx.int_scratch.key = None;
                                    }
                                    let int = ctx.int_activations.then_some((&mut ctx.int_scratch, src[0] as usize));
                                    let (xr, or) = (&x[r0 * k..r1 * k], &mut out[r0 * n..r1 * n]);
                                    let segs = ends_within(&seq_ends, r0, r1);
                                    quantized::qmatmul(isa, threads, xr, r1 - r0, q, n, or, path, int, &segs);
                                }
                            }
                        }
                    }
                    OpCode::GetRows => {
                        need(2)?;
                        let x = f32s(v(0), "x").map_err(e)?;
                        let rows = ints(v(1), "rows").map_err(e)?;
                        let (r, c) = (sn(0).rows(), sn(0).cols());
                        if node.numel() != rows.len() * c {
                            return Err(e("output must be [n_rows, cols]".into()));
                        }
                        for (j, &row) in rows.iter().enumerate() {
                            if row < 0 || row as usize >= r {
                                return Err(e(format!("row {row} out of range for {r} rows")));
                            }
                            out[j * c..(j + 1) * c].copy_from_slice(&x[row as usize * c..(row as usize + 1) * c]);
                        }
                        if let (RowOwners::Selected(_), Some(s)) = (owners[i], &seqs) {
                            selected[i] = Some(rows.iter().map(|&r| s.token_seq[r as usize]).collect());
                        }
                    }
                    OpCode::Add | OpCode::Mul | OpCode::SiluMul | OpCode::GeluTanhMul => {
                        need(2)?;
                        let a = f32s(v(0), "a").map_err(e)?;
                        let b = f32s(v(1), "b").map_err(e)?;
                        let ok = a.len() == node.numel()
                            && (b.len() == a.len()
                                || (op != OpCode::SiluMul && op != OpCode::GeluTanhMul && b.len() == node.cols()));
                        if !ok {
                            return Err(e(format!("cannot combine {} and {} elements", a.len(), b.len())));
                        }
                        let f = match op {
                            OpCode::Add => ew::Binary::Add,
                            OpCode::Mul => ew::Binary::Mul,
                            OpCode::SiluMul => ew::Binary::SiluMul,
                            _ => ew::Binary::GeluTanhMul,
                        };
                        binary(isa, f, &a, &b, &mut out);
                    }
                    OpCode::Scale
                    | OpCode::Silu
                    | OpCode::Gelu
                    | OpCode::GeluTanh
                    | OpCode::Relu
                    | OpCode::Softcap
                    | OpCode::Sigmoid => {
                        need(1)?;
                        let x = f32s(v(0), "x").map_err(e)?;
                        if x.len() != node.numel() {
                            return Err(e("output must have the input's shape".into()));
                        }
                        let p = node.fparams[0];
                        if op == OpCode::Softcap && p <= 0.0 {
                            return Err(e("soft-cap must be positive".into()));
                        }
                        match op {
                            OpCode::Scale => unary(&x, &mut out, |a| a * p),
                            OpCode::Silu => unary(&x, &mut out, ew::silu),
                            OpCode::Gelu => unary(&x, &mut out, ew::gelu_erf),
                            OpCode::GeluTanh => unary(&x, &mut out, ew::gelu_tanh),
                            OpCode::Relu => unary(&x, &mut out, |a| a.max(0.0)),
                            OpCode::Sigmoid => unary(&x, &mut out, ew::sigmoid),
                            _ => unary(&x, &mut out, |a| p * (a / p).tanh()),
                        };
                    }
                    OpCode::RmsNorm | OpCode::LayerNorm => {
                        need(if op == OpCode::RmsNorm { 2 } else { 3 })?;
                        let x = f32s(v(0), "x").map_err(e)?;
                        let w = floats(v(1), "weight").map_err(e)?;
                        let c = sn(0).cols();
                        if w.is_empty() || c % w.len() != 0 || x.len() != node.numel() {
                            return Err(e(format!("weight of {} does not divide {c} columns", w.len())));
                        }
                        let eps = node.fparams[0];
                        if op == OpCode::RmsNorm {
                            let unit = node.iparams[0] == 1;
                            norm::rms_norm(isa, &x, w, eps, unit, &mut out);
                        } else {
                            let b = floats(v(2), "bias").map_err(e)?;
                            if w.len() != c || b.len() != c {
                                return Err(e("layer norm weight and bias must span the columns".into()));
                            }
                            norm::layer_norm(&x, w, b, eps, &mut out);
                        }
                    }
                    OpCode::Rope => {
                        need(3)?;
                        let x = f32s(v(0), "x").map_err(e)?;
                        let pos = ints(v(1), "positions").map_err(e)?;
                        let inv = f32s(v(2), "inv_freq").map_err(e)?;
                        let (hd, rot) = (node.iparams[0] as usize, node.iparams[1] as usize);
                        let c = sn(0).cols();
                        if hd == 0 || c % hd != 0 || rot > hd || rot % 2 != 0 || sn(2).cols() != rot / 2 {
                            return Err(e(format!(
                                "bad rope shape: cols {c}, head_dim {hd}, rotary {rot}, {} frequencies",
                                sn(2).cols()
                            )));
                        }
                        let rows = sn(0).rows();
                        if pos.len() != rows {
                            return Err(e("one position per row required".into()));
                        }
                        let trad = node.iparams[2] == 1;
                        let ms = if node.fparams[0] == 0.0 { 1.0 } else { node.fparams[0] };
                        if sn(2).rows() == 1 {
                            rope::rope(isa, &mut ctx.rope_table, &x, pos, &inv, hd, rot, trad, ms, &mut out);
                        } else if sn(2).rows() == rows {
                            // Frequencies per row (per-sequence scaling such as dynamic NTK).
                            let f = rot / 2;
                            for r in 0..rows {
                                let (xr, or) = (&x[r * c..(r + 1) * c], &mut out[r * c..(r + 1) * c]);
                                let inv_r = &inv[r * f..(r + 1) * f];
                                rope::rope(isa, &mut ctx.rope_table, xr, &pos[r..r + 1], inv_r, hd, rot, trad, ms, or);
                            }
                        } else {
                            return Err(e(format!("inv_freq must have 1 or {rows} rows, has {}", sn(2).rows())));
                        }
                    }
                    OpCode::Attention => {
                        need(3)?;
                        let batch = batch.as_ref().ok_or_else(|| e("no step batch given".into()))?;
                        let t = batch.n_tokens as usize;
                        let spec = AttentionSpec::decode(node, srcs, t).map_err(e)?;
                        let (layer, window) = (spec.layer, spec.window);
                        let Heads { hq, hkv, dh } = spec.heads;
                        let q = f32s(v(0), "q").map_err(e)?;
                        let kx = f32s(v(1), "k").map_err(e)?;
                        let vx = f32s(v(2), "v").map_err(e)?;
                        let binding = kv.get(layer).ok_or_else(|| e(format!("KV cache layer {layer} not bound")))?;
                        let (k_type, v_type) = (binding.key_dtype(), binding.value_dtype());
                        let (Some(k_bytes), Some(v_bytes)) = (elem_bytes(k_type), elem_bytes(v_type)) else {
                            return Err(e(format!(
                                "the cpu backend keeps KV caches in f32, f16 or bf16, not {}/{}",
                                k_type.name(),
                                v_type.name()
                            )));
                        };
                        let group = groups
                            .get(binding.group as usize)
                            .ok_or_else(|| e(format!("layer {layer}: KV group {} not given", binding.group)))?;
                        if group.block_size == 0 {
                            return Err(e("block size 0".into()));
                        }
                        // SAFETY: the host guarantees the batch's arrays for the sizes it states.
                        let layout = unsafe {
                            PagedLayout {
                                token_seq: slice_from(batch.token_seq, t),
                                positions: slice_from(batch.positions, t),
                                slot_mapping: slice_from(group.slot_mapping, t),
                                block_tables: slice_from(
                                    group.block_tables,
                                    batch.n_seqs as usize * group.max_blocks_per_seq as usize,
                                ),
                                max_blocks_per_seq: group.max_blocks_per_seq as usize,
                                block_size: group.block_size as usize,
                            }
                        };
                        let kv_row = hkv * dh;
                        let slots = group.num_blocks as usize * group.block_size as usize;
                        if binding.k == binding.v {
                            // Two mutable views of one buffer: refused, not aliased.
                            return Err(e(format!("KV cache layer {layer}: K and V are bound to the same buffer")));
                        }
                        // SAFETY: two distinct handles the host bound for this layer; used by this thread only.
                        let (kb, vb) =
                            unsafe { ((binding.k as *mut Buffer).as_mut(), (binding.v as *mut Buffer).as_mut()) };
                        let (Some(kb), Some(vb)) = (kb, vb) else { return Err(e("null KV buffer".into())) };
                        let kc = kb.bytes_mut().ok_or_else(|| e("KV cache must be an allocated buffer".into()))?;
                        let vc = vb.bytes_mut().ok_or_else(|| e("KV cache must be an allocated buffer".into()))?;
                        if kc.len() < slots * kv_row * k_bytes || vc.len() < slots * kv_row * v_bytes {
                            return Err(e(format!("KV cache layer {layer} is smaller than {slots} slots")));
                        }
                        validate_layout(&layout, batch.n_seqs as usize, slots, group.num_blocks as usize, window)
                            .map_err(e)?;
                        let shape = AttentionShape {
                            n_heads: hq,
                            n_kv_heads: hkv,
                            head_dim: dh,
                            window,
                            scale: node.fparams[0],
                            softcap: node.fparams[1],
                        };
                        let step = CachedStep { isa, layout: &layout, shape, q: &q, k: &kx, v: &vx };
                        let scratch = &mut ctx.attention_scratch;
                        match (k_type, v_type) {
                            (DType::F32, DType::F32) => step.run::<f32, f32>(kc, vc, &mut out, scratch),
                            (DType::F16, DType::F16) => step.run::<f16, f16>(kc, vc, &mut out, scratch),
                            (DType::BF16, DType::BF16) => step.run::<bf16, bf16>(kc, vc, &mut out, scratch),
                            (DType::F16, DType::F32) => step.run::<f16, f32>(kc, vc, &mut out, scratch),
                            (DType::F32, DType::F16) => step.run::<f32, f16>(kc, vc, &mut out, scratch),
                            (DType::BF16, DType::F32) => step.run::<bf16, f32>(kc, vc, &mut out, scratch),
                            (DType::F32, DType::BF16) => step.run::<f32, bf16>(kc, vc, &mut out, scratch),
                            (DType::F16, DType::BF16) => step.run::<f16, bf16>(kc, vc, &mut out, scratch),
                            (DType::BF16, DType::F16) => step.run::<bf16, f16>(kc, vc, &mut out, scratch),
                            _ => unreachable!("elem_bytes admitted only f32, f16 and bf16"),
                        }
                    }
                    OpCode::Slice => {
                        need(1)?;
                        let x = f32s(v(0), "x").map_err(e)?;
                        let (c, c0, c1) = (sn(0).cols(), node.iparams[0], node.iparams[1]);
                        if c0 < 0 || c1 <= c0 || c1 as usize > c {
                            return Err(e(format!("column range {c0}..{c1} outside 0..{c}")));
                        }
                        let (c0, w) = (c0 as usize, (c1 - c0) as usize);
                        if node.cols() != w || node.rows() != sn(0).rows() {
                            return Err(e(format!("output must be [{}, {w}]", sn(0).rows())));
                        }
                        pool::zip_chunks(&mut out, w, &x, c, |_, o, xr| o.copy_from_slice(&xr[c0..c0 + w]));
                    }
                    OpCode::Softmax | OpCode::L2Normalize => {
                        need(1)?;
                        let x = f32s(v(0), "x").map_err(e)?;
                        let c = sn(0).cols();
                        if x.len() != node.numel() || node.cols() != c {
                            return Err(e("output must have the input's shape".into()));
                        }
                        if op == OpCode::Softmax {
                            let d = if node.iparams[0] == 0 { c } else { node.iparams[0].max(0) as usize };
                            if d == 0 || c % d != 0 {
                                return Err(e(format!("group width {d} does not divide {c} columns")));
                            }
                            softmax::softmax(isa, &x, d, &mut out);
                        } else {
                            let eps = if node.fparams[0] > 0.0 { node.fparams[0] } else { 1e-12 };
                            norm::l2_normalize(&x, c, eps, &mut out);
                        }
                    }
                    OpCode::SegmentPool => {
                        need(2)?;
                        let x = f32s(v(0), "x").map_err(e)?;
                        let seq = ints(v(1), "seq").map_err(e)?;
                        let (t, c, n) = (sn(0).rows(), sn(0).cols(), node.rows());
                        if seq.len() != t || node.cols() != c {
                            return Err(e(format!("x [{t}, {c}] with {} sequence indices", seq.len())));
                        }
                        if let Some(&s) = seq.iter().find(|&&s| s < 0 || s as usize >= n) {
                            return Err(e(format!("sequence index {s} out of range for {n} output rows")));
                        }
                        let pool = match node.iparams[0] {
                            POOL_MEAN => Pool::Mean,
                            POOL_FIRST => Pool::First,
                            POOL_LAST => Pool::Last,
                            p => return Err(e(format!("unknown pooling {p}"))),
                        };
                        segment_pool(&x, c, seq, pool, &mut out);
                    }
                    OpCode::StepAttention => {
                        need(4)?;
                        let spec = StepAttentionSpec::decode(node, srcs).map_err(e)?;
                        let (Heads { hq, hkv, dh }, t) = (spec.heads, spec.t);
                        let q = f32s(v(0), "q").map_err(e)?;
                        let kx = f32s(v(1), "k").map_err(e)?;
                        let vx = f32s(v(2), "v").map_err(e)?;
                        let seq = ints(v(3), "seq").map_err(e)?;
                        let segs = segments(seq, t).map_err(e)?;
                        let mask = Mask { causal: node.iparams[3] == 1, window: node.iparams[4].max(0) as usize };
                        let shape = attention_shape(hq, hkv, dh, node);
                        attention_step::step_attention(isa, shape, mask, &segs, &q, &kx, &vx, &mut out);
                    }
                    OpCode::StoreCrossKv => {
                        need(3)?;
                        let layer = node.iparams[0] as usize;
                        let (hkv, dh, max_len) =
                            (node.iparams[1] as usize, node.iparams[2] as usize, node.iparams[3] as usize);
                        let kv_row = hkv * dh;
                        let kx = f32s(v(0), "k").map_err(e)?;
                        let vx = f32s(v(1), "v").map_err(e)?;
                        let seq = ints(v(2), "seq").map_err(e)?;
                        if kv_row == 0 || kx.len() != seq.len() * kv_row || vx.len() != kx.len() {
                            return Err(e(format!("k/v must be [{}, {hkv} x {dh}]", seq.len())));
                        }
                        let n_seqs = batch.as_ref().map_or(0, |b| b.n_seqs as usize);
                        let segs = segments(seq, n_seqs).map_err(e)?;
                        if let Some(s) = segs.iter().find(|s| s.len() > max_len) {
                            return Err(e(format!("sequence {} has {} rows, more than {max_len}", s.seq, s.len())));
                        }
                        let re = cross_attention::row_elems(max_len, kv_row);
                        let state = state_buffer(&kv, layer).map_err(e)?;
                        let rows = state_rows(batch.as_ref(), &segs, re, state.len()).map_err(e)?;
                        cross_attention::store(&kx, &vx, kv_row, &segs, &rows, max_len, state);
                    }
                    OpCode::CrossAttention => {
                        need(2)?;
                        let spec = CrossAttentionSpec::decode(node, srcs).map_err(e)?;
                        let (layer, max_len) = (spec.layer, spec.max_len);
                        let Heads { hq, hkv, dh } = spec.heads;
                        let q = f32s(v(0), "q").map_err(e)?;
                        let seq = ints(v(1), "seq").map_err(e)?;
                        let n_seqs = batch.as_ref().map_or(0, |b| b.n_seqs as usize);
                        let segs = segments(seq, n_seqs).map_err(e)?;
                        let kv_row = hkv * dh;
                        let re = cross_attention::row_elems(max_len, kv_row);
                        let state = state_buffer(&kv, layer).map_err(e)?;
                        let rows = state_rows(batch.as_ref(), &segs, re, state.len()).map_err(e)?;
                        let lens: Vec<usize> =
                            rows.iter().map(|&r| cross_attention::stored_len(state, r, max_len, kv_row)).collect();
                        if let Some(&n) = lens.iter().find(|&&n| n > max_len) {
                            return Err(e(format!(
                                "state holds {n} rows, more than {max_len}: not a StoreCrossKv row"
                            )));
                        }
                        let shape = attention_shape(hq, hkv, dh, node);
                        cross_attention::cross_attention(isa, shape, &segs, &rows, &lens, max_len, &q, state, &mut out);
                    }
                    OpCode::Conv1d => {
                        need(3)?;
                        let spec = Conv1dSpec::decode(node, srcs).map_err(e)?;
                        let Conv1dSpec { t, c_in, c_out, kernel, stride, pad, groups, causal, .. } = spec;
                        let x = f32s(v(0), "x").map_err(e)?;
                        let mut w = f32s(v(1), "w").map_err(e)?;
                        let seq = ints(v(2), "seq").map_err(e)?;
                        if spec.torch_layout {
                            // PyTorch's [C_out, C_in/g, K] to the kernel's [C_out, K, C_in/g]: a copy of the
                            // (small) weight per run, so checkpoint weights still bind without one.
                            w = Cow::Owned(conv1d::torch_to_mlx_layout(&w, c_out, c_in / groups, kernel));
                        }
                        let bias = if spec.has_bias { f32s(v(3), "bias").map_err(e)? } else { Cow::Borrowed(&[][..]) };
                        if seq.len() != t || (spec.has_bias && bias.len() != c_out) {
                            return Err(e(format!("{} sequence indices, {} bias values", seq.len(), bias.len())));
                        }
                        let sh = ConvShape { c_in, c_out, kernel, stride, groups };
                        let n_seqs = if causal { batch.as_ref().map_or(0, |b| b.n_seqs as usize) } else { t };
                        let segs = segments(seq, n_seqs).map_err(e)?;
                        let rows;
                        let padding = if causal {
                            let state = state_buffer(&kv, spec.state_layer).map_err(e)?;
                            rows = state_rows(batch.as_ref(), &segs, spec.carried(), state.len()).map_err(e)?;
                            Padding::Carried { state, rows: &rows }
                        } else {
                            Padding::Zeros(pad)
                        };
                        let n_out: usize = padding.out_rows(&sh, &segs).iter().sum();
                        if n_out != node.rows() {
                            return Err(e(format!("output has {} rows, the sequences give {n_out}", node.rows())));
                        }
                        let mut padded = ctx.take(0);
                        conv1d::conv1d_segments(isa, threads, sh, &x, &segs, padding, &w, &bias, &mut out, &mut padded);
                        ctx.give(padded);
                    }
                    OpCode::TopK => {
                        need(1)?;
                        let spec = TopKSpec::decode(node, sn(0)).map_err(e)?;
                        let x = f32s(v(0), "x").map_err(e)?;
                        let p = experts::TopK {
                            k: spec.k,
                            indices: spec.indices,
                            softmax: spec.softmax,
                            renormalize: spec.renormalize,
                        };
                        let cols = spec.cols;
                        experts::top_k(isa, &x, cols, p, &mut out);
                    }
                    OpCode::GatherMatMul | OpCode::GatherQuantMatMul => {
                        need(if op == OpCode::GatherMatMul { 3 } else { 5 })?;
                        let GatherSpec { t, k, kdim, n, x_per_token } =
                            GatherSpec::decode(node, sn(0), sn(1)).map_err(e)?;
                        let x = f32s(v(0), "x").map_err(e)?;
                        let indices = f32s(v(1), "indices").map_err(e)?;
                        if op == OpCode::GatherMatMul {
                            // Consecutive experts from iparams[0]: stacks [E_i, N, K] or single [N, K].
                            let mut experts_w: Vec<Floats> = Vec::new();
                            for j in 2..src.len() {
                                let w = floats(v(j), "expert weight").map_err(e)?;
                                let d = sn(j).dims();
                                let (count, rows, cols) = match *d {
                                    [count, rows, cols] => (count as usize, rows as usize, cols as usize),
                                    [rows, cols] => (1, rows as usize, cols as usize),
                                    _ => return Err(e(format!("expert weight {j} has shape {d:?}"))),
                                };
                                if rows != n || cols != kdim {
                                    return Err(e(format!("expert weight {j} is {d:?}, expected [·, {n}, {kdim}]")));
                                }
                                experts_w.extend((0..count).map(|c| w.slice(c * n * kdim, n * kdim)));
                            }
                            let first = node.iparams[0].max(0) as usize;
                            let total =
                                if node.iparams[1] > 0 { node.iparams[1] as usize } else { first + experts_w.len() };
                            let r = experts::Routing {
                                indices: &indices,
                                k,
                                x_per_token,
                                tokens: t,
                                token_seq,
                                path_for: &path,
                                first_expert: first,
                                held: experts_w.len(),
                                total,
                            };
                            experts::gather_matmul(isa, threads, &x, kdim, &r, &experts_w, n, &mut out).map_err(e)?;
                        } else {
                            let (q, rows) = quant_matrix(&vals, nodes, node, kdim, None).map_err(e)?;
                            let n_experts = sn(2).dims().first().copied().unwrap_or(0) as usize;
                            if sn(2).dims().len() != 3 || rows != n_experts * n {
                                return Err(e(format!(
                                    "packed experts are {:?}, expected [E, {n}, {}]",
                                    sn(2).dims(),
                                    kdim * bits / 32
                                )));
                            }
                            let r = experts::Routing {
                                indices: &indices,
                                k,
                                x_per_token,
                                tokens: t,
                                token_seq,
                                path_for: &path,
                                first_expert: 0,
                                held: n_experts,
                                total: n_experts,
                            };
                            experts::gather_qmatmul(isa, threads, &x, &r, q, n, &mut out, &mut ctx.int_scratch)
                                .map_err(e)?;
                        }
                    }
                    OpCode::WeightedSum => {
                        need(2)?;
                        let WeightedSumSpec { k, n, .. } = WeightedSumSpec::decode(node, sn(0), sn(1)).map_err(e)?;
                        let y = f32s(v(0), "y").map_err(e)?;
                        let w = f32s(v(1), "weights").map_err(e)?;
                        experts::weighted_sum(&y, &w, k, n, &mut out);
                    }
                    OpCode::Input | OpCode::Weight | OpCode::Constant => unreachable!(),
                }
                Val::Act(out)
            }
        };
        vals[i] = val;
        for (m, result) in fused.iter_mut().take(n_fused) {
            vals[*m] = Val::Act(std::mem::take(result));
        }
        free_last_uses(ctx, &mut vals, &last_use, i, src);
        if let (Some(p), Some(start)) = (&mut ctx.profile, op_start) {
            p.op(op, start);
        }
    }
    let copy_start = Instant::now();

    for (o, dst) in outputs.iter().zip(outs) {
        let v = f32s(&vals[*o as usize], "output").map_err(PluginError::invalid)?;
        if dst.len != v.len() * 4 {
            return Err(PluginError::invalid(format!(
                "output node {o} has {} f32 values but the destination holds {} bytes",
                v.len(),
                dst.len
            )));
        }
        unsafe { std::ptr::copy_nonoverlapping(v.as_ptr() as *const u8, dst.ptr, dst.len) };
    }
    for v in vals {
        if let Val::Act(v) = v {
            ctx.give(v);
        }
    }
    if let Some(p) = &mut ctx.profile {
        p.setup(copy_start);
    }
    Ok(())
}
