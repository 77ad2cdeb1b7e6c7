//! The container image: `docker/build-local-image.sh` builds the runtime image of
//! docker/Dockerfile from the relay binary without pulling anything (`FROM scratch`, the
//! binary, the libraries `ldd` lists), and the image runs as a non-root user and relays
//! against real servers. Needs `podman` and `runc` (`tests/setup` installs them): runc,
//! because crun refuses this machine's hybrid cgroups.

#![allow(clippy::unwrap_used)]

use crate::support;

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use support::{insert_transaction, succeeds, Case, DEADLINE};
use testkit::{Nats, Postgres, Process};

/// `podman` with the arguments, its stdout; panics with its stderr on failure.
fn podman(args: &[&str]) -> String {
    let output = Command::new("podman")
        .args(args)
        .output()
        .unwrap_or_else(|e| {
            panic!(
                "{} ({e})",
                testkit::missing("`podman`", "install podman and runc yourself")
            )
        });
    assert!(
        output.status.success(),
        "podman {args:?} failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    String::from_utf8_lossy(&output.stdout).trim().to_owned()
}

/// Removes an image or a container when dropped, whatever the test's outcome.
struct Removes(&'static str, String);

impl Drop for Removes {
    fn drop(&mut self) {
        let _ = Command::new("podman")
            .args([self.0, "--force", &self.1])
            .output();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_image_built_without_pulling_runs_as_a_non_root_user_and_relays_events() {
    let tag = format!("localhost/outbox-relay-test:{}", std::process::id());
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    succeeds(
        Command::new(root.join("docker/build-local-image.sh"))
            .arg(env!("CARGO_BIN_EXE_outbox-relay"))
            .arg(&tag),
    );
    let _image = Removes("rmi", tag.clone());
    assert_eq!(
        podman(&["image", "inspect", "--format", "{{.Config.User}}", &tag]),
        "65532:65532"
    );

    let nats = Nats::start_with_args(&["--user", "relay", "--pass", "s3cret"]);
    let pg = Postgres::start();
    let mut case = Case::with_nats_url(&pg, &nats.url(), "container");
    case.extra_env = vec![
        ("OUTBOX_RELAY_NATS_USER".into(), "relay".into()),
        ("OUTBOX_RELAY_NATS_PASSWORD".into(), "s3cret".into()),
    ];
    let name = format!("outbox-relay-test-{}", std::process::id());
    let mut command = Command::new("podman");
    command.args([
        "--runtime",
        "runc",
        "run",
        "--rm",
        "--name",
        &name,
        "--network",
        "host",
        "--ulimit",
        "nofile=1024:1024",
        "--ulimit",
        "nproc=4096:4096",
    ]);
    for (key, value) in case.relay_env() {
        command.arg("--env").arg(format!("{key}={value}"));
    }
    command.arg(&tag); // the image's default command: run
    let _container = Removes("rm", name.clone());
    let mut relay = Process::spawn("relay-container", command);
    relay.wait_for_output("streaming outbox events", DEADLINE);
    assert_eq!(
        podman(&["top", &name, "huser"]).lines().nth(1),
        Some("65532"),
        "the relay runs as uid 65532 (on the host: no user namespace here)"
    );

    let mut sql = case.sql().await;
    let ids = insert_transaction(&mut sql, 5, 2, "container").await;
    let js = async_nats::jetstream::new(
        async_nats::ConnectOptions::with_user_and_password("relay".into(), "s3cret".into())
            .connect(nats.url())
            .await
            .unwrap(),
    );
    case.wait_for_count(&js, 5, DEADLINE).await;
    assert_eq!(case.outbox_ids(&js).await, ids);

    // `podman stop` sends SIGTERM: the relay drains and exits 0.
    podman(&["stop", "--time", "20", &name]);
    let status = relay.wait_exit(Duration::from_secs(30));
    assert!(status.success(), "{status:?}\n{}", relay.output());
}
