//! The batching engine on the real runner and CPU backend: the tiny qwen3 fixture for fast,
//! deterministic checks, SmolLM2-135M for the real-model ones (skipped without MLXCEL_TEST_MODELS).
//! Needs the staged plugins (`cargo xtask build`).

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use mlxcel::engine::{
    Engine, EngineError, EngineHandle, EngineOptions, EngineStats, FinishReason, GenerationEvent, GenerationRequest,
    ModelRunner, RequestStream, RunnerOptions, SamplingParams, Usage,
};
use mlxcel::text::{ChatMessage, TextTokenizer};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

fn fixture() -> PathBuf {
    mlxcel::testing::workspace_root().join("families/llama/tests/fixtures/qwen3-f32")
}

/// An engine over the model in `dir`; `pool_seqs` full contexts of KV pages.
fn start(dir: &Path, ctx_size: usize, pool_seqs: usize, opts: EngineOptions) -> (EngineHandle, Arc<TextTokenizer>) {
    let ropts = RunnerOptions { ctx_size, parallel: pool_seqs, threads: 2, ..Default::default() };
    let runner = ModelRunner::load(&mlxcel::testing::staged_catalog(), dir, &ropts)
        .unwrap_or_else(|e| panic!("{}: {e:#}", dir.display()));
    let tok = Arc::new(
        TextTokenizer::load(dir, &runner.checkpoint.config, runner.checkpoint.generation_config.as_ref()).unwrap(),
    );
    (Engine::start(runner, tok.clone(), opts).unwrap(), tok)
}

#[derive(Debug, Default)]
struct Answer {
    text: String,
    tokens: Vec<u32>,
    finish: Option<FinishReason>,
    usage: Usage,
}

fn collect(mut s: RequestStream) -> Answer {
    let mut a = Answer::default();
    while let Some(e) = s.blocking_next() {
        match e {
            GenerationEvent::Text { text, tokens, .. } => {
                a.text.push_str(&text);
                a.tokens.extend(tokens);
            }
            GenerationEvent::Started { .. }
            | GenerationEvent::PromptProgress { .. }
            | GenerationEvent::PromptLogprobs(_)
            | GenerationEvent::EndToken(_) => {}
            GenerationEvent::Done { finish, usage } => {
                a.finish = Some(finish);
                a.usage = usage;
            }
            GenerationEvent::Error(e) => panic!("request failed: {e}"),
        }
    }
    a
}

fn greedy(prompt: Vec<u32>, max_tokens: usize) -> GenerationRequest {
    let mut r = GenerationRequest::new(prompt, SamplingParams::greedy(), max_tokens);
    r.ignore_eos = true;
    r
}

fn random_prompt(seed: u64, len: usize) -> Vec<u32> {
    let mut rng = StdRng::seed_from_u64(seed);
    (0..len).map(|_| rng.gen_range(3..320)).collect()
}

/// Waits until the engine is idle and returns its stats.
fn idle_stats(engine: &EngineHandle) -> EngineStats {
    let t0 = Instant::now();
    loop {
        let st = engine.stats();
        if st.busy_slots() == 0 && st.queued == 0 {
            return st;
        }
        assert!(t0.elapsed() < Duration::from_secs(60), "the engine did not go idle: {st:?}");
        std::thread::sleep(Duration::from_millis(5));
    }
}

fn opts(parallel: usize) -> EngineOptions {
    EngineOptions { parallel, ..Default::default() }
}

#[test]
fn fixture_concurrent_greedy_requests_match_their_solo_runs() {
    let reqs: Vec<GenerationRequest> =
        (0..8).map(|i| greedy(random_prompt(i, 3 + 29 * i as usize), 12 + i as usize)).collect();
    let (solo, _) = start(&fixture(), 512, 1, opts(1));
    let want: Vec<Answer> = reqs.iter().map(|r| collect(solo.submit(r.clone()).unwrap())).collect();
    solo.shutdown();

    let (engine, _) = start(&fixture(), 512, 8, EngineOptions { ubatch_size: 64, ..opts(8) });
    let streams: Vec<RequestStream> = reqs.iter().map(|r| engine.submit(r.clone()).unwrap()).collect();
    let got: Vec<Answer> = streams.into_iter().map(collect).collect();
    for (i, (g, w)) in got.iter().zip(&want).enumerate() {
        assert_eq!(g.tokens, w.tokens, "request {i}: batched vs alone");
        assert_eq!(g.text, w.text, "request {i}");
        assert_eq!(g.finish, Some(FinishReason::Length));
    }
    let st = idle_stats(&engine);
    assert!(st.counters.steps < want.iter().map(|w| w.tokens.len() as u64).sum::<u64>(), "requests shared steps");
    assert_eq!(st.kv_pages_used, st.kv_pages_cached);
}

#[test]
fn fixture_shared_prefix_is_served_from_the_cache_with_the_same_output() {
    // 25 whole pages and 7 positions of the 26th, which the second request copies from the first's.
    let prefix = random_prompt(40, 407);
    let req = |seed| greedy([prefix.clone(), random_prompt(seed, 12)].concat(), 10);
    let (engine, _) = start(&fixture(), 512, 2, opts(2));
    let first = collect(engine.submit(req(1)).unwrap());
    assert_eq!(first.usage.cached_tokens, 0);
    let second = collect(engine.submit(req(2)).unwrap());
    assert!(second.usage.cached_tokens >= 407, "cached {}", second.usage.cached_tokens);

    let mut uncached = req(2);
    uncached.cache_prompt = false;
    let reference = collect(engine.submit(uncached).unwrap());
    assert_eq!(reference.usage.cached_tokens, 0);
    assert_eq!(second.tokens, reference.tokens, "cached prefix vs recomputed");
    assert_eq!(idle_stats(&engine).counters.cache_hit_tokens as usize, second.usage.cached_tokens);
}

#[test]
fn fixture_small_kv_budget_evicts_and_preempts_without_changing_answers() {
    let reqs: Vec<GenerationRequest> = (0..4).map(|i| greedy(random_prompt(60 + i, 20 + 5 * i as usize), 30)).collect();
    let (solo, _) = start(&fixture(), 512, 1, opts(1));
    let want: Vec<Answer> = reqs.iter().map(|r| collect(solo.submit(r.clone()).unwrap())).collect();
    solo.shutdown();
    // One 96-token context of pages (6 × 16) for four requests that each grow to 50-65 tokens.
    let (engine, _) = start(&fixture(), 96, 1, opts(4));
    for round in 0..2 {
        let streams: Vec<RequestStream> = reqs.iter().map(|r| engine.submit(r.clone()).unwrap()).collect();
        for (i, (s, w)) in streams.into_iter().zip(&want).enumerate() {
            assert_eq!(collect(s).tokens, w.tokens, "round {round}, request {i}");
        }
    }
    let st = idle_stats(&engine);
    assert!(st.counters.preemptions > 0);
    assert_eq!(st.kv_pages_used, st.kv_pages_cached, "no pages held but the cache's");
}

#[test]
fn fixture_dropping_the_stream_frees_the_pages() {
    let (engine, _) = start(&fixture(), 512, 1, EngineOptions { ubatch_size: 16, batch_size: 16, ..opts(2) });
    let mut s = engine.submit(greedy(random_prompt(70, 50), 400)).unwrap();
    assert!(matches!(s.blocking_next(), Some(GenerationEvent::Started { cached_tokens: 0, slot: 0 })));
    // The prompt's progress, one event per 16-token chunk, up to the whole prompt.
    let mut seen = vec![];
    while seen.last() != Some(&50) {
        match s.blocking_next() {
            Some(GenerationEvent::PromptProgress { processed, total: 50, cached: 0, .. }) => seen.push(processed),
            e => panic!("expected prompt progress, got {e:?}"),
        }
    }
    assert_eq!(seen, [16, 32, 48, 50]);
    for _ in 0..5 {
        assert!(matches!(s.blocking_next(), Some(GenerationEvent::Text { .. })));
    }
    assert!(engine.stats().kv_pages_used > 3);
    drop(s);
    let st = idle_stats(&engine);
    assert_eq!(st.kv_pages_used, st.kv_pages_cached);
    assert_eq!(st.counters.requests_cancelled, 1);
    engine.clear_prefix_cache();
    let t0 = Instant::now();
    while engine.stats().kv_pages_used > 0 {
        assert!(t0.elapsed() < Duration::from_secs(10), "the cache kept its pages");
        std::thread::sleep(Duration::from_millis(5));
    }
}

#[test]
fn fixture_hundred_requests_with_random_disconnects_leak_no_pages() {
    let (engine, _) = start(&fixture(), 128, 2, EngineOptions { ubatch_size: 64, max_queue: 1000, ..opts(4) });
    let shared = random_prompt(80, 40);
    let mut rng = StdRng::seed_from_u64(81);
    let mut handles = Vec::new();
    for i in 0..100u64 {
        let len = rng.gen_range(1..50);
        let p =
            if rng.gen_bool(0.5) { [shared.clone(), random_prompt(i, len)].concat() } else { random_prompt(i, len) };
        let mut s = engine.submit(greedy(p, rng.gen_range(1..30))).unwrap();
        let keep = rng.gen_range(0..12);
        handles.push(std::thread::spawn(move || {
            // Read `keep` events (prompt progress aside), then hang up (or read to the end).
            let mut read = 0;
            while read < keep {
                match s.blocking_next() {
                    None => return true,
                    Some(GenerationEvent::PromptProgress { .. }) => {}
                    Some(_) => read += 1,
                }
            }
            false
        }));
    }
    let ended: usize = handles.into_iter().map(|h| h.join().unwrap() as usize).sum();
    let st = idle_stats(&engine);
    assert_eq!(st.counters.requests, 100);
    assert_eq!(st.counters.requests_finished + st.counters.requests_cancelled, 100);
    assert!(st.counters.requests_cancelled > 10 && ended > 10, "{:?}", st.counters);
    assert_eq!(st.kv_pages_used, st.kv_pages_cached, "pages leaked");
}

#[test]
fn fixture_full_queue_and_shutdown() {
    let (engine, _) = start(&fixture(), 512, 1, EngineOptions { max_queue: 2, ..opts(1) });
    let long = || greedy(random_prompt(90, 10), 400);
    // One slot and two places in the queue, whether or not the engine has admitted the first yet.
    let streams: Vec<RequestStream> = (0..3).map(|_| engine.submit(long()).unwrap()).collect();
    assert!(matches!(engine.submit(long()), Err(EngineError::QueueFull { .. })));
    engine.shutdown();
    // A request cut with part of its answer ends `Cancelled`; one that never produced a token (the
    // two queued, at least) fails with `ShuttingDown`.
    let mut refused = 0;
    for mut s in streams {
        let (mut tokens, mut end) = (0, None);
        while let Some(e) = s.blocking_next() {
            match e {
                GenerationEvent::Text { tokens: t, .. } => tokens += t.len(),
                GenerationEvent::Done { finish, .. } => end = Some(Ok(finish)),
                GenerationEvent::Error(e) => end = Some(Err(e)),
                _ => {}
            }
        }
        match end {
            Some(Ok(FinishReason::Cancelled)) => assert!(tokens > 0),
            Some(Err(EngineError::ShuttingDown)) => {
                assert_eq!(tokens, 0);
                refused += 1;
            }
            other => panic!("{other:?}"),
        }
    }
    assert!(refused >= 2);
    assert_eq!(engine.submit(long()).err(), Some(EngineError::ShuttingDown));
}

#[test]
fn fixture_drain_lets_requests_in_flight_finish() {
    let (engine, _) = start(&fixture(), 512, 2, opts(1));
    let streams: Vec<RequestStream> =
        (0..2).map(|i| engine.submit(greedy(random_prompt(i, 10), 20)).unwrap()).collect();
    assert!(engine.drain(Duration::from_secs(60)));
    assert_eq!(engine.submit(greedy(vec![5], 1)).err(), Some(EngineError::ShuttingDown));
    for s in streams {
        let a = collect(s);
        assert_eq!((a.finish, a.tokens.len()), (Some(FinishReason::Length), 20));
    }
    engine.shutdown();
}

#[test]
fn fixture_prompt_over_the_context_is_refused() {
    let (engine, _) = start(&fixture(), 64, 1, opts(1));
    assert_eq!(
        engine.submit(greedy(random_prompt(1, 64), 1)).err(),
        Some(EngineError::PromptTooLong { prompt_tokens: 64, ctx_size: 64 })
    );
}

#[test]
fn fixture_dry_tables_are_built_by_the_submitter_not_the_engine_thread() {
    let (engine, _) = start(&fixture(), 512, 1, opts(1));
    let mut p = SamplingParams::greedy();
    p.dry.multiplier = 0.8;
    assert!(!engine.vocab_tables_ready(&p), "no request has asked for DRY yet");
    // Built inside `submit`, before the request reaches the engine thread.
    let stream =
        engine.submit(GenerationRequest { ignore_eos: true, ..GenerationRequest::new(vec![5, 6], p.clone(), 8) });
    assert!(engine.vocab_tables_ready(&p));
    let other =
        SamplingParams { dry: mlxcel::engine::DryParams { sequence_breakers: vec!["x".into()], ..p.dry.clone() }, ..p };
    assert!(!engine.vocab_tables_ready(&other), "another breaker list is another table");
    let a = collect(stream.unwrap());
    assert_eq!((a.finish, a.tokens.len()), (Some(FinishReason::Length), 8));
    engine.shutdown();
}

// ---- SmolLM2-135M-Instruct (4-bit) ----

const SMOLLM2: &str = "smollm2-135m-instruct-mlx-4bit";

fn smollm2(parallel: usize) -> Option<(EngineHandle, Arc<TextTokenizer>)> {
    let dir = mlxcel::testing::test_models()?.join(SMOLLM2);
    Some(start(&dir, 2048, parallel, opts(parallel)))
}

fn chat(tok: &TextTokenizer, system: Option<&str>, user: &str, max_tokens: usize) -> GenerationRequest {
    let mut m = Vec::new();
    if let Some(s) = system {
        m.push(ChatMessage::new("system", s));
    }
    m.push(ChatMessage::new("user", user));
    GenerationRequest::new(tok.chat_prompt(&m).unwrap(), SamplingParams::greedy(), max_tokens)
}

const QUESTIONS: [&str; 8] = [
    "What is the capital of France?",
    "Name three primary colors.",
    "Write a haiku about the sea.",
    "What is 12 times 12?",
    "Explain photosynthesis in one sentence.",
    "List the planets of the solar system in order from the sun.",
    "Who wrote Romeo and Juliet?",
    "Give me a short tip for learning to cook, and explain why it helps beginners.",
];

#[test]
fn smollm2_eight_concurrent_greedy_requests_match_their_solo_answers() {
    let Some((engine, tok)) = smollm2(8) else { return };
    let reqs: Vec<GenerationRequest> =
        QUESTIONS.iter().enumerate().map(|(i, q)| chat(&tok, None, q, 16 + 4 * i)).collect();
    let want: Vec<Answer> = reqs.iter().map(|r| collect(engine.submit(r.clone()).unwrap())).collect();
    assert!(want[0].text.contains("Paris"), "{:?}", want[0].text);
    let streams: Vec<RequestStream> = reqs.iter().map(|r| engine.submit(r.clone()).unwrap()).collect();
    for (i, (s, w)) in streams.into_iter().zip(&want).enumerate() {
        let g = collect(s);
        assert_eq!(g.text, w.text, "request {i} ({:?}): batched vs alone", QUESTIONS[i]);
    }
}

#[test]
fn smollm2_shared_400_token_prefix_comes_from_the_cache() {
    let Some((engine, tok)) = smollm2(2) else { return };
    // A long system prompt shared by two questions.
    let system: String = (1..=60).map(|i| format!("Rule {i}: answer briefly and politely. ")).collect();
    let first = chat(&tok, Some(&system), "What is the capital of France?", 12);
    let second = chat(&tok, Some(&system), "Who wrote Romeo and Juliet?", 12);
    let shared = first.prompt.iter().zip(&second.prompt).take_while(|(a, b)| a == b).count();
    assert!(shared >= 400, "the prompts share {shared} tokens");
    collect(engine.submit(first).unwrap());
    let cached = collect(engine.submit(second.clone()).unwrap());
    assert!(cached.usage.cached_tokens >= 384, "cached {}", cached.usage.cached_tokens);
    let mut uncached = second;
    uncached.cache_prompt = false;
    let reference = collect(engine.submit(uncached).unwrap());
    assert_eq!(cached.text, reference.text);
}

#[test]
fn smollm2_small_kv_budget_evicts_and_preempts_without_changing_answers() {
    let Some(models) = mlxcel::testing::test_models() else { return };
    let dir = models.join(SMOLLM2);
    let (roomy, tok) = start(&dir, 2048, 1, opts(1));
    let reqs: Vec<GenerationRequest> =
        QUESTIONS[..4].iter().map(|q| GenerationRequest { ignore_eos: true, ..chat(&tok, None, q, 40) }).collect();
    let want: Vec<Answer> = reqs.iter().map(|r| collect(roomy.submit(r.clone()).unwrap())).collect();
    roomy.shutdown();
    // 192 positions of KV (12 pages) for four requests of ~80 tokens each, twice over.
    let (engine, _) = start(&dir, 192, 1, opts(4));
    for round in 0..2 {
        let streams: Vec<RequestStream> = reqs.iter().map(|r| engine.submit(r.clone()).unwrap()).collect();
        for (i, (s, w)) in streams.into_iter().zip(&want).enumerate() {
            assert_eq!(collect(s).text, w.text, "round {round}, {:?}", QUESTIONS[i]);
        }
    }
    let st = idle_stats(&engine);
    assert!(st.counters.preemptions > 0, "{:?}", st.counters);
    assert_eq!(st.kv_pages_used, st.kv_pages_cached);
}

/// The warm-up step leaves every page free and changes no answer.
#[test]
fn fixture_warm_up_frees_its_pages_and_changes_no_answer() {
    let dir = fixture();
    let ropts = RunnerOptions { ctx_size: 256, parallel: 2, threads: 2, ..Default::default() };
    let answer = |warm: bool| {
        let mut runner = ModelRunner::load(&mlxcel::testing::staged_catalog(), &dir, &ropts).unwrap();
        let free = runner.pool.free_blocks();
        if warm {
            runner.warm_up().unwrap();
        }
        assert_eq!(runner.pool.free_blocks(), free, "the warm-up step's pages are back");
        let tok = Arc::new(
            TextTokenizer::load(&dir, &runner.checkpoint.config, runner.checkpoint.generation_config.as_ref()).unwrap(),
        );
        let engine = Engine::start(runner, tok, opts(2)).unwrap();
        collect(engine.submit(greedy(random_prompt(7, 40), 12)).unwrap()).tokens
    };
    assert_eq!(answer(true), answer(false));
}

/// The stats a client reads once it has its answer (`/slots`, `/metrics`) no longer show the request:
/// the engine publishes them before it sends the request's end. Each of many requests is checked
/// at once on its end, without waiting.
#[test]
fn a_finished_request_has_left_the_stats_when_its_client_hears_the_end() {
    let (engine, _) = start(&fixture(), 256, 2, EngineOptions { parallel: 2, ..Default::default() });
    for i in 0..200 {
        let mut s = engine.submit(greedy(random_prompt(i, 8 + i as usize % 32), 1 + i as usize % 4)).unwrap();
        while !matches!(s.blocking_next(), Some(GenerationEvent::Done { .. }) | None) {}
        let st = engine.stats();
        assert_eq!((st.busy_slots(), st.queued), (0, 0), "request {i}: {st:?}");
    }
}
