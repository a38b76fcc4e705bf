//! Constrained decoding (structured outputs): an answer held to a JSON schema, token by token.
//! llguidance keeps the grammar's state and says, before each token, which of the vocabulary's
//! tokens keep the text inside the grammar; the engine sets the others' logits to -inf before
//! sampling. The token trie behind it is built once per tokenizer, at the first constrained request.

use std::fmt;
use std::sync::Arc;

use llguidance::api::TopLevelGrammar;
use llguidance::toktrie::{ApproximateTokEnv, TokEnv, TokRxInfo, TokTrie};
use llguidance::{Matcher, ParserFactory};
use serde_json::Value;

use super::TextTokenizer;

/// What compiles grammars against one tokenizer's vocabulary.
pub struct Grammars {
    factory: ParserFactory,
    eos_ids: Vec<u32>,
    vocab: u32,
}

impl Grammars {
    /// The vocabulary as bytes: special tokens marked so that no grammar's text can spell them
    /// (only the ends of sequence, which a grammar allows when the answer may end).
    pub fn new(tok: &TextTokenizer) -> anyhow::Result<Grammars> {
        let Some(&eos) = tok.eos_ids.first() else {
            anyhow::bail!("the tokenizer names no end-of-sequence token, which a constrained answer ends with");
        };
        let added = tok.inner.get_added_vocabulary().get_added_tokens_decoder();
        let n = tok.id_count();
        let words: Vec<Vec<u8>> = (0..n)
            .map(|id| match added.get(&id).filter(|a| a.special) {
                Some(a) => [&[TokTrie::SPECIAL_TOKEN_MARKER], a.content.as_bytes()].concat(),
                None if tok.inner.id_to_token(id).is_none() => Vec::new(),
                None => tok.piece_bytes(id),
            })
            .collect();
        let trie = TokTrie::from(&TokRxInfo::new(n, eos), &words);
        let env: TokEnv = Arc::new(ApproximateTokEnv::new(trie));
        let mut factory = ParserFactory::new_simple(&env)?;
        factory.quiet();
        Ok(Grammars { factory, eos_ids: tok.eos_ids.clone(), vocab: n })
    }

    /// A constraint that holds the answer to JSON matching `schema` (`{"type": "object"}` for any
    /// object); Err says what is wrong with the schema.
    pub fn json_schema(&self, schema: &Value) -> Result<Constraint, String> {
        let mut schema = schema.clone();
        close_objects(&mut schema);
        // Compact JSON, as OpenAI's structured outputs come: with whitespace allowed between its
        // tokens a small model wanders (newlines, spaces until its token limit). A schema's own
        // `x-guidance` options win.
        if let Some(o) = schema.as_object_mut().filter(|o| !o.contains_key("x-guidance")) {
            o.insert("x-guidance".into(), serde_json::json!({"whitespace_flexible": false}));
        }
        self.compile(TopLevelGrammar::from_json_schema(schema))
    }

    /// A constraint that holds the answer to a grammar in llguidance's Lark syntax.
    pub fn lark(&self, grammar: &str) -> Result<Constraint, String> {
        self.compile(TopLevelGrammar::from_lark(grammar.to_string()))
    }

    fn compile(&self, grammar: TopLevelGrammar) -> Result<Constraint, String> {
        let parser = self.factory.create_parser(grammar).map_err(|e| format!("{e:#}"))?;
        let matcher = Matcher::new(Ok(parser));
        if let Some(e) = matcher.get_error() {
            return Err(e);
        }
        // A grammar no text can match (a schema that only refers to itself) compiles, and fails at
        // its first mask: asked here, so that it is refused with the request, not mid-answer.
        if let Err(e) = matcher.clone().compute_mask_or_eos() {
            return Err(format!("it fails at its first token ({})", short(&e)));
        }
        Ok(Constraint { matcher, eos_ids: self.eos_ids.clone(), vocab: self.vocab })
    }
}

/// Objects that list their `properties` and say nothing of others take no others, as llama.cpp's
/// schema grammars hold them (JSON Schema would allow any key): held to an open object, a model
/// writes keys of its own, repeats them and may never close it. Only plain objects are closed: one
/// combined with other schemas (`allOf`, `anyOf`, `oneOf`, `$ref`, `if`, `not`, …), which must all
/// hold together, keeps its keys open to theirs, and so do the branches of an object's own `anyOf`
/// and the definitions of a schema that uses `allOf` (its branches refer to them). A property named
/// `properties` is a name, not a keyword.
pub(crate) fn close_objects(schema: &mut Value) {
    let defs_closed = !serde_json::to_string(schema).is_ok_and(|t| t.contains("\"allOf\""));
    close(schema, defs_closed);
}

const COMBINED: [&str; 9] = ["allOf", "anyOf", "oneOf", "$ref", "if", "then", "else", "not", "dependentSchemas"];

fn close(schema: &mut Value, defs_closed: bool) {
    let Some(o) = schema.as_object_mut() else { return };
    let open_keys = ["additionalProperties", "patternProperties", "unevaluatedProperties"];
    let has_properties = o.get("properties").is_some_and(Value::is_object);
    if has_properties && !open_keys.iter().chain(&COMBINED).any(|k| o.contains_key(*k)) {
        o.insert("additionalProperties".into(), Value::Bool(false));
    }
    for (key, v) in o.iter_mut() {
        match key.as_str() {
            "items" | "additionalProperties" | "contains" | "additionalItems" => close(v, defs_closed),
            "prefixItems" => v.as_array_mut().into_iter().flatten().for_each(|s| close(s, defs_closed)),
            // Alternatives beside no keys of the object's own are whole schemas each.
            "anyOf" | "oneOf" if !has_properties => {
                v.as_array_mut().into_iter().flatten().for_each(|s| close(s, defs_closed))
            }
            "properties" => {
                v.as_object_mut().into_iter().flat_map(|m| m.values_mut()).for_each(|s| close(s, defs_closed))
            }
            "$defs" | "definitions" if defs_closed => {
                v.as_object_mut().into_iter().flat_map(|m| m.values_mut()).for_each(|s| close(s, defs_closed))
            }
            _ => {}
        }
    }
}

/// llguidance's errors follow their first line with a dump of the parser's state.
fn first_line(e: &str) -> &str {
    e.lines().next().unwrap_or(e)
}

/// A grammar's error: its first line for the client, the whole (with the parser's state) in the
/// debug log.
fn short(e: &impl fmt::Display) -> String {
    let e = format!("{e:#}");
    tracing::debug!("grammar error: {e}");
    first_line(&e).to_string()
}

/// One answer's grammar state.
#[derive(Clone)]
pub struct Constraint {
    matcher: Matcher,
    eos_ids: Vec<u32>,
    /// The tokenizer's vocabulary (a model's rows may be longer: padding no text can use).
    vocab: u32,
}

impl fmt::Debug for Constraint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Constraint")
    }
}

impl Constraint {
    /// Sets the logit of every token the grammar does not allow next to -inf; the ends of sequence
    /// are allowed where the answer may end (and are all that is allowed once it must).
    pub fn mask(&mut self, row: &mut [f32]) -> Result<(), String> {
        let mask = self.matcher.compute_mask_or_eos().map_err(|e| short(&e))?;
        let may_end = self.eos_ids.iter().any(|&t| t < self.vocab && mask.is_allowed(t));
        // Every end of sequence may end the answer where one may (the grammar knows one of them).
        let ends: Vec<(usize, f32)> =
            self.eos_ids.iter().filter_map(|&t| row.get(t as usize).map(|&l| (t as usize, l))).collect();
        // A word of the mask at a time: most are all allowed or all not.
        let words = mask.as_slice();
        for (w, chunk) in row.chunks_mut(32).enumerate() {
            match words.get(w).copied().unwrap_or(0) {
                u32::MAX => {}
                0 => chunk.fill(f32::NEG_INFINITY),
                bits => {
                    for (b, l) in chunk.iter_mut().enumerate() {
                        if bits >> b & 1 == 0 {
                            *l = f32::NEG_INFINITY;
                        }
                    }
                }
            }
        }
        // (Past the vocabulary the mask's last word may have bits set; no token lives there.)
        row.iter_mut().skip(self.vocab as usize).for_each(|l| *l = f32::NEG_INFINITY);
        for (t, l) in ends {
            row[t] = if may_end { l } else { f32::NEG_INFINITY };
        }
        Ok(())
    }

    /// Whether the answer may end here (the grammar is satisfied).
    pub fn may_end(&mut self) -> bool {
        self.matcher.is_accepting().unwrap_or(false)
    }

    /// Whether the grammar is complete and allows nothing more (the answer is done).
    pub fn finished(&self) -> bool {
        self.matcher.is_stopped()
    }

    /// Moves the grammar on past `token` (an end of sequence ends the answer and needs nothing).
    pub fn accept(&mut self, token: u32) -> Result<(), String> {
        if self.eos_ids.contains(&token) {
            return Ok(());
        }
        self.matcher.consume_token(token).map_err(|e| short(&e))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn objects_that_list_their_properties_take_no_others() {
        let mut s = json!({"type": "object", "properties": {
            "properties": {"type": "object", "properties": {"a": {"type": "integer"}}},
            "list": {"type": "array", "items": {"type": "object", "properties": {}}},
            "open": {"type": "object", "properties": {}, "additionalProperties": true},
            "any": {"type": "object"},
            "either": {"anyOf": [{"properties": {"x": {}}}, {"type": "null"}]}},
            "$defs": {"D": {"properties": {"y": {}}}}});
        close_objects(&mut s);
        assert_eq!(s["additionalProperties"], false);
        // The property named `properties` is closed as a schema; no property was added beside it.
        assert_eq!(s["properties"]["properties"]["additionalProperties"], false);
        assert!(s["properties"].get("additionalProperties").is_none(), "{s}");
        assert_eq!(s["properties"]["list"]["items"]["additionalProperties"], false);
        assert_eq!(s["properties"]["open"]["additionalProperties"], true);
        assert!(s["properties"]["any"].get("additionalProperties").is_none());
        assert_eq!(s["properties"]["either"]["anyOf"][0]["additionalProperties"], false);
        assert_eq!(s["$defs"]["D"]["additionalProperties"], false);
    }

    /// Schemas that must hold together stay open to each other's keys.
    #[test]
    fn combined_schemas_stay_open() {
        let cases = [
            json!({"properties": {"a": {}}, "allOf": [{"properties": {"b": {}}}]}),
            json!({"$defs": {"A": {"properties": {"a": {}}}}, "allOf": [{"$ref": "#/$defs/A"}]}),
            json!({"properties": {"kind": {}}, "anyOf": [{"properties": {"x": {}}}]}),
            json!({"properties": {"a": {}}, "if": {"properties": {"a": {"const": 1}}}, "then": {"properties": {"b": {}}}}),
        ];
        for case in cases {
            let mut s = case.clone();
            close_objects(&mut s);
            assert_eq!(s, case, "changed");
        }
    }

    #[test]
    fn a_key_the_schema_does_not_list_is_refused() {
        let dir = crate::testing::workspace_root().join("families/llama/tests/fixtures/qwen3-f32");
        let tok = TextTokenizer::load(&dir, &json!({}), None).unwrap();
        let grammars = tok.grammars().unwrap();
        let schema = json!({"type": "object", "properties": {"a": {"type": "integer"}}});
        let feed = |text: &str| {
            let mut c = grammars.json_schema(&schema).unwrap();
            tok.encode(text, false).unwrap().into_iter().try_for_each(|t| c.accept(t))
        };
        assert!(feed(r#"{"a":1}"#).is_ok());
        assert!(feed(r#"{"a":1,"b":2}"#).is_err());
        assert!(feed(r#"{"b":2}"#).is_err());
    }
}
