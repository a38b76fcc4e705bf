//! A reasoning model's thinking, told apart from its answer as llama-server's `--reasoning-format`
//! does: a thought in `<think>…</think>` at the start of the generated text (or from its first
//! token, when the prompt ends with an opened `<think>`, as DeepSeek-R1's template leaves it)
//! becomes `reasoning_content` (OpenAI dialect) or a `thinking` block (Anthropic), stripped of the
//! whitespace around it; the rest is the answer. Streams are split as they arrive: text that could
//! still turn out to be a tag is held back until the next piece says which it is.

/// How a generation's thinking is returned.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReasoningFormat {
    /// Left in the content, tags and all (llama-server's `none`).
    None,
    /// Taken out of the content into the reasoning (`auto`, `deepseek`).
    Split,
    /// Given as reasoning and also left in the content, tags and all (`deepseek-legacy`).
    Legacy,
}

impl ReasoningFormat {
    /// llama-server's names for the formats.
    pub fn parse(name: &str) -> Result<ReasoningFormat, String> {
        match name {
            "none" => Ok(ReasoningFormat::None),
            "auto" | "deepseek" => Ok(ReasoningFormat::Split),
            "deepseek-legacy" => Ok(ReasoningFormat::Legacy),
            other => {
                Err(format!("unknown reasoning format `{other}` (expected auto, deepseek, deepseek-legacy or none)"))
            }
        }
    }
}

use super::error::ApiError;
use super::state::{AppState, LoadedModel};
use crate::engine::ThoughtBudget;

const OPEN: &str = "<think>";
const CLOSE: &str = "</think>";

/// Whether a rendered prompt leaves a thought open: then the generated text is reasoning from its
/// first token until `</think>`.
pub fn forced_open(prompt: &str) -> bool {
    prompt.trim_end().ends_with(OPEN)
}

/// The reasoning format of a request: its llama-server `reasoning_format` field, else the server's
/// `--reasoning-format`. Where thoughts have a place of their own (Anthropic's thinking blocks,
/// Responses' reasoning items), `deepseek-legacy` is read as `deepseek`: a thought is never given
/// twice.
pub fn request_format(state: &AppState, field: Option<&str>, own_place: bool) -> Result<ReasoningFormat, ApiError> {
    let f = match field {
        None => state.config.reasoning_format,
        Some(f) => ReasoningFormat::parse(f).map_err(|e| ApiError::field("reasoning_format", e))?,
    };
    Ok(if own_place && f == ReasoningFormat::Legacy { ReasoningFormat::Split } else { f })
}

/// A cap of `budget` tokens (None: no cap) on the thought of an answer to `prompt` (the rendered
/// chat prompt): the engine ends the thought with `</think>` once it is spent.
pub fn thought_budget(
    model: &LoadedModel,
    budget: Option<usize>,
    prompt: &str,
) -> Result<Option<ThoughtBudget>, ApiError> {
    let Some(budget) = budget else { return Ok(None) };
    let close = model.text.encode("\n</think>\n\n", false).map_err(|e| ApiError::internal(e.to_string()))?;
    Ok(Some(ThoughtBudget { budget, close, open_at_start: forced_open(prompt) }))
}

/// The server's `--reasoning-budget` for a request rendered with the template variables `kwargs`:
/// a budget of 0 (thinking off) gives way to a request that switches thinking on
/// (`enable_thinking: true`).
pub fn server_budget(state: &AppState, kwargs: Option<&serde_json::Map<String, serde_json::Value>>) -> Option<usize> {
    let on = kwargs.and_then(|k| k.get("enable_thinking")) == Some(&serde_json::Value::Bool(true));
    state.config.reasoning_budget.filter(|&b| b > 0 || !on)
}

/// What a request's reasoning effort asks of the template and the engine.
#[derive(Debug, Default, PartialEq)]
pub struct Effort {
    /// Template variables (`reasoning_effort`, or `enable_thinking`).
    pub vars: serde_json::Map<String, serde_json::Value>,
    /// A cap on the thought, in tokens.
    pub budget: Option<usize>,
}

/// The efforts OpenAI names, and the thought budget each gives a model whose template only switches
/// thinking on and off.
const EFFORTS: [(&str, Option<usize>); 6] = [
    ("none", Some(0)),
    ("minimal", Some(0)),
    ("low", Some(1024)),
    ("medium", Some(4096)),
    ("high", None),
    ("xhigh", None),
];

/// OpenAI's reasoning effort (chat's `reasoning_effort`, Responses' `reasoning.effort`, named by
/// `field`) for a model whose chat template is `template`. A template that reads
/// `reasoning_effort` (gpt-oss's) gets it, `none`/`minimal` as `low` and `xhigh` as `high` (its
/// levels). One with Qwen3's `enable_thinking` switch thinks
/// unless the effort is `none` or `minimal` (then a thought it starts anyway is closed at once), with
/// its thought capped at 1024 tokens for `low` and
/// 4096 for `medium`. A template with neither has no reasoning to set: refused, as OpenAI refuses
/// the field for a model without reasoning.
pub fn effort(effort: Option<&str>, field: &str, template: Option<&str>) -> Result<Effort, ApiError> {
    let Some(effort) = effort else { return Ok(Effort::default()) };
    let Some(&(_, budget)) = EFFORTS.iter().find(|(name, _)| *name == effort) else {
        let names: Vec<&str> = EFFORTS.iter().map(|(n, _)| *n).collect();
        return Err(ApiError::field(
            field,
            format!("unknown reasoning effort `{effort}` (expected {})", names.join(", ")),
        ));
    };
    let t = template.unwrap_or_default();
    let mut vars = serde_json::Map::new();
    if t.contains("reasoning_effort") {
        // gpt-oss's levels are low, medium and high.
        let level = match effort {
            "none" | "minimal" => "low",
            "xhigh" => "high",
            e => e,
        };
        vars.insert("reasoning_effort".into(), level.into());
        return Ok(Effort { vars, budget: None });
    }
    if t.contains("enable_thinking") {
        vars.insert("enable_thinking".into(), (budget != Some(0)).into());
        // Off also closes at once a thought the model starts anyway.
        return Ok(Effort { vars, budget });
    }
    Err(ApiError::field(
        field,
        "this model's chat template has no reasoning to set (it reads neither `reasoning_effort` nor `enable_thinking`)",
    ))
}

impl Effort {
    /// The effort's cap on the thought, unless the request's own template variables (`kwargs`)
    /// switch thinking themselves, which win over the effort.
    pub fn budget_under(&self, kwargs: Option<&serde_json::Map<String, serde_json::Value>>) -> Option<usize> {
        match kwargs.is_some_and(|k| k.contains_key("enable_thinking")) {
            true => None,
            false => self.budget,
        }
    }
}

/// The smaller of two thought caps (None: no cap).
pub fn tighter(a: Option<usize>, b: Option<usize>) -> Option<usize> {
    match (a, b) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    }
}

/// What a piece of generated text adds to the reasoning and to the answer.
#[derive(Debug, Default, Clone, PartialEq)]
pub struct Parts {
    pub reasoning: String,
    pub content: String,
}

impl Parts {
    pub fn is_empty(&self) -> bool {
        self.reasoning.is_empty() && self.content.is_empty()
    }
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum State {
    /// Nothing but whitespace and maybe the start of `<think>` seen yet.
    Start,
    Thinking,
    /// Just past `</think>`: whitespace before the answer is dropped.
    AfterThought,
    Answer,
}

/// Splits a stream of generated text into reasoning and answer.
pub struct Splitter {
    format: ReasoningFormat,
    state: State,
    /// Text given to neither part yet: a possible start of `<think>` (before a thought), or the
    /// thought's trailing whitespace and a possible start of `</think>`.
    held: String,
    /// Whether the thought has shown anything but whitespace (its leading whitespace is dropped).
    thought_begun: bool,
    /// `deepseek-legacy` with the thought opened by the prompt: the content still owes its
    /// `<think>`, so that its tags stay balanced.
    owes_open_tag: bool,
}

impl Splitter {
    /// A splitter for a generation whose prompt `forced_open` says leaves a thought open.
    pub fn new(format: ReasoningFormat, forced_open: bool) -> Splitter {
        let state = if forced_open { State::Thinking } else { State::Start };
        let owes_open_tag = forced_open && format == ReasoningFormat::Legacy;
        Splitter { format, state, held: String::new(), thought_begun: false, owes_open_tag }
    }

    /// The parts `text` adds (some of it may be held back until the next piece).
    pub fn push(&mut self, text: &str) -> Parts {
        match self.format {
            ReasoningFormat::None => Parts { reasoning: String::new(), content: text.to_string() },
            ReasoningFormat::Split => self.split(text, false),
            ReasoningFormat::Legacy => {
                let reasoning = self.split(text, false).reasoning;
                let open = if self.owes_open_tag && !text.is_empty() { OPEN } else { "" };
                self.owes_open_tag &= text.is_empty();
                Parts { reasoning, content: format!("{open}{text}") }
            }
        }
    }

    /// What was held back, at the end of the generation (an unclosed thought is reasoning).
    pub fn finish(&mut self) -> Parts {
        match self.format {
            ReasoningFormat::None => Parts::default(),
            ReasoningFormat::Split => self.split("", true),
            ReasoningFormat::Legacy => Parts { reasoning: self.split("", true).reasoning, content: String::new() },
        }
    }

    /// A whole answer's parts.
    pub fn split_all(format: ReasoningFormat, forced_open: bool, text: &str) -> Parts {
        let mut s = Splitter::new(format, forced_open);
        let mut parts = s.push(text);
        let rest = s.finish();
        parts.reasoning.push_str(&rest.reasoning);
        parts.content.push_str(&rest.content);
        parts
    }

    fn split(&mut self, text: &str, last: bool) -> Parts {
        self.held.push_str(text);
        let mut out = Parts::default();
        loop {
            match self.state {
                State::Start => {
                    let t = self.held.trim_start();
                    if let Some(rest) = t.strip_prefix(OPEN) {
                        self.held = rest.to_string();
                        self.state = State::Thinking;
                    } else if !last && OPEN.starts_with(t) {
                        return out;
                    } else {
                        self.state = State::Answer;
                    }
                }
                State::Thinking => {
                    if let Some(at) = self.held.find(CLOSE) {
                        let thought = self.held[..at].trim_end().to_string();
                        self.think(&thought, &mut out);
                        self.held.drain(..at + CLOSE.len());
                        self.state = State::AfterThought;
                        continue;
                    }
                    if last {
                        let thought = std::mem::take(&mut self.held);
                        self.think(thought.trim_end(), &mut out);
                        return out;
                    }
                    // Keep a possible start of `</think>` and the whitespace before it.
                    let tag_from = (1..CLOSE.len())
                        .rev()
                        .find(|&k| self.held.ends_with(&CLOSE[..k]))
                        .map_or(self.held.len(), |k| self.held.len() - k);
                    let body_end = self.held[..tag_from].trim_end().len();
                    let body: String = self.held.drain(..body_end).collect();
                    self.think(&body, &mut out);
                    return out;
                }
                State::AfterThought => {
                    let t = self.held.trim_start();
                    if t.is_empty() && !last {
                        self.held.clear();
                        return out;
                    }
                    self.held = t.to_string();
                    self.state = State::Answer;
                }
                State::Answer => {
                    out.content.push_str(&self.held);
                    self.held.clear();
                    return out;
                }
            }
        }
    }

    fn think(&mut self, text: &str, out: &mut Parts) {
        let text = if self.thought_begun { text } else { text.trim_start() };
        if !text.is_empty() {
            self.thought_begun = true;
            out.reasoning.push_str(text);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gpt_oss_templates_get_their_own_effort_levels() {
        let t = Some("Reasoning: {{ reasoning_effort }}");
        for (asked, level) in [
            ("none", "low"),
            ("minimal", "low"),
            ("low", "low"),
            ("medium", "medium"),
            ("high", "high"),
            ("xhigh", "high"),
        ] {
            let e = effort(Some(asked), "reasoning_effort", t).unwrap();
            assert_eq!((e.vars["reasoning_effort"].as_str(), e.budget), (Some(level), None), "{asked}");
        }
        assert_eq!(effort(None, "reasoning_effort", t).unwrap(), Effort::default());
    }

    /// Every way of cutting `text` into two pieces gives the same parts as the whole.
    fn streamed(format: ReasoningFormat, forced: bool, text: &str) -> Parts {
        let whole = Splitter::split_all(format, forced, text);
        for cut in (0..=text.len()).filter(|&i| text.is_char_boundary(i)) {
            let mut s = Splitter::new(format, forced);
            let (a, b, c) = (s.push(&text[..cut]), s.push(&text[cut..]), s.finish());
            let joined = Parts {
                reasoning: a.reasoning + &b.reasoning + &c.reasoning,
                content: a.content + &b.content + &c.content,
            };
            assert_eq!(joined, whole, "cut at {cut} of {text:?}");
        }
        whole
    }

    fn parts(reasoning: &str, content: &str) -> Parts {
        Parts { reasoning: reasoning.into(), content: content.into() }
    }

    #[test]
    fn a_leading_thought_becomes_reasoning_in_any_cut() {
        let split = ReasoningFormat::Split;
        let t = "<think>\nThe user asks about France.\n</think>\n\nParis.";
        assert_eq!(streamed(split, false, t), parts("The user asks about France.", "Paris."));
        assert_eq!(streamed(split, false, "  <think>a  b </think>x"), parts("a  b", "x"));
        // Qwen3 with thinking off: an empty thought, then the answer.
        assert_eq!(streamed(split, false, "<think>\n\n</think>\n\nHi"), parts("", "Hi"));
        // The template opened the thought: the text is reasoning until </think>.
        assert_eq!(streamed(split, true, "Let me see.</think>Paris"), parts("Let me see.", "Paris"));
        // Unclosed: all reasoning.
        assert_eq!(streamed(split, false, "<think>still going"), parts("still going", ""));
    }

    #[test]
    fn text_without_a_leading_thought_is_the_answer_untouched() {
        let split = ReasoningFormat::Split;
        assert_eq!(streamed(split, false, "Paris <think>x</think>"), parts("", "Paris <think>x</think>"));
        assert_eq!(streamed(split, false, "<thin"), parts("", "<thin"));
        assert_eq!(streamed(split, false, "\n  Paris"), parts("", "\n  Paris"));
        assert_eq!(streamed(split, false, "a < b"), parts("", "a < b"));
    }

    #[test]
    fn none_leaves_everything_and_legacy_gives_both() {
        let t = "<think>hmm</think> Paris";
        assert_eq!(streamed(ReasoningFormat::None, false, t), parts("", t));
        assert_eq!(streamed(ReasoningFormat::Legacy, false, t), parts("hmm", t));
        // The prompt opened the thought: the content gets its opening tag.
        assert_eq!(streamed(ReasoningFormat::Legacy, true, "hmm</think>x"), parts("hmm", "<think>hmm</think>x"));
        assert!(forced_open("<|im_start|>assistant\n<think>\n") && !forced_open("<think>\n\n</think>\n\n"));
    }

    #[test]
    fn text_that_may_be_a_tag_is_held_until_it_is_not() {
        let mut s = Splitter::new(ReasoningFormat::Split, false);
        assert_eq!(s.push("<th"), parts("", ""));
        assert_eq!(s.push("ink>I think"), parts("I think", ""));
        assert_eq!(s.push(" so </th"), parts(" so", ""));
        assert_eq!(s.push("ought"), parts(" </thought", ""));
        assert_eq!(s.push("</think>\n"), parts("", ""));
        assert_eq!(s.push("Yes"), parts("", "Yes"));
        assert_eq!(s.finish(), parts("", ""));
        assert_eq!(ReasoningFormat::parse("auto"), Ok(ReasoningFormat::Split));
        assert!(ReasoningFormat::parse("harmony").unwrap_err().contains("deepseek-legacy"));
    }
}
