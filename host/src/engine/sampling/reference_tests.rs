//! The samplers against llama.cpp's own, case by case: `host/tests/fixtures/samplers/llama-samplers.json`
//! holds what llama-cpp-python 0.3.36's bindings of `llama_sampler_apply` leave of fixed rows of
//! logits (its `make_reference.py` says how it was made). Each case here runs the same samplers
//! over the same row and history and must leave the same candidates, in the same order, with the
//! same logits. DRY's cases run over SmolLM2's vocabulary (from `MLXCEL_TEST_MODELS`).

use rand::rngs::StdRng;
use rand::SeedableRng;
use serde_json::Value;

use super::chain::Candidates;
use super::dry::{self, DryBreakers};
use super::params::{DryParams, SamplingParams};
use super::token_texts::TokenTexts;

const REFERENCE: &str = include_str!("../../../tests/fixtures/samplers/llama-samplers.json");

fn cases() -> Vec<Value> {
    let v: Value = serde_json::from_str(REFERENCE).expect("the reference file is JSON");
    v["cases"].as_array().expect("cases").clone()
}

fn f(spec: &Value, key: &str) -> f32 {
    spec[key].as_f64().unwrap_or_else(|| panic!("{spec}: no {key}")) as f32
}

fn u(spec: &Value, key: &str) -> usize {
    spec.get(key).and_then(Value::as_u64).unwrap_or(0) as usize
}

fn ids(v: &Value) -> Vec<u32> {
    v.as_array().unwrap().iter().map(|i| i.as_u64().unwrap() as u32).collect()
}

/// Runs one of the reference's sampler specs over `cand`.
fn apply(spec: &Value, cand: &mut Candidates, history: &[u32], rng: &mut StdRng) {
    match spec["kind"].as_str().unwrap() {
        "top_k" => cand.top_k(u(spec, "k")),
        "top_p" => cand.top_p(f(spec, "p"), u(spec, "min_keep")),
        "min_p" => cand.min_p(f(spec, "p"), u(spec, "min_keep")),
        "typical" => cand.typical(f(spec, "p"), u(spec, "min_keep")),
        "top_n_sigma" => cand.top_n_sigma(f(spec, "n")),
        "xtc" => cand.xtc(f(spec, "probability"), f(spec, "threshold"), u(spec, "min_keep"), rng),
        "temp" => cand.temperature_ext(
            f(spec, "t"),
            spec.get("range").map_or(0.0, |_| f(spec, "range")),
            spec.get("exponent").map_or(1.0, |_| f(spec, "exponent")),
        ),
        "penalties" => {
            let p = SamplingParams {
                penalty_last_n: u(spec, "last_n"),
                repeat_penalty: f(spec, "repeat"),
                frequency_penalty: f(spec, "freq"),
                presence_penalty: f(spec, "present"),
                ..Default::default()
            };
            super::penalize(cand, history, &p);
        }
        "mirostat" => {
            let (tau, eta) = (f(spec, "tau"), f(spec, "eta"));
            let vocab = cand.len();
            cand.mirostat(vocab, tau, eta, &mut (2.0 * tau), rng);
        }
        "mirostat_v2" => {
            let (tau, eta) = (f(spec, "tau"), f(spec, "eta"));
            cand.mirostat_v2(tau, eta, &mut (2.0 * tau), rng);
        }
        k => panic!("unknown sampler {k}"),
    }
}

#[test]
fn samplers_leave_what_llama_cpp_leaves() {
    let mut checked = 0;
    for case in cases().iter().filter(|c| c.get("logits").is_some()) {
        let name = case["name"].as_str().unwrap();
        let row: Vec<f32> = case["logits"].as_array().unwrap().iter().map(|v| v.as_f64().unwrap() as f32).collect();
        let history = ids(&case["history"]);
        let mut cand = Candidates::from_row(&row);
        let mut rng = StdRng::seed_from_u64(1);
        for spec in case["samplers"].as_array().unwrap() {
            apply(spec, &mut cand, &history, &mut rng);
        }
        let expect = &case["expect"];
        let got: Vec<u32> = cand.items.iter().map(|c| c.id).collect();
        assert_eq!(got, ids(&expect["ids"]), "{name}: the candidates left, in order");
        for (c, want) in cand.items.iter().zip(expect["logits"].as_array().unwrap()) {
            let want = want.as_f64().map_or(f32::NEG_INFINITY, |w| w as f32);
            let close = c.logit == want || (want.is_finite() && (c.logit - want).abs() <= 1e-5 * want.abs().max(1.0));
            assert!(close, "{name}: token {} has logit {} where llama.cpp has {want}", c.id, c.logit);
        }
        assert_eq!(cand.sorted, expect["sorted"].as_bool().unwrap(), "{name}: whether they are sorted");
        checked += 1;
    }
    assert!(checked >= 20, "only {checked} cases");
}

#[test]
fn dry_penalises_what_llama_cpp_penalises_over_smollm2s_vocabulary() {
    let Some(models) = crate::testing::test_models() else { return };
    let dir = models.join("smollm2-135m-instruct-mlx-4bit");
    let config: Value = serde_json::from_slice(&std::fs::read(dir.join("config.json")).unwrap()).unwrap();
    let tok = crate::text::TextTokenizer::load(&dir, &config, None).unwrap();
    let texts = TokenTexts::new(&tok);
    let mut checked = 0;
    for case in cases().iter().filter(|c| c.get("text").is_some()) {
        let name = case["name"].as_str().unwrap();
        let spec = &case["samplers"][0];
        let breakers: Vec<String> =
            spec["breakers"].as_array().unwrap().iter().map(|b| b.as_str().unwrap().to_string()).collect();
        let p = DryParams {
            multiplier: f(spec, "multiplier"),
            base: f(spec, "base"),
            allowed_length: u(spec, "allowed_length"),
            last_n: u(spec, "last_n"),
            sequence_breakers: breakers.clone(),
        };
        let history = ids(&case["history"]);
        assert_eq!(tok.encode(case["text"].as_str().unwrap(), false).unwrap(), history, "{name}: the tokenization");
        let table = DryBreakers::new(&tok, &texts, &breakers);
        let n_vocab = case["n_vocab"].as_u64().unwrap() as usize;
        let mut cand = Candidates::from_row(&vec![0.0; n_vocab]);
        dry::penalize(&mut cand, &history, &p, &table);
        let got: Vec<(u32, f32)> = cand.items.iter().filter(|c| c.logit != 0.0).map(|c| (c.id, -c.logit)).collect();
        let want: Vec<(u32, f32)> = case["expect"]["penalties"]
            .as_array()
            .unwrap()
            .iter()
            .map(|e| (e[0].as_u64().unwrap() as u32, e[1].as_f64().unwrap() as f32))
            .collect();
        assert_eq!(got, want, "{name}: the tokens penalised and by how much");
        checked += 1;
    }
    assert!(checked >= 6, "only {checked} DRY cases");
}
