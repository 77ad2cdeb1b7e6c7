//! Subject templates: `{prefix}.{shard}.{event_type}` (the default) or the user's own, such as
//! `{prefix}.{aggregatetype}.{shard}`.
//!
//! A template is dot-separated tokens, each a literal or one placeholder: `{prefix}`,
//! `{shard}`, `{event_type}` or `{column}` for any column of the table.
//!
//! # Invariants
//! - TPL1 A template starts with `{prefix}`, holds `{shard}` exactly once and each
//!   placeholder as a whole token, so every subject is `prefix.` followed by one NATS token
//!   per template token after it: the stream's `{prefix}.>` covers it, and a shard's filter
//!   ([`SubjectTemplate::shard_filter`]) is the template with `*` for every row-derived token.
//! - TPL2 Every row-derived token (event type, column values) is escaped by the subject rule
//!   ([`crate::subject`], injective, never empty, never a wildcard or a dot), so a row cannot
//!   make a subject outside its shard's filter, and distinct values give distinct subjects.
//! - TPL3 The default template renders exactly [`crate::subject::subject`].

use std::fmt;
use std::fmt::Write as _;

use crate::subject::push_token;

/// One token of a template.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
enum Token {
    Literal(String),
    Prefix,
    Shard,
    EventType,
    Column(String),
}

/// A parsed subject template (TPL1).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct SubjectTemplate {
    tokens: Vec<Token>,
}

/// The relay's subjects since the start: `{prefix}.{shard}.{event_type}`.
pub const DEFAULT_TEMPLATE: &str = "{prefix}.{shard}.{event_type}";

impl Default for SubjectTemplate {
    fn default() -> Self {
        SubjectTemplate {
            tokens: vec![Token::Prefix, Token::Shard, Token::EventType],
        }
    }
}

impl SubjectTemplate {
    /// Parses and checks a template (TPL1).
    pub fn parse(text: &str) -> Result<SubjectTemplate, String> {
        let mut tokens = Vec::new();
        for part in text.split('.') {
            let token = if let Some(name) = part.strip_prefix('{').and_then(|p| p.strip_suffix('}'))
            {
                match name {
                    "prefix" => Token::Prefix,
                    "shard" => Token::Shard,
                    "event_type" => Token::EventType,
                    "" => {
                        return Err(format!(
                            "subject template {text:?} has an empty placeholder {{}}"
                        ))
                    }
                    column if column.contains(['{', '}']) => {
                        return Err(format!(
                            "subject template {text:?}: {part:?} is not one placeholder"
                        ))
                    }
                    column => Token::Column(column.to_owned()),
                }
            } else if part.is_empty() {
                return Err(format!(
                    "subject template {text:?} has an empty token (two dots, or a dot at an end)"
                ));
            } else if part
                .bytes()
                .any(|b| matches!(b, b'{' | b'}' | b'*' | b'>' | 0x00..=0x20 | 0x7F))
            {
                return Err(format!(
                    "subject template {text:?}: token {part:?} is neither a literal (no braces, wildcards or whitespace) nor one whole placeholder such as {{shard}}"
                ));
            } else {
                Token::Literal(part.to_owned())
            };
            tokens.push(token);
        }
        if tokens.first() != Some(&Token::Prefix)
            || tokens.iter().filter(|t| **t == Token::Prefix).count() != 1
        {
            return Err(format!(
                "subject template {text:?} must start with {{prefix}} and hold it once (the stream takes {{prefix}}.>)"
            ));
        }
        if tokens.iter().filter(|t| **t == Token::Shard).count() != 1 {
            return Err(format!(
                "subject template {text:?} must hold {{shard}} exactly once (consumers filter their shard on it)"
            ));
        }
        Ok(SubjectTemplate { tokens })
    }

    /// Whether this is [`DEFAULT_TEMPLATE`].
    pub fn is_default(&self) -> bool {
        // No allocation: the builder asks this for every event.
        matches!(
            self.tokens.as_slice(),
            [Token::Prefix, Token::Shard, Token::EventType]
        )
    }

    /// The columns its placeholders name, in template order, each once.
    pub fn columns(&self) -> impl Iterator<Item = &str> {
        let mut seen: Vec<&str> = Vec::new();
        self.tokens.iter().filter_map(move |t| match t {
            Token::Column(c) if !seen.contains(&c.as_str()) => {
                seen.push(c);
                Some(c.as_str())
            }
            _ => None,
        })
    }

    /// Whether it uses `{event_type}`.
    pub fn uses_event_type(&self) -> bool {
        self.tokens.contains(&Token::EventType)
    }

    /// Appends the subject of an event to `out` (TPL2): `column` gives the text of a
    /// placeholder's column.
    pub fn render<'a>(
        &self,
        out: &mut String,
        prefix: &str,
        shard: u64,
        event_type: &str,
        column: impl Fn(&str) -> &'a str,
    ) {
        for (i, token) in self.tokens.iter().enumerate() {
            if i > 0 {
                out.push('.');
            }
            match token {
                Token::Literal(text) => out.push_str(text),
                Token::Prefix => out.push_str(prefix),
                Token::Shard => {
                    let _ = write!(out, "{shard}");
                }
                Token::EventType => push_token(out, event_type),
                Token::Column(name) => push_token(out, column(name)),
            }
        }
    }

    /// The subjects of one shard (`Some`) or of every shard (`None`): the template with `*`
    /// for each row-derived token (TPL1).
    pub fn shard_filter(&self, prefix: &str, shard: Option<u64>) -> String {
        let mut out = String::new();
        for (i, token) in self.tokens.iter().enumerate() {
            if i > 0 {
                out.push('.');
            }
            match (token, shard) {
                (Token::Literal(text), _) => out.push_str(text),
                (Token::Prefix, _) => out.push_str(prefix),
                (Token::Shard, Some(shard)) => {
                    let _ = write!(out, "{shard}");
                }
                _ => out.push('*'),
            }
        }
        out
    }

    /// Which token of a subject (0-based, `prefix` counting as its own dot-separated
    /// tokens) carries the shard, for a subject under `prefix`.
    pub fn shard_token_index(&self, prefix: &str) -> usize {
        let at = self
            .tokens
            .iter()
            .position(|t| *t == Token::Shard)
            .unwrap_or(1);
        prefix.split('.').count() + at - 1
    }
}

impl fmt::Display for SubjectTemplate {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, token) in self.tokens.iter().enumerate() {
            if i > 0 {
                f.write_str(".")?;
            }
            match token {
                Token::Literal(text) => f.write_str(text)?,
                Token::Prefix => f.write_str("{prefix}")?,
                Token::Shard => f.write_str("{shard}")?,
                Token::EventType => f.write_str("{event_type}")?,
                Token::Column(name) => write!(f, "{{{name}}}")?,
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::subject::subject;
    use proptest::prelude::*;

    fn render(t: &SubjectTemplate, shard: u64, event_type: &str, value: &str) -> String {
        let mut out = String::new();
        t.render(&mut out, "app.outbox", shard, event_type, |_| value);
        out
    }

    #[test]
    fn templates_parse_render_and_filter() {
        let t = SubjectTemplate::parse("{prefix}.{aggregatetype}.{shard}").unwrap();
        assert_eq!(
            render(&t, 3, "ignored", "Order.Line"),
            "app.outbox.Order%2ELine.3"
        );
        assert_eq!(t.shard_filter("app.outbox", Some(3)), "app.outbox.*.3");
        assert_eq!(t.shard_filter("app.outbox", None), "app.outbox.*.*");
        assert_eq!(t.shard_token_index("app.outbox"), 3);
        assert_eq!(t.columns().collect::<Vec<_>>(), ["aggregatetype"]);
        assert_eq!(t.to_string(), "{prefix}.{aggregatetype}.{shard}");
        let d = SubjectTemplate::parse(DEFAULT_TEMPLATE).unwrap();
        assert!(d.is_default());
        assert_eq!(d.shard_filter("outbox", Some(7)), "outbox.7.*");
        assert_eq!(d.shard_token_index("outbox"), 1);
        let lit = SubjectTemplate::parse("{prefix}.events.{shard}.{event_type}").unwrap();
        assert_eq!(render(&lit, 0, "A B", ""), "app.outbox.events.0.A%20B");
    }

    #[test]
    fn bad_templates_are_refused() {
        for bad in [
            "",
            "{shard}.{prefix}",
            "{prefix}.{event_type}",
            "{prefix}.{shard}.{shard}",
            "{prefix}.{prefix}.{shard}",
            "{prefix}.x{shard}",
            "{prefix}..{shard}",
            "{prefix}.{shard}.>",
            "{prefix}.{shard}.*",
            "{prefix}.{}.{shard}",
            "{prefix}.{shard}.a b",
        ] {
            assert!(SubjectTemplate::parse(bad).is_err(), "{bad:?}");
        }
    }

    proptest! {
        #[test]
        fn the_default_renders_the_seed_subject(shard in 0u64..1000, event_type in any::<String>()) {
            let t = SubjectTemplate::default();
            let mut out = String::new();
            t.render(&mut out, "outbox", shard, &event_type, |_| "");
            prop_assert_eq!(out, subject("outbox", shard, &event_type));
        }
    }
}
