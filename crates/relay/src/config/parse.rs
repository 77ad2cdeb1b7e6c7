//! Parsing and formatting single values: names, sizes, durations, addresses, the NATS URL
//! list (CFG3).

use super::*;

/// `NATS_URL`: a comma-separated list of `nats://` or `tls://` servers (never WebSocket),
/// each `[user:password@]host[:port]`, with the same credentials in every entry or none.
/// The errors never quote the text (it may hold a password).
pub(super) fn parse_nats_url(v: &str) -> Result<NatsUrl, String> {
    for (i, url) in v.split(',').enumerate() {
        let url = url.trim();
        if ["ws://", "wss://"].iter().any(|s| url.starts_with(s)) {
            return Err(format!(
                "server {} of the list is a WebSocket URL (ws:// or wss://), which the \
                 relay cannot use: it speaks the NATS TCP protocol only; give the \
                 server's client port (4222 by default, not its websocket port) as \
                 nats://host:4222, or tls://host:4222 for TLS",
                i + 1
            ));
        }
        let scheme_ok =
            ["nats://", "tls://"].iter().any(|s| url.starts_with(s)) || !url.contains("://");
        if url.is_empty() || !scheme_ok {
            return Err("expected nats://host:port (or tls://), comma-separated".into());
        }
        // Not quoted: the text may hold a password.
        if !nats_host_port_ok(split_nats_url(url).2) {
            return Err(format!(
                "server {} of the list is not [user:password@]host[:port] with a \
                 numeric port (a ',' or '@' in a password must be percent-encoded: \
                 %2C, %40)",
                i + 1
            ));
        }
    }
    if let Some(entry) = comma_in_credentials(v) {
        return Err(format!(
            "server {entry} of the list has user information (user:password@ or \
             token@) but server {} does not, so a ',' may have split a credential: a \
             ',' in a user name, password or token must be percent-encoded as %2C; \
             separate servers need the same credentials in every URL (or --user and \
             --password, or --token, instead)",
            entry - 1
        ));
    }
    Ok(NatsUrl(v.to_owned()))
}

/// The subjects' prefix ([`outbox::subject::validate_prefix`]).
pub(super) fn parse_subject_prefix(v: &str) -> Result<String, String> {
    outbox::subject::validate_prefix(v)?;
    Ok(v.to_owned())
}

/// `--partitions`: a positive integer.
pub(super) fn parse_partitions(v: &str) -> Result<NonZeroU64, String> {
    v.parse::<NonZeroU64>()
        .map_err(|_| "expected a positive integer (the seed's default is 12)".to_owned())
}

/// A publication's name, as Postgres accepts it.
pub(super) fn parse_publication_name(v: &str) -> Result<String, String> {
    if v.is_empty() || v.len() > 63 {
        Err("publication names have 1 to 63 characters".into())
    } else {
        Ok(v.to_owned())
    }
}

/// An integer from `low` to `high`.
pub(super) fn integer_in<T>(v: &str, low: T, high: T) -> Result<T, String>
where
    T: std::str::FromStr + PartialOrd + std::fmt::Display + Copy,
{
    match v.parse::<T>() {
        Ok(n) if (low..=high).contains(&n) => Ok(n),
        _ => Err(format!("expected an integer from {low} to {high}")),
    }
}

/// The value of the word `v` among `words`; the error names them all ("expected a, b or c").
pub(super) fn one_of<T: Clone>(v: &str, words: &[(&str, T)]) -> Result<T, String> {
    if let Some((_, value)) = words.iter().find(|(word, _)| *word == v) {
        return Ok(value.clone());
    }
    let names: Vec<&str> = words.iter().map(|(word, _)| *word).collect();
    Err(match names.split_last() {
        Some((last, rest)) if !rest.is_empty() => {
            format!("expected {} or {last}", rest.join(", "))
        }
        _ => format!("expected {}", names.join("")),
    })
}

/// `--on-poison`: `halt` or `dead-letter`.
pub(super) fn parse_on_poison(v: &str) -> Result<sink::PoisonPolicy, String> {
    one_of(
        v,
        &[
            ("halt", sink::PoisonPolicy::Halt),
            ("dead-letter", sink::PoisonPolicy::DeadLetter),
        ],
    )
}

/// `--log-format`: `text` or `json`.
pub(super) fn parse_log_format(v: &str) -> Result<LogFormat, String> {
    one_of(v, &[("text", LogFormat::Text), ("json", LogFormat::Json)])
}

/// `schema.table`, or `table` alone in schema `public`, read as PostgreSQL reads a qualified
/// name (CFG5): a part in double quotes is taken as written (case, dots and spaces kept, `""`
/// for one `"`); an unquoted part is folded to lower case and may hold letters, digits, `_`
/// and `$` (not first), as SQL's identifiers do.
pub(super) fn parse_table_name(v: &str) -> Result<Table, String> {
    let parts = sql_name_parts(v)?;
    let (schema, name) = match parts.as_slice() {
        [name] => ("public".to_owned(), name.clone()),
        [schema, name] => (schema.clone(), name.clone()),
        _ => {
            return Err(format!(
                "expected schema.table or table, as SQL writes them, e.g. public.outbox_events or \
                 '\"Billing\".\"Outbox Events\"'; read {} names (a database name cannot be given \
                 here, and a name holding a dot goes in double quotes)",
                parts.len()
            ))
        }
    };
    Ok(Table::new(TableName { schema, name }))
}

/// The dot-separated identifiers of a qualified SQL name (CFG5).
fn sql_name_parts(v: &str) -> Result<Vec<String>, String> {
    let mut parts = Vec::new();
    let mut rest = v.trim_start();
    loop {
        let (part, after) = match rest.strip_prefix('"') {
            Some(quoted) => quoted_identifier(quoted)?,
            None => unquoted_identifier(rest)?,
        };
        if part.len() > 63 {
            return Err(format!(
                "the name {part:?} is longer than 63 bytes, and PostgreSQL cuts names to 63"
            ));
        }
        parts.push(part);
        rest = after.trim_start();
        match rest.strip_prefix('.') {
            Some(after_dot) => rest = after_dot.trim_start(),
            None if rest.is_empty() => return Ok(parts),
            None => {
                return Err(format!(
                    "unexpected {rest:?} after a name (names are separated by dots; a name \
                     holding spaces or other characters goes in double quotes)"
                ))
            }
        }
    }
}

/// A double-quoted identifier's text up to its closing quote (already past the opening
/// one), and what follows it.
fn quoted_identifier(v: &str) -> Result<(String, &str), String> {
    let mut name = String::new();
    let mut chars = v.char_indices();
    while let Some((i, c)) = chars.next() {
        if c != '"' {
            name.push(c);
            continue;
        }
        if v[i + 1..].starts_with('"') {
            name.push('"');
            chars.next();
            continue;
        }
        if name.is_empty() {
            return Err("a name in double quotes is empty".into());
        }
        return Ok((name, &v[i + 1..]));
    }
    Err("a double quote is not closed".into())
}

/// An unquoted identifier at the start of `v`, folded to lower case as SQL folds it, and
/// what follows it.
fn unquoted_identifier(v: &str) -> Result<(String, &str), String> {
    let end = v
        .char_indices()
        .find(|(_, c)| !(c.is_ascii_alphanumeric() || *c == '_' || *c == '$' || !c.is_ascii()))
        .map_or(v.len(), |(i, _)| i);
    let word = &v[..end];
    match word.chars().next() {
        None => Err("expected schema.table, e.g. public.outbox_events (a name is missing)".into()),
        Some(first) if first.is_ascii_digit() || first == '$' => Err(format!(
            "the unquoted name {word:?} starts with {first:?}, which SQL does not allow: put it \
             in double quotes"
        )),
        Some(_) => Ok((word.to_ascii_lowercase(), &v[end..])),
    }
}

/// A replication slot's name, as Postgres accepts it.
pub(super) fn parse_slot_name(v: &str) -> Result<String, String> {
    let valid = !v.is_empty()
        && v.len() <= 63
        && v.bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_');
    if valid {
        Ok(v.to_owned())
    } else {
        Err("replication slot names have 1 to 63 characters: lower-case letters, digits and underscores".into())
    }
}

/// A JetStream stream's name, as the server accepts it.
pub(super) fn parse_stream_name(v: &str) -> Result<String, String> {
    let valid = !v.is_empty()
        && v.bytes()
            .all(|b| !matches!(b, b'.' | b'*' | b'>' | b'/' | b'\\') && b.is_ascii_graphic());
    if valid {
        Ok(v.to_owned())
    } else {
        Err("stream names are printable ASCII without spaces, '.', '*', '>', '/' or '\\'".into())
    }
}
/// `unlimited` as `None`, anything else through `parse`.
pub(super) fn unlimited_or<T>(
    text: &str,
    parse: impl FnOnce(&str) -> Result<T, String>,
) -> Result<Option<T>, String> {
    word_or("unlimited", text, parse)
}

/// `None` for `word` (`unlimited`, `off`), else what `parse` makes of `text`.
pub(super) fn word_or<T>(
    word: &str,
    text: &str,
    parse: impl FnOnce(&str) -> Result<T, String>,
) -> Result<Option<T>, String> {
    if text.trim() == word {
        Ok(None)
    } else {
        parse(text)
            .map(Some)
            .map_err(|why| format!("{why}, or {word}"))
    }
}

pub(super) fn at_most(value: u64, limit: u64) -> Result<u64, String> {
    if value <= limit {
        Ok(value)
    } else {
        Err(format!("must be at most {limit} bytes"))
    }
}

/// Parses a listening address: `IP:PORT`, `[IPv6]:PORT`, or `:PORT` for every interface.
pub fn parse_listen_addr(text: &str) -> Result<SocketAddr, String> {
    let text = text.trim();
    let expanded;
    let text = match text.strip_prefix(':') {
        Some(port) => {
            expanded = format!("0.0.0.0:{port}");
            &expanded
        }
        None => text,
    };
    text.parse().map_err(|_| {
        "expected an IP address and a port, e.g. 0.0.0.0:9464, [::]:9464, :9464 or 127.0.0.1:0 \
         (a host name is not accepted)"
            .to_owned()
    })
}

/// Parses a byte size: `1048576`, `512KiB`, `64MiB`, `10GiB`, `1TiB` (also `K`, `KB`, `M`,
/// `MB`…, any case: powers of 1024, as Postgres and nats-server read them).
pub fn parse_size(text: &str) -> Result<u64, String> {
    let text = text.trim();
    let split = text
        .find(|c: char| !c.is_ascii_digit())
        .unwrap_or(text.len());
    let (number, unit) = text.split_at(split);
    let expected = || "expected a size like 1048576, 512KiB, 64MiB or 10GiB".to_owned();
    let number: u64 = number.parse().map_err(|_| expected())?;
    let unit = unit.trim().to_ascii_lowercase();
    let prefix = unit
        .strip_suffix("ib")
        .or_else(|| unit.strip_suffix('b'))
        .unwrap_or(&unit);
    let power = match prefix {
        "" => 0,
        "k" => 1,
        "m" => 2,
        "g" => 3,
        "t" => 4,
        _ => return Err(format!("unknown unit {unit:?}: use KiB, MiB, GiB or TiB")),
    };
    let bytes = number
        .checked_mul(1024u64.pow(power))
        .ok_or_else(|| "too large".to_owned())?;
    if bytes == 0 {
        return Err("must be greater than zero".into());
    }
    Ok(bytes)
}

/// A byte count for people: `56 B`, `64 MiB` (exact), `120.6 KiB` (rounded).
pub fn format_size(bytes: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut unit = 0;
    while unit + 1 < UNITS.len() && bytes >= 1024u64.pow(unit as u32 + 1) {
        unit += 1;
    }
    let scale = 1024u64.pow(unit as u32);
    if bytes % scale == 0 {
        format!("{} {}", bytes / scale, UNITS[unit])
    } else {
        format!("{:.1} {}", bytes as f64 / scale as f64, UNITS[unit])
    }
}

/// A duration as [`parse_duration`] reads it: `500ms`, `90s`, `2m`, `1h`, `7d`.
pub fn format_duration(duration: Duration) -> String {
    let millis = duration.as_millis();
    if millis % 1000 != 0 {
        return format!("{millis}ms");
    }
    let secs = millis / 1000;
    match secs {
        0 => "0s".into(),
        s if s % 86_400 == 0 => format!("{}d", s / 86_400),
        s if s % 3600 == 0 => format!("{}h", s / 3600),
        s if s % 60 == 0 => format!("{}m", s / 60),
        s => format!("{s}s"),
    }
}

/// Parses `true`/`false` (also `1`/`0`, `yes`/`no`, `on`/`off`).
pub fn parse_bool(text: &str) -> Result<bool, String> {
    match text.trim().to_ascii_lowercase().as_str() {
        "true" | "1" | "yes" | "on" => Ok(true),
        "false" | "0" | "no" | "off" => Ok(false),
        _ => Err("expected true or false".into()),
    }
}

/// Parses `500ms`, `90s`, `2m`, `1h`, `7d` (a bare number is seconds).
pub fn parse_duration(text: &str) -> Result<Duration, String> {
    let text = text.trim();
    // A bare number is seconds, as it always was; everything else is humantime's
    // (`500ms`, `90s`, `2min`, `1h30m`, `7d`), which the ecosystem's tools read too.
    let duration = match text.parse::<u64>() {
        Ok(seconds) => Duration::from_secs(seconds),
        Err(_) => humantime::parse_duration(text)
            .map_err(|e| format!("expected a duration like 500ms, 90s, 2min, 1h30m or 7d ({e})"))?,
    };
    if duration.is_zero() {
        return Err("must be greater than zero".into());
    }
    Ok(duration)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn read(v: &str) -> Result<(String, String, String), String> {
        parse_table_name(v).map(|t| {
            (
                t.name().schema.clone(),
                t.name().name.clone(),
                t.sql().to_owned(),
            )
        })
    }

    fn named(schema: &str, name: &str, sql: &str) -> Result<(String, String, String), String> {
        Ok((schema.into(), name.into(), sql.into()))
    }

    #[test]
    fn table_names_read_as_sql_reads_them() {
        let seed = named("public", "outbox_events", r#""public"."outbox_events""#);
        assert_eq!(read("public.outbox_events"), seed);
        assert_eq!(read("outbox_events"), seed);
        assert_eq!(
            read("  Public . Outbox_Events "),
            seed,
            "unquoted names fold"
        );
        assert_eq!(
            read(r#""Billing Dept"."Outbox Events""#),
            named(
                "Billing Dept",
                "Outbox Events",
                r#""Billing Dept"."Outbox Events""#
            )
        );
        assert_eq!(
            read(r#""my.schema"."say ""hi"" $1""#),
            named(
                "my.schema",
                r#"say "hi" $1"#,
                r#""my.schema"."say ""hi"" $1""#
            )
        );
        assert_eq!(
            read(r#"public."OutboxMessages""#),
            named("public", "OutboxMessages", r#""public"."OutboxMessages""#)
        );
        assert_eq!(
            read("app.évènements_2$"),
            named("app", "évènements_2$", r#""app"."évènements_2$""#)
        );
    }

    #[test]
    fn what_sql_would_refuse_is_refused_naming_why() {
        let refused = [
            ("db.public.outbox_events", "read 3 names"),
            (r#""Billing.outbox"#, "not closed"),
            (r#""".outbox"#, "is empty"),
            ("public.", "a name is missing"),
            (".outbox", "a name is missing"),
            ("", "a name is missing"),
            ("public.my-table", "unexpected \"-table\""),
            ("public.1table", "starts with '1'"),
            ("public outbox", "unexpected \"outbox\""),
        ];
        for (text, why) in refused {
            let e = read(text).unwrap_err();
            assert!(e.contains(why), "{text:?}: {e}");
        }
        let long = format!("public.{}", "a".repeat(64));
        assert!(read(&long).unwrap_err().contains("longer than 63 bytes"));
        assert!(read(&format!("public.{}", "a".repeat(63))).is_ok());
    }
}
