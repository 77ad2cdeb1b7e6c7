//! The parameters' values resolved in libpq's order: the connection string, then the
//! `PG*` variables, then the defaults, with TLS and the password file.

use super::*;

/// The TLS parameters, with libpq's defaults from `~/.postgresql` (`home`).
pub(super) struct Tls {
    pub(super) sslmode: SslMode,
    pub(super) sslrootcert: Option<RootCerts>,
    pub(super) sslcert: Option<PathBuf>,
    pub(super) sslkey: Option<PathBuf>,
}

/// The connection string's values and the environment, handing out each parameter once
/// and recording where it came from.
pub(super) struct Values<'a> {
    pub(super) given: BTreeMap<&'static str, String>,
    pub(super) sources: BTreeMap<&'static str, Source>,
    pub(super) env: &'a dyn Fn(&str) -> Option<String>,
}

impl<'a> Values<'a> {
    /// Sorts the connection string's pairs: a supported parameter's value is kept (the last
    /// one wins, as in libpq; an empty value means "not given"), a neutral parameter's is
    /// checked and its name returned, anything else is an error ([`unsupported`]).
    pub(super) fn sort(
        pairs: Vec<Pair>,
        env: &'a dyn Fn(&str) -> Option<String>,
    ) -> Result<(Self, Vec<&'static str>), Error> {
        let mut values = Values {
            given: BTreeMap::new(),
            sources: BTreeMap::new(),
            env,
        };
        let mut neutral_given = Vec::new();
        for pair in pairs {
            if let Some(parameter) = PARAMETERS.iter().find(|p| p.name == pair.key) {
                if pair.value.is_empty() {
                    values.given.remove(parameter.name);
                } else {
                    values.given.insert(parameter.name, pair.value);
                }
            } else if let Some(neutral) = NEUTRAL.iter().find(|n| n.0 == pair.key) {
                check_neutral(neutral, &pair.value, None)?;
                neutral_given.push(neutral.0);
            } else {
                return Err(unsupported(&pair));
            }
        }
        Ok((values, neutral_given))
    }
}

impl Values<'_> {
    pub(super) fn take(&mut self, name: &'static str) -> Option<String> {
        if let Some(value) = self.given.remove(name) {
            self.sources.insert(name, Source::ConnString);
            return Some(value);
        }
        let variable = PARAMETERS.iter().find(|p| p.name == name)?.env;
        let value = (self.env)(variable)?;
        self.sources.insert(name, Source::Env(variable));
        Some(value)
    }

    /// How an error shows `value`, just taken for `name` (R8): `PGPORT="abc"` when a variable
    /// gave it; not at all when the connection string did.
    pub(super) fn shown(&self, name: &str, value: &str) -> String {
        match self.sources.get(name) {
            Some(Source::Env(variable)) => format!("{variable}={value:?}"),
            _ => "(the connection string's value, not shown)".to_owned(),
        }
    }

    /// `host` and `port`, paired: one port for all hosts, or one for each.
    pub(super) fn hosts(&mut self) -> Result<Vec<(String, u16)>, Error> {
        let host_list = self.host_list();
        let port_list = self.port_list()?;
        match (host_list.len(), port_list.len()) {
            (_, 1) => Ok(host_list
                .into_iter()
                .map(|host| (host, port_list[0]))
                .collect()),
            (h, p) if h == p => Ok(host_list.into_iter().zip(port_list).collect()),
            (h, p) => Err(Error::Config(format!(
                "{p} ports for {h} hosts: give one port for all hosts, or one for each \
                 (port=5432,5433 for host=a,b)"
            ))),
        }
    }

    /// `host`'s comma-separated list; libpq: an empty entry is the default.
    pub(super) fn host_list(&mut self) -> Vec<String> {
        match self.take("host") {
            None => vec![DEFAULT_HOST.to_owned()],
            Some(list) => list
                .split(',')
                .map(|host| match host.trim() {
                    "" => DEFAULT_HOST.to_owned(),
                    host => host.to_owned(),
                })
                .collect(),
        }
    }

    /// `port`'s comma-separated list; libpq: an empty entry is the default.
    pub(super) fn port_list(&mut self) -> Result<Vec<u16>, Error> {
        let Some(list) = self.take("port") else {
            return Ok(vec![DEFAULT_PORT]);
        };
        list.split(',')
            .map(|port| match port.trim() {
                "" => Ok(DEFAULT_PORT),
                text => match text.parse::<u16>() {
                    Ok(port) if port != 0 => Ok(port),
                    _ => Err(Error::Config(format!(
                        "invalid port {}: expected a number from 1 to 65535{}",
                        self.shown("port", &list),
                        if list.contains(',') {
                            " for each host, comma-separated"
                        } else {
                            ""
                        }
                    ))),
                },
            })
            .collect()
    }

    pub(super) fn target_session_attrs(&mut self) -> Result<TargetSessionAttrs, Error> {
        let Some(text) = self.take("target_session_attrs") else {
            return Ok(TargetSessionAttrs::Any);
        };
        TargetSessionAttrs::ALL
            .into_iter()
            .find(|attrs| attrs.as_str().eq_ignore_ascii_case(text.trim()))
            .ok_or_else(|| {
                Error::Config(format!(
                    "invalid target_session_attrs {}: expected any, read-write, read-only, \
                     primary, standby or prefer-standby",
                    self.shown("target_session_attrs", &text)
                ))
            })
    }

    pub(super) fn load_balance_hosts(&mut self) -> Result<LoadBalanceHosts, Error> {
        let Some(text) = self.take("load_balance_hosts") else {
            return Ok(LoadBalanceHosts::Disable);
        };
        match text.trim().to_ascii_lowercase().as_str() {
            "disable" => Ok(LoadBalanceHosts::Disable),
            "random" => Ok(LoadBalanceHosts::Random),
            _ => Err(Error::Config(format!(
                "invalid load_balance_hosts {}: expected disable or random",
                self.shown("load_balance_hosts", &text)
            ))),
        }
    }

    /// `password`, or else the password file's entry for `key` (host, port, dbname, user).
    pub(super) fn password(
        &mut self,
        passfile: Option<&Path>,
        key: [&str; 4],
        warnings: &mut Vec<String>,
    ) -> Option<Secret> {
        if let Some(password) = self.take("password") {
            return Some(Secret(password));
        }
        let path = passfile?;
        let password = password_from_file(path, key, warnings);
        if password.is_some() {
            self.sources
                .insert("password", Source::PassFile(path.to_path_buf()));
        }
        password
    }

    /// `sslmode`, `sslrootcert`, `sslcert` and `sslkey`, the files defaulting to those in
    /// `~/.postgresql` that exist; `sslrootcert=system` means `verify-full`.
    pub(super) fn tls(&mut self, home: Option<&Path>) -> Result<Tls, Error> {
        let explicit_sslmode = match self.take("sslmode") {
            None => None,
            Some(mode) => Some(mode.parse::<SslMode>().map_err(|_| {
                Error::Config(format!(
                    "invalid sslmode {}: expected one of disable, prefer, require, verify-ca, \
                     verify-full",
                    self.shown("sslmode", &mode)
                ))
            })?),
        };
        let in_home = |file: &str| home.map(|home| home.join(".postgresql").join(file));
        let sslrootcert = match self.take("sslrootcert") {
            Some(text) if text == "system" => Some(RootCerts::System),
            Some(path) => Some(RootCerts::File(PathBuf::from(path))),
            None => in_home("root.crt")
                .filter(|path| path.is_file())
                .map(RootCerts::File),
        };
        let sslmode = match (explicit_sslmode, &sslrootcert) {
            (Some(SslMode::VerifyFull) | None, Some(RootCerts::System)) => SslMode::VerifyFull,
            (Some(weak), Some(RootCerts::System)) => {
                return Err(Error::Config(format!(
                    "weak sslmode {:?} may not be used with sslrootcert=system (use \
                     \"verify-full\")",
                    weak.as_str()
                )))
            }
            (mode, _) => mode.unwrap_or_default(),
        };
        let sslcert = self
            .take("sslcert")
            .map(PathBuf::from)
            .or_else(|| in_home("postgresql.crt").filter(|path| path.is_file()));
        let sslkey = self.take("sslkey").map(PathBuf::from).or_else(|| {
            sslcert.as_ref()?;
            in_home("postgresql.key")
        });
        Ok(Tls {
            sslmode,
            sslrootcert,
            sslcert,
            sslkey,
        })
    }

    /// `channel_binding`; `require` needs TLS, so neither `sslmode=disable` nor a socket.
    pub(super) fn channel_binding(
        &mut self,
        sslmode: SslMode,
        hosts: &[(String, u16)],
    ) -> Result<ChannelBinding, Error> {
        let channel_binding = match self.take("channel_binding").as_deref() {
            None => ChannelBinding::default(),
            Some("disable") => ChannelBinding::Disable,
            Some("prefer") => ChannelBinding::Prefer,
            Some("require") => ChannelBinding::Require,
            Some(other) => {
                return Err(Error::Config(format!(
                    "invalid channel_binding {}: expected disable, prefer or require",
                    self.shown("channel_binding", other)
                )))
            }
        };
        if channel_binding == ChannelBinding::Require {
            if sslmode == SslMode::Disable {
                return Err(Error::Config(
                    "channel_binding=require needs TLS, but sslmode=disable; use \
                     sslmode=require or stricter"
                        .to_owned(),
                ));
            }
            if hosts.iter().any(|(host, _)| host.starts_with('/')) {
                return Err(Error::Config(
                    "channel_binding=require needs TLS, which is not used over a Unix socket; \
                     connect over TCP"
                        .to_owned(),
                ));
            }
        }
        Ok(channel_binding)
    }

    /// `connect_timeout` in seconds; libpq: zero or negative waits forever, the minimum is 2
    /// seconds.
    pub(super) fn connect_timeout(&mut self) -> Result<Option<Duration>, Error> {
        let Some(text) = self.take("connect_timeout") else {
            return Ok(Some(DEFAULT_CONNECT_TIMEOUT));
        };
        let seconds = text.trim().parse::<i64>().map_err(|_| {
            Error::Config(format!(
                "invalid connect_timeout {}: expected a whole number of seconds",
                self.shown("connect_timeout", &text)
            ))
        })?;
        Ok(u64::try_from(seconds)
            .ok()
            .filter(|s| *s > 0)
            .map(|s| Duration::from_secs(s.max(2))))
    }
}
