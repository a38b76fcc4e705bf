//! The engine on its own thread: the [`Scheduler`] owns the model there, and front ends (the server's
//! handlers, the CLI) talk to it through a cloneable [`EngineHandle`]. Each request gets a
//! [`RequestStream`] of [`GenerationEvent`]s; dropping the stream cancels the request, and its pages are
//! let go at the next step.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{self, Receiver, Sender, TryRecvError};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver};

use super::request::{EngineError, GenerationEvent, GenerationRequest};
use super::sampling::{SamplingParams, VocabTables};
use super::scheduler::{EngineOptions, EngineStats, QueueCounts, RequestLimits, Scheduler, StepModel, Submission};
use crate::text::TextTokenizer;

enum Command {
    Submit(Box<Submission>),
    ClearPrefixCache,
    RefuseWaiting,
    Shutdown,
}

/// What every handle shares.
struct Shared {
    commands: Mutex<Sender<Command>>,
    accepting: AtomicBool,
    counts: Arc<QueueCounts>,
    next_id: AtomicU64,
    limits: RequestLimits,
    options: EngineOptions,
    stats: Mutex<EngineStats>,
    vocab: Arc<VocabTables>,
    thread: Mutex<Option<JoinHandle<()>>>,
}

/// Starts engines.
pub struct Engine;

impl Engine {
    /// Moves `model` onto a new thread that schedules every request submitted through the returned
    /// handle.
    pub fn start<M: StepModel + Send + 'static>(
        model: M,
        tokenizer: Arc<TextTokenizer>,
        options: EngineOptions,
    ) -> std::io::Result<EngineHandle> {
        let scheduler = Scheduler::new(model, tokenizer, options);
        let (tx, rx) = mpsc::channel();
        let shared = Arc::new(Shared {
            commands: Mutex::new(tx),
            accepting: AtomicBool::new(true),
            counts: scheduler.queue_counts(),
            next_id: AtomicU64::new(1),
            limits: scheduler.limits(),
            options: scheduler.options().clone(),
            stats: Mutex::new(scheduler.stats()),
            vocab: scheduler.vocab_tables(),
            thread: Mutex::new(None),
        });
        let weak = Arc::downgrade(&shared);
        let thread = std::thread::Builder::new().name("mlxcel-engine".into()).spawn(move || {
            let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| serve(scheduler, rx, &weak)));
            if let Some(shared) = weak.upgrade() {
                shared.accepting.store(false, Ordering::SeqCst);
            }
            if result.is_err() {
                tracing::error!("the engine thread panicked; requests in flight end without a result");
            }
        })?;
        *shared.thread.lock().unwrap() = Some(thread);
        Ok(EngineHandle { shared })
    }
}

/// The engine loop: wait for work when idle, otherwise take new commands and step.
fn serve<M: StepModel>(mut scheduler: Scheduler<M>, commands: Receiver<Command>, shared: &std::sync::Weak<Shared>) {
    scheduler.hold_ends();
    let mut open = true;
    loop {
        if scheduler.is_idle() {
            if !open {
                break;
            }
            // (Nothing held may wait on the next command.)
            publish(&mut scheduler, shared);
            match commands.recv() {
                Ok(c) => {
                    if !apply(&mut scheduler, c) {
                        break;
                    }
                }
                Err(_) => break,
            }
        }
        loop {
            match commands.try_recv() {
                Ok(c) => {
                    if !apply(&mut scheduler, c) {
                        scheduler.cancel_all();
                        publish(&mut scheduler, shared);
                        return;
                    }
                }
                Err(TryRecvError::Empty) => break,
                // Every handle is gone: finish what is in flight, then stop.
                Err(TryRecvError::Disconnected) => {
                    open = false;
                    break;
                }
            }
        }
        if scheduler.admit_waiting() {
            publish(&mut scheduler, shared);
        }
        scheduler.step();
        publish(&mut scheduler, shared);
    }
    publish(&mut scheduler, shared);
}

/// Applies one command; false means shut down.
fn apply<M: StepModel>(scheduler: &mut Scheduler<M>, command: Command) -> bool {
    match command {
        Command::Submit(s) => scheduler.enqueue(*s),
        Command::ClearPrefixCache => scheduler.clear_prefix_cache(),
        Command::RefuseWaiting => scheduler.refuse_waiting(),
        Command::Shutdown => {
            scheduler.cancel_all();
            return false;
        }
    }
    true
}

/// Publishes the scheduler's stats, then sends the ends of the requests that finished: a client
/// that has its answer finds its slot free.
fn publish<M: StepModel>(scheduler: &mut Scheduler<M>, shared: &std::sync::Weak<Shared>) {
    if let Some(shared) = shared.upgrade() {
        *shared.stats.lock().unwrap_or_else(|e| e.into_inner()) = scheduler.stats();
    }
    scheduler.send_ends();
}

/// A cloneable, thread-safe handle to a running engine.
#[derive(Clone)]
pub struct EngineHandle {
    shared: Arc<Shared>,
}

impl EngineHandle {
    /// Queues a request. Refuses at once what could never run (`Invalid`, `PromptTooLong`), a full
    /// queue (`QueueFull`) and a stopped engine (`ShuttingDown`). Makes the request's sampler here,
    /// building any vocabulary table it reads that no request built before (milliseconds), rather
    /// than on the engine thread.
    pub fn submit(&self, request: GenerationRequest) -> Result<RequestStream, EngineError> {
        let s = &self.shared;
        if !s.accepting.load(Ordering::SeqCst) {
            return Err(EngineError::ShuttingDown);
        }
        s.limits.check(&request)?;
        s.counts.try_enter(s.options.parallel, s.options.max_queue)?;
        let submitted = Instant::now();
        let r = &request;
        let sampler = Some(s.vocab.sampler(r.sampling.clone(), &r.end_tokens, r.ignore_eos));
        let (events, receiver) = unbounded_channel();
        let cancel = Arc::new(AtomicBool::new(false));
        let id = s.next_id.fetch_add(1, Ordering::Relaxed);
        let submission = Submission { id, request, events, cancel: cancel.clone(), submitted, sampler };
        let commands = s.commands.lock().unwrap_or_else(|e| e.into_inner());
        // Checked again under the lock [`refuse_waiting`](Self::refuse_waiting) takes: no request
        // slips in behind its command.
        let sent = match s.accepting.load(Ordering::SeqCst) {
            true => commands.send(Command::Submit(Box::new(submission))).is_ok(),
            false => false,
        };
        drop(commands);
        if !sent {
            s.counts.leave();
            return Err(EngineError::ShuttingDown);
        }
        Ok(RequestStream { id, events: receiver, cancel })
    }

    /// Whether [`submit`](Self::submit) can make a sampler for `params` without building a
    /// vocabulary table (milliseconds of work) first.
    pub fn vocab_tables_ready(&self, params: &SamplingParams) -> bool {
        self.shared.vocab.is_ready(params)
    }

    /// The latest snapshot (updated after every step). `queued` also counts requests submitted but
    /// not yet taken by the engine thread.
    pub fn stats(&self) -> EngineStats {
        let mut st = self.shared.stats.lock().unwrap_or_else(|e| e.into_inner()).clone();
        st.queued = st.queued.max(self.shared.counts.waiting());
        st
    }

    pub fn options(&self) -> &EngineOptions {
        &self.shared.options
    }

    pub fn limits(&self) -> RequestLimits {
        self.shared.limits
    }

    /// Whether new requests are accepted.
    pub fn is_accepting(&self) -> bool {
        self.shared.accepting.load(Ordering::SeqCst)
    }

    /// Drops every cached prefix page no request is using.
    pub fn clear_prefix_cache(&self) {
        let _ = self.shared.commands.lock().unwrap_or_else(|e| e.into_inner()).send(Command::ClearPrefixCache);
    }

    /// Stops accepting new requests and fails those still waiting to start with `ShuttingDown` (the
    /// first part of a graceful shutdown: the running ones go on).
    pub fn refuse_waiting(&self) {
        let s = &self.shared;
        let commands = s.commands.lock().unwrap_or_else(|e| e.into_inner());
        s.accepting.store(false, Ordering::SeqCst);
        let _ = commands.send(Command::RefuseWaiting);
    }

    /// Stops accepting new requests and waits up to `timeout` for those in flight or queued to finish;
    /// true if they all did. Follow with [`shutdown`](Self::shutdown), which cancels what is left.
    pub fn drain(&self, timeout: Duration) -> bool {
        self.shared.accepting.store(false, Ordering::SeqCst);
        let t0 = Instant::now();
        loop {
            let st = self.stats();
            if st.busy_slots() == 0 && st.queued == 0 {
                return true;
            }
            if t0.elapsed() >= timeout {
                return false;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    /// Stops accepting, ends every request in flight or waiting (a stream with sampled tokens gets
    /// `Done` with `Cancelled`, one without fails with `ShuttingDown`) and waits for the engine thread
    /// to end. Later calls return at once.
    pub fn shutdown(&self) {
        let s = &self.shared;
        s.accepting.store(false, Ordering::SeqCst);
        let _ = s.commands.lock().unwrap_or_else(|e| e.into_inner()).send(Command::Shutdown);
        let thread = s.thread.lock().unwrap_or_else(|e| e.into_inner()).take();
        if let Some(t) = thread {
            let _ = t.join();
        }
    }
}

/// The events of one request. Dropping it cancels the request.
pub struct RequestStream {
    id: u64,
    events: UnboundedReceiver<GenerationEvent>,
    cancel: Arc<AtomicBool>,
}

impl RequestStream {
    /// The engine's id for the request (as `/slots` shows it).
    pub fn id(&self) -> u64 {
        self.id
    }

    /// The next event; `None` after the last one (`Done` or `Error`), or if the engine stopped.
    pub async fn next(&mut self) -> Option<GenerationEvent> {
        self.events.recv().await
    }

    /// [`next`](Self::next) for threads outside an async runtime (the CLI).
    pub fn blocking_next(&mut self) -> Option<GenerationEvent> {
        self.events.blocking_recv()
    }

    /// Asks the engine to stop the request; it still ends the stream with `Done` (`Cancelled`).
    pub fn cancel(&self) {
        self.cancel.store(true, Ordering::Relaxed);
    }

    /// The flag [`cancel`](Self::cancel) sets, for a signal handler.
    pub fn cancel_flag(&self) -> Arc<AtomicBool> {
        self.cancel.clone()
    }

    /// The raw receiver (e.g. for `tokio_stream::wrappers::UnboundedReceiverStream`); dropping it
    /// cancels the request.
    pub fn into_receiver(self) -> UnboundedReceiver<GenerationEvent> {
        self.events
    }
}
