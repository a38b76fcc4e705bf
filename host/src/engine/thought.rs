//! A cap on a reasoning model's thought (llama-server's `--reasoning-budget`, Anthropic's
//! `thinking.budget_tokens`): the tokens a sequence generates inside `<think>…</think>` are
//! counted, and once they reach the budget the engine writes the thought's end itself — the
//! request's `close` tokens, one per step in place of sampling — so that the model goes on to its
//! answer. The thought is found in the generated text: from the start when the prompt left it
//! open, else when the text begins with `<think>`.

use std::collections::VecDeque;

const OPEN: &str = "<think>";
const CLOSE: &str = "</think>";

/// What a request asks of its thought.
#[derive(Debug, Clone, PartialEq)]
pub struct ThoughtBudget {
    /// The most tokens of thought.
    pub budget: usize,
    /// The tokens that end a thought (`</think>` and the break after it), written in when the budget
    /// is spent.
    pub close: Vec<u32>,
    /// The prompt left the thought open (its generation prompt ends in `<think>`).
    pub open_at_start: bool,
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum Phase {
    /// Nothing but whitespace and maybe the start of `<think>` generated yet.
    Before,
    Inside,
    /// The thought ended (or there was none).
    After,
}

/// One sequence's thought as it is generated.
#[derive(Debug)]
pub struct Thought {
    budget: ThoughtBudget,
    phase: Phase,
    /// Tokens of thought so far.
    used: usize,
    /// Close tokens still to write.
    forced: VecDeque<u32>,
    /// Whether the close was written in (it is written once).
    closed_by_budget: bool,
    /// The generated text while it matters: before the thought, all of it; inside, its end.
    text: String,
}

impl Thought {
    pub fn new(budget: ThoughtBudget) -> Thought {
        let phase = if budget.open_at_start { Phase::Inside } else { Phase::Before };
        let mut t =
            Thought { budget, phase, used: 0, forced: VecDeque::new(), closed_by_budget: false, text: String::new() };
        t.check_budget();
        t
    }

    /// The token to write next instead of sampling one, once the budget is spent.
    pub fn forced(&mut self) -> Option<u32> {
        self.forced.pop_front()
    }

    /// Whether the thought may still matter (it has not ended).
    pub fn watching(&self) -> bool {
        self.phase != Phase::After
    }

    /// Whether the thought has begun and not ended.
    pub fn inside(&self) -> bool {
        self.phase == Phase::Inside
    }

    /// Takes note of a generated token's text.
    pub fn push(&mut self, piece: &str) {
        match self.phase {
            Phase::Before => {
                self.text.push_str(piece);
                let t = self.text.trim_start();
                if let Some(rest) = t.strip_prefix(OPEN) {
                    self.text = rest.to_string();
                    self.phase = Phase::Inside;
                    self.check_budget();
                } else if !t.is_empty() && !OPEN.starts_with(t) {
                    self.phase = Phase::After;
                    self.text.clear();
                }
            }
            Phase::Inside => {
                self.used += 1;
                self.text.push_str(piece);
                if self.text.contains(CLOSE) {
                    // (A close being written in goes on to its end.)
                    self.phase = Phase::After;
                    self.text.clear();
                    return;
                }
                // Only the end can still hold the start of `</think>`.
                if self.text.len() > 2 * CLOSE.len() {
                    let mut cut = self.text.len() - CLOSE.len();
                    while !self.text.is_char_boundary(cut) {
                        cut -= 1;
                    }
                    self.text.drain(..cut);
                }
                self.check_budget();
            }
            Phase::After => {}
        }
    }

    fn check_budget(&mut self) {
        if self.phase == Phase::Inside && self.used >= self.budget.budget && !self.closed_by_budget {
            self.closed_by_budget = true;
            self.forced = self.budget.close.iter().copied().collect();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn budget(n: usize, open: bool) -> Thought {
        Thought::new(ThoughtBudget { budget: n, close: vec![7, 8], open_at_start: open })
    }

    #[test]
    fn the_close_is_written_once_the_budget_is_spent() {
        let mut t = budget(2, false);
        t.push("<think>");
        assert_eq!(t.forced(), None);
        t.push(" a");
        assert_eq!(t.forced(), None);
        t.push(" b");
        assert_eq!((t.forced(), t.forced(), t.forced()), (Some(7), Some(8), None));
        // Its text ends the thought; nothing more is forced.
        t.push("</think>");
        t.push(" answer");
        assert_eq!(t.forced(), None);
    }

    #[test]
    fn a_thought_that_ends_in_time_or_never_starts_is_left_alone() {
        let mut t = budget(3, true);
        t.push("short</th");
        t.push("ink>");
        for _ in 0..5 {
            t.push(" answer");
        }
        assert_eq!(t.forced(), None);
        let mut t = budget(1, false);
        for piece in ["\n", "Paris", " is", " big"] {
            t.push(piece);
        }
        assert_eq!(t.forced(), None);
        // A budget of 0 closes an opened thought at once.
        assert_eq!(budget(0, true).forced(), Some(7));
    }
}
