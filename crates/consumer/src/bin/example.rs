//! `outbox-consumer-example`: applies every outbox event to a `ledger` table, once, in
//! entity order. Copy the handler and `main`; configure through the environment:
//!
//! ```text
//! DATABASE_URL                  postgres://... (required; where the ledger and processed_events live)
//! NATS_URL                      nats://127.0.0.1:4222
//! OUTBOX_RELAY_STREAM           OUTBOX   } the relay's values
//! OUTBOX_RELAY_SUBJECT_PREFIX   outbox   }
//! OUTBOX_RELAY_PARTITIONS       12       }
//! OUTBOX_RELAY_SUBJECT_TEMPLATE {prefix}.{shard}.{event_type} } (the relay's subject template)
//! OUTBOX_CONSUMER_NAME          ledger   (durable consumers ledger-0 .. ledger-11)
//! OUTBOX_CONSUMER_SHARDS        all, or e.g. 0,1,2 to split shards between processes
//! OUTBOX_CONSUMER_ACK_WAIT_MS   30000
//! OUTBOX_CONSUMER_RETRY_DELAY_MS 5000    (the first retry's delay; doubled per failure)
//! OUTBOX_CONSUMER_RETRY_DELAY_MAX_MS 60000
//! OUTBOX_CONSUMER_MAX_ATTEMPTS  10       (handler failures of one event before ON_FAILURE)
//! OUTBOX_CONSUMER_ON_FAILURE    park     (park it in parked_events and go on), or stop
//! OUTBOX_CONSUMER_BATCH_SIZE    100      (events per transaction; 1: one transaction each)
//! OUTBOX_CONSUMER_BATCH_WAIT_MS 0
//! OUTBOX_CONSUMER_METRICS_ADDR  unset; e.g. 127.0.0.1:9465 serves /metrics, /healthz, /readyz
//! ```
//!
//! It creates `processed_events` and `parked_events` (sql/consumer.sql) and `ledger` if missing, and stops on
//! SIGINT/SIGTERM after finishing the messages in hand.

use std::process::ExitCode;
use std::time::Duration;

use outbox_consumer::{BoxError, Config, Consumer, Metrics, OnFailure, Postgres};
use tracing::{error, info};

#[path = "example/ledger.rs"]
mod ledger;

use ledger::{Ledger, LEDGER_SQL};

#[tokio::main]
async fn main() -> ExitCode {
    // Colour only on a terminal (not in a file, a journal or a container's log), and never
    // with NO_COLOR set, as the relay does.
    let colour = std::io::IsTerminal::is_terminal(&std::io::stdout())
        && std::env::var_os("NO_COLOR").is_none_or(|v| v.is_empty());
    tracing_subscriber::fmt()
        .with_ansi(colour)
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .init();
    match run().await {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            error!("{error}");
            ExitCode::FAILURE
        }
    }
}

async fn run() -> Result<(), BoxError> {
    let database_url =
        std::env::var("DATABASE_URL").map_err(|_| "DATABASE_URL is not set: set it to the database of the ledger, e.g. postgres://app@localhost/app")?;
    let nats_url = env_or("NATS_URL", "nats://127.0.0.1:4222");
    let config = config_from_env()?;
    let pg_config: tokio_postgres::Config = database_url
        .parse()
        .map_err(|e| format!("DATABASE_URL is not a valid connection string: {e}"))?;
    let (setup, connection) = pg_config.connect(tokio_postgres::NoTls).await?;
    tokio::spawn(connection);
    setup.batch_execute(outbox_consumer::SCHEMA_SQL).await?;
    setup.batch_execute(LEDGER_SQL).await?;
    drop(setup);

    let metrics_addr: Option<std::net::SocketAddr> =
        match std::env::var("OUTBOX_CONSUMER_METRICS_ADDR") {
            Err(_) => None,
            Ok(addr) => Some(addr.parse().map_err(|_| {
                format!(
                    "OUTBOX_CONSUMER_METRICS_ADDR {addr:?} is not an address like 127.0.0.1:9465"
                )
            })?),
        };
    let shards = config.shard_list()?;
    let nats = async_nats::connect(&nats_url).await?;
    let mut consumer = Consumer::new(
        config,
        nats,
        Postgres::new(pg_config, tokio_postgres::NoTls),
    );
    let _serving = match metrics_addr {
        Some(addr) => Some(serve(addr, consumer.metrics(), shards).await?),
        None => None,
    };
    if let Ok(id) = std::env::var("OUTBOX_CONSUMER_EXAMPLE_STALL_AFTER_COMMIT") {
        consumer = stall_after_commit(consumer, id.parse()?);
    }
    consumer.run_batch(Ledger, shutdown()).await?;
    Ok(())
}

/// The consumer's configuration from the environment (the table above).
fn config_from_env() -> Result<Config, String> {
    let mut config = Config::new(env_or("OUTBOX_CONSUMER_NAME", "ledger"));
    config.stream = env_or("OUTBOX_RELAY_STREAM", &config.stream);
    config.subject_prefix = env_or("OUTBOX_RELAY_SUBJECT_PREFIX", &config.subject_prefix);
    config.subject_template = env_or("OUTBOX_RELAY_SUBJECT_TEMPLATE", &config.subject_template);
    config.partitions = parsed("OUTBOX_RELAY_PARTITIONS", config.partitions)?;
    if let Ok(shards) = std::env::var("OUTBOX_CONSUMER_SHARDS") {
        if shards != "all" {
            let list: Result<Vec<u64>, _> = shards.split(',').map(|s| s.trim().parse()).collect();
            config.shards = Some(list.map_err(|_| {
                format!("OUTBOX_CONSUMER_SHARDS {shards:?} is not `all` or a comma-separated list of shard numbers")
            })?);
        }
    }
    let millis = |key, default| parsed(key, default).map(Duration::from_millis);
    config.ack_wait = millis("OUTBOX_CONSUMER_ACK_WAIT_MS", 30_000)?;
    config.retry_delay = millis("OUTBOX_CONSUMER_RETRY_DELAY_MS", 5_000)?;
    config.retry_delay_max = millis("OUTBOX_CONSUMER_RETRY_DELAY_MAX_MS", 60_000)?;
    config.max_attempts = parsed("OUTBOX_CONSUMER_MAX_ATTEMPTS", config.max_attempts)?;
    config.on_failure = match env_or("OUTBOX_CONSUMER_ON_FAILURE", "park").as_str() {
        "park" => OnFailure::Park,
        "stop" => OnFailure::Stop,
        other => {
            return Err(format!(
                "OUTBOX_CONSUMER_ON_FAILURE {other:?} is not `park` or `stop`"
            ))
        }
    };
    config.batch_size = parsed("OUTBOX_CONSUMER_BATCH_SIZE", config.batch_size)?;
    config.batch_wait = millis("OUTBOX_CONSUMER_BATCH_WAIT_MS", 0)?;
    Ok(config)
}

/// Serves `GET /metrics` (Prometheus text), `/healthz` (200 while the process runs) and
/// `/readyz` (200, or 503 naming the shards without a running session) on `addr`, one
/// request per connection, until the handle is dropped.
async fn serve(
    addr: std::net::SocketAddr,
    metrics: std::sync::Arc<Metrics>,
    shards: Vec<u64>,
) -> Result<tokio_util::task::AbortOnDropHandle<()>, BoxError> {
    use tokio::io::AsyncWriteExt as _;
    let listener = tokio::net::TcpListener::bind(addr).await.map_err(|e| {
        format!("cannot serve metrics on {addr}: {e} (set OUTBOX_CONSUMER_METRICS_ADDR to a free local address, or unset it)")
    })?;
    info!(address = %addr, "serving metrics and health on http://{addr}/metrics, /healthz, /readyz");
    let shards = std::sync::Arc::new(shards);
    Ok(tokio_util::task::AbortOnDropHandle::new(tokio::spawn(
        async move {
            loop {
                let Ok((mut stream, _)) = listener.accept().await else {
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                };
                let (metrics, shards) = (metrics.clone(), shards.clone());
                tokio::spawn(tokio::time::timeout(Duration::from_secs(5), async move {
                    let Some(head) = read_head(&mut stream).await else {
                        return;
                    };
                    let response = respond(&head, &metrics, &shards);
                    let _ = stream.write_all(response.as_bytes()).await;
                    let _ = stream.shutdown().await;
                }));
            }
        },
    )))
}

/// A request's head, at most 8 KiB; `None` if the connection ended first.
async fn read_head(stream: &mut tokio::net::TcpStream) -> Option<String> {
    use tokio::io::AsyncReadExt as _;
    let mut head = Vec::new();
    let mut buf = [0u8; 1024];
    while !head.windows(4).any(|w| w == b"\r\n\r\n") && head.len() < 8192 {
        match stream.read(&mut buf).await {
            Ok(0) | Err(_) => return None,
            Ok(n) => head.extend_from_slice(&buf[..n]),
        }
    }
    Some(String::from_utf8_lossy(&head).into_owned())
}

/// The HTTP response to the request with `head`.
fn respond(head: &str, metrics: &Metrics, shards: &[u64]) -> String {
    let path = head.split(' ').nth(1).unwrap_or("");
    let (status, content_type, body) = match path {
        "/metrics" => (
            200,
            outbox_consumer::metrics::CONTENT_TYPE,
            metrics.encode(),
        ),
        "/healthz" => (200, "text/plain", "ok\n".to_owned()),
        "/readyz" => match metrics.readiness(shards) {
            Ok(()) => (200, "text/plain", "ready\n".to_owned()),
            Err(reason) => (503, "text/plain", format!("{reason}\n")),
        },
        _ => (
            404,
            "text/plain",
            "not found: /metrics, /healthz, /readyz\n".to_owned(),
        ),
    };
    let reason = match status {
        200 => "OK",
        503 => "Service Unavailable",
        _ => "Not Found",
    };
    format!(
        "HTTP/1.1 {status} {reason}\r\nContent-Type: {content_type}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )
}

/// Resolves on SIGINT or SIGTERM.
async fn shutdown() {
    use tokio::signal::unix::{signal, SignalKind};
    let (Ok(mut term), Ok(mut int)) = (
        signal(SignalKind::terminate()),
        signal(SignalKind::interrupt()),
    ) else {
        error!("cannot install signal handlers; stop with SIGKILL");
        return std::future::pending().await;
    };
    tokio::select! {
        _ = term.recv() => {}
        _ = int.recv() => {}
    }
}

fn env_or(key: &str, default: &str) -> String {
    std::env::var(key).unwrap_or_else(|_| default.to_owned())
}

fn parsed<T: std::str::FromStr>(key: &str, default: T) -> Result<T, String> {
    match std::env::var(key) {
        Err(_) => Ok(default),
        Ok(text) => text
            .parse()
            .map_err(|_| format!("{key} {text:?} is not a valid number")),
    }
}

/// For the crate's fault tests only: after the transaction of outbox id `id` committed,
/// announce it and hang before the ack, so a test can kill the process right there.
fn stall_after_commit(consumer: Consumer, id: i64) -> Consumer {
    consumer.after_commit(move |event| {
        if event.id.as_int() == Some(id) {
            info!(
                outbox_id = id,
                "stalling after commit, before the ack (test hook)"
            );
            loop {
                std::thread::sleep(Duration::from_secs(3600));
            }
        }
    })
}
