//! Pooling each sequence's rows into one (sentence embeddings): mean, first row (CLS) or last row.

/// How [`segment_pool`] reduces a sequence's rows.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Pool {
    Mean,
    First,
    Last,
}

/// `out[s, :]` from the rows `t` of `x [T, C]` with `seq[t] == s` (zeros for a sequence with none).
/// Every `seq[t]` must be in `0..out.len() / c` (the caller checked).
pub fn segment_pool(x: &[f32], c: usize, seq: &[i32], pool: Pool, out: &mut [f32]) {
    out.fill(0.0);
    let n = out.len() / c;
    match pool {
        Pool::Mean => {
            let mut count = vec![0usize; n];
            for (t, &s) in seq.iter().enumerate() {
                let s = s as usize;
                count[s] += 1;
                for (o, &v) in out[s * c..(s + 1) * c].iter_mut().zip(&x[t * c..(t + 1) * c]) {
                    *o += v;
                }
            }
            for (row, &k) in out.chunks_exact_mut(c).zip(&count) {
                if k > 0 {
                    let inv = 1.0 / k as f32;
                    row.iter_mut().for_each(|v| *v *= inv);
                }
            }
        }
        Pool::First | Pool::Last => {
            let mut pick = vec![usize::MAX; n];
            for (t, &s) in seq.iter().enumerate() {
                let p = &mut pick[s as usize];
                if pool == Pool::Last || *p == usize::MAX {
                    *p = t;
                }
            }
            for (row, &t) in out.chunks_exact_mut(c).zip(&pick) {
                if t != usize::MAX {
                    row.copy_from_slice(&x[t * c..(t + 1) * c]);
                }
            }
        }
    }
}
