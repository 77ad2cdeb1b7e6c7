//! Parsing a connection string, URL or key/value form, with advice for a misspelt
//! parameter (R8: an error never quotes the string).

use super::*;

/// Every parameter the relay accepts, for errors.
pub(super) fn supported_parameters() -> String {
    PARAMETERS
        .iter()
        .map(|p| p.name)
        .chain(NEUTRAL.iter().map(|n| n.0))
        .collect::<Vec<_>>()
        .join(", ")
}

/// The supported parameter within two edits of `name` (a typo), if one is.
pub(super) fn closest_parameter(name: &str) -> Option<&'static str> {
    PARAMETERS
        .iter()
        .map(|p| p.name)
        .chain(NEUTRAL.iter().map(|n| n.0))
        .map(|candidate| (edit_distance(name, candidate), candidate))
        .filter(|(distance, _)| *distance <= 2)
        .min()
        .map(|(_, candidate)| candidate)
}

/// Levenshtein distance, by characters.
pub(super) fn edit_distance(a: &str, b: &str) -> usize {
    let b: Vec<char> = b.chars().collect();
    let mut row: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.chars().enumerate() {
        let mut diagonal = row[0];
        row[0] = i + 1;
        for (j, cb) in b.iter().enumerate() {
            let above = row[j + 1];
            row[j + 1] = (above + 1)
                .min(row[j] + 1)
                .min(diagonal + usize::from(ca != *cb));
            diagonal = above;
        }
    }
    row[b.len()]
}

/// A neutral parameter's value, from the connection string (`variable` `None`: never
/// quoted, R8) or from `variable`.
pub(super) fn check_neutral(
    (name, _, accepted): &(&str, &str, &[&str]),
    value: &str,
    variable: Option<&str>,
) -> Result<(), Error> {
    if value.is_empty() || accepted.iter().any(|a| a.eq_ignore_ascii_case(value)) {
        return Ok(());
    }
    let given = match variable {
        Some(variable) => format!("{variable}={value:?}"),
        None => format!("{name} (the connection string's value, not shown)"),
    };
    Err(Error::Config(format!(
        "{given} is not supported: outbox-relay always behaves as {name}={}",
        accepted[0]
    )))
}
/// One parameter of a connection string.
pub(super) struct Pair {
    pub(super) key: String,
    pub(super) value: String,
    /// Key=value notation: the pair right after an unquoted password, whose "key" may be
    /// the rest of a password with a space in it (so errors must not quote it).
    pub(super) follows_bare_password: bool,
    /// A URL's query parameter: its place in the query string, from 1 (errors name it by
    /// that, R8).
    pub(super) url_query_index: Option<usize>,
}

impl Pair {
    pub(super) fn new(key: &str, value: String) -> Pair {
        Pair {
            key: key.to_owned(),
            value,
            follows_bare_password: false,
            url_query_index: None,
        }
    }
}

/// `user:password@host:port/dbname?k=v&...`, after the scheme.
pub(super) fn parse_url(rest: &str) -> Result<Vec<Pair>, Error> {
    let mut pairs = Vec::new();
    let (userinfo, rest) = split_userinfo(rest);
    if let Some(userinfo) = userinfo {
        let (user, password) = match userinfo.split_once(':') {
            Some((user, password)) => (user, Some(password)),
            None => (userinfo, None),
        };
        pairs.push(Pair::new("user", percent_decode(user, "user")?));
        if let Some(password) = password {
            pairs.push(Pair::new("password", percent_decode(password, "password")?));
        }
    }
    let (main, query) = match rest.split_once('?') {
        Some((main, query)) => (main, Some(query)),
        None => (rest, None),
    };
    let (host_port, path) = match main.split_once('/') {
        Some((host_port, path)) => (host_port, Some(path)),
        None => (main, None),
    };
    url_hosts(host_port, &mut pairs)?;
    if let Some(path) = path {
        pairs.push(Pair::new("dbname", percent_decode(path, "dbname")?));
    }
    if let Some(query) = query {
        url_query(query, &mut pairs)?;
    }
    Ok(pairs)
}

/// `host1:port1,host2:port2`: libpq's lists, an entry without a port being the default.
pub(super) fn url_hosts(host_port: &str, pairs: &mut Vec<Pair>) -> Result<(), Error> {
    let mut hosts = Vec::new();
    let mut ports = Vec::new();
    for host_port in host_port.split(',') {
        let (host, port) = split_host_port(host_port)?;
        let port = port.unwrap_or("");
        if !port.bytes().all(|b| b.is_ascii_digit()) {
            // Not quoted: without an '@', "user:password" lands here.
            return Err(Error::Config(
                "invalid port in the URL: expected a number after the host's ':' (if the \
                 URL has user:password, it needs an '@' before the host)"
                    .to_owned(),
            ));
        }
        hosts.push(host);
        ports.push(port);
    }
    pairs.push(Pair::new("host", hosts.join(",")));
    if ports.iter().any(|port| !port.is_empty()) {
        pairs.push(Pair::new("port", ports.join(",")));
    }
    Ok(())
}

/// `k=v&...`, each pair numbered (from 1) by its place in the query string.
pub(super) fn url_query(query: &str, pairs: &mut Vec<Pair>) -> Result<(), Error> {
    for (index, param) in (1..).zip(query.split('&')) {
        if param.is_empty() {
            continue;
        }
        // Not quoted (R8): `?password=hun&ter2` makes "ter2" a parameter.
        let (key, value) = param.split_once('=').ok_or_else(|| {
            Error::Config(format!(
                "query parameter {index} of the URL has no '=' and value (not shown: it may be \
                 the tail of a password with an unencoded '&'; percent-encode '&' in values as \
                 %26)"
            ))
        })?;
        let key = percent_decode(key, &format!("query parameter {index} (its name)"))?;
        let value = percent_decode(value, &format!("query parameter {index} (its value)"))?;
        let mut pair = Pair::new(&key, value);
        pair.url_query_index = Some(index);
        pairs.push(pair);
    }
    Ok(())
}

/// `host`, `host:port`, `[ipv6]` or `[ipv6]:port`; the host percent-decoded, the port as
/// written.
pub(super) fn split_host_port(host_port: &str) -> Result<(String, Option<&str>), Error> {
    if let Some(bracketed) = host_port.strip_prefix('[') {
        let (host, after) = bracketed.split_once(']').ok_or_else(|| {
            Error::Config("unterminated IPv6 address ('[' without ']') in the URL".to_owned())
        })?;
        let port = match after {
            "" => None,
            _ => Some(after.strip_prefix(':').ok_or_else(|| {
                Error::Config("unexpected text after the IPv6 address in the URL".to_owned())
            })?),
        };
        return Ok((host.to_owned(), port));
    }
    Ok(match host_port.rsplit_once(':') {
        Some((host, port)) => (percent_decode(host, "host")?, Some(port)),
        None => (percent_decode(host_port, "host")?, None),
    })
}

/// Splits `user:password@` off the rest of the URL. The user info ends at the last '@', so
/// that a password with unencoded '@', '/', '?', '=' or ':' stays whole and never ends up in
/// the host, port or database name, where errors and logs would show it. The one exception
/// is an '@' inside a query string (`?application_name=me@host`): when the text before the
/// last '@' has a '?', and reading that '?' as the start of the query (with the user info,
/// if any, ending at an earlier '@') gives a well-formed URL whose query names only
/// supported parameters, that reading wins.
pub(super) fn split_userinfo(rest: &str) -> (Option<&str>, &str) {
    let Some(last) = rest.rfind('@') else {
        return (None, rest);
    };
    if let Some(question) = rest[..last].find('?') {
        let (userinfo, after) = match rest[..question].rfind('@') {
            Some(at) => (Some(&rest[..at]), &rest[at + 1..]),
            None => (None, rest),
        };
        if is_well_formed_after_userinfo(after) {
            return (userinfo, after);
        }
    }
    (Some(&rest[..last]), &rest[last + 1..])
}

/// Whether `host[:port][/dbname]?query` has a numeric port (if any) and a query of
/// supported `name=value` parameters only.
pub(super) fn is_well_formed_after_userinfo(text: &str) -> bool {
    let Some((main, query)) = text.split_once('?') else {
        return false;
    };
    let host_port = main
        .split_once('/')
        .map_or(main, |(host_port, _)| host_port);
    let port_ok = match split_host_port(host_port) {
        Ok((_, Some(port))) => port.bytes().all(|b| b.is_ascii_digit()),
        Ok((_, None)) => true,
        Err(_) => false,
    };
    port_ok
        && query.split('&').filter(|p| !p.is_empty()).all(|param| {
            param.split_once('=').is_some_and(|(key, _)| {
                percent_decode(key, "query parameter name").is_ok_and(|key| {
                    PARAMETERS.iter().any(|p| p.name == key) || NEUTRAL.iter().any(|n| n.0 == key)
                })
            })
        })
}

/// Decodes `%XX` escapes (`+` stays a plus, as in libpq). Errors name `what` and never
/// quote the text (R8).
pub(super) fn percent_decode(text: &str, what: &str) -> Result<String, Error> {
    let bytes = text.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' {
            let hex = bytes
                .get(i + 1..i + 3)
                .and_then(|h| std::str::from_utf8(h).ok())
                .and_then(|h| u8::from_str_radix(h, 16).ok())
                .ok_or_else(|| {
                    Error::Config(format!(
                        "invalid percent-encoding in the URL's {what}: '%' must be followed by \
                         two hexadecimal digits (write a '%' itself as %25)"
                    ))
                })?;
            out.push(hex);
            i += 3;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    String::from_utf8(out).map_err(|_| {
        Error::Config(format!(
            "the URL's {what} is not UTF-8 after percent-decoding"
        ))
    })
}

/// Shuffles `items` (Fisher-Yates) with the standard library's per-process random keys: the
/// order of `load_balance_hosts=random` needs no cryptographic strength.
pub(super) fn shuffle<T>(items: &mut [T]) {
    use std::hash::{BuildHasher, Hasher};
    let state = std::collections::hash_map::RandomState::new();
    for i in (1..items.len()).rev() {
        let mut hasher = state.build_hasher();
        hasher.write_usize(i);
        let j = (hasher.finish() % (i as u64 + 1)) as usize;
        items.swap(i, j);
    }
}

/// Encodes everything but the URL's unreserved characters.
pub fn percent_encode(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for byte in text.bytes() {
        if byte.is_ascii_alphanumeric() || matches!(byte, b'-' | b'.' | b'_' | b'~') {
            out.push(char::from(byte));
        } else {
            out.push_str(&format!("%{byte:02X}"));
        }
    }
    out
}

/// The `key`/`value` pairs of a libpq key=value connection string, in order (for a tool
/// that rewrites one, e.g. without its password). Errors never quote a value.
pub fn conninfo_pairs(text: &str) -> Result<Vec<(String, String)>, Error> {
    Ok(parse_key_values(text)?
        .into_iter()
        .map(|pair| (pair.key, pair.value))
        .collect())
}

/// `value` as libpq's key=value notation writes it: bare when it has no white space, quote
/// or backslash (and is not empty), else in single quotes with `\'` and `\\`.
pub fn quote_conninfo_value(value: &str) -> String {
    if !value.is_empty()
        && !value
            .chars()
            .any(|c| c.is_whitespace() || c == '\'' || c == '\\')
    {
        return value.to_owned();
    }
    format!("'{}'", value.replace('\\', "\\\\").replace('\'', "\\'"))
}

/// libpq's key=value notation. Errors never quote a value (it might be the password).
pub(super) fn parse_key_values(text: &str) -> Result<Vec<Pair>, Error> {
    let mut pairs: Vec<Pair> = Vec::new();
    let mut chars = text.chars().peekable();
    let mut after_bare_password = false;
    loop {
        while chars.next_if(|c| c.is_whitespace()).is_some() {}
        if chars.peek().is_none() {
            return Ok(pairs);
        }
        let mut key = String::new();
        while let Some(c) = chars.next_if(|c| !c.is_whitespace() && *c != '=') {
            key.push(c);
        }
        while chars.next_if(|c| c.is_whitespace()).is_some() {}
        if chars.next() != Some('=') {
            // The word is not quoted: it may be the tail of a password that lacks quotes.
            return Err(Error::Config(
                "missing \"=\" after a parameter name in the connection info string".to_owned(),
            ));
        }
        while chars.next_if(|c| c.is_whitespace()).is_some() {}
        let quoted = chars.next_if_eq(&'\'').is_some();
        let value = if quoted {
            quoted_value(&mut chars, &key, after_bare_password)?
        } else {
            bare_value(&mut chars)
        };
        let bare_password = key == "password" && !quoted;
        pairs.push(Pair {
            key,
            value,
            follows_bare_password: after_bare_password,
            url_query_index: None,
        });
        after_bare_password = bare_password;
    }
}

/// A quoted value's text after its opening quote, through the closing one: a backslash
/// escapes the next character and (an extension) `''` is one quote. The error for a missing
/// closing quote names the parameter `key`, never the text; a password's (or what follows a
/// bare password, `after_bare_password`) does not even name it.
pub(super) fn quoted_value(
    chars: &mut std::iter::Peekable<std::str::Chars<'_>>,
    key: &str,
    after_bare_password: bool,
) -> Result<String, Error> {
    let mut value = String::new();
    loop {
        match chars.next() {
            None if key == "password" || after_bare_password => {
                return Err(Error::Config(
                    "unterminated quoted password in connection info string".to_owned(),
                ))
            }
            None => {
                return Err(Error::Config(format!(
                    "unterminated quoted value of {key:?} in connection info string"
                )))
            }
            Some('\\') => {
                if let Some(c) = chars.next() {
                    value.push(c);
                }
            }
            Some('\'') => {
                // Extension: '' inside quotes is one quote (libpq would reject it).
                if chars.next_if_eq(&'\'').is_some() {
                    value.push('\'');
                } else {
                    return Ok(value);
                }
            }
            Some(c) => value.push(c),
        }
    }
}

/// An unquoted value: up to the next whitespace, a backslash escaping the next character.
pub(super) fn bare_value(chars: &mut std::iter::Peekable<std::str::Chars<'_>>) -> String {
    let mut value = String::new();
    while let Some(c) = chars.next_if(|c| !c.is_whitespace()) {
        if c == '\\' {
            if let Some(escaped) = chars.next() {
                value.push(escaped);
            }
        } else {
            value.push(c);
        }
    }
    value
}
