//! Cross-attention over an encoder output stored once per sequence (Whisper's decoder): the encoder
//! step stores each sequence's K/V rows in its state row, every later decoder step attends to them
//! through the prefill tile kernel, all stored rows visible.
//!
//! State row (f32): [`CROSS_KV_HEADER`] elements (element 0 = stored length as `u32` bits), then
//! `max_len` rows of K `[Hkv*Dh]` followed by V `[Hkv*Dh]`.

use crate::pool;
use mlxcel_plugin_api::CROSS_KV_HEADER;

use super::attention::AttentionShape;
use super::attention_prefill::{attend_tile_scratch, tile_tokens, Run, TileKeys};
use super::{Segment, SharedMut};
use crate::isa::Isa;

const HEADER: usize = CROSS_KV_HEADER as usize;

/// f32 elements of one state row.
pub fn row_elems(max_len: usize, kv_row: usize) -> usize {
    HEADER + max_len * 2 * kv_row
}

/// Writes each segment's K/V rows (`[S, kv_row]`) into its state row (`row_of(seq)`, in rows of
/// [`row_elems`]) and sets its stored length. The caller checked lengths and rows against `state`.
pub fn store(
    k: &[f32],
    v: &[f32],
    kv_row: usize,
    segs: &[Segment],
    row_of: &[usize],
    max_len: usize,
    state: &mut [f32],
) {
    let re = row_elems(max_len, kv_row);
    for (seg, &row) in segs.iter().zip(row_of) {
        let base = row * re;
        state[base] = f32::from_bits(seg.len() as u32);
        for (p, t) in (seg.start..seg.end).enumerate() {
            let dst = base + HEADER + p * 2 * kv_row;
            state[dst..dst + kv_row].copy_from_slice(&k[t * kv_row..(t + 1) * kv_row]);
            state[dst + kv_row..dst + 2 * kv_row].copy_from_slice(&v[t * kv_row..(t + 1) * kv_row]);
        }
    }
}

/// The stored length of state row `row`.
pub fn stored_len(state: &[f32], row: usize, max_len: usize, kv_row: usize) -> usize {
    state[row * row_elems(max_len, kv_row)].to_bits() as usize
}

/// `out[t, h*Dh..]` = attention of token `t` over the rows stored for its segment's sequence:
/// `rows[i]` is the state row of `segs[i]` and `lens[i]` its stored length (checked ≤ `max_len`).
#[allow(clippy::too_many_arguments)]
pub fn cross_attention(
    isa: Isa,
    shape: AttentionShape,
    segs: &[Segment],
    rows: &[usize],
    lens: &[usize],
    max_len: usize,
    q: &[f32],
    state: &[f32],
    out: &mut [f32],
) {
    let kv_row = shape.n_kv_heads * shape.head_dim;
    let per_tile = tile_tokens(shape);
    let re = row_elems(max_len, kv_row);
    let mut tasks: Vec<(Run, usize, usize, usize)> = Vec::new(); // tile, KV head, state row, length
    for ((seg, &row), &len) in segs.iter().zip(rows).zip(lens) {
        let mut t0 = seg.start;
        while t0 < seg.end {
            let tile = Run { start: t0, end: (t0 + per_tile).min(seg.end) };
            tasks.extend((0..shape.n_kv_heads).map(|h| (tile, h, row, len)));
            t0 = tile.end;
        }
    }
    tasks.sort_by_key(|t| std::cmp::Reverse(t.3));
    let out = SharedMut(out.as_mut_ptr());
    pool::for_each(tasks.len(), |task| {
        let (tile, kvh, row, len) = tasks[task];
        let base = row * re + HEADER;
        let keys = TileKeys {
            k: &state[base..row * re + re],
            v: &state[base + kv_row..row * re + re],
            row: |p: usize| p * 2 * kv_row,
            visible: |_| (0, len),
        };
        // SAFETY: keys `0..len ≤ max_len` lie inside the state row; each task writes only its tile's rows
        // of its KV head's query heads.
        unsafe { attend_tile_scratch(isa, shape, tile, kvh, q, &keys, out) }
    });
}
