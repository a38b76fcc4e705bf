//! llama-server's `samplers`: which samplers run, in what order, by name (`["top_k", "top_p",
//! "infill"]`) or by letter (`"kpt"`). Here the order is fixed — penalties, top-k, top-p, infill,
//! min-p, temperature — so a list must keep it; the samplers it leaves out are off, as in
//! llama-server, where only the listed ones run before the final draw (without `temperature`, the
//! draw weighs the survivors by their raw logits, at temperature 1). Samplers this server lacks
//! (DRY, typical-p, XTC, top-n-sigma) may be named: each is refused by its own settings when they
//! would switch it on, as without a list. Names llama-server does not know either are skipped, as it
//! skips them (older web UIs still send `tfs_z`); `adaptive_p`, which would replace the draw, is
//! refused.

use serde_json::Value;

use super::error::ApiError;
use crate::engine::SamplingParams;

/// This server's samplers, in the order they run.
const ORDER: [&str; 6] = ["penalties", "top_k", "top_p", "infill", "min_p", "temperature"];
/// llama-server's samplers that this server does not have (off at their default settings).
const LACKING: [&str; 4] = ["dry", "typ_p", "xtc", "top_n_sigma"];

/// The canonical names in a `samplers` value (unknown ones left out), or why it is not one.
fn names(v: &Value) -> Result<Vec<String>, String> {
    let letter = |c: char| -> Result<Option<&'static str>, String> {
        Ok(Some(match c {
            'e' => "penalties",
            'd' => "dry",
            'k' => "top_k",
            'y' => "typ_p",
            'p' => "top_p",
            'm' => "min_p",
            'x' => "xtc",
            't' => "temperature",
            's' => "top_n_sigma",
            'i' => "infill",
            'a' => return Err("the adaptive-p sampler is not implemented".into()),
            _ => return Ok(None),
        }))
    };
    let named = |n: &Value| -> Result<Option<String>, String> {
        let n = n.as_str().ok_or("expected sampler names (strings)")?;
        let name = n.trim().to_lowercase().replace('-', "_");
        Ok(match name.as_str() {
            "topk" => Some("top_k"),
            "topp" | "nucleus" => Some("top_p"),
            "minp" => Some("min_p"),
            "temp" => Some("temperature"),
            "typ" | "typp" | "typical_p" => Some("typ_p"),
            "topnsigma" => Some("top_n_sigma"),
            "adaptive_p" | "adaptivep" => return Err("the adaptive-p sampler is not implemented".into()),
            n if ORDER.contains(&n) || LACKING.contains(&n) => Some(n),
            _ => None,
        }
        .map(str::to_string))
    };
    let listed: Result<Vec<Option<String>>, String> = match v {
        Value::String(s) => s.chars().map(|c| letter(c).map(|n| n.map(str::to_string))).collect(),
        Value::Array(list) => list.iter().map(named).collect(),
        _ => Err("expected a list of sampler names or a string of their letters".into()),
    };
    Ok(listed?.into_iter().flatten().collect())
}

/// The samplers of this server a `samplers` value lists, in order, or why it cannot be run here.
fn ours(v: &Value) -> Result<Vec<&'static str>, String> {
    let listed = names(v)?;
    let ours: Vec<&'static str> = listed.iter().filter_map(|n| ORDER.iter().find(|o| *o == n).copied()).collect();
    // (A name given twice runs once: a sampler run again on its own output changes nothing.)
    let mut next = 0;
    for name in &ours {
        match ORDER[next..].iter().position(|o| o == name) {
            Some(at) => next += at,
            None => {
                return Err(format!(
                    "samplers run here in the order {}; [{}] does not keep it",
                    ORDER.join(", "),
                    ours.join(", ")
                ))
            }
        }
    }
    Ok(ours)
}

/// Runs only the samplers `v` lists: the others of this server are switched off in `p`.
pub fn apply(v: &Value, p: &mut SamplingParams) -> Result<(), ApiError> {
    let ours = ours(v).map_err(|e| ApiError::field("samplers", e))?;
    let on = |name: &str| ours.contains(&name);
    if !on("penalties") {
        (p.repeat_penalty, p.presence_penalty, p.frequency_penalty) = (1.0, 0.0, 0.0);
    }
    if !on("top_k") {
        p.top_k = 0;
    }
    if !on("top_p") {
        p.top_p = 1.0;
    }
    if !on("min_p") {
        p.min_p = 0.0;
    }
    if !on("temperature") {
        p.temperature = 1.0;
    }
    p.infill = on("infill");
    Ok(())
}

/// Whether `v` lists all of this server's samplers but infill in their order (penalties may go
/// unnamed, as llama.cpp's web UI leaves them): a list that changes nothing, whatever it says of
/// the samplers this server lacks.
pub fn is_default_order(v: &Value) -> bool {
    let Ok(ours) = ours(v) else { return false };
    let all = ["penalties", "top_k", "top_p", "min_p", "temperature"];
    ours == all || ours == all[1..]
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn applied(v: Value) -> Result<SamplingParams, ApiError> {
        let mut p = SamplingParams { repeat_penalty: 1.1, ..Default::default() };
        apply(&v, &mut p).map(|_| p)
    }

    #[test]
    fn listed_samplers_run_and_the_rest_are_off() {
        // llama.vim's fill-in-the-middle chain.
        let p = applied(json!(["top_k", "top_p", "infill"])).unwrap();
        assert_eq!(
            (p.top_k, p.top_p, p.min_p, p.temperature, p.infill, p.repeat_penalty),
            (40, 0.95, 0.0, 1.0, true, 1.0)
        );
        // Its chat chain, and an empty list (the draw alone).
        let p = applied(json!(["min_p", "temperature"])).unwrap();
        assert_eq!((p.top_k, p.top_p, p.min_p, p.temperature, p.infill), (0, 1.0, 0.05, 0.8, false));
        let p = applied(json!([])).unwrap();
        assert_eq!((p.top_k, p.top_p, p.min_p, p.temperature), (0, 1.0, 0.0, 1.0));
        // llama.cpp's web UI: every sampler, by letter; names in other spellings.
        let p = applied(json!("edkypmxt")).unwrap();
        assert_eq!((p.top_k, p.top_p, p.min_p, p.temperature, p.repeat_penalty), (40, 0.95, 0.05, 0.8, 1.1));
        assert!(applied(json!(["Top-K", "nucleus", "temp"])).is_ok());
        // Names llama-server does not know are skipped, as there (an older web UI's list).
        let p = applied(json!(["top_k", "tfs_z", "typical_p", " top_p", "min_p", "temperature"])).unwrap();
        assert_eq!((p.top_k, p.top_p, p.min_p, p.temperature), (40, 0.95, 0.05, 0.8));
        assert!(applied(json!("kfpmt")).is_ok() && applied(json!(["top_k", "top_k", "top_p"])).is_ok());
        assert!(is_default_order(&json!("edkypmxt")) && is_default_order(&json!("kpmt")));
        assert!(!is_default_order(&json!(["top_k", "top_p", "infill"])));
    }

    #[test]
    fn another_order_or_adaptive_p_is_refused_by_name() {
        for (v, says) in [
            (json!(["temperature", "top_k"]), "order"),
            (json!(["top_k", "adaptive_p"]), "adaptive-p"),
            (json!("kpa"), "adaptive-p"),
            (json!([1]), "names"),
        ] {
            let e = applied(v.clone()).unwrap_err();
            assert_eq!(e.param.as_deref(), Some("samplers"));
            assert!(e.message.contains(says), "{v}: {}", e.message);
        }
    }
}
