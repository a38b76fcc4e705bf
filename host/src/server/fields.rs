//! Request fields a route does not read. OpenAI's and Anthropic's APIs refuse a field they do not
//! know, and an option this server accepted without acting on it would be a silent lie, so a field
//! outside a route's request type is refused by name — except the ones in [`inert`]: fields clients
//! send routinely (llama.cpp's web UI sends every sampler's settings, OpenAI's SDK users an end-user
//! id) that are accepted at the values where they do nothing, and refused at any other.
//!
//! (A field inside a value the request types read as one of several shapes — a content part, an
//! Anthropic block, a rerank document — is not seen here: serde buffers those values whole. The
//! routes refuse unknown part and block *types* by name.)

use serde_json::{Map, Value};

use super::error::ApiError;

/// A field the request type did not take: `path` as the error names it (`messages[0].name`), `top`
/// its top-level key when it is one.
pub struct Unread {
    pub path: String,
    pub top: Option<String>,
}

impl Unread {
    pub fn of(p: &serde_ignored::Path) -> Unread {
        use serde_ignored::Path;
        let top = match p {
            Path::Map { parent: Path::Root, key } => Some(key.clone()),
            _ => None,
        };
        Unread { path: spell(p), top }
    }
}

fn spell(p: &serde_ignored::Path) -> String {
    use serde_ignored::Path;
    match p {
        Path::Root => String::new(),
        Path::Seq { parent, index } => format!("{}[{index}]", spell(parent)),
        Path::Map { parent, key } => match spell(parent) {
            s if s.is_empty() => key.clone(),
            s => format!("{s}.{key}"),
        },
        Path::Some { parent } | Path::NewtypeStruct { parent } | Path::NewtypeVariant { parent } => spell(parent),
    }
}

/// Accepts `field` where it is an inert field at an inert value, else the error that refuses it.
pub fn check(field: &Unread, body: &Map<String, Value>) -> Result<(), ApiError> {
    let refuse = |why: String| Err(ApiError::field(&field.path, why));
    let Some(name) = field.top.as_deref() else {
        return Err(ApiError::unknown_field(&field.path));
    };
    let value = body.get(name).unwrap_or(&Value::Null);
    // A typed client that writes every field it knows sends the rest as null: not sent.
    if value.is_null() {
        return Ok(());
    }
    match inert(name, value, body) {
        Some(Ok(())) => Ok(()),
        Some(Err(why)) => refuse(format!("`{name}` = {value} is not supported by this server: {why}")),
        None => Err(ApiError::unknown_field(name)),
    }
}

/// Why a sampler setting that would act is refused where it is not read.
const SAMPLER_ROUTES: &str = "llama.cpp's sampler settings are read by the routes that generate text";

/// `Some(Ok)` for a known field at a value where it changes nothing, `Some(Err(why))` for a known
/// field at a value that would act, `None` for a field this server does not know.
fn inert(name: &str, v: &Value, body: &Map<String, Value>) -> Option<Result<(), String>> {
    let num = |x: f64| v.is_null() || v.as_f64() == Some(x);
    let off = |switch: &str, x: f64| body.get(switch).is_none_or(|s| s.is_null() || s.as_f64() == Some(x));
    let ok = |cond: bool, why: &str| if cond { Ok(()) } else { Err(why.to_string()) };
    Some(match name {
        // Like llama-server, any model name is answered by the served model (the routes that report
        // a model echo it back).
        "model" => ok(v.is_null() || v.is_string(), "expected a string"),
        // Bookkeeping for the client (OpenAI's end-user id, OpenAI's and Anthropic's metadata): no
        // effect on an answer here or upstream.
        "user" | "safety_identifier" => ok(v.is_null() || v.is_string(), "expected a string"),
        // A hint for OpenAI's prompt cache; the prefix cache here keys on the tokens themselves.
        "prompt_cache_key" | "prompt_cache_retention" => ok(v.is_null() || v.is_string(), "expected a string"),
        // Anthropic's request-level cache marker: prefixes are cached here without being asked.
        "cache_control" => ok(v.is_null() || v.is_object(), "expected an object"),
        "metadata" => ok(v.is_null() || v.is_object(), "expected an object"),
        "store" => ok(v.is_null() || v == &Value::Bool(false), "completions are not stored"),
        "service_tier" => ok(
            v.is_null() || matches!(v.as_str(), Some("auto" | "default" | "standard_only")),
            "there is one service tier",
        ),
        // OpenAI's answer-length hint for its reasoning models, at its default; and a response run
        // in the background (nothing is stored here to poll), off.
        "verbosity" => ok(v.is_null() || v.as_str() == Some("medium"), "only the default verbosity, medium"),
        "background" => {
            ok(v.is_null() || v == &Value::Bool(false), "responses are not stored to run in the background")
        }
        // Anthropic's: the standard speed is what runs here; the rest of its request fields (server
        // containers, MCP servers, context editing, output settings, routing) are not implemented.
        "speed" => ok(v.as_str() == Some("standard"), "only the standard speed"),
        "output_config" | "container" | "mcp_servers" | "context_management" | "inference_geo" | "diagnostics"
        | "user_profile_id" | "workspace_id" => ok(
            v.as_array().is_some_and(Vec::is_empty) || v.as_object().is_some_and(Map::is_empty),
            "an Anthropic platform feature",
        ),
        // Read by the chat routes; inert where only a template is rendered.
        "parallel_tool_calls" => ok(v.is_boolean(), "expected true or false"),
        "modalities" => ok(v.is_null() || v == &serde_json::json!(["text"]), "this server answers in text only"),
        // llama-server's sampler settings: read by every generating route (and by the token-count
        // routes, which ignore them; see [`samplers`](super::samplers)); elsewhere inert at their
        // "off" values only.
        "typical_p" | "typ_p" => ok(num(1.0), SAMPLER_ROUTES),
        "mirostat" => ok(num(0.0), SAMPLER_ROUTES),
        "mirostat_tau" | "mirostat_eta" => ok(off("mirostat", 0.0), SAMPLER_ROUTES),
        "dry_multiplier" => ok(num(0.0), SAMPLER_ROUTES),
        "dry_base" | "dry_allowed_length" | "dry_penalty_last_n" | "dry_sequence_breakers" => {
            ok(off("dry_multiplier", 0.0), SAMPLER_ROUTES)
        }
        "xtc_probability" => ok(num(0.0), SAMPLER_ROUTES),
        "xtc_threshold" => ok(off("xtc_probability", 0.0), SAMPLER_ROUTES),
        "top_n_sigma" => ok(v.is_null() || v.as_f64().is_some_and(|x| x <= 0.0), SAMPLER_ROUTES),
        "dynatemp_range" => ok(num(0.0), SAMPLER_ROUTES),
        "dynatemp_exponent" => ok(off("dynatemp_range", 0.0), SAMPLER_ROUTES),
        "min_keep" => ok(num(0.0), SAMPLER_ROUTES),
        "samplers" => ok(v.is_null() || super::samplers::is_default_order(v), SAMPLER_ROUTES),
        // Tokens kept when the context shifts: this server never shifts (generation stops at the end
        // of the context), as llama-server without --context-shift.
        "n_keep" => ok(v.is_null() || v.is_i64(), "expected an integer"),
        // A slot asked for by id: the generating routes run the request there (see `samplers`);
        // inert elsewhere, as in llama-server.
        "id_slot" | "slot_id" => ok(v.as_i64().is_some_and(|s| s >= -1), "expected a slot id (-1: any)"),
        // llama-server parses this but does not act on it (a TODO there); editors send it.
        "t_max_prompt_ms" => ok(v.is_number(), "expected a number"),
        // Older llama-server clients' fields, at the values that do nothing.
        "penalize_nl" => ok(v == &Value::Bool(false), "newline penalties are not implemented"),
        "tfs_z" => ok(num(1.0), "tail-free sampling is not implemented (1.0 turns it off)"),
        "image_data" => ok(v.as_array().is_some_and(Vec::is_empty), "images are not supported"),
        "api_key" => ok(v.as_str() == Some(""), "send API keys in the Authorization or x-api-key header"),
        "t_max_predict_ms" | "n_indent" => {
            ok(v.is_null() || v.as_f64().is_some_and(|x| x <= 0.0), "read by /completion and /infill only")
        }
        // llama-server ignores it on its OpenAI-style answers (llama.vim sends it with chat warm-ups).
        "response_fields" => ok(v.is_array(), "expected a list of field paths"),
        "post_sampling_probs" => {
            ok(v.is_null() || v == &Value::Bool(false), "probabilities are reported before sampling")
        }
        "backend_sampling" => ok(v.is_null() || v == &Value::Bool(false), "not implemented"),
        // Read by the routes that have them (llama-server's generating routes; reasoning on chat);
        // elsewhere inert at their "off" values.
        "timings_per_token" | "return_progress" => {
            ok(v.is_null() || v == &Value::Bool(false), "not available on this route")
        }
        "reasoning_format" => {
            ok(v.is_null() || v.as_str() == Some("none"), "reasoning is split from the answer on the chat routes only")
        }
        "lora" => ok(v.is_null() || v.as_array().is_some_and(Vec::is_empty), "LoRA adapters are not implemented"),
        "grammar" => ok(
            v.is_null() || v.as_str() == Some(""),
            "GBNF grammars are not implemented; a JSON schema (`json_schema`, `response_format`) is",
        ),
        "json_schema" => ok(
            v.is_null() || v.as_object().is_some_and(Map::is_empty),
            "not on this route (chat completions, /completion and /infill take it)",
        ),
        "response_format" => ok(
            v.is_null() || v.get("type").and_then(Value::as_str) == Some("text"),
            "not on this route (chat completions take it; /v1/responses takes text.format)",
        ),
        _ => return None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn body(v: Value) -> Map<String, Value> {
        v.as_object().unwrap().clone()
    }

    fn top(name: &str) -> Unread {
        Unread { path: name.into(), top: Some(name.into()) }
    }

    #[test]
    fn inert_values_pass_and_acting_ones_are_refused_by_name() {
        let b =
            body(json!({"mirostat": 0, "mirostat_tau": 5.0, "typical_p": 1.0, "user": "u1", "dry_multiplier": 0.8}));
        for f in ["mirostat", "mirostat_tau", "typical_p", "user"] {
            check(&top(f), &b).unwrap();
        }
        let e = check(&top("dry_multiplier"), &b).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("dry_multiplier"));
        assert!(e.message.contains("routes that generate"), "{}", e.message);
        // A sampler's setting is inert only while the sampler is off.
        let b = body(json!({"mirostat": 2, "mirostat_tau": 5.0}));
        assert!(check(&top("mirostat_tau"), &b).is_err());
        let e = check(&top("frobnicate"), &body(json!({"frobnicate": 1}))).unwrap_err();
        assert_eq!(e.message, "Unrecognized request argument supplied: frobnicate");
        let nested = Unread { path: "messages[0].colour".into(), top: None };
        assert!(check(&nested, &b).unwrap_err().message.contains("messages[0].colour"));
    }
}
