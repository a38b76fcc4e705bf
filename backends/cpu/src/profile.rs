//! `MLXCEL_CPU_PROFILE=1`: wall time per op kind, summed over a context's graph runs and written to
//! stderr when the context is dropped (the end of a `run`, or a server's shutdown) — where a step's
//! time goes, without a profiler. A fused matmul's partners count under the first; the graph's
//! checks and the outputs' copy count as `(setup)`.

use std::time::{Duration, Instant};

use mlxcel_plugin_api::OpCode;

/// Rows of the table: one per op code, and the setup.
const SLOTS: usize = 64;
const SETUP: usize = SLOTS - 1;

pub struct OpProfile {
    totals: Box<[(Duration, u64); SLOTS]>,
    names: Box<[Option<String>; SLOTS]>,
    runs: u64,
}

impl OpProfile {
    /// A profile when `MLXCEL_CPU_PROFILE` is set (to anything but `0`).
    pub fn from_env() -> Option<OpProfile> {
        std::env::var("MLXCEL_CPU_PROFILE").is_ok_and(|v| v != "0").then(|| OpProfile {
            totals: Box::new([(Duration::ZERO, 0); SLOTS]),
            names: Box::new(std::array::from_fn(|_| None)),
            runs: 0,
        })
    }

    /// Counts one node of `op` that took since `start`.
    pub fn op(&mut self, op: OpCode, start: Instant) {
        let slot = (op as usize).min(SETUP - 1);
        self.names[slot].get_or_insert_with(|| format!("{op:?}"));
        self.add(slot, start);
    }

    /// Counts graph setup (checks, bookkeeping, the outputs' copy) since `start`.
    pub fn setup(&mut self, start: Instant) {
        self.names[SETUP].get_or_insert_with(|| "(setup)".to_string());
        self.add(SETUP, start);
    }

    /// Counts one graph run.
    pub fn run(&mut self) {
        self.runs += 1;
    }

    fn add(&mut self, slot: usize, start: Instant) {
        let (t, n) = &mut self.totals[slot];
        *t += start.elapsed();
        *n += 1;
    }
}

impl Drop for OpProfile {
    fn drop(&mut self) {
        let total: Duration = self.totals.iter().map(|(t, _)| *t).sum();
        if self.runs == 0 || total.is_zero() {
            return;
        }
        let mut rows: Vec<(usize, &(Duration, u64))> =
            self.totals.iter().enumerate().filter(|(_, (_, n))| *n > 0).collect();
        rows.sort_by_key(|(_, (t, _))| std::cmp::Reverse(*t));
        let mut s = format!("cpu op profile: {} graph runs, {:.1} ms in all\n", self.runs, total.as_secs_f64() * 1e3);
        s += &format!("  {:<20} {:>10} {:>7} {:>12} {:>10}\n", "op", "ms", "%", "ms per run", "calls");
        for (slot, (t, n)) in rows {
            let name = self.names[slot].as_deref().unwrap_or("?");
            s += &format!(
                "  {:<20} {:>10.1} {:>6.1}% {:>12.3} {:>10}\n",
                name,
                t.as_secs_f64() * 1e3,
                100.0 * t.as_secs_f64() / total.as_secs_f64(),
                t.as_secs_f64() * 1e3 / self.runs as f64,
                n
            );
        }
        eprint!("{s}");
    }
}
