//! Stop strings over streamed text: a stop string may span several tokens, so text that could still be
//! the start of one is held back until it is decided.

/// Feeds text pieces, releases what is safe to show, and reports when a stop string appears.
#[derive(Debug, Default)]
pub struct StopMatcher {
    stops: Vec<String>,
    pending: String,
}

/// What a piece of text did.
#[derive(Debug, PartialEq, Eq)]
pub enum StopResult {
    /// Text that can be shown now (may be empty while a possible stop string is pending).
    Continue(String),
    /// A stop string matched: show this text (everything before the stop string) and end.
    Stopped(String),
}

impl StopMatcher {
    pub fn new(stops: &[String]) -> Self {
        StopMatcher { stops: stops.iter().filter(|s| !s.is_empty()).cloned().collect(), pending: String::new() }
    }

    pub fn push(&mut self, piece: &str) -> StopResult {
        self.pending.push_str(piece);
        if self.stops.is_empty() {
            return StopResult::Continue(std::mem::take(&mut self.pending));
        }
        if let Some(at) = self.stops.iter().filter_map(|s| self.pending.find(s.as_str())).min() {
            let out = self.pending[..at].to_string();
            self.pending.clear();
            return StopResult::Stopped(out);
        }
        // Hold back the longest tail that is a prefix of some stop string.
        let mut hold = 0;
        for s in &self.stops {
            for (i, _) in s.char_indices().skip(1).chain(std::iter::once((s.len(), ' '))) {
                let prefix = &s[..i];
                if i > hold && self.pending.ends_with(prefix) {
                    hold = i;
                }
            }
        }
        let cut = self.pending.len() - hold;
        let out = self.pending[..cut].to_string();
        self.pending.drain(..cut);
        StopResult::Continue(out)
    }

    /// Text still held back when generation ends for another reason.
    pub fn flush(&mut self) -> String {
        std::mem::take(&mut self.pending)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stop_string_across_pieces_is_caught_and_not_shown() {
        let mut m = StopMatcher::new(&["</end>".to_string()]);
        assert_eq!(m.push("Hello </"), StopResult::Continue("Hello ".into()));
        assert_eq!(m.push("en"), StopResult::Continue("".into()));
        assert_eq!(m.push("d> tail"), StopResult::Stopped("".into()));
    }

    #[test]
    fn false_alarm_is_released() {
        let mut m = StopMatcher::new(&["STOP".to_string()]);
        assert_eq!(m.push("ST"), StopResult::Continue("".into()));
        assert_eq!(m.push("AR"), StopResult::Continue("STAR".into()));
        assert_eq!(m.flush(), "");
    }

    #[test]
    fn text_before_stop_in_same_piece_is_kept() {
        let mut m = StopMatcher::new(&["\n\n".to_string()]);
        assert_eq!(m.push("a\n\nb"), StopResult::Stopped("a".into()));
    }
}
