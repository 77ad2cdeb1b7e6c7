//! NATS authentication and TLS, end to end: for every mode a real nats-server requires
//! (user/password, token, nkey, a JWT operator set-up, TLS with a client certificate), the
//! relay connects and relays events, and a wrong secret stops it at once (exit 1, not
//! retried) with a message naming the option to check and without the secret.
//!
//! Each test starts its own nats-server configured for its mode (flags or a config file the
//! test writes); the Postgres is shared by the tests of this binary.

#![allow(clippy::unwrap_used)]

use crate::support;

use support::assert_contains_all;

use std::path::{Path, PathBuf};
use std::sync::OnceLock;
use std::time::Duration;

use async_nats::jetstream;
use nkeys::KeyPair;
use support::nats_jwt::{creds, operator_config};
use support::{eventually, insert_transaction, Case, DEADLINE};
use testkit::{Ca, Nats, Postgres, Process, TlsFront};

/// How long a refused relay may take to give up: one connection attempt, no retries.
const REFUSAL_DEADLINE: Duration = Duration::from_secs(30);

fn pg() -> &'static Postgres {
    static PG: OnceLock<Postgres> = OnceLock::new();
    testkit::shared(&PG, Postgres::start)
}

/// A private directory for a test's files.
fn temp_dir() -> tempfile::TempDir {
    tempfile::Builder::new()
        .prefix("nats-auth-")
        .tempdir()
        .unwrap()
}

fn write(dir: &Path, name: &str, contents: &str) -> PathBuf {
    let path = dir.join(name);
    std::fs::write(&path, contents).unwrap();
    path
}

/// A nats-server with JetStream and the configuration file `config`.
fn nats_with_config(dir: &Path, config: &str) -> Nats {
    let path = write(dir, "nats-server.conf", config);
    Nats::start_with_args(&["-c", path.to_str().unwrap()])
}

/// `nats://127.0.0.1:{port}` with `user_info@` in front of the host.
fn url_with(nats: &Nats, user_info: &str) -> String {
    format!("nats://{user_info}@127.0.0.1:{}", nats.port())
}

/// Runs the relay for `case` (extra arguments after `run`), commits a transaction of three
/// events and waits until the stream, read by a client connected to `nats` with `client`,
/// holds exactly them.
async fn relays_events(
    case: &Case,
    args: &[&str],
    nats: &Nats,
    client: async_nats::ConnectOptions,
) {
    let mut command = case.relay_command("run");
    command.args(args);
    let relay = Process::spawn(&format!("relay-{}", case.name), command);
    relay.wait_for_output("streaming outbox events", DEADLINE);
    let mut sql = case.sql().await;
    let ids = insert_transaction(&mut sql, 3, 2, &case.name).await;
    let js = jetstream::new(
        client
            .connect(nats.url())
            .await
            .expect("the test's client connects"),
    );
    holds_exactly(case, &js, &ids).await;
    drop(relay);
}

/// Waits until the stream holds as many events as `ids`, and asserts that they are `ids`.
async fn holds_exactly(case: &Case, js: &jetstream::Context, ids: &[i64]) {
    case.wait_for_count(js, ids.len() as u64, DEADLINE).await;
    assert_eq!(
        case.outbox_ids(js).await,
        ids,
        "the committed events, once, in order"
    );
}

/// Runs the relay for `case` (extra arguments after `run`) and asserts that it stops on its
/// own with exit status 1 without retrying, that its final error names every one of
/// `names`, and that its output contains none of `secrets`.
fn is_refused(case: &Case, args: &[&str], names: &[&str], secrets: &[&str]) -> String {
    let mut command = case.relay_command("run");
    command.args(args);
    let mut relay = Process::spawn(&format!("refused-{}", case.name), command);
    let status = relay.wait_exit(REFUSAL_DEADLINE);
    let output = relay.output();
    assert_eq!(status.code(), Some(1), "exit status 1 expected:\n{output}");
    let last = output
        .lines()
        .rev()
        .find(|line| line.starts_with("outbox-relay: "))
        .unwrap_or_else(|| panic!("no final error line:\n{output}"));
    for name in names {
        assert!(last.contains(name), "{name} is not named in: {last}");
    }
    eprintln!("{}: {last}", case.name);
    assert!(last.contains("cannot connect to NATS"), "{last}");
    assert!(
        !output.contains("resuming from the slot's confirmed position"),
        "a refusal is not retried:\n{output}"
    );
    for secret in secrets {
        assert!(
            !output.contains(secret),
            "the secret {secret:?} is printed:\n{output}"
        );
    }
    output
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn user_and_password_from_flags_or_the_url_relay_and_a_wrong_password_is_refused() {
    const PASSWORD: &str = "p@ss:w/rd s3cret";
    const ENCODED: &str = "p%40ss%3Aw%2Frd%20s3cret";
    let nats = Nats::start_with_args(&["--user", "relay", "--pass", PASSWORD]);
    let client =
        || async_nats::ConnectOptions::with_user_and_password("relay".into(), PASSWORD.into());

    // --user/--password (flags).
    let case = Case::with_nats_url(pg(), &nats.url(), "userpass_flags");
    relays_events(
        &case,
        &["--user", "relay", "--password", PASSWORD],
        &nats,
        client(),
    )
    .await;

    // In the URL, percent-encoded, for every server of the list (the first is down).
    let down = testkit::free_port();
    let url = format!(
        "nats://relay:{ENCODED}@127.0.0.1:{down},{}",
        url_with(&nats, &format!("relay:{ENCODED}"))
    );
    let case = Case::with_nats_url(pg(), &url, "userpass_url");
    relays_events(&case, &[], &nats, client()).await;

    // Wrong passwords: the option named as given, the password never printed.
    let mut case = Case::with_nats_url(pg(), &nats.url(), "userpass_wrong");
    case.extra_env = vec![
        ("OUTBOX_RELAY_NATS_USER".into(), "relay".into()),
        ("OUTBOX_RELAY_NATS_PASSWORD".into(), "wr0ng-passw0rd".into()),
    ];
    is_refused(
        &case,
        &[],
        &["OUTBOX_RELAY_NATS_USER", "OUTBOX_RELAY_NATS_PASSWORD"],
        &["wr0ng-passw0rd"],
    );
    let case = Case::with_nats_url(
        pg(),
        &url_with(&nats, "relay:wr0ng-in-url"),
        "userpass_url_wrong",
    );
    is_refused(
        &case,
        &[],
        &["the user:password in NATS_URL"],
        &["wr0ng-in-url"],
    );

    // No credentials at all: the message lists what to set.
    let case = Case::with_nats_url(pg(), &nats.url(), "userpass_none");
    is_refused(&case, &[], &["--user", "--token", "--creds"], &[PASSWORD]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn token_from_the_option_or_the_url_relays_and_a_wrong_token_is_refused() {
    const TOKEN: &str = "tok3n-s3cret";
    let nats = Nats::start_with_args(&["--auth", TOKEN]);
    let client = || async_nats::ConnectOptions::with_token(TOKEN.into());

    let mut case = Case::with_nats_url(pg(), &nats.url(), "token_env");
    case.extra_env = vec![("OUTBOX_RELAY_NATS_TOKEN".into(), TOKEN.into())];
    relays_events(&case, &[], &nats, client()).await;

    let case = Case::with_nats_url(pg(), &url_with(&nats, TOKEN), "token_url");
    relays_events(&case, &[], &nats, client()).await;

    let case = Case::with_nats_url(pg(), &nats.url(), "token_wrong");
    is_refused(
        &case,
        &["--token", "wr0ng-tok3n"],
        &["--token"],
        &["wr0ng-tok3n"],
    );
    let case = Case::with_nats_url(pg(), &url_with(&nats, "wr0ng-url-tok3n"), "token_url_wrong");
    is_refused(&case, &[], &["the token in NATS_URL"], &["wr0ng-url-tok3n"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nkey_seed_file_relays_and_another_users_seed_is_refused() {
    let dir = temp_dir();
    let user = KeyPair::new_user();
    let nats = nats_with_config(
        dir.path(),
        &format!(
            "authorization {{ users: [ {{ nkey: {} }} ] }}\n",
            user.public_key()
        ),
    );
    let seed = user.seed().unwrap();
    let seed_file = write(dir.path(), "relay.nk", &format!("{seed}\n"));
    let client = async_nats::ConnectOptions::with_nkey(seed.clone());

    let case = Case::with_nats_url(pg(), &nats.url(), "nkey");
    relays_events(
        &case,
        &["--nkey", seed_file.to_str().unwrap()],
        &nats,
        client,
    )
    .await;

    let stranger = KeyPair::new_user().seed().unwrap();
    let stranger_file = write(dir.path(), "stranger.nk", &format!("{stranger}\n"));
    let mut case = Case::with_nats_url(pg(), &nats.url(), "nkey_wrong");
    case.extra_env = vec![(
        "OUTBOX_RELAY_NATS_NKEY".into(),
        stranger_file.to_str().unwrap().into(),
    )];
    is_refused(&case, &[], &["OUTBOX_RELAY_NATS_NKEY"], &[&stranger, &seed]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn creds_file_of_an_operator_set_up_relays_and_a_user_of_an_unknown_account_is_refused() {
    let dir = temp_dir();
    let (config, account) = operator_config(dir.path(), -1);
    let nats = nats_with_config(dir.path(), &config);
    let user = KeyPair::new_user();
    let creds_text = creds(&account, &user);
    let creds_file = write(dir.path(), "relay.creds", &creds_text);
    let client = async_nats::ConnectOptions::with_credentials(&creds_text).unwrap();

    let case = Case::with_nats_url(pg(), &nats.url(), "creds");
    relays_events(
        &case,
        &["--creds", creds_file.to_str().unwrap()],
        &nats,
        client,
    )
    .await;

    // A user signed by an account the operator never signed.
    let stranger = KeyPair::new_user();
    let stranger_seed = stranger.seed().unwrap();
    let wrong = write(
        dir.path(),
        "stranger.creds",
        &creds(&KeyPair::new_account(), &stranger),
    );
    let mut case = Case::with_nats_url(pg(), &nats.url(), "creds_wrong");
    case.extra_env = vec![(
        "OUTBOX_RELAY_NATS_CREDS".into(),
        wrong.to_str().unwrap().into(),
    )];
    is_refused(
        &case,
        &[],
        &["OUTBOX_RELAY_NATS_CREDS"],
        &[&stranger_seed, &user.seed().unwrap()],
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tls_with_a_private_ca_and_a_required_client_certificate_relays_and_wrong_certificates_are_refused(
) {
    let dir = temp_dir();
    let ca = Ca::new();
    let ca_file = dir.path().join("ca.crt");
    ca.write_cert(&ca_file);
    let (server_cert, server_key) = ca.write_server(dir.path(), "server");
    let (client_cert, client_key) = ca.write_client(dir.path(), "relay", "relay");
    let nats = nats_with_config(
        dir.path(),
        &format!(
            "tls {{\n  cert_file: {server_cert:?}\n  key_file: {server_key:?}\n  ca_file: {ca_file:?}\n  verify: true\n  timeout: 5\n}}\n"
        ),
    );
    let client = async_nats::ConnectOptions::new()
        .add_root_certificates(ca_file.clone())
        .add_client_certificate(client_cert.clone(), client_key.clone())
        .require_tls(true);

    // The files given as keys of the TOML file.
    let config = write(
        dir.path(),
        "relay.toml",
        &format!(
            "nats_tlsca = {ca_file:?}\nnats_tlscert = {client_cert:?}\nnats_tlskey = {client_key:?}\n"
        ),
    );
    let case = Case::with_nats_url(pg(), &nats.url(), "tls");
    relays_events(
        &case,
        &["--config", config.to_str().unwrap()],
        &nats,
        client,
    )
    .await;

    // A client certificate of another CA: the server rejects it.
    let other = Ca::new();
    let (other_cert, other_key) = other.write_client(dir.path(), "stranger", "relay");
    let other_key_text = std::fs::read_to_string(&other_key).unwrap();
    let key_body = other_key_text.lines().nth(1).unwrap().to_owned();
    let ca_arg = ca_file.to_str().unwrap();
    let case = Case::with_nats_url(pg(), &nats.url(), "tls_wrong_client");
    is_refused(
        &case,
        &[
            "--tlsca",
            ca_arg,
            "--tlscert",
            other_cert.to_str().unwrap(),
            "--tlskey",
            other_key.to_str().unwrap(),
        ],
        &["--tlscert", "--tlskey"],
        &[&key_body],
    );

    // No CA given: the server's certificate is not trusted; the message says to set --tlsca.
    let case = Case::with_nats_url(pg(), &nats.url(), "tls_no_ca");
    is_refused(
        &case,
        &[
            "--tlscert",
            client_cert.to_str().unwrap(),
            "--tlskey",
            client_key.to_str().unwrap(),
        ],
        &["--tlsca"],
        &[],
    );
}

/// `--tlsfirst` (`nats_tlsfirst`): TLS before the server's `INFO`, for a nats-server with
/// `handshake_first` or one behind a load balancer that terminates TLS. nats-server 2.9.10
/// has no `handshake_first`, so a TLS-terminating front (the load balancer's part) stands
/// before a plain server: it accepts nothing but a TLS handshake, so the events arrive only
/// if both of the relay's connections (async-nats's and the publishing one) handshake first.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tls_first_relays_through_a_front_that_terminates_tls() {
    let dir = temp_dir();
    let ca = Ca::new();
    let ca_file = dir.path().join("ca.crt");
    ca.write_cert(&ca_file);
    let (cert, key) = ca.write_server(dir.path(), "front");
    let nats = Nats::start();
    let front = TlsFront::start(
        format!("127.0.0.1:{}", nats.port()).parse().unwrap(),
        &cert,
        &key,
    );
    let url = format!("tls://127.0.0.1:{}", front.port());
    let case = Case::with_nats_url(pg(), &url, "tls_first");
    relays_events(
        &case,
        &["--tlsfirst", "--tlsca", ca_file.to_str().unwrap()],
        &nats,
        async_nats::ConnectOptions::new(),
    )
    .await;
    assert!(
        front.handshakes() >= 2,
        "both of the relay's connections handshake first: {} handshakes",
        front.handshakes()
    );
}

/// `--tlsfirst` against a nats-server that requires it itself (`tls { handshake_first: true }`,
/// 2.10 and later): both of the relay's connections start with the TLS handshake, and events
/// flow. A client that waits for the server's INFO first never gets one from this server.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tls_first_relays_to_a_server_with_handshake_first() {
    let dir = temp_dir();
    let ca = Ca::new();
    let ca_file = dir.path().join("ca.crt");
    ca.write_cert(&ca_file);
    let (cert, key) = ca.write_server(dir.path(), "nats");
    let config = dir.path().join("nats.conf");
    std::fs::write(
        &config,
        format!(
            "tls {{\n  cert_file: \"{}\"\n  key_file: \"{}\"\n  handshake_first: true\n}}\n",
            cert.display(),
            key.display()
        ),
    )
    .unwrap();
    let nats = Nats::start_current(&["-c", config.to_str().unwrap()]);
    let url = format!("tls://127.0.0.1:{}", nats.port());
    let case = Case::with_nats_url(pg(), &url, "handshake_first");
    let client = async_nats::ConnectOptions::new()
        .add_root_certificates(ca_file.clone())
        .tls_first();
    let mut command = case.relay_command("run");
    command.args(["--tlsfirst", "--tlsca", ca_file.to_str().unwrap()]);
    let relay = Process::spawn("relay-handshake_first", command);
    relay.wait_for_output("streaming outbox events", DEADLINE);
    let mut sql = case.sql().await;
    let ids = insert_transaction(&mut sql, 3, 2, &case.name).await;
    let js = jetstream::new(
        client
            .connect(&url)
            .await
            .expect("the test's client connects"),
    );
    holds_exactly(&case, &js, &ids).await;
    drop(relay);

    // Without --tlsfirst the relay cannot connect: it says so and streams nothing.
    let mut command = case.relay_command("run");
    command.args(["--tlsca", ca_file.to_str().unwrap()]);
    let waiting = Process::spawn("relay-handshake_first-plain", command);
    eventually(
        "the relay without --tlsfirst reports the failed connection",
        DEADLINE,
        || async {
            let output = waiting.output();
            (output.contains("ERROR") || output.contains("WARN")).then_some(())
        },
    )
    .await;
    assert!(!waiting.output().contains("streaming outbox events"));
}

/// Part 3 of issue 8: `outbox-relay config` with a password in DATABASE_URL and a NATS token
/// (then a `.creds` file: one credential source at a time) shows where each value came from
/// and no secret: the token as `<redacted>`, the creds file by its path only.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn config_shows_no_password_token_or_credentials() {
    const PASSWORD: &str = "Pg-pw-s3cret-77";
    const TOKEN: &str = "nats-tok3n-s3cret-88";
    let nats = Nats::start();
    let mut case = Case::new(pg(), &nats, "config_secrets");
    case.pg_url = format!(
        "postgres://relay:{PASSWORD}@127.0.0.1:{}/{}",
        pg().port(),
        case.database
    );
    let config = |env: (&str, &str)| {
        let output = case
            .relay_command("config")
            .env(env.0, env.1)
            .output()
            .unwrap();
        let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(output.status.success(), "{stdout}{stderr}");
        for secret in [PASSWORD, TOKEN] {
            assert!(
                !stdout.contains(secret) && !stderr.contains(secret),
                "{stdout}{stderr}"
            );
        }
        stdout
    };

    let with_token = config(("OUTBOX_RELAY_NATS_TOKEN", TOKEN));
    assert!(with_token.contains("<redacted>"), "{with_token}");
    assert!(
        with_token.contains("OUTBOX_RELAY_NATS_TOKEN"),
        "{with_token}"
    );

    let dir = temp_dir();
    let (account, user) = (KeyPair::new_account(), KeyPair::new_user());
    let contents = creds(&account, &user);
    let path = write(dir.path(), "relay.creds", &contents);
    let with_creds = config(("OUTBOX_RELAY_NATS_CREDS", path.to_str().unwrap()));
    assert!(with_creds.contains(path.to_str().unwrap()), "{with_creds}");
    let seed = user.seed().unwrap();
    assert!(!with_creds.contains(&seed), "{with_creds}");
    let jwt_line = contents.lines().nth(1).unwrap();
    assert!(!with_creds.contains(jwt_line), "{with_creds}");
}

/// The client options of the user `admin` of [`nats_with_runbook_permissions`] and the
/// publish test's server, who may do anything.
fn admin() -> async_nats::ConnectOptions {
    async_nats::ConnectOptions::with_user_and_password("admin".into(), "admin-s3cret".into())
}

/// A case named `name` relayed by a nats-server of [`nats_with_runbook_permissions`] whose
/// user `relay` subscribes only to `{inbox}.>`; returns the case, the server and its
/// directory.
fn runbook_case(name: &str, inbox: &str) -> (Case, Nats, tempfile::TempDir) {
    let mut case = Case::with_nats_url(pg(), "nats://127.0.0.1:1", name);
    let dir = temp_dir();
    let nats = nats_with_runbook_permissions(&case, dir.path(), inbox);
    case.nats_url = nats.url();
    (case, nats, dir)
}

/// A nats-server whose user `relay` (password `relay-s3cret`) may publish only to `case`'s
/// prefix and the stream's three JetStream APIs, and subscribe only to `{inbox}.>`; the user
/// `admin` (password `admin-s3cret`) may do anything.
fn nats_with_runbook_permissions(case: &Case, dir: &Path, inbox: &str) -> Nats {
    let (stream, prefix) = (&case.stream, &case.prefix);
    nats_with_config(
        dir,
        &format!(
            r#"
authorization {{
  users = [
    {{
      user: relay, password: relay-s3cret,
      permissions: {{
        publish: {{ allow: ["{prefix}.>", "$JS.API.STREAM.INFO.{stream}", "$JS.API.STREAM.CREATE.{stream}", "$JS.API.STREAM.MSG.GET.{stream}"] }},
        subscribe: {{ allow: ["{inbox}.>"] }}
      }}
    }},
    {{ user: admin, password: admin-s3cret }}
  ]
}}
"#
        ),
    )
}

/// docs/operations.md's runbook permissions are enough: a user who may publish only to the
/// prefix and the stream's three JetStream APIs, and subscribe only to `_INBOX.>`, relays
/// events. The sink's acks arrive on one subscription per session under the client's inbox
/// prefix (sink P10), which that permission covers, like async-nats's request replies.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_runbooks_permissions_are_enough_to_relay() {
    let (case, nats, _dir) = runbook_case("runbook_permissions", "_INBOX");
    relays_events(
        &case,
        &["--user", "relay", "--password", "relay-s3cret"],
        &nats,
        admin(),
    )
    .await;
}

/// `--inbox-prefix`: a user who may subscribe only to its own inboxes (`_INBOX_relay.>`, so
/// it cannot read other users' replies) relays events when the relay is given that prefix:
/// both connections take their reply subjects under it. Without it, the relay says at once
/// that the server refused its subscription, and which permission or option fixes it,
/// instead of timing out on requests whose replies it may not receive.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_user_limited_to_its_own_inbox_prefix_relays_with_inbox_prefix() {
    let (case, nats, _dir) = runbook_case("inbox_prefix", "_INBOX_relay");

    let mut command = case.relay_command("run");
    command.args(["--user", "relay", "--password", "relay-s3cret"]);
    let refused = Process::spawn(&format!("refused-{}", case.name), command);
    refused.wait_for_output("--inbox-prefix", DEADLINE);
    let output = refused.output();
    assert_contains_all(
        &output,
        [
            "refused the subscription to _INBOX.",
            "Permissions Violation for Subscription",
            "subscribe permission on _INBOX.>",
        ],
    );
    assert!(
        !output.contains("timed out"),
        "named before any request times out:\n{output}"
    );
    drop(refused);

    relays_events(
        &case,
        &[
            "--user",
            "relay",
            "--password",
            "relay-s3cret",
            "--inbox-prefix",
            "_INBOX_relay",
        ],
        &nats,
        admin(),
    )
    .await;
}

/// The relay's publishing connection (sink CN7, P11) reports what the server refuses in its
/// own words instead of waiting for acks that never come, and loses nothing: a user who may
/// not publish to the prefix makes the relay halt (the default poison policy) naming the
/// first event, its subject and `Permissions Violation for Publish`, and nothing is stored;
/// once the server's configuration allows it and the relay is started again, the events
/// are stored, once, in order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_publish_the_server_forbids_is_reported_in_its_words_and_relayed_once_allowed() {
    let mut case = Case::with_nats_url(pg(), "nats://127.0.0.1:1", "publish_forbidden");
    let (stream, prefix) = (case.stream.clone(), case.prefix.clone());
    let dir = temp_dir();
    let config = |publish: &str| {
        format!(
            r#"
authorization {{
  users = [
    {{
      user: relay, password: relay-s3cret,
      permissions: {{
        publish: {{ allow: [{publish}"$JS.API.STREAM.INFO.{stream}", "$JS.API.STREAM.CREATE.{stream}", "$JS.API.STREAM.MSG.GET.{stream}"] }},
        subscribe: {{ allow: ["_INBOX.>"] }}
      }}
    }},
    {{ user: admin, password: admin-s3cret }}
  ]
}}
"#
        )
    };
    let mut nats = nats_with_config(dir.path(), &config(""));
    case.nats_url = nats.url();
    let mut command = case.relay_command("run");
    command.args(["--user", "relay", "--password", "relay-s3cret"]);
    let mut relay = Process::spawn(&format!("relay-{}", case.name), command);
    relay.wait_for_output("streaming outbox events", DEADLINE);
    let mut sql = case.sql().await;
    let ids = insert_transaction(&mut sql, 3, 2, &case.name).await;
    let status = tokio::task::block_in_place(|| relay.wait_exit(DEADLINE));
    let output = relay.output();
    assert!(!status.success(), "halts: {status:?}\n{output}");
    assert_contains_all(
        &output,
        [
            format!("outbox event id={}", ids[0]),
            "Permissions Violation for Publish".to_owned(),
            format!("{prefix}."),
            "allow the user to publish".to_owned(),
        ],
    );
    let js = jetstream::new(
        admin()
            .connect(nats.url())
            .await
            .expect("the test's client connects"),
    );
    assert_eq!(
        case.outbox_ids(&js).await,
        Vec::<i64>::new(),
        "nothing stored"
    );

    // Allowed from now on: the server restarts with the new configuration (a reload with
    // SIGHUP leaves nats-server 2.9.10's JetStream API unanswered for this user); the relay,
    // started again, publishes what it could not.
    write(
        dir.path(),
        "nats-server.conf",
        &config(&format!("\"{prefix}.>\", ")),
    );
    nats.stop();
    nats.start_again();
    let js = jetstream::new(
        admin()
            .connect(nats.url())
            .await
            .expect("the test's client connects"),
    );
    let mut command = case.relay_command("run");
    command.args(["--user", "relay", "--password", "relay-s3cret"]);
    let relay = Process::spawn(&format!("relay-again-{}", case.name), command);
    holds_exactly(&case, &js, &ids).await;
    drop(relay);
}
