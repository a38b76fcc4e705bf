//! Tool calls written as Python calls, as LFM2 writes them: `[name(k="v", n=1), other()]`, keyword
//! arguments whose values are Python literals (strings in either quote, numbers, `True`/`False`/
//! `None` — or JSON's `true`/`false`/`null` —, lists, tuples, dicts), read into JSON; and the way
//! back, for the calls of a conversation's history.

use serde_json::{Map, Number, Value};

use super::formats::RawCall;

/// The calls in `text`: a bracketed list of calls, or one call; None if it is anything else.
pub fn calls(text: &str) -> Option<Vec<RawCall>> {
    let mut p = Reader { s: text.as_bytes(), i: 0, depth: 0 };
    let mut out = Vec::new();
    p.space();
    let listed = p.eat(b'[');
    loop {
        p.space();
        if listed && p.eat(b']') {
            break;
        }
        out.push(p.call()?);
        p.space();
        if !listed || p.eat(b']') {
            break;
        }
        if !p.eat(b',') {
            return None;
        }
    }
    p.space();
    (p.i == p.s.len() && !out.is_empty()).then_some(out)
}

/// `name(k=v, …)` with the arguments as Python literals (JSON text is one for strings and numbers).
pub fn call_text(name: &str, args: &Value) -> String {
    let args: Vec<String> = match args {
        Value::Object(m) => m.iter().map(|(k, v)| format!("{k}={}", literal(v))).collect(),
        _ => Vec::new(),
    };
    format!("{name}({})", args.join(", "))
}

fn literal(v: &Value) -> String {
    match v {
        Value::Null => "None".into(),
        Value::Bool(true) => "True".into(),
        Value::Bool(false) => "False".into(),
        Value::Number(_) | Value::String(_) => v.to_string(),
        Value::Array(a) => format!("[{}]", a.iter().map(literal).collect::<Vec<_>>().join(", ")),
        Value::Object(m) => {
            let items: Vec<String> =
                m.iter().map(|(k, v)| format!("{}: {}", Value::from(k.as_str()), literal(v))).collect();
            format!("{{{}}}", items.join(", "))
        }
    }
}

struct Reader<'a> {
    s: &'a [u8],
    i: usize,
    /// Lists and dicts open around the value being read (bounded, as serde_json bounds them: a
    /// model's text must not nest deep enough to exhaust the stack).
    depth: usize,
}

/// The deepest nesting of lists and dicts read.
const MAX_DEPTH: usize = 128;

impl Reader<'_> {
    fn peek(&self) -> Option<u8> {
        self.s.get(self.i).copied()
    }

    fn eat(&mut self, c: u8) -> bool {
        let hit = self.peek() == Some(c);
        self.i += hit as usize;
        hit
    }

    fn space(&mut self) {
        while self.peek().is_some_and(|c| c.is_ascii_whitespace()) {
            self.i += 1;
        }
    }

    /// A name, dots allowed (`module.function`).
    fn name(&mut self) -> Option<String> {
        let start = self.i;
        while self.peek().is_some_and(|c| c.is_ascii_alphanumeric() || c == b'_' || c == b'.' || c == b'-') {
            self.i += 1;
        }
        (self.i > start && !self.s[start].is_ascii_digit())
            .then(|| String::from_utf8_lossy(&self.s[start..self.i]).into_owned())
    }

    fn call(&mut self) -> Option<RawCall> {
        let name = self.name()?;
        self.space();
        if !self.eat(b'(') {
            return None;
        }
        let mut args = Map::new();
        loop {
            self.space();
            if self.eat(b')') {
                break;
            }
            let key = self.name()?;
            self.space();
            if !self.eat(b'=') {
                return None;
            }
            self.space();
            args.insert(key, self.value()?);
            self.space();
            if self.eat(b')') {
                break;
            }
            if !self.eat(b',') {
                return None;
            }
        }
        Some((name, Value::Object(args)))
    }

    fn value(&mut self) -> Option<Value> {
        let nested = |r: &mut Self, read: fn(&mut Self) -> Option<Value>| {
            if r.depth >= MAX_DEPTH {
                return None;
            }
            r.depth += 1;
            let v = read(r);
            r.depth -= 1;
            v
        };
        match self.peek()? {
            b'"' | b'\'' => self.string().map(Value::String),
            b'[' => nested(self, |r| r.seq(b']').map(Value::Array)),
            b'(' => nested(self, |r| r.seq(b')').map(Value::Array)),
            b'{' => nested(self, Self::dict),
            b'-' | b'+' | b'.' | b'0'..=b'9' => self.number(),
            _ => match self.name()?.as_str() {
                "True" | "true" => Some(Value::Bool(true)),
                "False" | "false" => Some(Value::Bool(false)),
                "None" | "null" => Some(Value::Null),
                _ => None,
            },
        }
    }

    fn seq(&mut self, close: u8) -> Option<Vec<Value>> {
        self.i += 1;
        let mut items = Vec::new();
        loop {
            self.space();
            if self.eat(close) {
                return Some(items);
            }
            items.push(self.value()?);
            self.space();
            if !self.eat(b',') && self.peek() != Some(close) {
                return None;
            }
        }
    }

    fn dict(&mut self) -> Option<Value> {
        self.i += 1;
        let mut m = Map::new();
        loop {
            self.space();
            if self.eat(b'}') {
                return Some(Value::Object(m));
            }
            let key = match self.value()? {
                Value::String(s) => s,
                other => other.to_string(),
            };
            self.space();
            if !self.eat(b':') {
                return None;
            }
            self.space();
            m.insert(key, self.value()?);
            self.space();
            if !self.eat(b',') && self.peek() != Some(b'}') {
                return None;
            }
        }
    }

    fn number(&mut self) -> Option<Value> {
        let start = self.i;
        while self.peek().is_some_and(|c| c.is_ascii_digit() || matches!(c, b'-' | b'+' | b'.' | b'e' | b'E' | b'_')) {
            self.i += 1;
        }
        let text: String = String::from_utf8_lossy(&self.s[start..self.i]).replace('_', "");
        let text = text.strip_prefix('+').unwrap_or(&text);
        if let Ok(n) = text.parse::<i64>() {
            return Some(Value::Number(n.into()));
        }
        text.parse::<f64>().ok().and_then(Number::from_f64).map(Value::Number)
    }

    /// A quoted string with Python's escapes (an unknown one keeps its backslash, as in Python).
    fn string(&mut self) -> Option<String> {
        let quote = self.s[self.i];
        self.i += 1;
        let mut out = Vec::new();
        loop {
            let c = self.peek()?;
            self.i += 1;
            match c {
                _ if c == quote => break,
                b'\\' => {
                    let e = self.peek()?;
                    self.i += 1;
                    let mut hex = |digits: usize| -> Option<char> {
                        let h = std::str::from_utf8(self.s.get(self.i..self.i + digits)?).ok()?;
                        let ch = char::from_u32(u32::from_str_radix(h, 16).ok()?)?;
                        self.i += digits;
                        Some(ch)
                    };
                    let ch = match e {
                        b'n' => '\n',
                        b't' => '\t',
                        b'r' => '\r',
                        b'0' => '\0',
                        b'a' => '\x07',
                        b'b' => '\x08',
                        b'f' => '\x0c',
                        b'v' => '\x0b',
                        b'x' => hex(2)?,
                        b'u' => hex(4)?,
                        b'U' => hex(8)?,
                        b'\\' | b'\'' | b'"' => e as char,
                        b'\n' => continue,
                        other => {
                            out.push(b'\\');
                            out.push(other);
                            continue;
                        }
                    };
                    out.extend_from_slice(ch.to_string().as_bytes());
                }
                _ => out.push(c),
            }
        }
        String::from_utf8(out).ok()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn python_calls_read_into_json() {
        let text = r#"[get_weather(location="Paris, France", days=3, hourly=False, units=None),
            search(query='it\'s "here"', tags=['a', "b"], opts={'depth': 2.5, "x": (1, -2)}), noop()]"#;
        assert_eq!(
            calls(text).unwrap(),
            [
                ("get_weather".into(), json!({"location": "Paris, France", "days": 3, "hourly": false, "units": null})),
                (
                    "search".into(),
                    json!({"query": "it's \"here\"", "tags": ["a", "b"], "opts": {"depth": 2.5, "x": [1, -2]}})
                ),
                ("noop".into(), json!({})),
            ]
        );
        assert_eq!(calls("f(a=1)").unwrap(), [("f".into(), json!({"a": 1}))]);
        assert_eq!(calls("f(a=\"\\u00e9\\n\")").unwrap(), [("f".into(), json!({"a": "é\n"}))]);
        // Unknown escapes keep their backslash (regexes, Windows paths), as Python keeps them.
        assert_eq!(
            calls(r"f(p='\d+\.txt', w='C:\Program', x='\x41\U0001F600')").unwrap()[0].1,
            json!({"p": "\\d+\\.txt", "w": "C:\\Program", "x": "A😀"})
        );
        // Nesting is bounded.
        let deep = format!("f(a={}{})", "[".repeat(100_000), "]".repeat(100_000));
        assert_eq!(calls(&deep), None);
        let fine = format!("f(a={}{})", "[".repeat(100), "]".repeat(100));
        assert!(calls(&fine).is_some());
        for bad in ["", "[]", "hello", "f(1)", "f(a=1", "[f(a=1) g()]", "f(a=1) extra", "f(a=os.system)", "1f()"] {
            assert_eq!(calls(bad), None, "{bad}");
        }
    }

    #[test]
    fn calls_are_written_back_as_python() {
        let args = json!({"city": "Paris \"FR\" \\d \u{8}\u{c}\u{1}", "n": 2, "ok": true, "none": null, "list": [1, false], "m": {"k": "v"}});
        let text = call_text("f", &args);
        assert_eq!(
            text,
            r#"f(city="Paris \"FR\" \\d \b\f\u0001", n=2, ok=True, none=None, list=[1, False], m={"k": "v"})"#
        );
        assert_eq!(calls(&format!("[{text}]")).unwrap(), [("f".into(), args)]);
    }
}
