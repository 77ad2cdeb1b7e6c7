//! The two ceilings a relay cannot beat on this machine, measured on the same backlog.
//!
//! - **Decode ceiling**: `pg_recvlogical` streams the pgoutput decoding of the backlog
//!   (`proto_version=1`, the relay's publication) to `/dev/null` and exits at the backlog's
//!   end LSN. It reads and discards, so the time is what the walsender needs to decode and
//!   send the backlog to a client that does nothing. Its slot was created before the
//!   backlog was written, like the relay's.
//! - **Broker ceiling**: the events the relay would publish for the backlog (same subjects,
//!   payloads and headers, built by `sink::publish_message`, each with its unique
//!   `Nats-Msg-Id`, and the `Nats-Expected-Last-Sequence` fence the relay adds in its default
//!   strict mode) published pipelined to a fresh stream of the relay's configuration,
//!   with the relay's window (4 096 unacknowledged publishes) and two tasks like the
//!   relay's sink (one publishes, one awaits the acks in order). Timed from the first
//!   publish to the last ack, with nothing else running.

use std::process::Stdio;
use std::time::{Duration, Instant};

use anyhow::{bail, Context as _, Result};
use async_nats::jetstream;
use outbox::OutboxEvent;
use pgoutput::Lsn;

use crate::harness::{Bench, Case};
use crate::procfs;

/// The relay's default `max_in_flight`.
pub const WINDOW: usize = 4096;

/// What one `pg_recvlogical` pass cost.
#[derive(Debug, Clone, Copy)]
pub struct Decode {
    pub seconds: f64,
    /// CPU of the walsender that served it.
    pub walsender_cpu: f64,
    /// CPU of `pg_recvlogical` itself.
    pub client_cpu: f64,
}

/// Streams the backlog through slot `slot` with `pg_recvlogical` until `endpos`.
pub async fn decode(bench: &Bench, case: &Case, slot: &str, endpos: Lsn) -> Result<Decode> {
    let postmaster = bench.pg.pid();
    let me = std::process::id();
    let walsenders_before = procfs::reaped_children_cpu_seconds(postmaster)?;
    let clients_before = procfs::reaped_children_cpu_seconds(me)?;
    let start = Instant::now();
    let output = tokio::process::Command::new(bench.pg_bin("pg_recvlogical"))
        .args(["-d", &case.pg_url, "--slot", slot, "--start", "--no-loop"])
        .args(["-o", "proto_version=1"])
        .args(["-o", &format!("publication_names={}", case.publication)])
        .args(["-f", "/dev/null", "--endpos", &endpos.to_string()])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .output()
        .await
        .context("run pg_recvlogical")?;
    let seconds = start.elapsed().as_secs_f64();
    if !output.status.success() {
        bail!(
            "pg_recvlogical failed ({}): {}",
            output.status,
            String::from_utf8_lossy(&output.stderr)
        );
    }
    let client_cpu = procfs::reaped_children_cpu_seconds(me)? - clients_before;
    // The walsender's CPU reaches the postmaster's cutime once it has exited and been reaped.
    let deadline = Instant::now() + Duration::from_secs(30);
    while bench.walsender_pid(slot).await?.is_some() && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    tokio::time::sleep(Duration::from_millis(200)).await;
    let walsender_cpu = procfs::reaped_children_cpu_seconds(postmaster)? - walsenders_before;
    Ok(Decode {
        seconds,
        walsender_cpu,
        client_cpu,
    })
}

/// What one pipelined publishing pass cost.
#[derive(Debug, Clone, Copy)]
pub struct Broker {
    pub seconds: f64,
    /// CPU of nats-server during the pass.
    pub server_cpu: f64,
    /// CPU of this process (the publishing client) during the pass.
    pub client_cpu: f64,
}

/// A JetStream context for [`publish_pipelined`]: the relay's window.
pub async fn pipelined_context(bench: &Bench) -> Result<jetstream::Context> {
    let client = async_nats::connect(bench.nats.url()).await?;
    Ok(jetstream::context::ContextBuilder::new()
        .timeout(Duration::from_secs(10))
        .max_ack_inflight(WINDOW + 1)
        .build(client))
}

/// Publishes `events` (as the relay does, with its headers) to an empty stream, pipelined
/// with the relay's window and two tasks like the relay's sink (one publishes, one awaits
/// the acks in order); returns how many were stored as new.
pub async fn publish_pipelined(js: &jetstream::Context, events: &[OutboxEvent]) -> Result<u64> {
    publish_pipelined_as(js, events, sink::publish_message).await
}

/// [`publish_pipelined`] with each event's message built by `message` (its fence added).
pub async fn publish_pipelined_as(
    js: &jetstream::Context,
    events: &[OutboxEvent],
    message: impl Fn(&OutboxEvent) -> jetstream::message::PublishMessage,
) -> Result<u64> {
    let (acks_tx, mut acks_rx) = tokio::sync::mpsc::channel(WINDOW);
    let acker = tokio::spawn(async move {
        let mut stored = 0u64;
        while let Some(ack) = acks_rx.recv().await {
            let ack: jetstream::context::PublishAckFuture = ack;
            let ack = ack.await.context("pipelined publishing: ack")?;
            if !ack.duplicate {
                stored += 1;
            }
        }
        anyhow::Ok(stored)
    });
    for (sequence, event) in events.iter().enumerate() {
        // The relay's default (strict) mode fences every publish on the stream's last
        // sequence; so does this, on its empty stream.
        let message = message(event).expected_last_sequence(sequence as u64);
        let ack = js
            .send_publish(event.subject.clone(), message)
            .await
            .context("pipelined publishing: publish")?;
        if acks_tx.send(ack).await.is_err() {
            break;
        }
    }
    drop(acks_tx);
    acker.await.context("pipelined publishing: acker task")?
}

/// Publishes `events` pipelined to a fresh stream `stream` covering `{prefix}.>` (the
/// events' subjects must start with `prefix`); deletes the stream afterwards.
pub async fn broker(
    bench: &Bench,
    events: &[OutboxEvent],
    stream: &str,
    prefix: &str,
) -> Result<Broker> {
    broker_as(bench, events, stream, prefix, sink::publish_message).await
}

/// [`broker`] with each event's message built by `message` (its fence added).
pub async fn broker_as(
    bench: &Bench,
    events: &[OutboxEvent],
    stream: &str,
    prefix: &str,
    message: impl Fn(&OutboxEvent) -> jetstream::message::PublishMessage,
) -> Result<Broker> {
    bench.create_stream(stream, prefix).await?;
    let js = pipelined_context(bench).await?;
    let server_before = procfs::cpu_seconds(bench.nats.pid())?;
    let client_before = procfs::cpu_seconds(std::process::id())?;
    let start = Instant::now();
    let stored = publish_pipelined_as(&js, events, message).await?;
    let seconds = start.elapsed().as_secs_f64();
    let server_cpu = procfs::cpu_seconds(bench.nats.pid())? - server_before;
    let client_cpu = procfs::cpu_seconds(std::process::id())? - client_before;
    if stored != events.len() as u64 {
        bail!(
            "broker ceiling: {stored} of {} publishes were stored as new",
            events.len()
        );
    }
    bench
        .js
        .delete_stream(stream)
        .await
        .with_context(|| format!("delete stream {stream}"))?;
    Ok(Broker {
        seconds,
        server_cpu,
        client_cpu,
    })
}
