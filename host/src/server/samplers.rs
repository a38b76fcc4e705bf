//! llama-server's sampler settings beyond OpenAI's — typical-p, top-nσ, XTC, DRY, dynamic
//! temperature, Mirostat, `min_keep` — and `samplers`, which lists the samplers that run and their
//! order, by name (`["top_k", "top_p", "infill"]`) or by letter (`"kpt"`). Every generating route
//! reads them with [`parse_body_with`](super::error::parse_body_with), as llama-server reads them on
//! all of its routes; the token-count routes read and drop them; elsewhere they are refused unless at
//! their "off" values (see [`fields`](super::fields)).
//!
//! As in llama-server, names it does not know are skipped (older web UIs still send `tfs_z`);
//! `adaptive_p`, a sampler this server lacks, is refused.
//!
//! The same routes read `id_slot` with them: the slot a request runs in.

use serde::Deserialize;
use serde_json::Value;

use super::error::{ApiError, Shared};
use crate::engine::{SamplingOverrides, SamplingParams, Step};

/// How many recent tokens the repeat penalties read for a request's `repeat_last_n` (llama-server's
/// field, which its OpenAI routes read too): `default` when not given, the whole context (`ctx`) for
/// -1; below that refused, as llama-server refuses it.
pub fn penalty_last_n(asked: Option<i64>, default: usize, ctx: usize) -> Result<usize, ApiError> {
    match asked {
        None => Ok(default),
        Some(-1) => Ok(ctx),
        Some(n) => usize::try_from(n)
            .map_err(|_| ApiError::field("repeat_last_n", format!("repeat_last_n must be -1 or more, got {n}"))),
    }
}

/// The settings, as llama-server's request fields name them.
#[derive(Deserialize, Debug, Default)]
pub struct LlamaSamplers {
    #[serde(alias = "typ_p")]
    pub typical_p: Option<f32>,
    pub top_n_sigma: Option<f32>,
    pub xtc_probability: Option<f32>,
    pub xtc_threshold: Option<f32>,
    pub dynatemp_range: Option<f32>,
    pub dynatemp_exponent: Option<f32>,
    pub min_keep: Option<i64>,
    pub dry_multiplier: Option<f32>,
    pub dry_base: Option<f32>,
    pub dry_allowed_length: Option<i64>,
    pub dry_penalty_last_n: Option<i64>,
    pub dry_sequence_breakers: Option<Vec<String>>,
    pub mirostat: Option<i64>,
    pub mirostat_tau: Option<f32>,
    pub mirostat_eta: Option<f32>,
    pub samplers: Option<Value>,
    /// The slot to run in (-1: any), as llama.vim asks for slot 0.
    #[serde(alias = "slot_id")]
    pub id_slot: Option<i64>,
}

impl Shared for LlamaSamplers {
    /// The request fields this type reads (its serde names and aliases).
    const FIELDS: &'static [&'static str] = &[
        "typical_p",
        "typ_p",
        "top_n_sigma",
        "xtc_probability",
        "xtc_threshold",
        "dynatemp_range",
        "dynatemp_exponent",
        "min_keep",
        "dry_multiplier",
        "dry_base",
        "dry_allowed_length",
        "dry_penalty_last_n",
        "dry_sequence_breakers",
        "mirostat",
        "mirostat_tau",
        "mirostat_eta",
        "samplers",
        "id_slot",
        "slot_id",
    ];
}

impl LlamaSamplers {
    /// These settings over `p` (the rest of the request's sampling), or the field at fault.
    pub fn apply(&self, p: &mut SamplingParams) -> Result<(), ApiError> {
        self.overrides()?.apply_to(p);
        Ok(())
    }

    /// The slot the request asked for (None: any). Past the last slot it wraps, as in llama-server.
    pub fn slot(&self) -> Result<Option<usize>, ApiError> {
        match self.id_slot {
            None | Some(-1) => Ok(None),
            Some(s) => usize::try_from(s)
                .map(Some)
                .map_err(|_| ApiError::field("id_slot", format!("id_slot must be a slot id or -1 (any), got {s}"))),
        }
    }

    /// The settings, checked, as overrides of the request's other sampling fields.
    fn overrides(&self) -> Result<SamplingOverrides, ApiError> {
        let count = |v: Option<i64>, field: &str| {
            v.map(|n| usize::try_from(n).map_err(|_| ApiError::field(field, format!("{field} must be ≥ 0"))))
                .transpose()
        };
        // (llama-server puts a base under 1 back to its default; here it is refused, not ignored.)
        if let Some(b) = self.dry_base.filter(|b| b.is_nan() || *b < 1.0) {
            return Err(ApiError::field("dry_base", format!("dry_base must be at least 1, got {b}")));
        }
        let dry_last_n = match self.dry_penalty_last_n {
            Some(-1) => Some(usize::MAX),
            n => n
                .map(|n| {
                    usize::try_from(n).map_err(|_| {
                        ApiError::field("dry_penalty_last_n", "dry_penalty_last_n must be ≥ -1 (-1: the whole context)")
                    })
                })
                .transpose()?,
        };
        if self.dry_sequence_breakers.as_ref().is_some_and(Vec::is_empty) {
            return Err(ApiError::field(
                "dry_sequence_breakers",
                "dry_sequence_breakers must be a non-empty array of strings",
            ));
        }
        let mirostat =
            self.mirostat
                .map(|m| {
                    u8::try_from(m).ok().filter(|m| *m <= 2).ok_or_else(|| {
                        ApiError::field("mirostat", format!("mirostat must be 0 (off), 1 or 2, got {m}"))
                    })
                })
                .transpose()?;
        let chain = match self.samplers.as_ref().filter(|v| !v.is_null()) {
            Some(list) => Some(chain(list).map_err(|e| ApiError::field("samplers", e))?),
            None => None,
        };
        Ok(SamplingOverrides {
            typical_p: self.typical_p,
            top_n_sigma: self.top_n_sigma,
            xtc_probability: self.xtc_probability,
            xtc_threshold: self.xtc_threshold,
            dynatemp_range: self.dynatemp_range,
            dynatemp_exponent: self.dynatemp_exponent,
            min_keep: count(self.min_keep, "min_keep")?,
            dry_multiplier: self.dry_multiplier,
            dry_base: self.dry_base,
            dry_allowed_length: count(self.dry_allowed_length, "dry_allowed_length")?,
            dry_last_n,
            dry_sequence_breakers: self.dry_sequence_breakers.clone(),
            mirostat,
            mirostat_tau: self.mirostat_tau,
            mirostat_eta: self.mirostat_eta,
            chain,
            ..Default::default()
        })
    }
}

/// The samplers a `samplers` value lists, in order (names llama.cpp does not know skipped), or why
/// it cannot be run here.
fn chain(v: &Value) -> Result<Vec<Step>, String> {
    let listed: Result<Vec<Option<Step>>, String> = match v {
        Value::String(s) => s.chars().map(Step::from_letter).collect(),
        Value::Array(list) => list
            .iter()
            .map(|n| n.as_str().ok_or_else(|| "expected sampler names (strings)".to_string()).and_then(Step::from_name))
            .collect(),
        _ => Err("expected a list of sampler names or a string of their letters".into()),
    };
    Ok(listed?.into_iter().flatten().collect())
}

/// Whether `v` lists the samplers a route that does not read these settings runs anyway: the
/// default order, less the samplers those routes cannot switch on (DRY, typical-p, XTC, top-nσ) and
/// with penalties optional (llama.cpp's web UI sends its whole list everywhere).
pub fn is_default_order(v: &Value) -> bool {
    let Ok(steps) = chain(v) else { return false };
    let on: Vec<Step> =
        steps.into_iter().filter(|s| !matches!(s, Step::Dry | Step::TypicalP | Step::Xtc | Step::TopNSigma)).collect();
    let rest = [Step::TopK, Step::TopP, Step::MinP, Step::Temperature];
    on == rest || on.split_first().is_some_and(|(first, tail)| *first == Step::Penalties && tail == rest)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn applied(v: Value) -> Result<SamplingParams, ApiError> {
        let s: LlamaSamplers = serde_json::from_value(v).unwrap();
        let mut p = SamplingParams::default();
        s.apply(&mut p).map(|_| p)
    }

    #[test]
    fn listed_samplers_run_in_their_order() {
        // llama.vim's fill-in-the-middle chain.
        let p = applied(json!({"samplers": ["top_k", "top_p", "infill"]})).unwrap();
        assert_eq!(p.chain, [Step::TopK, Step::TopP, Step::Infill]);
        assert!(p.infill() && p.validate().is_ok());
        // Any order, as llama-server runs it; letters; other spellings; unknown names skipped.
        let p = applied(json!({"samplers": ["temperature", "Top-K", "tfs_z", "nucleus"]})).unwrap();
        assert_eq!(p.chain, [Step::Temperature, Step::TopK, Step::TopP]);
        let p = applied(json!({"samplers": "edskypmxt"})).unwrap();
        assert_eq!(p.chain, Step::DEFAULT_CHAIN);
        assert!(applied(json!({"samplers": []})).unwrap().chain.is_empty());
        assert!(is_default_order(&json!("edskypmxt")) && is_default_order(&json!("kpmt")));
        assert!(is_default_order(&json!(["top_k", "typ_p", "top_p", "min_p", "temperature"])));
        assert!(!is_default_order(&json!(["top_k", "temperature"])) && !is_default_order(&json!("ektpm")));
    }

    #[test]
    fn llama_server_settings_reach_the_sampler() {
        let p = applied(json!({
            "typical_p": 0.9, "top_n_sigma": 1.5, "xtc_probability": 0.5, "xtc_threshold": 0.2,
            "dynatemp_range": 0.3, "dynatemp_exponent": 2.0, "min_keep": 2, "dry_multiplier": 0.8,
            "dry_base": 1.5, "dry_allowed_length": 3, "dry_penalty_last_n": -1,
            "dry_sequence_breakers": ["\n", "###"], "mirostat": 2, "mirostat_tau": 4.0, "mirostat_eta": 0.2
        }))
        .unwrap();
        assert_eq!((p.typical_p, p.top_n_sigma, p.xtc_probability, p.xtc_threshold), (0.9, 1.5, 0.5, 0.2));
        assert_eq!((p.dynatemp_range, p.dynatemp_exponent, p.min_keep), (0.3, 2.0, 2));
        assert_eq!((p.dry.multiplier, p.dry.base, p.dry.allowed_length, p.dry.last_n), (0.8, 1.5, 3, usize::MAX));
        assert_eq!(p.dry.sequence_breakers, ["\n", "###"]);
        assert_eq!((p.mirostat, p.mirostat_tau, p.mirostat_eta), (2, 4.0, 0.2));
        assert_eq!(applied(json!({"typ_p": 0.5})).unwrap().typical_p, 0.5);
    }

    #[test]
    fn out_of_range_settings_and_adaptive_p_are_refused_by_name() {
        for (v, field, says) in [
            (json!({"samplers": ["top_k", "adaptive_p"]}), "samplers", "adaptive-p"),
            (json!({"samplers": "kpa"}), "samplers", "adaptive-p"),
            (json!({"samplers": [1]}), "samplers", "names"),
            (json!({"mirostat": 3}), "mirostat", "0 (off), 1 or 2"),
            (json!({"dry_base": 0.5}), "dry_base", "at least 1"),
            (json!({"dry_penalty_last_n": -2}), "dry_penalty_last_n", "≥ -1"),
            (json!({"dry_sequence_breakers": []}), "dry_sequence_breakers", "non-empty"),
            (json!({"min_keep": -1}), "min_keep", "≥ 0"),
        ] {
            let e = applied(v.clone()).unwrap_err();
            assert_eq!(e.param.as_deref(), Some(field), "{v}");
            assert!(e.message.contains(says), "{v}: {}", e.message);
        }
    }

    /// `FIELDS` names every field the type reads, so that the routes reading them accept them.
    #[test]
    fn fields_lists_what_the_type_reads() {
        for name in LlamaSamplers::FIELDS {
            let v = if *name == "dry_sequence_breakers" {
                json!(["x"])
            } else if *name == "samplers" {
                json!("k")
            } else {
                json!(1)
            };
            let mut unread = Vec::new();
            let body = serde_json::to_vec(&json!({ *name: v })).unwrap();
            let mut de = serde_json::Deserializer::from_slice(&body);
            let _: LlamaSamplers = serde_ignored::deserialize(&mut de, |p| unread.push(p.to_string())).unwrap();
            assert!(unread.is_empty(), "{name} is not read: {unread:?}");
        }
    }
}
