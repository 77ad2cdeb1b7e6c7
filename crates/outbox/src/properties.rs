//! Java properties text, read as `java.util.Properties.load` reads it: how Debezium's outbox
//! extension stores a trace context in its `tracingspancontext` column
//! (`Properties.store`, which escapes `=`, `:`, `#`, `!` and `\` in keys and values).
//!
//! # Invariants
//! - JP1 A value reads back as the `String` Java stored: every escape `store` writes is
//!   undone (`\=`, `\:`, `\#`, `\!`, `\\`, `\ `, `\t`, `\n`, `\r`, `\f`, `\uXXXX`), and the
//!   rest of `load`'s syntax is followed (`#` and `!` comment lines, `\r\n`, `\r` or `\n` line
//!   ends, a line continued by an odd number of trailing backslashes, `=`, `:` or white
//!   space between key and value). Tested against files Java itself wrote
//!   (`tests/fixtures/java-properties`).
//! - JP2 Nothing panics on any input: a malformed `\u` escape is kept as written, never a
//!   reason to drop the line.

/// The key/value pairs of `text`, in order (`load` keeps the last of a repeated key).
pub fn parse(text: &str) -> Vec<(String, String)> {
    logical_lines(text)
        .into_iter()
        .filter_map(|line| {
            let line = line.trim_start_matches(is_space);
            if line.is_empty() || line.starts_with(['#', '!']) {
                return None;
            }
            Some(key_value(line))
        })
        .collect()
}

/// White space as `load` counts it: space, tab and form feed.
fn is_space(c: char) -> bool {
    matches!(c, ' ' | '\t' | '\u{c}')
}

/// The logical lines: natural lines joined where one ends in an odd number of backslashes
/// (the backslash dropped, the next line's leading white space skipped). A comment line is
/// never continued.
fn logical_lines(text: &str) -> Vec<String> {
    let mut lines = Vec::new();
    let mut current: Option<String> = None;
    for natural in text.split_inclusive(['\n', '\r']) {
        let natural = natural.trim_end_matches(['\n', '\r']);
        let (line, continuing) = match current.take() {
            Some(mut open) => {
                open.push_str(natural.trim_start_matches(is_space));
                (open, true)
            }
            None => (natural.to_owned(), false),
        };
        let is_comment = !continuing && line.trim_start_matches(is_space).starts_with(['#', '!']);
        let trailing = line.chars().rev().take_while(|&c| c == '\\').count();
        if !is_comment && trailing % 2 == 1 {
            let mut open = line;
            open.pop();
            current = Some(open);
        } else {
            lines.push(line);
        }
    }
    lines.extend(current);
    lines
}

/// A logical line's key (up to the first unescaped `=`, `:` or white space) and value.
fn key_value(line: &str) -> (String, String) {
    let mut end = line.len();
    let mut escaped = false;
    for (i, c) in line.char_indices() {
        if escaped {
            escaped = false;
        } else if c == '\\' {
            escaped = true;
        } else if c == '=' || c == ':' || is_space(c) {
            end = i;
            break;
        }
    }
    let key = &line[..end];
    let mut rest = line[end..].trim_start_matches(is_space);
    if let Some(after) = rest.strip_prefix(['=', ':']) {
        rest = after.trim_start_matches(is_space);
    }
    (unescape(key), unescape(rest))
}

/// `text` with `load`'s escapes undone (JP1, JP2).
fn unescape(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut chars = text.chars();
    while let Some(c) = chars.next() {
        if c != '\\' {
            out.push(c);
            continue;
        }
        match chars.next() {
            Some('t') => out.push('\t'),
            Some('n') => out.push('\n'),
            Some('r') => out.push('\r'),
            Some('f') => out.push('\u{c}'),
            Some('u') => {
                let hex: String = chars.clone().take(4).collect();
                match u32::from_str_radix(&hex, 16)
                    .ok()
                    .filter(|_| hex.len() == 4)
                {
                    Some(code) => {
                        out.push(char::from_u32(code).unwrap_or(char::REPLACEMENT_CHARACTER));
                        chars.nth(3);
                    }
                    None => out.push_str("\\u"),
                }
            }
            Some(other) => out.push(other),
            None => {}
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn load_syntax_beyond_what_store_writes() {
        let text = "! comment\n  # another\r\nkey1 = a\\\n    b\\\\\r\nkey2:x\\u0041\\u00e9\\u12\n\
                    key\\ 3 spaced value\n\tkey4\nkey5=\\#not\\!comment\\=\\:\n";
        assert_eq!(
            parse(text),
            [
                ("key1", "ab\\"),
                ("key2", "xAé\\u12"),
                ("key 3", "spaced value"),
                ("key4", ""),
                ("key5", "#not!comment=:"),
            ]
            .map(|(k, v)| (k.to_owned(), v.to_owned()))
        );
        assert_eq!(parse("# a=1"), []);
        assert_eq!(
            parse("a=1\\"),
            [("a".into(), "1".into())],
            "a dangling continuation"
        );
        for hostile in ["\\", "\\u", "\\uZZZZ", "=\\", "\u{0}\\\r\\\n\\"] {
            let _ = parse(hostile);
        }
    }
}
