//! Scheduler tests over a stand-in model that behaves like a transformer where it matters here: the
//! KV a position writes depends on every token before it, logits depend on the KV the block table
//! points at, and reading a slot that does not hold the position it should is an error. So a wrong
//! page, a page overwritten while shared or a prefix reused wrongly changes the output or fails.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver};

use super::*;
use crate::engine::runner::{RowsWanted, StepRows};
use crate::engine::sampling::{SamplingParams, Step};

const VOCAB: usize = 320;

fn mix(a: u64, b: u64) -> u64 {
    // splitmix64 of the pair
    let mut z = a ^ b.wrapping_mul(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

struct CheckingModel {
    pool: KvCache,
    ctx: usize,
    /// What each KV slot holds: its position and a digest of every token up to it.
    slots: Vec<Option<(usize, u64)>>,
    /// Per forward pass: (sequences, tokens).
    steps: Vec<(usize, usize)>,
    fail_next: bool,
    /// What each step asked to bring back.
    wants: Vec<RowsWanted>,
    in_flight: Option<StepRows>,
    /// Whether the model copies pages (a backend with `copy_blocks`).
    copies_pages: bool,
}

impl CheckingModel {
    fn new(pages: usize, page_size: usize, ctx: usize) -> Self {
        CheckingModel {
            pool: KvCache::single(pages, page_size),
            ctx,
            slots: vec![None; pages * page_size],
            steps: Vec::new(),
            fail_next: false,
            wants: Vec::new(),
            in_flight: None,
            copies_pages: true,
        }
    }

    fn slot(&self, c: &SeqChunk, pos: usize) -> usize {
        let bs = self.pool.block_size;
        c.blocks.blocks[pos / bs] as usize * bs + pos % bs
    }
}

impl CheckingModel {
    /// The logits rows of one step (and the KV it writes).
    fn forward(&mut self, chunks: &[SeqChunk]) -> anyhow::Result<Vec<f32>> {
        if std::mem::take(&mut self.fail_next) {
            anyhow::bail!("injected failure");
        }
        self.steps.push((chunks.len(), chunks.iter().map(|c| c.tokens.len()).sum()));
        let mut out = Vec::new();
        for c in chunks {
            let end = c.start_pos + c.tokens.len();
            anyhow::ensure!(end <= self.ctx, "past the context");
            anyhow::ensure!(c.blocks.blocks.len() * self.pool.block_size >= end, "pages do not cover {end}");
            for (j, &t) in c.tokens.iter().enumerate() {
                let pos = c.start_pos + j;
                let before = if pos == 0 {
                    0
                } else {
                    match self.slots[self.slot(c, pos - 1)] {
                        Some((p, d)) if p == pos - 1 => d,
                        _ => anyhow::bail!("stale KV at position {}", pos - 1),
                    }
                };
                let s = self.slot(c, pos);
                self.slots[s] = Some((pos, mix(before, t as u64 + 1)));
            }
            let rows = match c.logits {
                Logits::All => c.start_pos..end,
                Logits::Last => end - 1..end,
                Logits::None => end..end,
            };
            for pos in rows {
                let (_, digest) = self.slots[self.slot(c, pos)].unwrap();
                out.extend(logits_row(digest));
            }
        }
        Ok(out)
    }
}

impl StepModel for CheckingModel {
    fn submit(&mut self, chunks: &[SeqChunk], want: RowsWanted) -> anyhow::Result<()> {
        let rows = self.forward(chunks)?;
        self.wants.push(want);
        self.in_flight = Some(StepRows::select(rows, VOCAB, want));
        Ok(())
    }
    fn wait(&mut self) -> anyhow::Result<StepRows> {
        self.in_flight.take().ok_or_else(|| anyhow::anyhow!("wait without a step in flight"))
    }
    fn vocab_size(&self) -> usize {
        VOCAB
    }
    fn ctx_size(&self) -> usize {
        self.ctx
    }
    fn kv_cache(&self) -> &KvCache {
        &self.pool
    }
    fn kv_bytes_per_token(&self) -> usize {
        64
    }
    fn prefix_reuse_safe(&self) -> bool {
        true
    }
    fn copies_pages(&self) -> bool {
        self.copies_pages
    }
    fn copy_page(&mut self, src: u32, dst: u32) -> anyhow::Result<()> {
        anyhow::ensure!(self.in_flight.is_none(), "a page copy while a step is in flight");
        anyhow::ensure!(self.copies_pages, "a page copy on a model that cannot");
        let bs = self.pool.block_size;
        let (src, dst) = (src as usize * bs, dst as usize * bs);
        self.slots.copy_within(src..src + bs, dst);
        Ok(())
    }
}

/// The logits a position holding `digest` (of every token up to it) gives.
fn logits_row(digest: u64) -> Vec<f32> {
    (0..VOCAB as u64).map(|v| (mix(digest, v) >> 40) as f32 / (1u64 << 24) as f32 * 8.0).collect()
}

fn tokenizer() -> Arc<TextTokenizer> {
    let dir = crate::testing::workspace_root().join("families/llama/tests/fixtures/qwen3-f32");
    Arc::new(TextTokenizer::load(&dir, &serde_json::json!({}), None).unwrap())
}

fn scheduler(model: CheckingModel, opts: EngineOptions) -> Scheduler<CheckingModel> {
    Scheduler::new(model, tokenizer(), opts)
}

fn opts(parallel: usize) -> EngineOptions {
    EngineOptions { parallel, ..Default::default() }
}

fn prompt(seed: u64, len: usize) -> Vec<u32> {
    let mut rng = StdRng::seed_from_u64(seed);
    (0..len).map(|_| rng.gen_range(3..VOCAB as u32)).collect()
}

fn request(prompt: Vec<u32>, max_tokens: usize) -> GenerationRequest {
    let mut r = GenerationRequest::new(prompt, SamplingParams::greedy(), max_tokens);
    r.ignore_eos = true;
    r
}

#[derive(Debug, Default, Clone, PartialEq)]
struct Outcome {
    text: String,
    tokens: Vec<u32>,
    finish: Option<FinishReason>,
    usage: Usage,
    error: Option<EngineError>,
    prompt_scores: Option<Vec<TokenLogprob>>,
    /// The slot it ran in (its last admission's).
    slot: Option<usize>,
}

struct Client {
    events: UnboundedReceiver<GenerationEvent>,
    cancel: Arc<AtomicBool>,
    got: Outcome,
    done: bool,
}

impl Client {
    fn poll(&mut self) {
        while let Ok(e) = self.events.try_recv() {
            match e {
                GenerationEvent::Text { text, tokens, .. } => {
                    self.got.text.push_str(&text);
                    self.got.tokens.extend(tokens);
                }
                GenerationEvent::Started { slot, .. } => self.got.slot = Some(slot),
                GenerationEvent::PromptProgress { .. } | GenerationEvent::EndToken(_) => {}
                GenerationEvent::PromptLogprobs(scores) => {
                    assert!(self.got.prompt_scores.is_none() && self.got.tokens.is_empty(), "scores once, first");
                    self.got.prompt_scores = Some(scores);
                }
                GenerationEvent::Done { finish, usage } => {
                    self.got.finish = Some(finish);
                    self.got.usage = usage;
                    self.done = true;
                }
                GenerationEvent::Error(e) => {
                    self.got.error = Some(e);
                    self.done = true;
                }
            }
        }
    }
}

fn submit<M: StepModel>(s: &mut Scheduler<M>, id: u64, req: GenerationRequest) -> Result<Client, EngineError> {
    let (tx, rx) = unbounded_channel();
    let cancel = Arc::new(AtomicBool::new(false));
    s.submit(Submission {
        id,
        request: req,
        events: tx,
        cancel: cancel.clone(),
        submitted: Instant::now(),
        sampler: None,
    })?;
    Ok(Client { events: rx, cancel, got: Outcome::default(), done: false })
}

/// Steps until nothing is left, polling the clients.
fn drain<M: StepModel>(s: &mut Scheduler<M>, clients: &mut [Client]) {
    for _ in 0..100_000 {
        s.step();
        clients.iter_mut().for_each(Client::poll);
        if s.is_idle() {
            return;
        }
    }
    panic!("the scheduler did not finish");
}

/// What `req` produces alone on a roomy model.
fn solo(req: &GenerationRequest) -> Outcome {
    let mut s = scheduler(CheckingModel::new(256, 16, 2048), opts(1));
    let mut c = vec![submit(&mut s, 1, req.clone()).unwrap()];
    drain(&mut s, &mut c);
    c.pop().unwrap().got
}

fn assert_no_leak<M: StepModel>(s: &Scheduler<M>) {
    let st = s.stats();
    assert_eq!(st.kv_pages_total - st.kv_pages_used, st.kv_pages_total - st.kv_pages_cached, "pages leaked");
    assert_eq!(st.busy_slots(), 0);
    assert_eq!(s.counts.waiting(), 0, "queue count");
}

fn same_answer(a: &Outcome, b: &Outcome) {
    assert_eq!((&a.tokens, &a.text, a.finish, &a.error), (&b.tokens, &b.text, b.finish, &b.error));
}

#[test]
fn concurrent_requests_each_match_their_solo_run() {
    let reqs: Vec<GenerationRequest> =
        (0..8).map(|i| request(prompt(i, 5 + 37 * i as usize), 40 + i as usize)).collect();
    let want: Vec<Outcome> = reqs.iter().map(solo).collect();
    // A small step budget forces prompts into chunks beside running decodes.
    let mut s = scheduler(CheckingModel::new(256, 16, 2048), EngineOptions { ubatch_size: 64, ..opts(8) });
    let mut clients: Vec<Client> =
        reqs.iter().enumerate().map(|(i, r)| submit(&mut s, i as u64, r.clone()).unwrap()).collect();
    drain(&mut s, &mut clients);
    for (c, w) in clients.iter().zip(&want) {
        same_answer(&c.got, w);
        assert_eq!(c.got.finish, Some(FinishReason::Length));
    }
    let steps = &s.model().steps;
    assert!(steps.iter().any(|&(seqs, _)| seqs >= 8), "all eight ran in one step");
    assert!(steps.iter().all(|&(_, tokens)| tokens <= 64), "the step budget holds");
    assert_no_leak(&s);
}

#[test]
fn decodes_keep_running_while_a_long_prompt_is_prefilled_in_chunks() {
    let mut s = scheduler(CheckingModel::new(64, 16, 1024), EngineOptions { ubatch_size: 32, ..opts(2) });
    let mut clients = vec![submit(&mut s, 1, request(prompt(1, 4), 40)).unwrap()];
    s.step();
    clients.push(submit(&mut s, 2, request(prompt(2, 300), 2)).unwrap());
    drain(&mut s, &mut clients);
    // While the 300-token prompt went through in ≤ 32-token chunks, the first request decoded in the
    // same steps.
    let mixed = s.model().steps.iter().filter(|&&(seqs, tokens)| seqs == 2 && tokens == 32).count();
    assert!(mixed >= 9, "steps with a decode beside a prompt chunk: {mixed}");
    same_answer(&clients[0].got, &solo(&request(prompt(1, 4), 40)));
    same_answer(&clients[1].got, &solo(&request(prompt(2, 300), 2)));
}

#[test]
fn shared_prefix_comes_from_the_cache_with_the_same_answer() {
    let prefix = prompt(7, 400);
    let with_suffix = |seed| [prefix.clone(), prompt(seed, 9)].concat();
    let mut s = scheduler(CheckingModel::new(128, 16, 2048), opts(4));
    let mut first = vec![submit(&mut s, 1, request(with_suffix(1), 5)).unwrap()];
    drain(&mut s, &mut first);
    assert_eq!(first[0].got.usage.cached_tokens, 0);

    let second = request(with_suffix(2), 8);
    let mut c = vec![submit(&mut s, 2, second.clone()).unwrap()];
    drain(&mut s, &mut c);
    assert_eq!(c[0].got.usage.cached_tokens, 400, "25 whole pages of the shared prefix");
    assert_eq!(c[0].got.usage.prompt_tokens, 409);

    let mut uncached = second.clone();
    uncached.cache_prompt = false;
    let mut fresh = scheduler(CheckingModel::new(128, 16, 2048), opts(4));
    let mut u = vec![submit(&mut fresh, 3, uncached).unwrap()];
    drain(&mut fresh, &mut u);
    assert_eq!(u[0].got.usage.cached_tokens, 0);
    same_answer(&c[0].got, &u[0].got);
    assert_eq!(s.stats().counters.cache_hit_tokens, 400);
    assert_no_leak(&s);
}

#[test]
fn answers_to_one_prompt_submitted_together_compute_its_pages_once() {
    // Three answers to one prompt (llama-server's n_cmpl), and a fourth request sharing its start.
    let p = prompt(11, 150);
    let reqs = [request(p.clone(), 6), request(p.clone(), 6), request(p.clone(), 6), request(p[..100].to_vec(), 4)];
    let mut s = scheduler(CheckingModel::new(128, 16, 2048), EngineOptions { ubatch_size: 64, ..opts(4) });
    let mut clients: Vec<Client> =
        reqs.iter().enumerate().map(|(i, r)| submit(&mut s, i as u64, r.clone()).unwrap()).collect();
    drain(&mut s, &mut clients);
    let cached: Vec<usize> = clients.iter().map(|c| c.got.usage.cached_tokens).collect();
    // Nine whole pages of the 150 tokens; all but the last of the 100 (the head of its last page
    // copied from a full page, as this model copies pages).
    assert_eq!(cached, [0, 144, 144, 99]);
    for (c, r) in clients.iter().zip(&reqs) {
        same_answer(&c.got, &solo(r));
    }
    let computed: usize = s.model().steps.iter().map(|&(_, tokens)| tokens).sum();
    assert_eq!(computed, 150 + 6 + 6 + 1 + 5 * 3 + 3, "the shared pages once, then the decodes");
    assert_no_leak(&s);
}

#[test]
fn a_request_waiting_for_shared_pages_lets_the_ones_behind_it_start() {
    let p = prompt(12, 300);
    let reqs = [request(p.clone(), 4), request(p.clone(), 4), request(prompt(13, 20), 4)];
    let mut s = scheduler(CheckingModel::new(128, 16, 2048), EngineOptions { ubatch_size: 64, ..opts(3) });
    let mut clients: Vec<Client> =
        reqs.iter().enumerate().map(|(i, r)| submit(&mut s, i as u64, r.clone()).unwrap()).collect();
    s.step();
    let running: Vec<u64> = s.running.iter().map(|r| r.id).collect();
    assert_eq!(running, [0, 2], "the second waits for the first's pages; the third need not");
    drain(&mut s, &mut clients);
    assert!(clients[1].got.usage.cached_tokens >= 288, "{:?}", clients[1].got.usage);
    for (c, r) in clients.iter().zip(&reqs) {
        same_answer(&c.got, &solo(r));
    }
    assert_no_leak(&s);

    // With two slots, the one passed over keeps the second: the third waits.
    let mut s = scheduler(CheckingModel::new(128, 16, 2048), EngineOptions { ubatch_size: 64, ..opts(2) });
    let mut clients: Vec<Client> =
        reqs.iter().enumerate().map(|(i, r)| submit(&mut s, i as u64, r.clone()).unwrap()).collect();
    s.step();
    assert_eq!(s.running.iter().map(|r| r.id).collect::<Vec<_>>(), [0]);
    drain(&mut s, &mut clients);
    assert!(clients[1].got.usage.cached_tokens >= 288, "{:?}", clients[1].got.usage);
    assert_no_leak(&s);
}

#[test]
fn admit_waiting_admits_before_any_forward_pass() {
    let mut s = scheduler(CheckingModel::new(64, 16, 1024), opts(2));
    let mut c = vec![submit(&mut s, 1, request(prompt(3, 100), 2)).unwrap()];
    assert!(s.admit_waiting(), "the request is admitted");
    assert!(s.model().steps.is_empty(), "before any forward pass");
    assert_eq!(s.stats().busy_slots(), 1);
    assert!(!s.admit_waiting(), "nothing changed since");
    drain(&mut s, &mut c);
    assert_eq!(c[0].got.finish, Some(FinishReason::Length));
}

#[test]
fn a_json_schema_holds_the_answer_to_it() {
    let tok = tokenizer();
    let schema = serde_json::json!({"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}, "n": {"type": "integer", "maximum": 99}},
        "required": ["answer", "n"], "additionalProperties": false});
    let constraint = tok.grammars().unwrap().json_schema(&schema).unwrap();
    let mut s = scheduler(CheckingModel::new(64, 16, 1024), opts(2));
    let mut free = request(prompt(5, 20), 40);
    free.ignore_eos = false;
    let mut held = free.clone();
    held.constraint = Some(constraint);
    let mut c = vec![submit(&mut s, 1, held).unwrap(), submit(&mut s, 2, free).unwrap()];
    drain(&mut s, &mut c);
    let v: serde_json::Value =
        serde_json::from_str(&c[0].got.text).unwrap_or_else(|e| panic!("{e}: {:?}", c[0].got.text));
    assert!(["yes", "no"].contains(&v["answer"].as_str().unwrap()), "{v}");
    assert!(v["n"].as_u64().is_some_and(|n| n <= 99) && v.as_object().unwrap().len() == 2, "{v}");
    assert_eq!(c[0].got.finish, Some(FinishReason::Stop));
    // The same model, unconstrained, writes something else (the check above is the grammar's doing).
    assert!(serde_json::from_str::<serde_json::Value>(&c[1].got.text).is_err(), "{:?}", c[1].got.text);
    assert!(s.model().wants.contains(&RowsWanted::Full), "a constrained row comes back whole");
    assert_no_leak(&s);
}

/// A thought the prompt opened is free text: the answer's grammar holds only what follows it (here
/// the thought is closed by its budget, the close written in by the engine).
#[test]
fn a_grammar_holds_what_follows_the_thought() {
    let tok = tokenizer();
    let schema = serde_json::json!({"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}},
        "required": ["answer"], "additionalProperties": false});
    let close = tok.encode("\n</think>\n\n", false).unwrap();
    let mut free = request(prompt(5, 20), 40);
    free.ignore_eos = false;
    let free = solo(&free);
    let mut req = request(prompt(5, 20), 40);
    req.ignore_eos = false;
    req.thought_budget = Some(crate::engine::ThoughtBudget { budget: 6, close: close.clone(), open_at_start: true });
    req.constraint = Some(tok.grammars().unwrap().json_schema(&schema).unwrap());
    let got = solo(&req);
    assert_eq!(got.error, None, "{got:?}");
    // The thought is the model's own (unconstrained) tokens, then the close, then JSON.
    assert_eq!(got.tokens[..6], free.tokens[..6]);
    assert_eq!(got.tokens[6..6 + close.len()], close[..]);
    let (_, answer) = got.text.split_once("</think>").unwrap_or_else(|| panic!("{:?}", got.text));
    let v: serde_json::Value = serde_json::from_str(answer.trim()).unwrap_or_else(|e| panic!("{e}: {answer:?}"));
    assert!(["yes", "no"].contains(&v["answer"].as_str().unwrap()), "{v}");
    assert_eq!(got.finish, Some(FinishReason::Stop));
    // A model that would end inside the thought may not: the answer the grammar holds still comes.
    req.sampling.logit_bias = vec![(tok.eos_ids[0], 50.0)];
    let eager = solo(&req);
    assert_eq!(eager.tokens.get(6..6 + close.len()), Some(&close[..]), "{eager:?}");
    let (_, answer) = eager.text.split_once("</think>").unwrap_or_else(|| panic!("{:?}", eager.text));
    serde_json::from_str::<serde_json::Value>(answer.trim()).unwrap_or_else(|e| panic!("{e}: {answer:?}"));
    // Nor does a stop string end it there (unconstrained, the same stop ends the thought).
    req.sampling.logit_bias.clear();
    let thought = tok.decode(&free.tokens[2..4]).unwrap();
    req.stop = vec![thought.clone()];
    let stopped = solo(&req);
    let (_, answer) = stopped.text.split_once("</think>").unwrap_or_else(|| panic!("{thought:?}: {stopped:?}"));
    serde_json::from_str::<serde_json::Value>(answer.trim()).unwrap_or_else(|e| panic!("{e}: {answer:?}"));
    let mut unheld = req.clone();
    unheld.constraint = None;
    assert!(!solo(&unheld).text.contains("</think>"), "the stop string is in the thought");
    // Nor a stop string in the close the engine writes for the budget (it ends "\n\n").
    req.stop = vec!["\n\n".into()];
    let closed = solo(&req);
    let (_, answer) = closed.text.split_once("</think>").unwrap_or_else(|| panic!("{closed:?}"));
    serde_json::from_str::<serde_json::Value>(answer.trim()).unwrap_or_else(|e| panic!("{e}: {answer:?}"));
}

/// A forced call: the answer is a Hermes `<tool_call>` to the named tool, its arguments fitting the
/// tool's schema, read back as a call.
#[test]
fn a_forced_tool_call_is_a_call_in_the_templates_format() {
    use crate::server::tools::{Forced, Piece, Tooling};
    let tok = tokenizer();
    let tools = vec![
        serde_json::json!({"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object",
            "properties": {"unit": {"enum": ["C", "F"]}}, "required": ["unit"], "additionalProperties": false}}}),
        serde_json::json!({"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}),
    ];
    // (A tool whose schema refers to its own definitions, as Pydantic writes them.)
    let with_defs = serde_json::json!({"type": "function", "function": {"name": "get_time", "parameters": {"type": "object",
        "properties": {"zone": {"$ref": "#/$defs/Zone"}}, "required": ["zone"], "additionalProperties": false, "$defs": {"Zone": {"enum": ["UTC", "CET"]}}}}});
    let hermes = "{% if tools %}<tool_call>{% endif %}";
    let llama3 = "{% if tools %}<|python_tag|>{% endif %}";
    let cases = [
        (hermes, false, Forced::Named("get_weather".into()), Some("get_weather")),
        (hermes, false, Forced::Any, None),
        (hermes, true, Forced::Any, None),
        (hermes, true, Forced::Named("get_time".into()), Some("get_time")),
        (llama3, false, Forced::Any, None),
    ];
    for (template, parallel, forced, name) in cases {
        let mut tooling = Tooling::new(vec![tools[0].clone(), with_defs.clone()], parallel, Some(template)).unwrap();
        tooling.forced = Some(forced);
        let grammar = tooling.forced_grammar(|_| None).unwrap();
        let mut req = request(prompt(9, 12), 120);
        req.ignore_eos = false;
        req.constraint = Some(tok.grammars().unwrap().lark(&grammar).unwrap());
        let mut s = scheduler(CheckingModel::new(64, 16, 1024), opts(1));
        let mut c = vec![submit(&mut s, 1, req).unwrap()];
        drain(&mut s, &mut c);
        let text = &c[0].got.text;
        let start = if template == hermes { "<tool_call>\n{\"name\": \"" } else { "{\"name\": \"" };
        assert!(text.starts_with(start), "{text:?}");
        let pieces = tooling.pieces("call_", text);
        let calls: Vec<_> = pieces.iter().filter_map(|p| if let Piece::Call(c) = p { Some(c) } else { None }).collect();
        assert!(!calls.is_empty() && calls.len() == pieces.len(), "{text:?}: {pieces:?}");
        assert!(calls.len() == 1 || (parallel && name.is_none()), "{text:?}");
        for call in calls {
            if let Some(name) = name {
                assert_eq!(call.name, name);
            }
            match call.name.as_str() {
                "get_weather" => assert!(["C", "F"].contains(&call.arguments["unit"].as_str().unwrap()), "{text:?}"),
                _ => assert!(["UTC", "CET"].contains(&call.arguments["zone"].as_str().unwrap()), "{text:?}"),
            }
        }
        assert_eq!(c[0].got.finish, Some(FinishReason::Stop), "{text:?}");
    }
    // A tag the tokenizer holds as a special token is written as that token.
    let mut tooling = Tooling::new(tools, false, Some(hermes)).unwrap();
    tooling.forced = Some(Forced::Any);
    let eos = tok.eos_ids[0];
    let grammar = tooling.forced_grammar(|t| (t == "<tool_call>").then_some(eos)).unwrap();
    assert!(grammar.contains(&format!("<[{eos}]>")), "{grammar}");
    tok.grammars().unwrap().lark(&grammar).unwrap();
}

#[test]
fn a_repeated_prompt_still_computes_its_last_token() {
    let p = prompt(3, 64); // exactly four pages
    let mut s = scheduler(CheckingModel::new(64, 16, 1024), opts(1));
    let mut a = vec![submit(&mut s, 1, request(p.clone(), 4)).unwrap()];
    drain(&mut s, &mut a);
    let mut b = vec![submit(&mut s, 2, request(p.clone(), 4)).unwrap()];
    drain(&mut s, &mut b);
    assert_eq!(b[0].got.usage.cached_tokens, 63, "the last prompt token is recomputed, in a copy of its page");
    same_answer(&a[0].got, &b[0].got);
}

#[test]
fn a_prefix_ending_inside_a_page_takes_that_pages_head_from_the_cache() {
    // 25 whole pages and 7 positions of a 26th are shared.
    let prefix = prompt(8, 407);
    let with_suffix = |seed| [prefix.clone(), prompt(seed, 20)].concat();
    for copies_pages in [true, false] {
        let mut model = CheckingModel::new(128, 16, 2048);
        model.copies_pages = copies_pages;
        let mut s = scheduler(model, opts(4));
        let mut first = vec![submit(&mut s, 1, request(with_suffix(1), 5)).unwrap()];
        drain(&mut s, &mut first);

        let second = request(with_suffix(2), 8);
        let mut c = vec![submit(&mut s, 2, second.clone()).unwrap()];
        drain(&mut s, &mut c);
        let cached = if copies_pages { 407 } else { 400 };
        assert_eq!(c[0].got.usage.cached_tokens, cached, "copies pages: {copies_pages}");
        let mut uncached = second.clone();
        uncached.cache_prompt = false;
        same_answer(&c[0].got, &solo(&uncached));
        assert_no_leak(&s);
        // The copied page is the second request's own: the first one's page is still cached as it was.
        let mut third = vec![submit(&mut s, 3, request(with_suffix(1), 5)).unwrap()];
        drain(&mut s, &mut third);
        same_answer(&third[0].got, &first[0].got);
        assert_eq!(third[0].got.usage.cached_tokens, 416, "26 whole pages, the first request's");
    }
}

#[test]
fn cache_prompt_false_neither_reuses_nor_leaves_pages() {
    let p = prompt(4, 100);
    let mut s = scheduler(CheckingModel::new(64, 16, 1024), opts(1));
    let mut r = request(p.clone(), 3);
    r.cache_prompt = false;
    let mut a = vec![submit(&mut s, 1, r.clone()).unwrap()];
    drain(&mut s, &mut a);
    assert_eq!(s.stats().kv_pages_cached, 0);
    assert_eq!(s.stats().kv_pages_used, 0);
    let mut b = vec![submit(&mut s, 2, request(p, 3)).unwrap()];
    drain(&mut s, &mut b);
    assert_eq!(b[0].got.usage.cached_tokens, 0);
}

#[test]
fn eviction_under_a_small_kv_budget_keeps_answers_correct() {
    // 12 pages of 16 tokens: room for about two of these prompts' pages at a time.
    let mut s = scheduler(CheckingModel::new(12, 16, 1024), opts(1));
    let prompts: Vec<Vec<u32>> = (0..4).map(|i| prompt(100 + i, 70)).collect();
    for round in 0..3 {
        for (i, p) in prompts.iter().enumerate() {
            let req = request(p.clone(), 6);
            let mut c = vec![submit(&mut s, (round * 10 + i) as u64, req.clone()).unwrap()];
            drain(&mut s, &mut c);
            same_answer(&c[0].got, &solo(&req));
            assert!(s.stats().kv_pages_cached <= 12);
        }
    }
    // The last prompt ran just before it was asked again: its pages are still cached.
    let req = request(prompts[3].clone(), 6);
    let mut c = vec![submit(&mut s, 99, req.clone()).unwrap()];
    drain(&mut s, &mut c);
    assert_eq!(c[0].got.usage.cached_tokens, 64);
    same_answer(&c[0].got, &solo(&req));
    assert_no_leak(&s);
}

#[test]
fn slots_sharing_one_context_of_pages_admit_what_fits_together() {
    // Four slots over one 256-token context (`-np` auto): prompts of 100 tokens fit two at a time,
    // so two start and two wait, rather than four starting and two being preempted; one that needs
    // the whole pool waits for the others and then runs alone.
    let mut reqs: Vec<GenerationRequest> = (0..4).map(|i| request(prompt(60 + i, 100), 10)).collect();
    reqs.push(request(prompt(70, 240), 10));
    let mut s = scheduler(CheckingModel::new(16, 16, 256), opts(4));
    let mut clients: Vec<Client> =
        reqs.iter().enumerate().map(|(i, r)| submit(&mut s, i as u64, r.clone()).unwrap()).collect();
    s.step();
    assert_eq!(s.stats().busy_slots(), 2, "two prompts fit the pool together");
    drain(&mut s, &mut clients);
    assert_eq!(s.stats().counters.preemptions, 0, "nothing admitted had to be preempted");
    for (c, r) in clients.iter().zip(&reqs) {
        same_answer(&c.got, &solo(r));
    }
    assert_no_leak(&s);
}

#[test]
fn preemption_when_pages_run_out_gives_the_same_greedy_output() {
    // Ten pages of four tokens; three requests that each grow to ~30 tokens cannot all stay.
    let reqs: Vec<GenerationRequest> = (0..3).map(|i| request(prompt(20 + i, 10), 20)).collect();
    let mut s = scheduler(CheckingModel::new(10, 4, 256), opts(3));
    let mut clients: Vec<Client> =
        reqs.iter().enumerate().map(|(i, r)| submit(&mut s, i as u64, r.clone()).unwrap()).collect();
    drain(&mut s, &mut clients);
    assert!(s.stats().counters.preemptions > 0, "the pool is too small for all three");
    for (c, r) in clients.iter().zip(&reqs) {
        same_answer(&c.got, &solo(r));
        assert_eq!(c.got.tokens.len(), 20);
    }
    assert_no_leak(&s);
}

#[test]
fn preemption_without_the_prefix_cache_gives_the_same_output() {
    let reqs: Vec<GenerationRequest> = (0..3).map(|i| request(prompt(30 + i, 10), 20)).collect();
    let mut s = scheduler(CheckingModel::new(10, 4, 256), EngineOptions { prefix_cache: false, ..opts(3) });
    let mut clients: Vec<Client> =
        reqs.iter().enumerate().map(|(i, r)| submit(&mut s, i as u64, r.clone()).unwrap()).collect();
    drain(&mut s, &mut clients);
    assert!(s.stats().counters.preemptions > 0);
    for (c, r) in clients.iter().zip(&reqs) {
        same_answer(&c.got, &solo(r));
    }
    assert_eq!(s.stats().kv_pages_used, 0);
}

#[test]
fn a_sequence_that_outgrows_the_whole_pool_ends_with_length() {
    let mut s = scheduler(CheckingModel::new(4, 4, 256), opts(1));
    let mut c = vec![submit(&mut s, 1, request(prompt(5, 6), 100)).unwrap()];
    drain(&mut s, &mut c);
    assert_eq!(c[0].got.finish, Some(FinishReason::Length));
    assert_eq!(c[0].got.tokens.len(), 16 - 6 + 1, "every position of the pool, then the last sampled token");
    assert_no_leak(&s);
}

#[test]
fn dropping_the_stream_frees_the_pages_within_one_step() {
    let mut s = scheduler(CheckingModel::new(64, 16, 1024), opts(2));
    let mut c = submit(&mut s, 1, request(prompt(6, 100), 1000)).unwrap();
    for _ in 0..5 {
        s.step();
    }
    c.poll();
    assert!(!c.got.tokens.is_empty());
    assert!(s.stats().kv_pages_used > 6);
    drop(c);
    s.step();
    let st = s.stats();
    assert_eq!(st.kv_pages_used, st.kv_pages_cached, "only the prefix cache holds pages");
    assert_eq!(st.busy_slots(), 0);
    assert_eq!(st.counters.requests_cancelled, 1);
    s.clear_prefix_cache();
    assert_eq!(s.stats().kv_pages_used, 0);
}

#[test]
fn cancel_flag_ends_the_request_with_cancelled() {
    let mut s = scheduler(CheckingModel::new(64, 16, 1024), opts(1));
    let mut c = vec![submit(&mut s, 1, request(prompt(8, 10), 1000)).unwrap()];
    s.step();
    s.step();
    c[0].cancel.store(true, Ordering::Relaxed);
    drain(&mut s, &mut c);
    assert_eq!(c[0].got.finish, Some(FinishReason::Cancelled));
    assert_eq!(c[0].got.usage.completion_tokens, c[0].got.tokens.len());
}

#[test]
fn shutdown_cancels_a_started_answer_and_fails_one_that_never_started() {
    let mut s = scheduler(CheckingModel::new(64, 16, 1024), opts(1));
    let mut c = vec![
        submit(&mut s, 1, request(prompt(8, 10), 1000)).unwrap(),
        submit(&mut s, 2, request(prompt(9, 10), 1000)).unwrap(),
    ];
    s.step();
    s.step();
    s.cancel_all();
    s.send_ends();
    for client in &mut c {
        client.poll();
    }
    assert!(!c[0].got.tokens.is_empty());
    assert_eq!(c[0].got.finish, Some(FinishReason::Cancelled));
    assert!(c[1].got.tokens.is_empty(), "one slot: the second request was still waiting");
    assert!(matches!(c[1].got.error, Some(EngineError::ShuttingDown)), "{:?}", c[1].got);
    let st = s.stats();
    assert_eq!((st.counters.requests_cancelled, st.counters.requests_failed), (1, 1));
    assert_no_leak(&s);
}

#[test]
fn a_shutdown_refuses_the_waiting_requests_and_lets_the_running_one_finish() {
    let mut s = scheduler(CheckingModel::new(64, 16, 1024), opts(1));
    let mut c = vec![
        submit(&mut s, 1, request(prompt(10, 10), 20)).unwrap(),
        submit(&mut s, 2, request(prompt(11, 10), 20)).unwrap(),
    ];
    s.step();
    s.refuse_waiting();
    drain(&mut s, &mut c);
    same_answer(&c[0].got, &solo(&request(prompt(10, 10), 20)));
    assert!(matches!(c[1].got.error, Some(EngineError::ShuttingDown)), "{:?}", c[1].got);
    assert_no_leak(&s);
}

#[test]
fn a_timeout_cancels_the_request() {
    let mut s = scheduler(CheckingModel::new(64, 16, 1024), opts(1));
    let mut r = request(prompt(9, 10), 1_000_000);
    r.timeout = Some(Duration::from_millis(20));
    let mut c = vec![submit(&mut s, 1, r).unwrap()];
    s.step();
    s.step();
    std::thread::sleep(Duration::from_millis(30));
    drain(&mut s, &mut c);
    assert_eq!(c[0].got.finish, Some(FinishReason::Cancelled));
    assert_eq!(c[0].got.tokens.len(), 2);

    // A timeout too long to represent means none.
    let mut r = request(prompt(9, 10), 3);
    r.timeout = Some(Duration::MAX);
    let mut c = vec![submit(&mut s, 2, r).unwrap()];
    drain(&mut s, &mut c);
    assert_eq!(c[0].got.finish, Some(FinishReason::Length));
}

#[test]
fn a_hundred_requests_with_random_cancellations_leak_no_pages() {
    let mut rng = StdRng::seed_from_u64(11);
    // A small pool so that eviction and preemption happen along the way.
    let mut s = scheduler(CheckingModel::new(40, 8, 512), EngineOptions { ubatch_size: 48, ..opts(6) });
    let shared = prompt(12, 40);
    let mut live: Vec<(Client, usize)> = Vec::new();
    let mut finished = 0;
    for i in 0..100u64 {
        let len = rng.gen_range(1..60);
        let p = if rng.gen_bool(0.5) { [shared.clone(), prompt(i, len)].concat() } else { prompt(i, len) };
        let client = submit(&mut s, i, request(p, rng.gen_range(1..40))).unwrap();
        live.push((client, rng.gen_range(0..30)));
        for _ in 0..rng.gen_range(0..3) {
            s.step();
        }
        // Drop some streams after a random number of steps.
        live.retain_mut(|(c, ttl)| {
            c.poll();
            if c.done {
                finished += 1;
                return false;
            }
            *ttl = ttl.saturating_sub(1);
            *ttl > 0
        });
    }
    let mut rest: Vec<Client> = live.into_iter().map(|(c, _)| c).collect();
    drain(&mut s, &mut rest);
    let st = s.stats();
    assert_eq!(st.counters.requests, 100);
    assert!(st.counters.requests_cancelled > 10, "cancelled: {}", st.counters.requests_cancelled);
    assert!(finished > 10, "finished: {finished}");
    assert_eq!(st.counters.requests_cancelled + st.counters.requests_finished, 100);
    assert_no_leak(&s);
    s.clear_prefix_cache();
    assert_eq!(s.stats().kv_pages_used, 0, "every page back in the pool");
}

#[test]
fn a_full_queue_refuses_with_queue_full() {
    let mut s = scheduler(CheckingModel::new(64, 16, 1024), EngineOptions { max_queue: 2, ..opts(2) });
    let long = |i| request(prompt(i, 5), 100);
    // Two free slots and two places in the queue.
    let _held: Vec<Client> = (0..4).map(|i| submit(&mut s, i, long(i)).unwrap()).collect();
    assert_eq!(submit(&mut s, 4, long(4)).err(), Some(EngineError::QueueFull { queued: 4 }));
    s.step(); // two are admitted: the queue holds two
    assert_eq!(submit(&mut s, 5, long(5)).err(), Some(EngineError::QueueFull { queued: 2 }));
    assert_eq!(s.stats().queued, 2);
    let mut none_waiting = scheduler(CheckingModel::new(64, 16, 1024), EngineOptions { max_queue: 0, ..opts(1) });
    let _a = submit(&mut none_waiting, 1, long(1)).unwrap();
    assert!(matches!(submit(&mut none_waiting, 2, long(2)), Err(EngineError::QueueFull { .. })));
}

#[test]
fn prompts_that_can_never_fit_are_refused() {
    let mut s = scheduler(CheckingModel::new(8, 16, 100), opts(1));
    let too_long = |n| Some(EngineError::PromptTooLong { prompt_tokens: n, ctx_size: 100 });
    assert_eq!(submit(&mut s, 1, request(prompt(1, 100), 1)).err(), too_long(100));
    assert!(submit(&mut s, 2, request(prompt(1, 99), 1)).is_ok());
    // The pool (128 positions) is bigger than the context here; a smaller pool is the limit.
    let mut small = scheduler(CheckingModel::new(2, 16, 100), opts(1));
    assert_eq!(
        submit(&mut small, 1, request(prompt(1, 40), 1)).err(),
        Some(EngineError::PromptTooLong { prompt_tokens: 40, ctx_size: 32 })
    );
    assert!(matches!(submit(&mut s, 3, request(vec![], 1)).err(), Some(EngineError::Invalid(_))));
    assert!(matches!(submit(&mut s, 4, request(vec![VOCAB as u32], 1)).err(), Some(EngineError::Invalid(_))));
}

#[test]
fn the_context_limit_ends_generation() {
    let mut s = scheduler(CheckingModel::new(64, 16, 50), opts(1));
    let mut c = vec![submit(&mut s, 1, request(prompt(1, 40), 1000)).unwrap()];
    drain(&mut s, &mut c);
    assert_eq!(c[0].got.finish, Some(FinishReason::Length));
    assert_eq!(40 + c[0].got.tokens.len(), 50);
}

#[test]
fn max_tokens_zero_computes_the_prompt_for_the_cache_and_generates_nothing() {
    let mut s = scheduler(CheckingModel::new(64, 16, 1024), opts(1));
    let p = prompt(1, 40);
    let mut c = vec![submit(&mut s, 1, request(p.clone(), 0)).unwrap()];
    drain(&mut s, &mut c);
    assert_eq!(c[0].got.finish, Some(FinishReason::Length));
    assert!(c[0].got.tokens.is_empty());
    let mut d = vec![submit(&mut s, 2, request(p, 1)).unwrap()];
    drain(&mut s, &mut d);
    assert_eq!(d[0].got.usage.cached_tokens, 32);
}

#[test]
fn logprobs_are_the_log_softmax_of_the_logits_row() {
    let mut s = scheduler(CheckingModel::new(64, 16, 1024), opts(1));
    let mut r = request(prompt(1, 10), 3);
    r.logprobs = Some(4);
    let (tx, mut rx) = unbounded_channel();
    s.submit(Submission {
        id: 1,
        request: r,
        events: tx,
        cancel: Default::default(),
        submitted: Instant::now(),
        sampler: None,
    })
    .unwrap();
    while !s.is_idle() {
        s.step();
    }
    let mut n = 0;
    while let Ok(e) = rx.try_recv() {
        if let GenerationEvent::Text { tokens, logprobs, .. } = e {
            assert_eq!(logprobs.len(), tokens.len());
            for lp in logprobs {
                n += 1;
                assert_eq!(lp.top.len(), 4);
                // Greedy: the chosen token is the most likely one.
                assert_eq!(lp.top[0], (lp.token, lp.logprob));
                assert!(lp.logprob < 0.0 && lp.top.windows(2).all(|w| w[0].1 >= w[1].1));
            }
        }
    }
    assert_eq!(n, 3);
    let (lse, top) = log_softmax_top(&[0.0, (2f32).ln(), 0.0], 3);
    assert!((lse - (4f32).ln()).abs() < 1e-6);
    assert_eq!(top.iter().map(|t| t.0).collect::<Vec<_>>(), [1, 0, 2]);
    assert!((top[0].1 - (0.5f32).ln()).abs() < 1e-6);
}

/// Each prompt token's score computed straight from the model's rows: the log-softmax of the row of
/// the position before it.
fn expected_scores(prompt: &[u32], top: usize) -> Vec<TokenLogprob> {
    let mut digest = 0;
    let mut out = Vec::new();
    for (p, &t) in prompt.iter().enumerate() {
        digest = mix(digest, t as u64 + 1);
        if let Some(&next) = prompt.get(p + 1) {
            let row = logits_row(digest);
            let (lse, top) = log_softmax_top(&row, top);
            out.push(TokenLogprob { token: next, logprob: row[next as usize] - lse, top });
        }
    }
    out
}

#[test]
fn prompt_scores_are_each_tokens_log_softmax_whatever_batches_caches_or_preempts_it() {
    let scored = |p: Vec<u32>, max_tokens| {
        let mut r = request(p, max_tokens);
        r.prompt_logprobs = Some(3);
        r
    };
    // Alone, over several prompt chunks beside another request's decode: every token after the
    // first has its score, sent once before any text, and the answer is the unscored one's.
    let long = prompt(40, 300);
    let mut s = scheduler(CheckingModel::new(256, 16, 2048), EngineOptions { ubatch_size: 64, ..opts(2) });
    let mut c = vec![submit(&mut s, 1, request(prompt(41, 5), 30)).unwrap()];
    s.step();
    c.push(submit(&mut s, 2, scored(long.clone(), 4)).unwrap());
    drain(&mut s, &mut c);
    assert_eq!(c[1].got.prompt_scores.as_deref(), Some(&expected_scores(&long, 3)[..]));
    same_answer(&c[1].got, &solo(&request(long.clone(), 4)));
    assert_eq!(c[0].got.prompt_scores, None);
    same_answer(&c[0].got, &solo(&request(prompt(41, 5), 30)));

    // A cached prefix is not reused for a scored prompt (its rows are needed), and max_tokens 0
    // scores without generating; a one-token prompt has nothing to score.
    let mut c =
        vec![submit(&mut s, 3, scored(long.clone(), 0)).unwrap(), submit(&mut s, 4, scored(vec![9], 2)).unwrap()];
    drain(&mut s, &mut c);
    assert_eq!(c[0].got.usage.cached_tokens, 0);
    assert_eq!(c[0].got.prompt_scores.as_deref(), Some(&expected_scores(&long, 3)[..]));
    assert!(c[0].got.tokens.is_empty() && c[0].got.finish == Some(FinishReason::Length));
    assert_eq!(c[1].got.prompt_scores, Some(vec![]));
    // (Its sampling row comes after the other's rows of a scored chunk in the same step.)
    same_answer(&c[1].got, &solo(&request(vec![9], 2)));

    // Preempted part way (a pool too small for all three), each is scored once, whole.
    let prompts: Vec<Vec<u32>> = (0..3).map(|i| prompt(50 + i, 14)).collect();
    let mut s = scheduler(CheckingModel::new(10, 4, 256), EngineOptions { ubatch_size: 8, ..opts(3) });
    let mut c: Vec<Client> =
        prompts.iter().enumerate().map(|(i, p)| submit(&mut s, i as u64, scored(p.clone(), 12)).unwrap()).collect();
    drain(&mut s, &mut c);
    assert!(s.stats().counters.preemptions > 0);
    for (c, p) in c.iter().zip(&prompts) {
        assert_eq!(c.got.prompt_scores.as_deref(), Some(&expected_scores(p, 3)[..]));
        same_answer(&c.got, &solo(&request(p.clone(), 12)));
    }
    assert_no_leak(&s);

    // Preempted while its prompt is being scored (the other's decode takes the pages it was about
    // to fill): the scores so far are kept, the rest come after it is admitted again.
    let (a, b) = (prompt(70, 20), prompt(71, 28));
    let mut s = scheduler(CheckingModel::new(12, 4, 256), EngineOptions { ubatch_size: 4, ..opts(2) });
    let mut c = [submit(&mut s, 1, request(a.clone(), 24)).unwrap(), submit(&mut s, 2, scored(b.clone(), 4)).unwrap()];
    let mut preempted_while_scoring = false;
    for _ in 0..10_000 {
        let before = s.stats().counters.preemptions;
        s.step();
        c.iter_mut().for_each(Client::poll);
        preempted_while_scoring |= s.stats().counters.preemptions > before && c[1].got.prompt_scores.is_none();
        if s.is_idle() {
            break;
        }
    }
    assert!(preempted_while_scoring, "the scored prompt was never preempted part way");
    assert_eq!(c[1].got.prompt_scores.as_deref(), Some(&expected_scores(&b, 3)[..]));
    same_answer(&c[1].got, &solo(&request(b, 4)));
    same_answer(&c[0].got, &solo(&request(a, 24)));
    assert_no_leak(&s);
}

#[test]
fn a_request_for_a_slot_waits_for_that_slot_and_no_other() {
    let pinned = |slot| {
        let mut r = request(prompt(60 + slot as u64, 6), 8);
        r.slot = Some(slot);
        r
    };
    let mut s = scheduler(CheckingModel::new(64, 16, 1024), opts(3));
    // Slot 4 of three is slot 1, as llama-server wraps it.
    let mut c = vec![
        submit(&mut s, 1, pinned(1)).unwrap(),
        submit(&mut s, 2, pinned(4)).unwrap(),
        submit(&mut s, 3, request(prompt(63, 6), 8)).unwrap(),
        submit(&mut s, 4, pinned(2)).unwrap(),
    ];
    s.step();
    c.iter_mut().for_each(Client::poll);
    assert_eq!(c.iter().map(|c| c.got.slot).collect::<Vec<_>>(), [Some(1), None, Some(0), Some(2)]);
    drain(&mut s, &mut c);
    assert_eq!(c[1].got.slot, Some(1), "it ran once its slot was free");
    same_answer(&c[1].got, &solo(&request(prompt(64, 6), 8)));
    assert_no_leak(&s);
}

#[test]
fn stop_strings_end_the_request_and_are_not_shown() {
    let req = request(prompt(2, 10), 30);
    let full = solo(&req);
    // Stop at a piece of text from the middle of the answer.
    let cut = (0..=full.text.len() / 2).rev().find(|&i| full.text.is_char_boundary(i)).unwrap();
    let stop: String = full.text[cut..].chars().take(2).collect();
    let mut r = req.clone();
    r.stop = vec![stop.clone()];
    let got = solo(&r);
    assert_eq!(got.finish, Some(FinishReason::Stop));
    assert!(!got.text.contains(&stop));
    assert!(full.text.starts_with(&got.text));
}

#[test]
fn a_failed_forward_pass_fails_its_batch_and_frees_the_pages() {
    let mut s = scheduler(CheckingModel::new(64, 16, 1024), opts(2));
    let mut c = vec![submit(&mut s, 1, request(prompt(1, 20), 50)).unwrap()];
    s.step();
    s.model.fail_next = true;
    drain(&mut s, &mut c);
    assert!(matches!(c[0].got.error, Some(EngineError::Internal(_))));
    assert_eq!(s.stats().counters.requests_failed, 1);
    // Pages filled before the failure stay cached and correct; the engine keeps serving.
    let again = request(prompt(1, 20), 5);
    let mut d = vec![submit(&mut s, 2, again.clone()).unwrap()];
    drain(&mut s, &mut d);
    same_answer(&d[0].got, &solo(&again));
    assert_no_leak(&s);
}

#[test]
fn slots_report_what_each_sequence_is_doing() {
    let mut s = scheduler(CheckingModel::new(64, 16, 1024), EngineOptions { ubatch_size: 8, ..opts(2) });
    let _a = submit(&mut s, 7, request(prompt(1, 30), 50)).unwrap();
    s.step();
    let st = s.stats();
    assert_eq!(st.slots.len(), 2);
    let busy: Vec<&SlotStats> = st.slots.iter().filter(|x| x.state != SlotState::Idle).collect();
    assert_eq!(busy.len(), 1);
    assert_eq!(
        (busy[0].request, busy[0].state, busy[0].prompt_tokens, busy[0].kv_tokens),
        (Some(7), SlotState::Prefill, 30, 8)
    );
    for _ in 0..5 {
        s.step();
    }
    let st = s.stats();
    let busy = st.slots.iter().find(|x| x.request == Some(7)).unwrap();
    assert_eq!(busy.state, SlotState::Generating);
    assert!(busy.generated_tokens >= 1);
    assert_eq!(st.kv_page_tokens, 16);
    assert_eq!(st.kv_pages_total, 64);
}

/// Greedy and top-k sequences have the backend select their candidates (the largest top-k of the
/// step), and get what whole rows would give; a sequence with penalties or log-probabilities brings
/// the whole rows back for the step.
#[test]
fn steps_bring_back_only_the_top_k_their_samplers_need() {
    let sampled = |top_k: usize, seed: u64| {
        let mut r = request(prompt(seed, 20), 12);
        r.sampling = SamplingParams { temperature: 0.9, top_k, top_p: 0.9, seed: Some(seed), ..Default::default() };
        r
    };
    // What each request gives when every step brings whole rows back (a penalty-free logprobs
    // request rides along in the same steps and forces them).
    let mut whole = scheduler(CheckingModel::new(256, 16, 2048), opts(4));
    let reqs = [request(prompt(1, 9), 12), sampled(40, 2), sampled(7, 3)];
    let mut forcing = request(prompt(4, 30), 40);
    forcing.logprobs = Some(2);
    let mut clients: Vec<Client> =
        reqs.iter().enumerate().map(|(i, r)| submit(&mut whole, i as u64, r.clone()).unwrap()).collect();
    clients.push(submit(&mut whole, 9, forcing).unwrap());
    drain(&mut whole, &mut clients);
    assert!(whole.model().wants.iter().all(|w| *w == RowsWanted::Full), "{:?}", whole.model().wants);

    let mut top = scheduler(CheckingModel::new(256, 16, 2048), opts(4));
    let mut top_clients: Vec<Client> =
        reqs.iter().enumerate().map(|(i, r)| submit(&mut top, i as u64, r.clone()).unwrap()).collect();
    drain(&mut top, &mut top_clients);
    let wants = &top.model().wants;
    assert!(wants.contains(&RowsWanted::Top(40)), "{wants:?}");
    assert!(wants.iter().all(|w| matches!(w, RowsWanted::Top(_))), "{wants:?}");
    for (a, b) in top_clients.iter().zip(&clients) {
        same_answer(&a.got, &b.got);
    }

    let mut penalised = request(prompt(5, 9), 4);
    penalised.sampling.repeat_penalty = 1.3;
    let mut s = scheduler(CheckingModel::new(256, 16, 2048), opts(1));
    let mut c = vec![submit(&mut s, 1, penalised).unwrap()];
    drain(&mut s, &mut c);
    assert!(s.model().wants.iter().all(|w| *w == RowsWanted::Full));

    // Penalties after the top-k: served from the top-k, the survivors moved by the sequence's own
    // tokens — the answer whole rows give (greedy, so a penalty that demotes the best shows).
    // (A long prompt: the model's best tokens are often among those already said.)
    let mut after = request(prompt(6, 120), 12);
    after.sampling.top_k = 3;
    after.sampling.repeat_penalty = 50.0;
    after.sampling.penalty_last_n = 256;
    after.sampling.chain = vec![Step::TopK, Step::Penalties, Step::Temperature];
    let mut forcing = request(prompt(4, 30), 40);
    forcing.logprobs = Some(2);
    let mut s = scheduler(CheckingModel::new(256, 16, 2048), opts(2));
    let mut c = vec![submit(&mut s, 1, after.clone()).unwrap(), submit(&mut s, 2, forcing).unwrap()];
    drain(&mut s, &mut c);
    let mut t = scheduler(CheckingModel::new(256, 16, 2048), opts(1));
    let mut d = vec![submit(&mut t, 1, after.clone()).unwrap()];
    drain(&mut t, &mut d);
    assert!(t.model().wants.iter().all(|w| *w == RowsWanted::Top(3)), "{:?}", t.model().wants);
    same_answer(&d[0].got, &c[0].got);
    let mut unpenalised = after.clone();
    unpenalised.sampling.repeat_penalty = 1.0;
    assert_ne!(solo(&unpenalised).tokens, d[0].got.tokens, "the penalty changes the answer");
}

#[test]
fn a_thought_over_its_budget_is_closed_by_the_engine() {
    let tok = tokenizer();
    let close = tok.encode("\n</think>\n\n", false).unwrap();
    let free = solo(&request(prompt(5, 12), 24));
    let mut req = request(prompt(5, 12), 24);
    req.thought_budget = Some(crate::engine::ThoughtBudget { budget: 4, close: close.clone(), open_at_start: true });
    let capped = solo(&req);
    // Four tokens of thought as the model wrote them, then the close, then the model again.
    assert_eq!(capped.tokens[..4], free.tokens[..4]);
    assert_eq!(capped.tokens[4..4 + close.len()], close[..]);
    assert_eq!(capped.tokens.len(), 24);
    assert!(capped.text.contains("</think>"), "{:?}", capped.text);
    // A thought the prompt did not open (the text does not start with <think>) is not capped.
    req.thought_budget = Some(crate::engine::ThoughtBudget { budget: 4, close, open_at_start: false });
    assert_eq!(solo(&req).tokens, free.tokens);
}
