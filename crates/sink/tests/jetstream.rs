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
        name: name.to_owned(),
        subjects: vec![format!("{name}.>")],
        max_message_size,
        ..Default::default()
    })
    .await
    .unwrap();
    js
}

/// Publishes and waits for the server's answer: the ack, or why it refused.
async fn publish(
    js: &jetstream::Context,
    subject: impl ToSubject,
    message: PublishMessage,
) -> Result<PublishAck, PublishError> {
    js.send_publish(subject, message).await.unwrap().await
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

/// How nats-server orders its checks (docs/guarantees.md relies on this): the duplicate
/// check comes first, so a replayed id is acknowledged as a duplicate even when its
/// expected last sequence is stale; a new id with a stale expected sequence is refused and
/// nothing is stored.
#[tokio::test]
async fn dedupe_is_checked_before_the_expected_last_sequence() {
    let nats = Nats::start();
    let js = context(&nats, "ORDER", -1).await;
    let a = publish(&js, "ORDER.x", message("a", Some(0)))
        .await
        .unwrap();
    assert_eq!(a.sequence, 1);
    let replay = publish(&js, "ORDER.x", message("a", Some(0)))
        .await
        .unwrap();
    assert!(
        replay.duplicate,
        "a duplicate id wins over a stale expected sequence"
    );
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
/// switches de-duplication off; the same values percent-encoded do not.
#[tokio::test]
async fn a_header_name_inside_a_value_hides_the_header_unless_encoded() {
    let nats = Nats::start();
    let _ = context(&nats, "RAW", -1).await;
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
    assert_eq!(
        unfenced["seq"], 2,
        "the hidden fence let a stale publish in: {unfenced}"
    );
    let undeduplicated = raw
        .publish(
            "RAW.x",
            &["Outbox-Entity-Id: Nats-Msg-Id", "Nats-Msg-Id: a"],
        )
        .await;
    assert_eq!(
        undeduplicated["seq"], 3,
        "the hidden id let a duplicate in: {undeduplicated}"
    );
    assert_eq!(undeduplicated.get("duplicate"), None);

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
    let row = outbox::OutboxRow {
        id: i64::from(n),
        entity_id,
        event_type,
        payload: Bytes::from_static(b"{}"),
        created_at_ms: 1_700_000_000_000,
    };
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
        let fenced = |event: &outbox::OutboxEvent| {
            let message = sink::publish_message(event).expected_last_sequence(last);
            publish(&js, event.subject.clone(), message)
        };
        let stored = fenced(&event).await.unwrap();
        assert_eq!((stored.sequence, stored.duplicate), (last + 1, false));
        // A replay with a stale expected sequence: recognised as a duplicate.
        let replay = fenced(&event).await.unwrap();
        assert!(replay.duplicate, "message {n} was stored twice");
        // Another row with a stale expected sequence: refused.
        let refused = fenced(&hostile_event(n + 1000)).await.unwrap_err();
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

/// The reply subject async-nats puts on a JetStream publish is `sink::REPLY_SUBJECT_LEN`
/// bytes long (the control-line budget counts on it).
#[tokio::test]
async fn jetstream_publish_reply_subjects_are_as_long_as_budgeted() {
    use futures::StreamExt;
    let nats = Nats::start();
    let client = async_nats::connect(nats.url()).await.unwrap();
    let js = jetstream::new(client.clone());
    js.create_stream(stream::Config {
        name: "REPLY".into(),
        subjects: vec!["REPLY.>".into()],
        ..Default::default()
    })
    .await
    .unwrap();
    let mut watch = client.subscribe("REPLY.>").await.unwrap();
    client.flush().await.unwrap();
    for id in ["r1", "r2"] {
        publish(&js, "REPLY.x", message(id, None)).await.unwrap();
        let seen = watch.next().await.unwrap();
        let reply = seen
            .reply
            .expect("a JetStream publish carries a reply subject");
        assert_eq!(reply.len(), sink::REPLY_SUBJECT_LEN, "{reply}");
    }
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
    js.create_stream(stream::Config {
        name: "LINE".into(),
        subjects: vec!["LINE.>".into()],
        ..Default::default()
    })
    .await
    .unwrap();
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
