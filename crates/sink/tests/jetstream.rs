//! The JetStream behaviours the sink relies on, checked on the real nats-server.

#![allow(clippy::unwrap_used)]

use async_nats::jetstream::context::{PublishError, PublishErrorKind};
use async_nats::jetstream::{self, message::PublishMessage, publish::PublishAck, stream};
use async_nats::{HeaderMap, ToSubject};
use bytes::Bytes;
use testkit::Nats;

async fn context(nats: &Nats, name: &str, max_message_size: i32) -> jetstream::Context {
    let js = jetstream::new(async_nats::connect(nats.url()).await.unwrap());
    js.create_stream(stream::Config {
        max_message_size,
        ..stream_config(name)
    })
    .await
    .unwrap();
    js
}

/// A stream `name` of the subjects `{name}.>`.
fn stream_config(name: &str) -> stream::Config {
    stream::Config {
        name: name.to_owned(),
        subjects: vec![format!("{name}.>")],
        ..Default::default()
    }
}

/// Publishes and waits for the server's answer: the ack, or why it refused.
async fn publish(
    js: &jetstream::Context,
    subject: impl ToSubject,
    message: PublishMessage,
) -> Result<PublishAck, PublishError> {
    js.send_publish(subject, message).await.unwrap().await
}

/// Whether the server checks `Nats-Msg-Id` before `Nats-Expected-Last-Sequence`: 2.9.10
/// does; 2.12.8 checks the expected sequence first (nats-server PR 7060, ADR-50), so a
/// replay with a stale expected sequence is refused there instead of acknowledged as a
/// duplicate. Versions before 2.12 are taken to be the former (2.9.10 is the one measured).
fn checks_duplicates_first(js: &jetstream::Context) -> bool {
    let version = js.client().server_info().version;
    let mut parts = version
        .split(['.', '-'])
        .map(|p| p.parse::<u32>().unwrap_or(0));
    let (major, minor) = (parts.next().unwrap_or(0), parts.next().unwrap_or(0));
    (major, minor) < (2, 12)
}

/// How many messages stream `name` holds.
async fn stored(js: &jetstream::Context, name: &str) -> u64 {
    let mut stream = js.get_stream(name).await.unwrap();
    stream.info().await.unwrap().state.messages
}

fn message(id: &str, expected_last: Option<u64>) -> PublishMessage {
    let mut publish = PublishMessage::build()
        .payload(Bytes::from_static(b"{}"))
        .message_id(id);
    if let Some(seq) = expected_last {
        publish = publish.expected_last_sequence(seq);
    }
    publish
}

/// Publishing the same `Nats-Msg-Id` twice stores one message; the second ack says
/// `duplicate` and names the original sequence.
#[tokio::test]
async fn same_message_id_twice_is_stored_once() {
    let nats = Nats::start();
    let js = context(&nats, "DEDUPE", -1).await;
    let first = publish(&js, "DEDUPE.x", message("k1", None)).await.unwrap();
    let second = publish(&js, "DEDUPE.x", message("k1", None)).await.unwrap();
    assert!(!first.duplicate);
    assert!(second.duplicate);
    assert_eq!(second.sequence, first.sequence);
    assert_eq!(stored(&js, "DEDUPE").await, 1);
}

/// How nats-server orders its checks (docs/guarantees.md): on 2.9.10 the duplicate check
/// comes first, so a replayed id is acknowledged as a duplicate even when its expected last
/// sequence is stale; from 2.12 the expected sequence comes first and the replay is refused
/// ([`checks_duplicates_first`]). Either way nothing is stored twice, and a new id with a
/// stale expected sequence is refused and nothing is stored.
#[tokio::test]
async fn dedupe_is_checked_before_the_expected_last_sequence() {
    let nats = Nats::start();
    let js = context(&nats, "ORDER", -1).await;
    let a = publish(&js, "ORDER.x", message("a", Some(0)))
        .await
        .unwrap();
    assert_eq!(a.sequence, 1);
    let replay = publish(&js, "ORDER.x", message("a", Some(0))).await;
    if checks_duplicates_first(&js) {
        assert!(
            replay.unwrap().duplicate,
            "a duplicate id wins over a stale expected sequence"
        );
    } else {
        assert_eq!(
            replay.unwrap_err().kind(),
            PublishErrorKind::WrongLastSequence,
            "a stale expected sequence wins over a duplicate id"
        );
    }
    assert_eq!(stored(&js, "ORDER").await, 1);
    let stale = publish(&js, "ORDER.x", message("b", Some(0)))
        .await
        .unwrap_err();
    assert_eq!(stale.kind(), PublishErrorKind::WrongLastSequence);
    let ahead = publish(&js, "ORDER.x", message("b", Some(5)))
        .await
        .unwrap_err();
    assert_eq!(ahead.kind(), PublishErrorKind::WrongLastSequence);
    let b = publish(&js, "ORDER.x", message("b", Some(1)))
        .await
        .unwrap();
    assert_eq!(b.sequence, 2);
    assert_eq!(stored(&js, "ORDER").await, 2);
}

/// A lost publish fences every later one: pipelined publishes expecting sequences after a
/// gap are all refused, so nothing after the gap enters the stream.
#[tokio::test]
async fn a_gap_fences_every_later_pipelined_publish() {
    let nats = Nats::start();
    let js = context(&nats, "FENCE", -1).await;
    publish(&js, "FENCE.x", message("m1", Some(0)))
        .await
        .unwrap();
    // "m2" (expecting 1) is lost; m3.. were pipelined behind it, expecting 2, 3, ...
    let mut acks = Vec::new();
    for (i, expected) in (2..6).enumerate() {
        acks.push(
            js.send_publish("FENCE.x", message(&format!("m{}", i + 3), Some(expected)))
                .await
                .unwrap(),
        );
    }
    for ack in acks {
        assert_eq!(
            ack.await.unwrap_err().kind(),
            PublishErrorKind::WrongLastSequence
        );
    }
    assert_eq!(stored(&js, "FENCE").await, 1);
}

/// `sink::wire_size` counts what the server counts against `max_msg_size`: a message of
/// exactly the limit is stored, one byte more is refused.
#[tokio::test]
async fn wire_size_matches_the_servers_max_msg_size() {
    let nats = Nats::start();
    let js = context(&nats, "SIZE", 1000).await;
    let mut headers = HeaderMap::new();
    headers.insert("Nats-Msg-Id", "size-1");
    headers.insert("Outbox-Id", "1");
    let fits = 1000 - sink::wire_size(&headers, 0);
    let exact = PublishMessage::build()
        .headers(headers.clone())
        .payload(Bytes::from(vec![b'x'; fits]));
    publish(&js, "SIZE.x", exact)
        .await
        .expect("a message of exactly max_msg_size is stored");
    headers.insert("Nats-Msg-Id", "size-2");
    let over = PublishMessage::build()
        .headers(headers)
        .payload(Bytes::from(vec![b'x'; fits + 1]));
    let error = publish(&js, "SIZE.x", over).await.unwrap_err();
    assert!(error.to_string().contains("maximum"), "{error}");
}

/// A bare NATS connection writing its own `HPUB` frames, header block byte for byte (async-nats
/// writes headers in hash-map order), to show how the server reads them.
struct RawClient {
    reader: tokio::io::BufReader<tokio::net::tcp::OwnedReadHalf>,
    writer: tokio::net::tcp::OwnedWriteHalf,
}

impl RawClient {
    async fn connect(nats: &Nats) -> RawClient {
        use tokio::io::AsyncWriteExt;
        let stream = tokio::net::TcpStream::connect(("127.0.0.1", nats.port()))
            .await
            .unwrap();
        let (read, write) = stream.into_split();
        let mut client = RawClient {
            reader: tokio::io::BufReader::new(read),
            writer: write,
        };
        assert!(client.line().await.starts_with("INFO "));
        client
            .writer
            .write_all(b"CONNECT {\"verbose\":false,\"pedantic\":false,\"headers\":true,\"protocol\":1}\r\nSUB _RAW.reply 1\r\nPING\r\n")
            .await
            .unwrap();
        while client.line().await != "PONG" {}
        client
    }

    async fn line(&mut self) -> String {
        use tokio::io::AsyncBufReadExt;
        let mut line = String::new();
        self.reader.read_line(&mut line).await.unwrap();
        line.trim_end().to_owned()
    }

    /// Publishes with exactly these header lines; returns JetStream's reply.
    async fn publish(&mut self, subject: &str, header_lines: &[&str]) -> serde_json::Value {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let mut block = String::from("NATS/1.0\r\n");
        for line in header_lines {
            block.push_str(line);
            block.push_str("\r\n");
        }
        block.push_str("\r\n");
        let payload = "{}";
        let frame = format!(
            "HPUB {subject} _RAW.reply {} {}\r\n{block}{payload}\r\n",
            block.len(),
            block.len() + payload.len()
        );
        self.writer.write_all(frame.as_bytes()).await.unwrap();
        loop {
            let line = self.line().await;
            // nats-server 2.10+ sends an INFO after CONNECT (the account's).
            if line.starts_with("INFO ") {
                continue;
            }
            if line == "PING" {
                self.writer.write_all(b"PONG\r\n").await.unwrap();
                continue;
            }
            let len: usize = line
                .rsplit(' ')
                .next()
                .and_then(|n| n.parse().ok())
                .unwrap_or_else(|| panic!("unexpected server line {line:?}"));
            let mut body = vec![0; len + 2];
            self.reader.read_exact(&mut body).await.unwrap();
            return serde_json::from_slice(&body[..len]).unwrap();
        }
    }
}

/// Why the relay encodes hostile row values (docs/guarantees.md): nats-server 2.9.10 looks a
/// header up by the first occurrence of its name anywhere in the header block, and a name
/// that is not at a line start counts as absent. A header value containing
/// `Nats-Expected-Last-Sequence` switches the fence off, one containing `Nats-Msg-Id`
/// switches de-duplication off; the same values percent-encoded do not. nats-server 2.12.8
/// finds headers by line: there the raw values hide nothing either (versions before 2.12
/// are taken to be 2.9.10's kind, the one measured).
#[tokio::test]
async fn a_header_name_inside_a_value_hides_the_header_unless_encoded() {
    let nats = Nats::start();
    let js = context(&nats, "RAW", -1).await;
    let hides = checks_duplicates_first(&js);
    let mut raw = RawClient::connect(&nats).await;
    let first = raw
        .publish(
            "RAW.x",
            &["Nats-Msg-Id: a", "Nats-Expected-Last-Sequence: 0"],
        )
        .await;
    assert_eq!(first["seq"], 1, "{first}");

    // The fence expects 0, but the stream's last sequence is 1.
    let unfenced = raw
        .publish(
            "RAW.x",
            &[
                "Outbox-Entity-Id: x Nats-Expected-Last-Sequence: 1",
                "Nats-Expected-Last-Sequence: 0",
                "Nats-Msg-Id: b",
            ],
        )
        .await;
    if hides {
        assert_eq!(
            unfenced["seq"], 2,
            "the hidden fence let a stale publish in: {unfenced}"
        );
    } else {
        assert_eq!(unfenced["error"]["err_code"], 10071, "{unfenced}");
    }
    let undeduplicated = raw
        .publish(
            "RAW.x",
            &["Outbox-Entity-Id: Nats-Msg-Id", "Nats-Msg-Id: a"],
        )
        .await;
    if hides {
        assert_eq!(
            undeduplicated["seq"], 3,
            "the hidden id let a duplicate in: {undeduplicated}"
        );
        assert_eq!(undeduplicated.get("duplicate"), None);
    } else {
        assert_eq!(undeduplicated["duplicate"], true, "{undeduplicated}");
    }

    // Encoded, the same values hide nothing.
    let value = outbox::encoding::encode("x Nats-Expected-Last-Sequence: 3");
    let fenced = raw
        .publish(
            "RAW.x",
            &[
                &format!("Outbox-Entity-Id: {value}"),
                "Nats-Expected-Last-Sequence: 0",
                "Nats-Msg-Id: c",
            ],
        )
        .await;
    assert_eq!(fenced["error"]["err_code"], 10071, "{fenced}");
    let value = outbox::encoding::encode("Nats-Msg-Id");
    let deduplicated = raw
        .publish(
            "RAW.x",
            &[&format!("Outbox-Entity-Id: {value}"), "Nats-Msg-Id: a"],
        )
        .await;
    assert_eq!(deduplicated["duplicate"], true, "{deduplicated}");
}

fn hostile_event(n: u32) -> outbox::OutboxEvent {
    let entity_id = format!("order-{n} Nats-Msg-Id: fake Nats-Expected-Last-Sequence: 0");
    let event_type = if n % 2 == 0 {
        "Nats-Expected-Last-Sequence".to_owned()
    } else {
        format!("OrderPaid\r\nNats-Msg-Id: x-{n}")
    };
    let row = outbox::OutboxRow::seed(
        i64::from(n),
        entity_id,
        event_type,
        Bytes::from_static(b"{}"),
        1_700_000_000_000,
    );
    let position = outbox::Position {
        commit_lsn: outbox::Lsn(0x100 + u64::from(n)),
        index: 0,
    };
    row.into_event("HOSTILE", std::num::NonZeroU64::new(12).unwrap(), position)
}

/// Messages the relay builds for rows whose values contain `Nats-Msg-Id` and
/// `Nats-Expected-Last-Sequence` are de-duplicated and fenced on the real server, whatever
/// order async-nats writes their headers in (50 messages, 50 draws of that order), and the
/// exact values are recovered by decoding.
#[tokio::test]
async fn hostile_rows_built_by_the_relay_are_deduplicated_and_fenced() {
    let nats = Nats::start();
    let js = context(&nats, "HOSTILE", -1).await;
    for n in 0..50u32 {
        let event = hostile_event(n);
        let last = u64::from(n);
        // As the relay publishes it: fenced on the stream's last sequence being `last`.
        let fenced = |event: &outbox::OutboxEvent, last: u64| {
            let message = sink::publish_message(event).expected_last_sequence(last);
            publish(&js, event.subject.clone(), message)
        };
        let stored = fenced(&event, last).await.unwrap();
        assert_eq!((stored.sequence, stored.duplicate), (last + 1, false));
        // A replay, with a stale expected sequence where the server checks duplicates
        // first (else with the current one): recognised as a duplicate.
        let replay_fence = if checks_duplicates_first(&js) {
            last
        } else {
            last + 1
        };
        let replay = fenced(&event, replay_fence).await.unwrap();
        assert!(replay.duplicate, "message {n} was stored twice");
        // Another row with a stale expected sequence: refused.
        let refused = fenced(&hostile_event(n + 1000), last).await.unwrap_err();
        assert_eq!(
            refused.kind(),
            PublishErrorKind::WrongLastSequence,
            "message {n}"
        );
    }
    let stream = js.get_stream("HOSTILE").await.unwrap();
    assert_eq!(stream.cached_info().state.messages, 50);
    let stored = stream.get_raw_message(8).await.unwrap();
    let expected = hostile_event(7);
    let header = |name: &str| stored.headers.get(name).unwrap().as_str().to_owned();
    assert_eq!(header("Outbox-Encoding"), "percent");
    let decoded = |name: &str| outbox::encoding::decode(&header(name)).unwrap();
    assert_eq!(decoded("Outbox-Entity-Id"), expected.entity_id);
    assert_eq!(decoded("Outbox-Event-Type"), expected.event_type);
    assert_eq!(decoded("Outbox-Partition-Key"), expected.keys.partition_key);
    assert_eq!(decoded("Nats-Msg-Id"), expected.keys.dedupe_key);
}

/// Why the relay checks the publish line before publishing: nats-server closes a
/// connection whose `HPUB` line exceeds its `max_control_line` (4096 by default), so the
/// publish never gets an ack and the client reconnects; a line within the budget is stored.
#[tokio::test]
async fn a_publish_line_over_the_control_line_limit_is_never_acknowledged() {
    let nats = Nats::start();
    let client = async_nats::connect(nats.url()).await.unwrap();
    let js = jetstream::context::ContextBuilder::new()
        .timeout(std::time::Duration::from_secs(2))
        .build(client);
    js.create_stream(stream_config("LINE")).await.unwrap();
    let publish = |subject: String, id: &str| {
        let js = js.clone();
        let message = message(id, None);
        async move { js.send_publish(subject, message).await?.await }
    };
    // At the budget: stored.
    let headers = {
        let mut h = HeaderMap::new();
        h.insert("Nats-Msg-Id", "fits");
        h
    };
    let header_len = sink::wire_size(&headers, 0);
    let total = header_len + 2;
    let fixed = sink::control_line_len(0, header_len, total);
    let subject = format!(
        "LINE.{}",
        "x".repeat(sink::DEFAULT_MAX_CONTROL_LINE - fixed - 5)
    );
    assert_eq!(
        sink::control_line_len(subject.len(), header_len, total),
        sink::DEFAULT_MAX_CONTROL_LINE
    );
    publish(subject, "fits")
        .await
        .expect("a publish line within the budget is stored");
    // A 5 000-byte event type in the subject: never acknowledged.
    let error = publish(format!("LINE.{}", "x".repeat(5000)), "long")
        .await
        .unwrap_err();
    assert_eq!(error.kind(), PublishErrorKind::TimedOut, "{error}");
}

fn event(prefix: &str, id: i64, index: u32) -> outbox::OutboxEvent {
    let row = outbox::OutboxRow::seed(
        id,
        format!("order-{id}"),
        "OrderPaid".to_owned(),
        Bytes::from_static(b"{\"amount\":10}"),
        1_700_000_000_000,
    );
    let position = outbox::Position {
        commit_lsn: outbox::Lsn(0x1000),
        index,
    };
    row.into_event(prefix, std::num::NonZeroU64::new(12).unwrap(), position)
}

fn options(fence: Option<u64>, ack_timeout: std::time::Duration) -> sink::SinkOptions {
    sink::SinkOptions {
        max_in_flight: 16,
        fence,
        compare: None,
        limits: sink::Limits {
            max_message_bytes: 1024 * 1024,
            max_control_line: sink::DEFAULT_MAX_CONTROL_LINE,
        },
        poison: sink::PoisonPolicy::Halt,
        dead_letter_subject: "PATH.dlq".to_owned(),
        source: "test".to_owned(),
        ack_timeout,
        atomic: None,
        fast: None,
        id_chain: true,
    }
}

/// One session of `sink::run` publishing `events` in one transaction that ends at 1: how it
/// ended, the watermark (0 until confirmed) and its counters.
async fn session(
    nats: &Nats,
    js: &jetstream::Context,
    options: sink::SinkOptions,
    events: Vec<outbox::OutboxEvent>,
) -> (
    Result<(), sink::SinkError>,
    u64,
    std::sync::Arc<sink::SinkStats>,
) {
    let mut batch = vec![outbox::Item::Begin { commit_time_us: 0 }];
    batch.extend(events.into_iter().map(outbox::Item::Event));
    batch.push(outbox::Item::Commit(1));
    session_of(nats, js, options, batch).await
}

/// [`session`] over the input `items`, in one batch.
async fn session_of(
    nats: &Nats,
    js: &jetstream::Context,
    options: sink::SinkOptions,
    items: Vec<outbox::Item<u64>>,
) -> (
    Result<(), sink::SinkError>,
    u64,
    std::sync::Arc<sink::SinkStats>,
) {
    let (items_tx, items_rx) = tokio::sync::mpsc::channel(4);
    let (watermark_tx, watermark_rx) = tokio::sync::watch::channel(0u64);
    let stats = std::sync::Arc::new(sink::SinkStats::default());
    items_tx.send(items).await.unwrap();
    drop(items_tx);
    let connection = sink::Connector::plain(nats.url())
        .open(&js.client(), options.max_in_flight)
        .await
        .expect("open the publishing connection");
    let result = sink::run(
        js.clone(),
        connection,
        options,
        items_rx,
        watermark_tx,
        stats.clone(),
    )
    .await;
    let watermark = *watermark_rx.borrow();
    (result, watermark, stats)
}

fn ack_error_kind(result: &Result<(), sink::SinkError>) -> PublishErrorKind {
    match result {
        Err(sink::SinkError::Ack { source, .. }) => source.kind(),
        other => panic!("expected an ack error, got {other:?}"),
    }
}

/// The sink's own ack path (one subscription per session, reply `{inbox}.{n}`, the PubAck
/// read by hand) on the real server: events are stored and confirmed, each publish carries
/// its own numbered reply subject under `_INBOX` within the control-line budget, a replay is
/// acknowledged as a duplicate (and confirmed), a stale fence is refused as a fence refusal
/// with nothing stored or confirmed, and a subject no stream listens on (no responders) is
/// a transient error.
#[tokio::test]
async fn the_sink_reads_stored_duplicate_fence_and_no_stream_answers() {
    use futures::StreamExt;
    let nats = Nats::start();
    let client = async_nats::connect(nats.url()).await.unwrap();
    let js = jetstream::new(client.clone());
    js.create_stream(stream_config("PATH")).await.unwrap();
    let mut watch = testkit::subscribe(&client, "PATH.>").await;
    let timeout = std::time::Duration::from_secs(5);

    // Stored, in strict mode from an empty stream.
    let events: Vec<_> = (1..=3).map(|id| event("PATH", id, id as u32 - 1)).collect();
    let (result, watermark, stats) =
        session(&nats, &js, options(Some(0), timeout), events.clone()).await;
    result.unwrap();
    assert_eq!(watermark, 1, "the transaction is confirmed");
    assert_eq!(stats.stored.load(std::sync::atomic::Ordering::Relaxed), 3);
    assert_eq!(stored(&js, "PATH").await, 3);
    let mut inbox = None;
    for n in 1..=3u64 {
        let seen = watch.next().await.unwrap();
        let reply = seen.reply.expect("a publish carries a reply subject");
        assert!(reply.len() <= sink::REPLY_SUBJECT_LEN, "{reply}");
        let (prefix, sequence) = reply.rsplit_once('.').unwrap();
        assert_eq!(sequence, n.to_string(), "{reply}");
        assert!(prefix.starts_with("_INBOX."), "{reply}");
        assert_eq!(*inbox.get_or_insert_with(|| prefix.to_owned()), prefix);
    }

    // A replay: acknowledged as a duplicate of the same event, confirmed, nothing stored.
    let (result, watermark, stats) =
        session(&nats, &js, options(None, timeout), vec![events[0].clone()]).await;
    result.unwrap();
    assert_eq!(watermark, 1);
    assert_eq!(
        stats.duplicates.load(std::sync::atomic::Ordering::Relaxed),
        1
    );
    assert_eq!(stats.stored.load(std::sync::atomic::Ordering::Relaxed), 0);
    assert_eq!(
        stats.reused_ids.load(std::sync::atomic::Ordering::Relaxed),
        0
    );
    let replayed = watch.next().await.unwrap().reply.unwrap();
    assert!(
        !replayed.starts_with(inbox.as_deref().unwrap()),
        "a new session has its own inbox"
    );

    // A stale fence (the stream's last sequence is 3): refused, classified as before.
    let (result, watermark, stats) = session(
        &nats,
        &js,
        options(Some(0), timeout),
        vec![event("PATH", 4, 0)],
    )
    .await;
    assert_eq!(ack_error_kind(&result), PublishErrorKind::WrongLastSequence);
    let error = result.unwrap_err();
    assert!(error.is_fence_refusal(), "{error}");
    assert!(error.advice().is_some() && error.is_transient(), "{error}");
    assert!(error.to_string().contains("wrong last sequence"), "{error}");
    assert_eq!((watermark, stats.acked()), (0, 0), "nothing confirmed");
    assert_eq!(stored(&js, "PATH").await, 3);

    // No stream on the subject: the server's no-responders status.
    let (result, watermark, _) = session(
        &nats,
        &js,
        options(None, timeout),
        vec![event("NOSTREAM", 5, 0)],
    )
    .await;
    assert_eq!(ack_error_kind(&result), PublishErrorKind::StreamNotFound);
    let error = result.unwrap_err();
    assert!(error.is_transient() && !error.is_fence_refusal() && error.poison_id().is_none());
    assert_eq!(watermark, 0);
}

/// P10 against a responder that answers out of order and adds stray answers: an answer
/// for a later publish is kept until its turn, an answer for no publish in flight (a
/// repeated one, one far ahead, one with no number) is ignored, and every event counts
/// once; a publish whose answer never comes times out and confirms nothing.
#[tokio::test]
async fn acks_are_matched_by_sequence_and_a_missing_one_times_out() {
    use futures::StreamExt;
    let nats = Nats::start();
    let client = async_nats::connect(nats.url()).await.unwrap();
    let js = jetstream::new(client.clone());
    let mut requests = testkit::subscribe(&client, "ECHO.>").await;
    let responder = tokio::spawn({
        let client = client.clone();
        async move {
            // Pairs of publishes, answered second first, with strays around them.
            for _ in 0..2 {
                let first = requests.next().await.unwrap().reply.unwrap();
                let second = requests.next().await.unwrap().reply.unwrap();
                let (inbox, n) = first.rsplit_once('.').unwrap();
                let n: u64 = n.parse().unwrap();
                let answer = |seq: u64| Bytes::from(format!(r#"{{"stream":"ECHO","seq":{seq}}}"#));
                for stray in [format!("{inbox}.{}", n + 1_000_000), format!("{inbox}.x")] {
                    client.publish(stray, answer(0)).await.unwrap();
                }
                client.publish(second.clone(), answer(n + 1)).await.unwrap();
                client.publish(second, answer(n + 1)).await.unwrap();
                client.publish(first, answer(n)).await.unwrap();
            }
            client.flush().await.unwrap();
        }
    });
    let events: Vec<_> = (1..=4).map(|id| event("ECHO", id, id as u32 - 1)).collect();
    let (result, watermark, stats) = session(
        &nats,
        &js,
        options(None, std::time::Duration::from_secs(5)),
        events,
    )
    .await;
    result.unwrap();
    responder.await.unwrap();
    assert_eq!(watermark, 1);
    assert_eq!(stats.stored.load(std::sync::atomic::Ordering::Relaxed), 4);
    assert_eq!(stats.acked(), 4);

    // A listener that never answers: no no-responders status, no ack, a timeout.
    let _silent = testkit::subscribe(&client, "SILENT.>").await;
    let started = std::time::Instant::now();
    let (result, watermark, stats) = session(
        &nats,
        &js,
        options(None, std::time::Duration::from_millis(300)),
        vec![event("SILENT", 9, 0)],
    )
    .await;
    assert_eq!(ack_error_kind(&result), PublishErrorKind::TimedOut);
    assert!(started.elapsed() >= std::time::Duration::from_millis(300));
    assert_eq!((watermark, stats.acked()), (0, 0));
}

/// A session of `sink::run` whose publishing connection goes through a proxy (for the faults
/// a server cannot produce), its input kept open.
struct Proxied {
    js: jetstream::Context,
    proxy: testkit::Proxy,
    items: tokio::sync::mpsc::Sender<Vec<outbox::Item<u64>>>,
    watermark: tokio::sync::watch::Receiver<u64>,
    stats: std::sync::Arc<sink::SinkStats>,
    run: tokio::task::JoinHandle<Result<(), sink::SinkError>>,
}

impl Proxied {
    async fn start(nats: &Nats, name: &str, ping_interval: std::time::Duration) -> Proxied {
        let js = context(nats, name, 1024 * 1024).await;
        let proxy = testkit::Proxy::start(format!("127.0.0.1:{}", nats.port()).parse().unwrap());
        let mut connector = sink::Connector::plain(format!("nats://127.0.0.1:{}", proxy.port()));
        connector.ping_interval = ping_interval;
        let connection = connector
            .open(&js.client(), 16)
            .await
            .expect("open the publishing connection");
        let (items, items_rx) = tokio::sync::mpsc::channel(4);
        let (watermark_tx, watermark) = tokio::sync::watch::channel(0u64);
        let stats = std::sync::Arc::new(sink::SinkStats::default());
        let run = tokio::spawn(sink::run(
            js.clone(),
            connection,
            options(None, std::time::Duration::from_secs(30)),
            items_rx,
            watermark_tx,
            stats.clone(),
        ));
        Proxied {
            js,
            proxy,
            items,
            watermark,
            stats,
            run,
        }
    }

    /// How the session ended, within 30 s of being asked.
    async fn end(self) -> Result<(), sink::SinkError> {
        let ended = tokio::time::timeout(std::time::Duration::from_secs(30), self.run)
            .await
            .expect("the session ends within 30 s")
            .unwrap();
        drop(self.items);
        ended
    }
}

/// CN3: a session whose publishing connection closes while it publishes nothing ends with
/// the connection's reason at once, not at its next publish; an event published before
/// is confirmed first.
#[tokio::test]
async fn an_idle_session_ends_when_its_connection_closes() {
    let nats = Nats::start();
    let mut session = Proxied::start(&nats, "IDLE", sink::conn::PING_INTERVAL).await;
    session
        .items
        .send(vec![
            outbox::Item::Begin { commit_time_us: 0 },
            outbox::Item::Event(event("IDLE", 1, 0)),
            outbox::Item::Commit(1),
        ])
        .await
        .unwrap();
    tokio::time::timeout(
        std::time::Duration::from_secs(30),
        session.watermark.wait_for(|w| *w == 1),
    )
    .await
    .expect("the event is confirmed within 30 s")
    .unwrap();

    // Idle from here; the input stays open.
    session.proxy.cut();
    let (js, stats) = (session.js.clone(), session.stats.clone());
    let error = session.end().await.unwrap_err();
    assert!(
        matches!(error, sink::SinkError::Disconnected(_)) && error.is_transient(),
        "{error:?}"
    );
    assert_eq!(
        (
            stats.stored.load(std::sync::atomic::Ordering::Relaxed),
            stored(&js, "IDLE").await
        ),
        (1, 1)
    );
}

/// CN4: a connection whose server stops answering without closing it (a half-open
/// connection: the proxy holds every byte from the server) ends the session once
/// `PINGS_UNANSWERED` of its PINGs went unanswered, while the session is idle.
#[tokio::test]
async fn a_server_that_stops_answering_pings_ends_an_idle_session() {
    let nats = Nats::start();
    let session = Proxied::start(&nats, "SILENT", std::time::Duration::from_millis(200)).await;
    // Answered PINGs keep it open: five intervals pass while the server answers.
    tokio::time::sleep(std::time::Duration::from_secs(1)).await;
    assert!(
        !session.run.is_finished(),
        "answered PINGs keep the session open"
    );
    session.proxy.set_blackhole(true);
    match session.end().await {
        Err(sink::SinkError::Disconnected(why)) => assert!(why.contains("PINGs"), "{why}"),
        other => panic!("expected the connection to be closed for unanswered PINGs: {other:?}"),
    }
}

/// The headers a relayed event carries, from the frozen contract (`outbox::headers`), written
/// out independently of the sink: what the stored message must hold.
fn contract_headers(event: &outbox::OutboxEvent, source: &str) -> Vec<(&'static str, String)> {
    use outbox::headers as h;
    let hostile = outbox::encoding::row_is_hostile(&event.entity_id, &event.event_type);
    let row = |text: &str| {
        if hostile {
            outbox::encoding::encode(text)
        } else {
            text.to_owned()
        }
    };
    let mut headers = vec![
        (h::NATS_MSG_ID, row(&event.keys.dedupe_key)),
        (h::OUTBOX_ID, event.id.to_string()),
        (h::OUTBOX_ENTITY_ID, row(&event.entity_id)),
        (h::OUTBOX_EVENT_TYPE, row(&event.event_type)),
        (h::OUTBOX_PARTITION_KEY, row(&event.keys.partition_key)),
        (h::OUTBOX_ORDERING_KEY, event.keys.ordering_key.clone()),
        (h::OUTBOX_SHARD, event.shard.to_string()),
        (h::OUTBOX_COMMIT_LSN, event.position.commit_lsn.to_string()),
        (h::OUTBOX_TX_INDEX, event.position.index.to_string()),
        (h::OUTBOX_SOURCE, source.to_owned()),
    ];
    if hostile {
        headers.push((h::OUTBOX_ENCODING, outbox::encoding::PERCENT.to_owned()));
    }
    headers
}

/// The sink's hand-written frames against the real server, property-tested (sink M2, M4,
/// WIRE5): for rows of any shape (hostile ones included) and payloads around the stream's
/// `max_msg_size`, the server counts exactly the size the contract gives (`NATS/1.0`, one
/// `Name: value` line per header, the blank line, the payload): every message at or under
/// the limit is stored with exactly the contract's headers and the payload, every one over
/// it is refused for its size (poison, nothing confirmed), and the connection never
/// misreads a frame (a wrong byte count would corrupt every later frame of the session).
#[test]
fn frames_the_sink_writes_are_stored_as_the_contract_says_to_the_byte() {
    use proptest::prelude::*;
    const LIMIT: usize = 2000;
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let nats = Nats::start();
    let js = runtime.block_on(context(&nats, "FRAMES", LIMIT as i32));
    let next_id = std::cell::Cell::new(0i64);
    let (fitted, refused) = (std::cell::Cell::new(0), std::cell::Cell::new(0));
    let mut runner = proptest::test_runner::TestRunner::new(ProptestConfig {
        cases: 48,
        failure_persistence: None,
        ..ProptestConfig::default()
    });
    let rows = (
        "[a-zA-Z0-9:ü -]{1,40}|(?i)[a-z ]{0,5}nats-msg-id[:a-z ]{0,5}",
        "[A-Za-z]{1,20}|Nats-Expected-Last-Sequence|Order Paid",
        LIMIT - 700..LIMIT + 100,
        any::<u32>(),
    );
    runner
        .run(&rows, |(entity_id, event_type, payload_len, index)| {
            next_id.set(next_id.get() + 1);
            let row = outbox::OutboxRow::seed(
                next_id.get(),
                entity_id,
                event_type,
                Bytes::from(vec![b'p'; payload_len]),
                1_700_000_000_000 + next_id.get(),
            );
            let position = outbox::Position {
                commit_lsn: outbox::Lsn(0x1000 + next_id.get() as u64),
                index,
            };
            let event = row.into_event("FRAMES", std::num::NonZeroU64::new(12).unwrap(), position);
            let headers = contract_headers(&event, "test");
            let size = b"NATS/1.0\r\n\r\n".len()
                + headers
                    .iter()
                    .map(|(name, value)| name.len() + 2 + value.len() + 2)
                    .sum::<usize>()
                + payload_len;
            let timeout = std::time::Duration::from_secs(5);
            runtime.block_on(async {
                let before = stored(&js, "FRAMES").await;
                let (result, watermark, _) =
                    session(&nats, &js, options(None, timeout), vec![event.clone()]).await;
                if size <= LIMIT {
                    prop_assert!(result.is_ok(), "{size} bytes: {result:?}");
                    prop_assert_eq!(watermark, 1);
                    let stream = js.get_stream("FRAMES").await.unwrap();
                    let message = stream.get_raw_message(before + 1).await.unwrap();
                    prop_assert_eq!(message.subject.as_str(), event.subject.as_str());
                    prop_assert_eq!(&message.payload, &event.payload);
                    for (name, value) in &headers {
                        prop_assert_eq!(
                            message.headers.get(*name).map(|v| v.as_str()),
                            Some(value.as_str()),
                            "{}",
                            name
                        );
                    }
                    prop_assert_eq!(message.headers.iter().count(), headers.len());
                    fitted.set(fitted.get() + 1);
                } else {
                    let error = result.unwrap_err();
                    prop_assert!(error.poison_id() == Some(event.id), "{size} bytes: {error}");
                    prop_assert_eq!(watermark, 0);
                    prop_assert_eq!(stored(&js, "FRAMES").await, before);
                    refused.set(refused.get() + 1);
                }
                Ok(())
            })
        })
        .unwrap();
    assert!(
        fitted.get() >= 5 && refused.get() >= 5,
        "both sides of the limit were tried: {} stored, {} refused",
        fitted.get(),
        refused.get()
    );
}

/// Creates stream `name` on `{name}.>` through the JetStream API's JSON, with `allow_batched`
/// as given (async-nats 0.51 has the setting only behind a feature the relay leaves off).
async fn raw_stream(js: &jetstream::Context, name: &str, allow_batched: bool) {
    let config = serde_json::json!({
        "name": name,
        "subjects": [format!("{name}.>")],
        "storage": "file",
        "allow_batched": allow_batched,
    });
    let answer: serde_json::Value = js
        .request(format!("STREAM.CREATE.{name}"), &config)
        .await
        .unwrap();
    assert!(answer.get("error").is_none(), "{answer}");
}

/// A current nats-server and its JetStream context, with stream `name` allowing batches.
async fn batched_stream(name: &str) -> (Nats, jetstream::Context) {
    let nats = Nats::start_current(&[]);
    let client = async_nats::connect(nats.url()).await.unwrap();
    let js = jetstream::new(client);
    raw_stream(&js, name, true).await;
    (nats, js)
}

/// The message id stored at `sequence` of stream `name`.
async fn msg_id_at(js: &jetstream::Context, name: &str, sequence: u64) -> String {
    let stream = js.get_stream(name).await.unwrap();
    let message = stream.get_raw_message(sequence).await.unwrap();
    message
        .headers
        .get("Nats-Msg-Id")
        .map(|v| v.to_string())
        .unwrap_or_default()
}

/// P14, F1–F5 on a current nats-server: fast-ingest batches store every event once, in
/// order, and are confirmed by their commits; a message of a batch that the stream already
/// holds ends the session with nothing of that batch confirmed; a stream that does not allow
/// batch publish turns the mode off (F4).
#[tokio::test]
async fn fast_batches_store_every_event_once_in_order_and_refuse_what_they_cannot_prove() {
    let (nats, js) = batched_stream("FAST").await;
    let timeout = std::time::Duration::from_secs(10);
    let fast = |fence| sink::SinkOptions {
        max_in_flight: 2000,
        fast: Some(sink::batch::FAST_BATCH_LIMIT),
        ..options(Some(fence), timeout)
    };

    let events: Vec<_> = (1..=2500)
        .map(|id| event("FAST", id, id as u32 - 1))
        .collect();
    let (result, watermark, stats) = session(&nats, &js, fast(0), events.clone()).await;
    result.unwrap();
    assert_eq!(watermark, 1, "the transaction is confirmed");
    assert_eq!(
        stats.stored.load(std::sync::atomic::Ordering::Relaxed),
        2500
    );
    assert_eq!(
        stats
            .fast_batches
            .load(std::sync::atomic::Ordering::Relaxed),
        3,
        "batches of 1 000, 1 000 and 500"
    );
    assert_eq!(stored(&js, "FAST").await, 2500);
    for sequence in [1, 2, 999, 1000, 1001, 2000, 2001, 2500] {
        assert_eq!(
            msg_id_at(&js, "FAST", sequence).await,
            events[sequence as usize - 1].keys.dedupe_key,
            "stream sequence {sequence} holds the event published in that place"
        );
    }

    // A batch one of whose messages the stream already holds (a reused id): never confirmed.
    let mut more: Vec<_> = (2501..=2600)
        .map(|id| event("FAST", id, id as u32 - 1))
        .collect();
    more[49] = event("FAST", 10, 2549);
    let (result, watermark, _) = session(&nats, &js, fast(2500), more).await;
    assert!(result.is_err(), "{result:?}");
    assert_eq!(watermark, 0, "nothing of the batch is confirmed");
    assert_eq!(
        stored(&js, "FAST").await,
        2549,
        "what came before the duplicate is stored, nothing after it"
    );

    // A stream without allow_batched: the server refuses, and the mode turns off.
    raw_stream(&js, "SLOW", false).await;
    let events: Vec<_> = (1..=10)
        .map(|id| event("SLOW", id, id as u32 - 1))
        .collect();
    let (result, watermark, stats) = session(&nats, &js, fast(0), events).await;
    assert!(result.is_err(), "{result:?}");
    assert_eq!(watermark, 0);
    let off = stats.fast_off().expect("the mode is off");
    assert!(off.contains("batch publish is disabled"), "{off}");
}

/// F6 on a current nats-server: a poison event under halt inside an open fast batch. The
/// session ends naming it, with what the batch stored before it acknowledged: the
/// transaction before it confirmed, its own transaction not, nothing after it stored.
#[tokio::test]
async fn a_poison_event_inside_a_fast_batch_halts_with_what_came_before_it_acknowledged() {
    let (nats, js) = batched_stream("POISON").await;
    let options = sink::SinkOptions {
        max_in_flight: 2000,
        fast: Some(sink::batch::FAST_BATCH_LIMIT),
        limits: sink::Limits {
            max_message_bytes: 4096,
            max_control_line: sink::DEFAULT_MAX_CONTROL_LINE,
        },
        ..options(Some(0), std::time::Duration::from_secs(10))
    };
    // Transaction A (5 events, ends at position 1), then B: 2 events, the poison one, 2.
    let mut items = vec![outbox::Item::Begin { commit_time_us: 0 }];
    items.extend((1..=5).map(|id| outbox::Item::Event(event("POISON", id, id as u32 - 1))));
    items.push(outbox::Item::Commit(1));
    items.push(outbox::Item::Begin { commit_time_us: 0 });
    for id in 6..=10 {
        let mut event = event("POISON", id, id as u32 - 6);
        event.position.commit_lsn = outbox::Lsn(0x2000);
        if id == 8 {
            event.payload = Bytes::from(format!("{{\"blob\":\"{}\"}}", "x".repeat(10_000)));
        }
        items.push(outbox::Item::Event(event));
    }
    items.push(outbox::Item::Commit(2));
    let (result, watermark, stats) = session_of(&nats, &js, options, items).await;
    match &result {
        Err(sink::SinkError::Poison { id, .. }) => assert_eq!(id.to_string(), "8"),
        other => panic!("expected a halt on poison event 8, got {other:?}"),
    }
    assert_eq!(watermark, 1, "A confirmed, B not");
    assert_eq!(
        stats.stored.load(std::sync::atomic::Ordering::Relaxed),
        7,
        "the 7 events before the poison one acknowledged"
    );
    assert_eq!(
        stats
            .fast_batches
            .load(std::sync::atomic::Ordering::Relaxed),
        1,
        "one batch, ended by its end-of-batch commit"
    );
    assert_eq!(stored(&js, "POISON").await, 7, "nothing after it stored");
    assert_eq!(
        msg_id_at(&js, "POISON", 7).await,
        event("POISON", 7, 1).keys.dedupe_key
    );
    println!("fast poison halt: events 1-7 stored and acknowledged by the end-of-batch commit, A confirmed, B not, nothing after the poison event");
}
