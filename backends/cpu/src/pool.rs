//! The kernels' fork/join: a pool whose workers spin between the ops of a step instead of sleeping.
//!
//! A decode step is hundreds of short parallel ops (a few µs to a few hundred µs each). A general
//! work-stealing pool parks an idle worker after a few dozen yields and wakes it with a futex for
//! the next op: a cross-core interrupt, which under a hypervisor costs tens of µs — on a 2-vCPU cloud
//! host that made 2 threads decode slower than 1. Here the workers spin on an atomic word for as long
//! as a step runs ([`ThreadPool::install`]), so an op reaches them in well under a µs, and park on a condvar
//! between steps, so an idle server burns nothing. (llama.cpp's thread pool spins for the same
//! reason.)
//!
//! Kernels call the free functions ([`for_each`], [`for_each_init`], [`chunks_mut`], [`zip_chunks`]):
//! inside `install` they fan out over the pool, elsewhere (unit tests, a nested call from inside a
//! task) they run on the calling thread. Each task is one index, claimed by a compare-and-swap on a
//! word that holds the job's epoch and the next index, so a worker still looking at a finished job
//! can never claim a task of the next one; results do not depend on which thread ran a task.

use std::cell::{Cell, UnsafeCell};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;

/// A job as the workers see it: the task body, type-erased for the duration of one fan-out.
type TaskFn<'a> = dyn Fn(usize) + Sync + 'a;

struct Shared {
    /// `epoch << 32 | next task index`: publishing a job starts a new epoch at index 0.
    state: AtomicU64,
    /// `epoch << 32 | task count` of the current job, and its body (valid while its epoch's tasks are
    /// unfinished). The count carries its epoch so that a worker holding a stale `state` of the job
    /// before never compares its index with the next job's count: it could claim a task past the old
    /// job's end, run the old (dead) body and count it done for the new one.
    n_tasks: AtomicU64,
    job: AtomicU64Pair,
    /// Tasks of the current job that have finished (the caller waits for all of them).
    done: AtomicUsize,
    /// A task of the current job panicked: its payload, re-raised by the caller once the job is over.
    panicked: AtomicBool,
    payload: Mutex<Option<Box<dyn std::any::Any + Send>>>,
    /// Workers spin while set (a step is running), park while clear.
    spinning: AtomicBool,
    stop: AtomicBool,
    park: Mutex<()>,
    wake: Condvar,
}

/// A fat pointer stored as two words, so workers can read it without a lock; it is only
/// dereferenced after a task of its epoch was claimed (see the module comment).
struct AtomicU64Pair(AtomicUsize, AtomicUsize);

impl AtomicU64Pair {
    fn store(&self, f: &TaskFn) {
        // SAFETY: a `&dyn` is two words (data, vtable); it is rebuilt only while the job is alive.
        let [a, b]: [usize; 2] = unsafe { std::mem::transmute(f as *const TaskFn) };
        self.0.store(a, Ordering::Relaxed);
        self.1.store(b, Ordering::Relaxed);
    }

    /// # Safety
    /// The job stored last must still be alive (a task of its epoch is claimed and unfinished).
    unsafe fn load<'a>(&self) -> &'a TaskFn<'a> {
        let words = [self.0.load(Ordering::Relaxed), self.1.load(Ordering::Relaxed)];
        &*std::mem::transmute::<[usize; 2], *const TaskFn<'a>>(words)
    }
}

/// The kernels' thread pool: `threads - 1` workers plus the thread that calls [`ThreadPool::install`].
pub struct ThreadPool {
    shared: Arc<Shared>,
    threads: usize,
    workers: Vec<JoinHandle<()>>,
    /// Held for the length of an `install`: the pool runs one job at a time, so a second thread
    /// installing waits its turn instead of overwriting the first one's job.
    turn: Mutex<()>,
}

thread_local! {
    /// The pool of the `install` this thread is in, and this thread's participant number in it.
    static CURRENT: Cell<Option<(*const Shared, usize, usize)>> = const { Cell::new(None) };
    /// This thread is running a task (a nested fan-out runs inline).
    static IN_TASK: Cell<bool> = const { Cell::new(false) };
    /// The pools whose turn this thread holds (`install`s in progress on it, outermost first).
    static HELD: std::cell::RefCell<Vec<*const Shared>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// Spins before a waiting thread starts yielding its core between checks (a `pause` takes 10 to 140
/// cycles by CPU, so tens of µs to a few ms): a step's serial stretches are shorter, a machine with
/// more runnable threads than cores gets the core back.
const SPINS_BEFORE_YIELD: u32 = 1 << 16;

impl ThreadPool {
    pub fn new(threads: usize) -> Result<ThreadPool, String> {
        let threads = threads.max(1);
        let shared = Arc::new(Shared {
            state: AtomicU64::new(0),
            n_tasks: AtomicU64::new(0),
            job: AtomicU64Pair(AtomicUsize::new(0), AtomicUsize::new(0)),
            done: AtomicUsize::new(0),
            panicked: AtomicBool::new(false),
            payload: Mutex::new(None),
            spinning: AtomicBool::new(false),
            stop: AtomicBool::new(false),
            park: Mutex::new(()),
            wake: Condvar::new(),
        });
        let mut workers = Vec::with_capacity(threads - 1);
        for id in 1..threads {
            let s = Arc::clone(&shared);
            let handle = std::thread::Builder::new()
                .name(format!("mlxcel-cpu-{id}"))
                .spawn(move || worker(&s, id, threads))
                .map_err(|e| format!("cannot start {threads} worker threads: {e}"))?;
            workers.push(handle);
        }
        Ok(ThreadPool { shared, threads, workers, turn: Mutex::new(()) })
    }

    /// Runs `f` on this thread with the pool's workers spinning, ready for the kernels' fan-outs.
    pub fn install<R>(&self, f: impl FnOnce() -> R) -> R {
        struct Reset<'a>(&'a Shared, Option<(*const Shared, usize, usize)>);
        impl Drop for Reset<'_> {
            fn drop(&mut self) {
                self.0.spinning.store(false, Ordering::Release);
                CURRENT.with(|c| c.set(self.1));
                HELD.with_borrow_mut(|h| h.retain(|&p| !std::ptr::eq(p, self.0)));
            }
        }
        let sh = &*self.shared;
        // Already taking part in this pool (an `install` inside an `install`, maybe through another
        // pool's, or inside a task): the outer one keeps the workers and runs this one's fan-outs.
        let current = CURRENT.with(|c| c.get()).is_some_and(|(p, _, _)| std::ptr::eq(p, sh));
        if current || HELD.with_borrow(|h| h.iter().any(|&p| std::ptr::eq(p, sh))) {
            return f();
        }
        let _turn = self.turn.lock().unwrap_or_else(|p| p.into_inner());
        {
            let _lock = sh.park.lock().unwrap_or_else(|p| p.into_inner());
            sh.spinning.store(true, Ordering::Release);
        }
        sh.wake.notify_all();
        HELD.with_borrow_mut(|h| h.push(sh as *const Shared));
        let previous = CURRENT.with(|c| c.replace(Some((sh as *const Shared, 0, self.threads))));
        // Declared after `_turn`, so dropped before it: the workers stop spinning before the next
        // caller's turn can set them spinning again.
        let _reset = Reset(sh, previous);
        f()
    }
}

impl Drop for ThreadPool {
    fn drop(&mut self) {
        {
            let _lock = self.shared.park.lock().unwrap_or_else(|p| p.into_inner());
            self.shared.stop.store(true, Ordering::Release);
        }
        self.shared.wake.notify_all();
        for w in self.workers.drain(..) {
            let _ = w.join();
        }
    }
}

fn worker(sh: &Shared, id: usize, threads: usize) {
    CURRENT.with(|c| c.set(Some((sh as *const Shared, id, threads))));
    let mut seen_epoch = 0u64;
    loop {
        // Wait for a new epoch: spin while a step runs, park otherwise.
        let mut spins = 0u32;
        loop {
            if sh.stop.load(Ordering::Acquire) {
                return;
            }
            let epoch = sh.state.load(Ordering::Acquire) >> 32;
            if epoch != seen_epoch {
                seen_epoch = epoch;
                break;
            }
            if sh.spinning.load(Ordering::Acquire) {
                if spins < SPINS_BEFORE_YIELD {
                    spins += 1;
                    std::hint::spin_loop();
                } else {
                    std::thread::yield_now();
                }
            } else {
                let lock = sh.park.lock().unwrap_or_else(|p| p.into_inner());
                if !sh.spinning.load(Ordering::Acquire) && !sh.stop.load(Ordering::Acquire) {
                    drop(sh.wake.wait(lock).unwrap_or_else(|p| p.into_inner()));
                }
                spins = 0;
            }
        }
        run_tasks(sh, seen_epoch);
    }
}

/// Claims and runs tasks of `epoch` until none is left.
fn run_tasks(sh: &Shared, epoch: u64) {
    loop {
        let state = sh.state.load(Ordering::Acquire);
        if state >> 32 != epoch {
            return;
        }
        let index = state & 0xffff_ffff;
        let n_tasks = sh.n_tasks.load(Ordering::Acquire);
        if n_tasks >> 32 != epoch || index >= n_tasks & 0xffff_ffff {
            return;
        }
        let index = index as usize;
        if sh.state.compare_exchange_weak(state, state + 1, Ordering::AcqRel, Ordering::Acquire).is_err() {
            continue;
        }
        // SAFETY: task `index` of this epoch is claimed and not finished, so the caller is still
        // waiting in `fan_out` and its job is alive; `job` was published before the epoch.
        let job = unsafe { sh.job.load() };
        IN_TASK.with(|t| t.set(true));
        let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| job(index)));
        IN_TASK.with(|t| t.set(false));
        if let Err(payload) = result {
            sh.payload.lock().unwrap_or_else(|p| p.into_inner()).get_or_insert(payload);
            sh.panicked.store(true, Ordering::Release);
        }
        sh.done.fetch_add(1, Ordering::AcqRel);
    }
}

/// Runs `f(0..n)` over the current pool (this thread takes part), or inline outside one.
fn fan_out(n: usize, f: &TaskFn) {
    let current = CURRENT.with(|c| c.get());
    let nested = IN_TASK.with(|t| t.get());
    let Some((shared, _, threads)) = current.filter(|_| n > 1 && !nested) else {
        (0..n).for_each(f);
        return;
    };
    if threads <= 1 {
        (0..n).for_each(f);
        return;
    }
    // SAFETY: `CURRENT` is set only inside `ThreadPool::install` (or on the pool's own workers, which
    // never fan out: they are always `IN_TASK` when running kernels), so the pool outlives this call.
    let sh = unsafe { &*shared };
    assert!(n < u32::MAX as usize, "too many tasks for one fan-out");
    sh.done.store(0, Ordering::Relaxed);
    sh.panicked.store(false, Ordering::Relaxed);
    let epoch = ((sh.state.load(Ordering::Relaxed) >> 32) + 1) & 0xffff_ffff;
    sh.n_tasks.store(epoch << 32 | n as u64, Ordering::Relaxed);
    sh.job.store(f);
    sh.state.store(epoch << 32, Ordering::Release);
    run_tasks(sh, epoch);
    let mut spins = 0u32;
    while sh.done.load(Ordering::Acquire) < n {
        if spins < SPINS_BEFORE_YIELD {
            spins += 1;
            std::hint::spin_loop();
        } else {
            std::thread::yield_now();
        }
    }
    if sh.panicked.load(Ordering::Acquire) {
        let payload = sh.payload.lock().unwrap_or_else(|p| p.into_inner()).take();
        std::panic::resume_unwind(payload.unwrap_or_else(|| Box::new("a CPU kernel task panicked")));
    }
}

/// Threads the current pool runs tasks on (1 outside one).
pub fn threads() -> usize {
    CURRENT.with(|c| c.get()).map_or(1, |(_, _, t)| t)
}

/// `f(i)` for every `i` in `0..n`, in parallel.
pub fn for_each(n: usize, f: impl Fn(usize) + Sync) {
    fan_out(n, &f);
}

/// This thread's place in a fan-out: 0 for the caller (and for any thread outside a pool), `j` for
/// the pool's worker `j`.
pub fn participant() -> usize {
    CURRENT.with(|c| c.get()).map_or(0, |(_, id, _)| id)
}

/// [`for_each`] with a state per participating thread, made by `init` the first time that thread
/// runs a task (scratch buffers reused across a thread's tasks).
pub fn for_each_init<S: Send>(n: usize, init: impl Fn() -> S + Sync, f: impl Fn(&mut S, usize) + Sync) {
    let threads = threads();
    let slots: Vec<Slot<S>> = (0..threads).map(|_| Slot(UnsafeCell::new(None))).collect();
    fan_out(n, &|i| {
        // The caller is participant 0, worker `j` participant `j`; an inline run is one thread.
        let me = participant();
        // SAFETY: participant `me` runs its tasks one after another, so only it touches slot `me`.
        let slot = unsafe { &mut *slots[me.min(threads - 1)].0.get() };
        f(slot.get_or_insert_with(&init), i)
    });
}

struct Slot<S>(UnsafeCell<Option<S>>);
// SAFETY: each slot is used by one participant at a time (see `for_each_init`).
unsafe impl<S: Send> Sync for Slot<S> {}

/// A slice cut into `size`-long chunks (the last may be shorter) that the tasks of one fan-out
/// share, each task taking only its own chunk.
struct Chunks<T> {
    base: *mut T,
    len: usize,
    size: usize,
}
// SAFETY: tasks touch disjoint chunks (each helper below hands task `i` only chunk `i`).
unsafe impl<T: Send> Sync for Chunks<T> {}

impl<T> Chunks<T> {
    fn new(out: &mut [T], size: usize) -> Chunks<T> {
        assert!(size > 0, "chunk size must be positive");
        Chunks { base: out.as_mut_ptr(), len: out.len(), size }
    }

    fn count(&self) -> usize {
        self.len.div_ceil(self.size)
    }

    /// # Safety
    /// `i < self.count()`, the slice outlives the fan-out, and only task `i` takes chunk `i`.
    #[allow(clippy::mut_from_ref)]
    unsafe fn chunk(&self, i: usize) -> &mut [T] {
        let start = i * self.size;
        std::slice::from_raw_parts_mut(self.base.add(start), self.size.min(self.len - start))
    }
}

/// The `i`-th `size`-long chunk of `input` (the last may be shorter).
fn in_chunk<U>(input: &[U], size: usize, i: usize) -> &[U] {
    &input[i * size..((i + 1) * size).min(input.len())]
}

/// `f(i, chunk)` for each `size`-long chunk of `out` (the last may be shorter), in parallel.
pub fn chunks_mut<T: Send>(out: &mut [T], size: usize, f: impl Fn(usize, &mut [T]) + Sync) {
    let chunks = Chunks::new(out, size);
    // SAFETY: task `i` takes chunk `i` of `out`, borrowed for the whole fan-out.
    for_each(chunks.count(), |i| f(i, unsafe { chunks.chunk(i) }));
}

/// `f(i, out_chunk, in_chunk)` for the `i`-th `out_size` chunk of `out` beside the `i`-th `in_size`
/// chunk of `input`, for as many chunks as both have (as zipping two chunk iterators).
pub fn zip_chunks<T: Send, U: Sync>(
    out: &mut [T],
    out_size: usize,
    input: &[U],
    in_size: usize,
    f: impl Fn(usize, &mut [T], &[U]) + Sync,
) {
    assert!(in_size > 0, "chunk size must be positive");
    let chunks = Chunks::new(out, out_size);
    let n = chunks.count().min(input.len().div_ceil(in_size));
    // SAFETY: as in `chunks_mut`.
    for_each(n, |i| f(i, unsafe { chunks.chunk(i) }, in_chunk(input, in_size, i)));
}

/// [`zip_chunks`] with a state per participating thread, as [`for_each_init`].
pub fn zip_chunks_init<T: Send, U: Sync, S: Send>(
    out: &mut [T],
    out_size: usize,
    input: &[U],
    in_size: usize,
    init: impl Fn() -> S + Sync,
    f: impl Fn(&mut S, &mut [T], &[U]) + Sync,
) {
    assert!(in_size > 0, "chunk size must be positive");
    let chunks = Chunks::new(out, out_size);
    let n = chunks.count().min(input.len().div_ceil(in_size));
    // SAFETY: as in `chunks_mut`.
    for_each_init(n, init, |state, i| f(state, unsafe { chunks.chunk(i) }, in_chunk(input, in_size, i)));
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicUsize;

    #[test]
    fn every_task_runs_once_on_the_pool_and_inline() {
        let pool = ThreadPool::new(3).unwrap();
        for n in [0, 1, 2, 7, 1000] {
            let hits: Vec<AtomicUsize> = (0..n).map(|_| AtomicUsize::new(0)).collect();
            pool.install(|| {
                for _ in 0..50 {
                    for_each(n, |i| {
                        hits[i].fetch_add(1, Ordering::Relaxed);
                    });
                }
            });
            for_each(n, |i| {
                hits[i].fetch_add(1, Ordering::Relaxed);
            });
            assert!(hits.iter().all(|h| h.load(Ordering::Relaxed) == 51), "n = {n}");
        }
    }

    #[test]
    fn chunks_cover_the_slice_and_nested_fan_outs_run_inline() {
        let pool = ThreadPool::new(2).unwrap();
        let mut out = vec![0usize; 103];
        let input: Vec<usize> = (0..103).collect();
        pool.install(|| {
            zip_chunks(&mut out, 10, &input, 10, |i, o, x| {
                assert_eq!(x[0], i * 10);
                // A fan-out from inside a task runs on this thread.
                chunks_mut(o, 3, |_, c| c.iter_mut().for_each(|v| *v += 1));
                for (v, x) in o.iter_mut().zip(x) {
                    *v += x;
                }
            })
        });
        assert_eq!(out, (1..104).collect::<Vec<_>>());
    }

    #[test]
    fn state_per_thread_is_made_once_per_participant() {
        let pool = ThreadPool::new(2).unwrap();
        let made = AtomicUsize::new(0);
        let sum = AtomicUsize::new(0);
        pool.install(|| {
            for_each_init(
                500,
                || {
                    made.fetch_add(1, Ordering::Relaxed);
                    0usize
                },
                |s, i| {
                    *s += 1;
                    sum.fetch_add(i, Ordering::Relaxed);
                },
            )
        });
        assert!((1..=2).contains(&made.load(Ordering::Relaxed)));
        assert_eq!(sum.load(Ordering::Relaxed), 500 * 499 / 2);
    }

    #[test]
    fn a_panicking_task_reaches_the_caller_and_the_pool_keeps_working() {
        let pool = ThreadPool::new(2).unwrap();
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            pool.install(|| for_each(64, |i| assert!(i != 33, "task 33")))
        }));
        assert!(r.is_err());
        let count = AtomicUsize::new(0);
        pool.install(|| {
            for_each(64, |_| {
                count.fetch_add(1, Ordering::Relaxed);
            })
        });
        assert_eq!(count.load(Ordering::Relaxed), 64);
    }

    /// Back-to-back fan-outs of different sizes: every task of every job runs exactly once. (A worker
    /// that read the old job's state and the new job's task count used to claim a task past the old
    /// job's end — a dead closure, and one task too many counted for the new job.)
    #[test]
    fn back_to_back_jobs_of_different_sizes_never_share_a_claim() {
        let pool = ThreadPool::new(2).unwrap();
        let (stray, wrong) = (AtomicUsize::new(0), AtomicUsize::new(0));
        pool.install(|| {
            for round in 0..2_000_000usize {
                let n = if round % 2 == 0 { 2 } else { 3 + round % 5 };
                let hits: Vec<AtomicUsize> = (0..n).map(|_| AtomicUsize::new(0)).collect();
                for_each(n, |i| {
                    hits.get(i).unwrap_or(&stray).fetch_add(1, Ordering::Relaxed);
                });
                if hits.iter().any(|h| h.load(Ordering::Relaxed) != 1) {
                    wrong.fetch_add(1, Ordering::Relaxed);
                }
            }
        });
        assert_eq!((stray.into_inner(), wrong.into_inner()), (0, 0), "(tasks past a job's end, jobs miscounted)");
    }

    /// Two threads installing the same pool at once take turns; an `install` inside an `install`
    /// runs within the outer one (which keeps its workers spinning).
    #[test]
    fn concurrent_and_nested_installs_take_turns() {
        let pool = ThreadPool::new(3).unwrap();
        let counts: Vec<AtomicUsize> = (0..2).map(|_| AtomicUsize::new(0)).collect();
        std::thread::scope(|scope| {
            for count in &counts {
                let pool = &pool;
                scope.spawn(move || {
                    for _ in 0..20 {
                        pool.install(|| {
                            for _ in 0..5000 {
                                for_each(7, |_| {
                                    count.fetch_add(1, Ordering::Relaxed);
                                })
                            }
                        });
                    }
                });
            }
        });
        assert!(counts.iter().all(|c| c.load(Ordering::Relaxed) == 20 * 5000 * 7));
        let count = AtomicUsize::new(0);
        let add = |_| {
            count.fetch_add(1, Ordering::Relaxed);
        };
        pool.install(|| {
            pool.install(|| for_each(10, add));
            assert!(pool.shared.spinning.load(Ordering::Acquire), "the inner install stopped the workers");
            for_each(10, add);
        });
        assert_eq!(count.load(Ordering::Relaxed), 20);
        // Through another pool and back: the inner install of the first pool runs within its outer one.
        let other = ThreadPool::new(2).unwrap();
        pool.install(|| other.install(|| pool.install(|| for_each(10, add))));
        assert_eq!(count.load(Ordering::Relaxed), 30);
    }
}
