//! HTTP errors in the shape of the dialect the client speaks: OpenAI's
//! `{"error": {"message", "type", "param", "code"}}`, Anthropic's
//! `{"type": "error", "error": {"type", "message"}}`, llama-server's `{"error": {"code", "message", "type"}}`.

use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use serde_json::json;

use crate::engine::EngineError;

/// Which API a route belongs to, for the shape of its errors.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Dialect {
    OpenAi,
    Anthropic,
    Llama,
}

impl Dialect {
    /// The dialect of a request path (for errors raised before a route runs: auth, body limit, 404).
    pub fn of_path(path: &str) -> Dialect {
        if path.starts_with("/v1/messages") {
            Dialect::Anthropic
        } else if path.starts_with("/v1/") || path == "/models" {
            Dialect::OpenAi
        } else {
            Dialect::Llama
        }
    }

    /// [`of_path`](Self::of_path), except that the model routes both APIs share answer in
    /// Anthropic's shape to a client that says it speaks Anthropic's API (its SDK sends
    /// `anthropic-version` with every request).
    pub fn of_request(path: &str, headers: &axum::http::HeaderMap) -> Dialect {
        let shared = path == "/v1/models" || path.starts_with("/v1/models/");
        if shared && headers.contains_key("anthropic-version") {
            Dialect::Anthropic
        } else {
            Dialect::of_path(path)
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorKind {
    InvalidRequest,
    Authentication,
    NotFound,
    MethodNotAllowed,
    NotSupported,
    TooLarge,
    Unavailable,
    Timeout,
    Internal,
}

#[derive(Debug, Clone)]
pub struct ApiError {
    pub kind: ErrorKind,
    pub message: String,
    /// The request field at fault, when there is one.
    pub param: Option<String>,
    /// OpenAI's machine-readable `code` (e.g. `context_length_exceeded`).
    pub code: Option<&'static str>,
    /// Seconds for `Retry-After`.
    pub retry_after: Option<u64>,
    /// A field the route does not know (`param`), which each API words its own way.
    pub unknown_field: bool,
    /// A prompt over the context: its tokens and the context size (llama-server reports both).
    pub context: Option<(usize, usize)>,
    pub dialect: Dialect,
}

impl ApiError {
    pub fn new(kind: ErrorKind, message: impl Into<String>) -> Self {
        let message = message.into();
        ApiError {
            kind,
            message,
            param: None,
            code: None,
            retry_after: None,
            unknown_field: false,
            context: None,
            dialect: Dialect::OpenAi,
        }
    }
    pub fn invalid(message: impl Into<String>) -> Self {
        Self::new(ErrorKind::InvalidRequest, message)
    }
    /// An invalid value of the request field `param`.
    pub fn field(param: &str, message: impl Into<String>) -> Self {
        ApiError { param: Some(param.to_string()), ..Self::invalid(message) }
    }
    /// A request field the route does not know, worded as OpenAI words it (Anthropic's wording
    /// replaces it in that dialect).
    pub fn unknown_field(param: &str) -> Self {
        let message = format!("Unrecognized request argument supplied: {param}");
        ApiError { unknown_field: true, ..Self::field(param, message) }
    }
    /// A prompt of `prompt_tokens` (from the request field `param`, where one is named) that leaves
    /// no room in a context of `ctx_size`.
    pub fn context_exceeded(param: Option<&str>, prompt_tokens: usize, ctx_size: usize) -> Self {
        let message = format!(
            "the prompt has {prompt_tokens} tokens but the context size is {ctx_size}; shorten it or start the server with a larger --ctx-size"
        );
        let e = match param {
            Some(p) => Self::field(p, message),
            None => Self::invalid(message),
        };
        ApiError { context: Some((prompt_tokens, ctx_size)), ..e.with_code("context_length_exceeded") }
    }

    pub fn internal(message: impl Into<String>) -> Self {
        Self::new(ErrorKind::Internal, message)
    }
    /// A number of the request field `param` outside `[min, max]`, with OpenAI's code for the side
    /// it is on (`integer_below_min_value`, `decimal_above_max_value`, …).
    pub fn out_of_range(param: &str, integer: bool, above: bool, message: impl Into<String>) -> Self {
        let code = match (integer, above) {
            (true, true) => "integer_above_max_value",
            (true, false) => "integer_below_min_value",
            (false, true) => "decimal_above_max_value",
            (false, false) => "decimal_below_min_value",
        };
        Self::field(param, message).with_code(code)
    }
    pub fn with_code(mut self, code: &'static str) -> Self {
        self.code = Some(code);
        self
    }
    pub fn in_dialect(mut self, d: Dialect) -> Self {
        self.dialect = d;
        self
    }

    pub fn status(&self) -> StatusCode {
        match self.kind {
            // Anthropic's "overloaded" status.
            ErrorKind::Unavailable if self.dialect == Dialect::Anthropic => {
                StatusCode::from_u16(529).expect("529 is a valid status")
            }
            ErrorKind::InvalidRequest => StatusCode::BAD_REQUEST,
            ErrorKind::Authentication => StatusCode::UNAUTHORIZED,
            ErrorKind::NotFound => StatusCode::NOT_FOUND,
            ErrorKind::MethodNotAllowed => StatusCode::METHOD_NOT_ALLOWED,
            ErrorKind::NotSupported => StatusCode::NOT_IMPLEMENTED,
            ErrorKind::TooLarge => StatusCode::PAYLOAD_TOO_LARGE,
            ErrorKind::Unavailable => StatusCode::SERVICE_UNAVAILABLE,
            ErrorKind::Timeout => StatusCode::GATEWAY_TIMEOUT,
            ErrorKind::Internal => StatusCode::INTERNAL_SERVER_ERROR,
        }
    }

    /// The `type` string of the error in the current dialect.
    pub fn type_name(&self) -> &'static str {
        match (self.dialect, self.kind) {
            (Dialect::Anthropic, ErrorKind::InvalidRequest | ErrorKind::MethodNotAllowed) => "invalid_request_error",
            (Dialect::Anthropic, ErrorKind::Authentication) => "authentication_error",
            (Dialect::Anthropic, ErrorKind::NotFound) => "not_found_error",
            (Dialect::Anthropic, ErrorKind::TooLarge) => "request_too_large",
            (Dialect::Anthropic, ErrorKind::Unavailable) => "overloaded_error",
            (Dialect::Anthropic, ErrorKind::NotSupported | ErrorKind::Timeout | ErrorKind::Internal) => "api_error",
            (Dialect::Llama, ErrorKind::InvalidRequest) if self.context.is_some() => "exceed_context_size_error",
            (_, ErrorKind::InvalidRequest | ErrorKind::TooLarge | ErrorKind::MethodNotAllowed) => {
                "invalid_request_error"
            }
            (_, ErrorKind::Authentication) => "authentication_error",
            (_, ErrorKind::NotFound) => "not_found_error",
            (_, ErrorKind::NotSupported) => "not_supported_error",
            (_, ErrorKind::Unavailable) => "unavailable_error",
            (_, ErrorKind::Timeout) => "timeout_error",
            (_, ErrorKind::Internal) => "server_error",
        }
    }

    /// The error as the JSON body of its dialect (also what an SSE stream sends when it fails midway).
    pub fn body(&self) -> serde_json::Value {
        match self.dialect {
            Dialect::OpenAi => json!({"error": {
                "message": self.message,
                "type": self.type_name(),
                "param": self.param,
                "code": self.code,
            }}),
            Dialect::Anthropic => {
                let message = match (&self.param, self.unknown_field, self.code) {
                    // Anthropic's words, which clients look for to shorten a conversation.
                    _ if self.context.is_some() => {
                        // (A prompt must leave room for one token: the maximum is one less.)
                        let (n, ctx) = self.context.unwrap_or_default();
                        format!("prompt is too long: {n} tokens > {} maximum", ctx.saturating_sub(1))
                    }
                    (Some(p), true, _) => format!("{p}: Extra inputs are not permitted"),
                    (Some(p), _, Some("missing_required_parameter")) => format!("{}: Field required", dotted(p)),
                    _ => self.message.clone(),
                };
                json!({"type": "error", "error": {"type": self.type_name(), "message": message}})
            }
            Dialect::Llama => {
                let mut error = json!({
                    "code": self.status().as_u16(),
                    "message": self.message,
                    "type": self.type_name(),
                });
                if let Some((n_prompt_tokens, n_ctx)) = self.context {
                    error["n_prompt_tokens"] = n_prompt_tokens.into();
                    error["n_ctx"] = n_ctx.into();
                }
                json!({ "error": error })
            }
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut r = (self.status(), axum::Json(self.body())).into_response();
        if let Some(s) = self.retry_after {
            r.headers_mut().insert(header::RETRY_AFTER, HeaderValue::from(s));
        }
        r
    }
}

impl From<EngineError> for ApiError {
    fn from(e: EngineError) -> Self {
        let message = e.to_string();
        match e {
            EngineError::QueueFull { .. } => {
                ApiError { retry_after: Some(1), ..ApiError::new(ErrorKind::Unavailable, message) }
            }
            EngineError::ShuttingDown => ApiError::new(ErrorKind::Unavailable, message),
            EngineError::PromptTooLong { prompt_tokens, ctx_size } => {
                ApiError::context_exceeded(None, prompt_tokens, ctx_size)
            }
            EngineError::Invalid(_) => ApiError::invalid(message),
            EngineError::Internal(_) => ApiError::internal(message),
            EngineError::TimedOut(_) => ApiError::new(ErrorKind::Timeout, message),
        }
    }
}

/// A field's path as Anthropic words it, with dots (`messages[0].role` → `messages.0.role`).
pub fn dotted(path: &str) -> String {
    path.replace('[', ".").replace(']', "")
}

/// A request body that did not parse: not JSON at all, or a field of the wrong type (named).
pub fn json_error(e: serde_path_to_error::Error<serde_json::Error>) -> ApiError {
    let path = e.path().to_string();
    let inner = e.into_inner();
    if inner.is_syntax() || inner.is_eof() {
        return ApiError::invalid(format!("the request body is not valid JSON: {inner}"));
    }
    // serde's message ends with the position in the body, which says less than the field name.
    let msg = inner.to_string();
    let mut msg = msg.split(" at line ").next().unwrap_or(&msg).to_string();
    // A required field left out is named as the parameter (serde's path is the object around it).
    if let Some(name) = msg.strip_prefix("missing field `").and_then(|m| m.strip_suffix('`')) {
        let param = if path.is_empty() || path == "." { name.to_string() } else { format!("{path}.{name}") };
        let message = format!("missing required parameter `{param}`");
        return ApiError { code: Some("missing_required_parameter"), ..ApiError::field(&param, message) };
    }
    if path.is_empty() || path == "." {
        return ApiError::invalid(format!("invalid request body: {inner}"));
    }
    if let Some(name) = msg.strip_prefix("data did not match any variant of untagged enum ") {
        msg = format!("expected {}", expected_shape(name));
    }
    let e = ApiError::field(&path, format!("invalid value for `{path}`: {msg}"));
    // OpenAI's code for a value of the wrong JSON type.
    if msg.starts_with("invalid type") || msg.starts_with("expected ") {
        return e.with_code("invalid_type");
    }
    e
}

/// What an untagged request type accepts, in words.
fn expected_shape(type_name: &str) -> &'static str {
    match type_name {
        "StopField" => "a string or a list of strings",
        "Content" => "a string or a list of content parts",
        "Blocks" => "a string or a list of content blocks",
        "PromptField" => "a string, a list of strings, a list of token ids or a list of token-id lists",
        "Prompt" => "a string, a list of token ids, or token ids and strings mixed",
        "TokenizeContent" => "a string, or a list of token ids and strings",
        "Document" => "a string, or an object with `text` and no other field",
        _ => "another type",
    }
}

/// Parses a JSON request body into `T`, reporting a wrong field by its path. A field `T` does not read
/// is refused by name unless it is one of [`fields`](super::fields)' inert ones at an inert value.
pub fn parse_body<T: serde::de::DeserializeOwned>(body: &[u8]) -> Result<T, ApiError> {
    parse(body, &[]).map(|(v, _)| v)
}

/// [`parse_body`] for a route that also reads `X` from the same top-level fields (`X::FIELDS`):
/// settings several routes share, kept out of each route's own request type.
pub fn parse_body_with<T: serde::de::DeserializeOwned, X: Shared>(body: &[u8]) -> Result<(T, X), ApiError> {
    let (v, shared) = parse(body, X::FIELDS)?;
    let x = serde_path_to_error::deserialize(serde_json::Value::Object(shared)).map_err(json_error)?;
    Ok((v, x))
}

/// Settings read from the top level of several routes' bodies (see [`parse_body_with`]).
pub trait Shared: serde::de::DeserializeOwned {
    /// The fields it reads.
    const FIELDS: &'static [&'static str];
}

/// `T` from `body`, and the top-level fields named in `shared` that `T` left unread.
fn parse<T: serde::de::DeserializeOwned>(
    body: &[u8],
    shared: &[&str],
) -> Result<(T, serde_json::Map<String, serde_json::Value>), ApiError> {
    if body.iter().all(u8::is_ascii_whitespace) {
        return Err(ApiError::invalid("the request body is empty; send a JSON object"));
    }
    let mut unread = Vec::new();
    let mut de = serde_json::Deserializer::from_slice(body);
    let mut note = |p: serde_ignored::Path| unread.push(super::fields::Unread::of(&p));
    let v =
        serde_path_to_error::deserialize(serde_ignored::Deserializer::new(&mut de, &mut note)).map_err(json_error)?;
    de.end().map_err(|e| ApiError::invalid(format!("the request body is not valid JSON: {e}")))?;
    let mut taken = serde_json::Map::new();
    if !unread.is_empty() {
        // (Where this fails, the type's own parse passed over a value nested beyond serde_json's
        // recursion limit in a field it does not read; an empty map would pass every check.)
        let mut whole: serde_json::Map<String, serde_json::Value> = serde_json::from_slice(body)
            .map_err(|e| ApiError::invalid(format!("the request body cannot be read: {e}")))?;
        for field in &unread {
            match field.top.as_deref().filter(|t| shared.contains(t)) {
                Some(name) => {
                    if let Some(v) = whole.remove(name) {
                        taken.insert(name.to_string(), v);
                    }
                }
                None => super::fields::check(field, &whole)?,
            }
        }
    }
    Ok((v, taken))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(serde::Deserialize, Debug)]
    #[allow(dead_code)]
    struct R {
        temperature: Option<f32>,
        messages: Option<Vec<M>>,
    }
    #[derive(serde::Deserialize, Debug)]
    #[allow(dead_code)]
    struct S {
        stop: Option<crate::server::openai::StopField>,
    }
    #[derive(serde::Deserialize, Debug)]
    #[allow(dead_code)]
    struct M {
        role: String,
    }

    #[test]
    fn wrong_field_types_name_the_field_and_bad_json_says_so() {
        let e = parse_body::<R>(br#"{"temperature": "hot"}"#).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("temperature"));
        assert!(e.message.contains("`temperature`") && !e.message.contains("line 1"), "{}", e.message);
        let e = parse_body::<R>(br#"{"messages": [{"role": 3}]}"#).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("messages[0].role"));
        let e = parse_body::<S>(br#"{"stop": 5}"#).unwrap_err();
        assert_eq!(e.message, "invalid value for `stop`: expected a string or a list of strings");
        let e = parse_body::<R>(b"{not json").unwrap_err();
        assert!(e.message.contains("not valid JSON"), "{}", e.message);
        // A field the type does not read is refused by name, an inert one at its inert value taken.
        let e = parse_body::<R>(br#"{"unknown": 1}"#).unwrap_err();
        assert_eq!(
            (e.param.as_deref(), e.message.as_str()),
            (Some("unknown"), "Unrecognized request argument supplied: unknown")
        );
        let e = parse_body::<R>(br#"{"messages": [{"role": "user", "colour": "red"}]}"#).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("messages[0].colour"));
        assert!(parse_body::<R>(br#"{"user": "u-1", "mirostat": 0}"#).is_ok());
    }

    #[test]
    fn an_unread_field_nested_too_deep_is_refused_not_dropped() {
        let deep = format!(r#"{{"temperature": 1, "mirostat": 2, "zz": {}{}}}"#, "[".repeat(130), "]".repeat(130));
        let e = parse_body::<R>(deep.as_bytes()).unwrap_err();
        assert!(e.message.contains("recursion limit"), "{}", e.message);
        let e = parse_body_with::<R, crate::server::samplers::LlamaSamplers>(deep.as_bytes()).unwrap_err();
        assert!(e.message.contains("recursion limit"), "{}", e.message);
    }

    #[test]
    fn each_dialect_has_its_shape() {
        let e = ApiError::field("max_tokens", "max_tokens is required");
        assert_eq!(e.body()["error"]["param"], "max_tokens");
        assert_eq!(e.body()["error"]["type"], "invalid_request_error");
        let a = e.clone().in_dialect(Dialect::Anthropic).body();
        assert_eq!((a["type"].as_str(), a["error"]["type"].as_str()), (Some("error"), Some("invalid_request_error")));
        let l = e.in_dialect(Dialect::Llama).body();
        assert_eq!(l["error"]["code"], 400);
        assert_eq!(Dialect::of_path("/v1/messages/count_tokens"), Dialect::Anthropic);
        assert_eq!(Dialect::of_path("/v1/chat/completions"), Dialect::OpenAi);
        assert_eq!(Dialect::of_path("/completion"), Dialect::Llama);
    }
}
