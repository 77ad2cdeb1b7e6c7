//! The password file: read as libpq reads it, refused when others may read it.

use super::*;

/// The warning for a file holding a secret (the password file, `sslkey`, and the relay's
/// NATS seed, `.creds` and key files) that group or others can access, libpq's rule for
/// the password file and `sslkey` (which `crate::tls` refuses): `None` when only its owner can, or when it is no plain file one can
/// see. With `root_group_read`, a file root owns may also be group-readable (u=rw,g=r,
/// 0640), as libpq allows for `sslkey` (a key shared with the service's group). `what`
/// names the file as the operator gave it.
pub fn exposed_secret_file(path: &Path, what: &str, root_group_read: bool) -> Option<String> {
    use std::os::unix::fs::MetadataExt;
    let metadata = std::fs::metadata(path).ok()?;
    let mode = metadata.permissions().mode() & 0o777;
    // The group and other bits that must be clear.
    let (forbidden, allowed) = if root_group_read && metadata.uid() == 0 {
        (0o037, "u=rw,g=r (0640)")
    } else {
        (0o077, "u=rw (0600)")
    };
    (metadata.is_file() && mode & forbidden != 0).then(|| {
        format!(
            "{what} {} has group or world access (mode {mode:04o}); permissions should be \
             {allowed} or less (chmod {} {})",
            path.display(),
            if forbidden == 0o077 { "600" } else { "640" },
            path.display()
        )
    })
}

/// The password of the first line of the password file at `path` that matches
/// `[host, port, dbname, user]`. A file that is not a plain file, or that group or others
/// can access, is ignored with a warning (libpq's rule); a missing one silently.
pub(super) fn password_from_file(
    path: &Path,
    key: [&str; 4],
    warnings: &mut Vec<String>,
) -> Option<Secret> {
    let metadata = std::fs::metadata(path).ok()?;
    if !metadata.is_file() {
        warnings.push(format!(
            "password file {} is not a plain file; ignoring it",
            path.display()
        ));
        return None;
    }
    if let Some(exposed) = exposed_secret_file(path, "password file", false) {
        warnings.push(format!("{exposed}; ignoring it"));
        return None;
    }
    let text = match std::fs::read_to_string(path) {
        Ok(text) => text,
        Err(error) => {
            warnings.push(format!(
                "cannot read password file {}: {error}; ignoring it",
                path.display()
            ));
            return None;
        }
    };
    let host = if key[0] == DEFAULT_SOCKET_DIR {
        DEFAULT_HOST
    } else {
        key[0]
    };
    let key = [host, key[1], key[2], key[3]];
    text.lines()
        .map(|line| line.strip_suffix('\r').unwrap_or(line))
        .filter(|line| !line.is_empty() && !line.starts_with('#'))
        .find_map(|line| {
            let fields = password_file_fields(line);
            let matches = fields.len() >= 5
                && key
                    .iter()
                    .zip(&fields)
                    .all(|(wanted, (field, wildcard))| *wildcard || field == wanted);
            matches.then(|| Secret(fields[4].0.clone()))
        })
}

/// The `:`-separated fields of a password-file line, `\` escaping the next character; each
/// with whether it is the wildcard `*` (unescaped).
pub(super) fn password_file_fields(line: &str) -> Vec<(String, bool)> {
    let mut fields = Vec::new();
    let mut field = String::new();
    let mut escaped_any = false;
    let mut chars = line.chars();
    while let Some(c) = chars.next() {
        match c {
            '\\' => {
                escaped_any = true;
                if let Some(next) = chars.next() {
                    field.push(next);
                }
            }
            ':' => {
                let wildcard = field == "*" && !escaped_any;
                fields.push((std::mem::take(&mut field), wildcard));
                escaped_any = false;
            }
            c => field.push(c),
        }
    }
    let wildcard = field == "*" && !escaped_any;
    fields.push((field, wildcard));
    fields
}
