//! **What the relay's headers cost nats-server** (issue 44, only with `--only headers`): the
//! relay's messages for a backlog published pipelined ([`crate::ceilings`]'s broker ceiling,
//! the fence on every publish) to a fresh stream once per header profile, interleaved in one
//! run on one server, and nats-server's CPU per message for each:
//!
//! - **the relay's** (the seed's table: `Nats-Msg-Id` and the eight `Outbox-*` headers);
//! - **lean**: what a consumer cannot take from elsewhere on the seed's table. Dropped:
//!   `Outbox-Partition-Key` (equal to the entity id there), `Outbox-Shard` (in the subject) and
//!   `Outbox-Id` (the dedupe key's last part for an integer id);
//! - **`Nats-Msg-Id` alone**: the floor no profile goes below (de-duplication needs it).

use anyhow::Result;
use async_nats::jetstream::message::PublishMessage;
use async_nats::HeaderMap;
use outbox::{headers as h, OutboxEvent};

use crate::harness::Bench;
use crate::report::{Results, Unit};
use crate::{ceilings, consume};

/// A header profile: its label and the headers it keeps of the relay's.
struct Profile {
    label: &'static str,
    keeps: fn(&str) -> bool,
}

const PROFILES: [Profile; 3] = [
    Profile {
        label: "the relay's headers (9)",
        keeps: |_| true,
    },
    Profile {
        label: "lean (6: no Outbox-Id, Outbox-Partition-Key, Outbox-Shard)",
        keeps: |name| ![h::OUTBOX_ID, h::OUTBOX_PARTITION_KEY, h::OUTBOX_SHARD].contains(&name),
    },
    Profile {
        label: "Nats-Msg-Id alone (the floor)",
        keeps: |name| name == h::NATS_MSG_ID,
    },
];

/// `event`'s relay message with only the headers `keeps` keeps (read off the header block
/// the relay writes, `sink::event_block`).
fn message(event: &OutboxEvent, keeps: fn(&str) -> bool) -> PublishMessage {
    let block = sink::message::event_block(event);
    let mut headers = HeaderMap::new();
    for line in String::from_utf8_lossy(&block).split("\r\n").skip(1) {
        if let Some((name, value)) = line.split_once(':') {
            if keeps(name) {
                headers.insert(name, value.trim_start());
            }
        }
    }
    PublishMessage::build()
        .headers(headers)
        .payload(event.payload.clone())
}

/// Publishes `events` relay events once per profile, interleaved, on `bench`'s nats-server.
pub async fn compare(bench: &mut Bench, results: &mut Results, events: u64) -> Result<()> {
    for profile in &PROFILES {
        let case = bench.case("headers").await?;
        let backlog = consume::relay_events(&case, events);
        let published = ceilings::broker_as(bench, &backlog, &case.stream, &case.prefix, |e| {
            message(e, profile.keeps)
        })
        .await?;
        // The broker ceiling deleted its stream.
        bench.drop_case(case, &[]).await?;
        let (seconds, server_cpu) = (published.seconds, published.server_cpu);
        let label = format!(
            "publishing {} relay events pipelined, {}",
            Unit::Rate.format(events as f64),
            profile.label
        );
        let per_message = server_cpu * 1e6 / events as f64;
        results.record(&label, "events/s", Unit::Rate, events as f64 / seconds);
        results.record(&label, "nats-server CPU", Unit::MicrosPerEvent, per_message);
        eprintln!(
            "bench: {label}: {:.0}/s, nats-server {per_message:.2} µs/message",
            events as f64 / seconds
        );
    }
    Ok(())
}
