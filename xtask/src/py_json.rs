//! JSON written byte for byte as Python's `json.dump` writes it (key order kept, Python's separators,
//! float `repr`, `ensure_ascii` escapes), so that `fetch-model` makes the same files as the reference
//! converter `../shared/models/gguf_llama_to_hf.py`.

/// A JSON value whose objects keep their insertion order, as Python dicts do.
#[derive(Debug, Clone, PartialEq)]
pub enum Json {
    Null,
    Bool(bool),
    Int(i64),
    Float(f64),
    Str(String),
    Array(Vec<Json>),
    Object(Vec<(String, Json)>),
}

impl From<&str> for Json {
    fn from(s: &str) -> Json {
        Json::Str(s.to_string())
    }
}

impl From<String> for Json {
    fn from(s: String) -> Json {
        Json::Str(s)
    }
}

impl From<bool> for Json {
    fn from(b: bool) -> Json {
        Json::Bool(b)
    }
}

impl From<i64> for Json {
    fn from(i: i64) -> Json {
        Json::Int(i)
    }
}

impl<T: Into<Json>> From<Option<T>> for Json {
    fn from(v: Option<T>) -> Json {
        v.map_or(Json::Null, Into::into)
    }
}

/// An object from `(key, value)` pairs, in order.
pub fn object<K: Into<String>>(pairs: impl IntoIterator<Item = (K, Json)>) -> Json {
    Json::Object(pairs.into_iter().map(|(k, v)| (k.into(), v)).collect())
}

/// The arguments of `json.dump` that change its bytes.
#[derive(Debug, Clone, Copy)]
pub struct Style {
    /// `indent=N` (newline and N spaces per level); `None` writes one line.
    pub indent: Option<usize>,
    /// `ensure_ascii=True` (Python's default): everything outside printable ASCII as `\uXXXX`.
    pub ensure_ascii: bool,
    /// `separators=(",", ":")` instead of the defaults (`", "` or `","` with indent, and `": "`).
    pub compact: bool,
}

impl Style {
    /// `json.dump(v, f, indent=2)`
    pub const INDENT2: Style = Style { indent: Some(2), ensure_ascii: true, compact: false };
    /// `json.dump(v, f, indent=2, ensure_ascii=False)`
    pub const INDENT2_UTF8: Style = Style { indent: Some(2), ensure_ascii: false, compact: false };
    /// `json.dump(v, f, ensure_ascii=False)`
    pub const LINE_UTF8: Style = Style { indent: None, ensure_ascii: false, compact: false };
    /// `json.dumps(v, separators=(",", ":"))`
    pub const COMPACT: Style = Style { indent: None, ensure_ascii: true, compact: true };
}

/// `json.dumps(value, ...)` with the given style.
pub fn dumps(value: &Json, style: Style) -> String {
    let mut out = String::new();
    write_value(&mut out, value, style, 0);
    out
}

fn write_value(out: &mut String, value: &Json, style: Style, level: usize) {
    match value {
        Json::Null => out.push_str("null"),
        Json::Bool(b) => out.push_str(if *b { "true" } else { "false" }),
        Json::Int(i) => out.push_str(&i.to_string()),
        Json::Float(x) => out.push_str(&float_repr(*x)),
        Json::Str(s) => write_str(out, s, style.ensure_ascii),
        Json::Array(items) => {
            write_items(out, ('[', ']'), items.iter(), style, level, |out, v, level| write_value(out, v, style, level))
        }
        Json::Object(pairs) => write_items(out, ('{', '}'), pairs.iter(), style, level, |out, (k, v), level| {
            write_str(out, k, style.ensure_ascii);
            out.push_str(if style.compact { ":" } else { ": " });
            write_value(out, v, style, level);
        }),
    }
}

fn write_items<T>(
    out: &mut String,
    (open, close): (char, char),
    items: impl ExactSizeIterator<Item = T>,
    style: Style,
    level: usize,
    mut item: impl FnMut(&mut String, T, usize),
) {
    if items.len() == 0 {
        out.push(open);
        out.push(close);
        return;
    }
    out.push(open);
    let newline = |out: &mut String, level: usize| {
        if let Some(n) = style.indent {
            out.push('\n');
            out.push_str(&" ".repeat(n * level));
        }
    };
    newline(out, level + 1);
    for (i, v) in items.enumerate() {
        if i > 0 {
            out.push(',');
            if style.indent.is_none() && !style.compact {
                out.push(' ');
            }
            newline(out, level + 1);
        }
        item(out, v, level + 1);
    }
    newline(out, level);
    out.push(close);
}

fn write_str(out: &mut String, s: &str, ensure_ascii: bool) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{8}' => out.push_str("\\b"),
            '\u{c}' => out.push_str("\\f"),
            c if (c as u32) < 0x20 || (ensure_ascii && !(' '..='~').contains(&c)) => {
                let mut units = [0u16; 2];
                for u in c.encode_utf16(&mut units) {
                    out.push_str(&format!("\\u{u:04x}"));
                }
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

/// Python's `repr(float)`: the shortest digits that round-trip, in fixed notation for decimal
/// exponents -4..16 (always with a fraction) and scientific (`1e-05`, `1.5e+16`) outside it.
pub fn float_repr(x: f64) -> String {
    if x.is_nan() {
        return "NaN".into();
    }
    if x.is_infinite() {
        return if x > 0.0 { "Infinity" } else { "-Infinity" }.into();
    }
    // Rust's `{:e}` also prints the shortest round-trip digits: "9.999999747378752e-6", "1e5".
    let sci = format!("{x:e}");
    let (mantissa, exp) = sci.split_once('e').expect("{:e} has an exponent");
    let exp: i32 = exp.parse().expect("{:e} exponent is an integer");
    let (sign, mantissa) = mantissa.strip_prefix('-').map_or(("", mantissa), |m| ("-", m));
    let digits: String = mantissa.chars().filter(|c| *c != '.').collect();
    if (-4..16).contains(&exp) {
        if exp < 0 {
            format!("{sign}0.{}{digits}", "0".repeat((-exp - 1) as usize))
        } else {
            let int_len = exp as usize + 1;
            if digits.len() <= int_len {
                format!("{sign}{digits}{}.0", "0".repeat(int_len - digits.len()))
            } else {
                format!("{sign}{}.{}", &digits[..int_len], &digits[int_len..])
            }
        }
    } else {
        let exp_sign = if exp < 0 { '-' } else { '+' };
        format!("{sign}{mantissa}e{exp_sign}{:02}", exp.abs())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn floats_print_as_python_repr() {
        // Expected strings are Python 3's repr of the same doubles.
        for (x, want) in [
            (1e-5, "1e-05"),
            (1e-5f32 as f64, "9.999999747378752e-06"),
            (100000.0, "100000.0"),
            (10000.0, "10000.0"),
            (0.0, "0.0"),
            (-0.0, "-0.0"),
            (0.0001, "0.0001"),
            (0.5, "0.5"),
            (-2.25, "-2.25"),
            (123.456, "123.456"),
            (1e16, "1e+16"),
            (1.5e16, "1.5e+16"),
            (9999999999999998.0, "9999999999999998.0"),
            (1.2345678901234568e17, "1.2345678901234568e+17"),
            (1e-300, "1e-300"),
        ] {
            assert_eq!(float_repr(x), want, "{x:e}");
        }
    }

    #[test]
    fn strings_escape_as_python_json() {
        let s = "a\"b\\c\n\t\u{1}\u{7f}é😀Ġ";
        let ascii = dumps(&Json::Str(s.into()), Style::INDENT2);
        assert_eq!(ascii, r#""a\"b\\c\n\t\u0001\u007f\u00e9\ud83d\ude00\u0120""#);
        let utf8 = dumps(&Json::Str(s.into()), Style::LINE_UTF8);
        assert_eq!(utf8, "\"a\\\"b\\\\c\\n\\t\\u0001\u{7f}é😀Ġ\"");
    }

    #[test]
    fn containers_use_python_separators_and_indentation() {
        let v = object([
            ("a", Json::Array(vec![Json::Int(1), Json::Null])),
            ("b", Json::Array(vec![])),
            ("c", object([("d", Json::Bool(false))])),
            ("e", Json::Object(vec![])),
        ]);
        assert_eq!(dumps(&v, Style::LINE_UTF8), r#"{"a": [1, null], "b": [], "c": {"d": false}, "e": {}}"#);
        assert_eq!(dumps(&v, Style::COMPACT), r#"{"a":[1,null],"b":[],"c":{"d":false},"e":{}}"#);
        let indented =
            "{\n  \"a\": [\n    1,\n    null\n  ],\n  \"b\": [],\n  \"c\": {\n    \"d\": false\n  },\n  \"e\": {}\n}";
        assert_eq!(dumps(&v, Style::INDENT2), indented);
    }
}
