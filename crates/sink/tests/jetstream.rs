//! The JetStream behaviours the sink relies on, checked on the real nats-server.

#![allow(clippy::unwrap_used)]

use async_nats::jetstream::{self, context::PublishErrorKind, message::PublishMessage, stream};
use async_nats::HeaderMap;
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
    let first = js
        .send_publish("DEDUPE.x", message("k1", None))
        .await
        .unwrap()
        .await
        .unwrap();
    let second = js
        .send_publish("DEDUPE.x", message("k1", None))
        .await
        .unwrap()
        .await
        .unwrap();
    assert!(!first.duplicate);
    assert!(second.duplicate);
    assert_eq!(second.sequence, first.sequence);
    assert_eq!(
        js.get_stream("DEDUPE")
            .await
            .unwrap()
            .info()
            .await
            .unwrap()
            .state
            .messages,
        1
    );
}

/// How nats-server orders its checks (docs/guarantees.md relies on this): the duplicate
/// check comes first, so a replayed id is acknowledged as a duplicate even when its
/// expected last sequence is stale; a new id with a stale expected sequence is refused and
/// nothing is stored.
#[tokio::test]
async fn dedupe_is_checked_before_the_expected_last_sequence() {
    let nats = Nats::start();
    let js = context(&nats, "ORDER", -1).await;
    let a = js
        .send_publish("ORDER.x", message("a", Some(0)))
        .await
        .unwrap()
        .await
        .unwrap();
    assert_eq!(a.sequence, 1);
    let replay = js
        .send_publish("ORDER.x", message("a", Some(0)))
        .await
        .unwrap()
        .await
        .unwrap();
    assert!(
        replay.duplicate,
        "a duplicate id wins over a stale expected sequence"
    );
    let stale = js
        .send_publish("ORDER.x", message("b", Some(0)))
        .await
        .unwrap()
        .await
        .unwrap_err();
    assert_eq!(stale.kind(), PublishErrorKind::WrongLastSequence);
    let ahead = js
        .send_publish("ORDER.x", message("b", Some(5)))
        .await
        .unwrap()
        .await
        .unwrap_err();
    assert_eq!(ahead.kind(), PublishErrorKind::WrongLastSequence);
    let b = js
        .send_publish("ORDER.x", message("b", Some(1)))
        .await
        .unwrap()
        .await
        .unwrap();
    assert_eq!(b.sequence, 2);
    assert_eq!(
        js.get_stream("ORDER")
            .await
            .unwrap()
            .info()
            .await
            .unwrap()
            .state
            .messages,
        2
    );
}

/// A lost publish fences every later one: pipelined publishes expecting sequences after a
/// gap are all refused, so nothing after the gap enters the stream.
#[tokio::test]
async fn a_gap_fences_every_later_pipelined_publish() {
    let nats = Nats::start();
    let js = context(&nats, "FENCE", -1).await;
    js.send_publish("FENCE.x", message("m1", Some(0)))
        .await
        .unwrap()
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
    assert_eq!(
        js.get_stream("FENCE")
            .await
            .unwrap()
            .info()
            .await
            .unwrap()
            .state
            .messages,
        1
    );
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
    let publish = PublishMessage::build()
        .headers(headers.clone())
        .payload(Bytes::from(vec![b'x'; fits]));
    js.send_publish("SIZE.x", publish)
        .await
        .unwrap()
        .await
        .expect("a message of exactly max_msg_size is stored");
    headers.insert("Nats-Msg-Id", "size-2");
    let publish = PublishMessage::build()
        .headers(headers)
        .payload(Bytes::from(vec![b'x'; fits + 1]));
    let error = js
        .send_publish("SIZE.x", publish)
        .await
        .unwrap()
        .await
        .unwrap_err();
    assert!(error.to_string().contains("maximum"), "{error}");
}
