//! The relay against a three-node JetStream cluster on loopback (three `nats-server`
//! processes with routes) and an R3 stream: the stream's leader is SIGKILLed mid-run, twice,
//! while writers commit transactions of mixed sizes. Afterwards the stream holds every
//! committed row exactly once, in commit order, with no gap; the relay's stall per kill is
//! printed.

#![allow(clippy::unwrap_used)]

use crate::support;

use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use async_nats::jetstream;
use support::{check_faithful, eventually, Case, Writers, DEADLINE};
use testkit::cluster::NatsCluster;
use testkit::Postgres;

/// Leader kills in one run.
const KILLS: usize = 2;
/// Messages the relay must store between two kills (proves it streams again).
const FLOW: u64 = 300;

/// A JetStream context on every node of the cluster, with short request timeouts so polls
/// during an election come back quickly.
async fn cluster_jetstream(urls: &str) -> jetstream::Context {
    let servers: Vec<&str> = urls.split(',').collect();
    let client = async_nats::ConnectOptions::new()
        .connection_timeout(Duration::from_secs(2))
        .connect(servers)
        .await
        .expect("connect to the cluster");
    jetstream::context::ContextBuilder::new()
        .timeout(Duration::from_secs(1))
        .build(client)
}

/// The stream's state, `None` while it cannot be read (no leader).
async fn stream_state(js: &jetstream::Context, stream: &str) -> Option<jetstream::stream::State> {
    let mut stream = js.get_stream(stream).await.ok()?;
    stream.info().await.ok().map(|info| info.state.clone())
}

fn unix_nanos(time: SystemTime) -> i128 {
    time.duration_since(UNIX_EPOCH).unwrap().as_nanos() as i128
}

#[derive(Debug)]
struct Kill {
    node: String,
    new_leader: String,
    stored_before: u64,
    /// From the kill until another node led the stream.
    election: Duration,
    /// From the kill until the stream stored a message published after it.
    stall: Duration,
    /// From the kill until the restarted node was back and caught up.
    node_back: Duration,
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn r3_stream_leader_killed_twice_nothing_lost_duplicated_or_reordered() {
    let started = Instant::now();
    let pg = Postgres::start();
    let mut cluster = NatsCluster::start();
    let mut case = Case::with_nats_url(&pg, &cluster.urls(), "r3");
    case.set_env(&[("OUTBOX_RELAY_ACK_TIMEOUT", "2s")]);
    let js = cluster_jetstream(&cluster.urls()).await;
    let first_leader = case.create_r3_stream(&js, &cluster).await;
    eprintln!(
        "r3: cluster {:?} up, stream {} led by {first_leader}",
        cluster.node_names(),
        case.stream
    );

    let relay = case.start_relay();
    let writers = Writers::start(&case, 2, Duration::from_millis(100)).await;

    let mut kills: Vec<Kill> = Vec::new();
    for round in 0..KILLS {
        // The relay streams: the stream grows by FLOW messages.
        let base = stream_state(&js, &case.stream)
            .await
            .map_or(0, |s| s.messages);
        eventually(
            &format!("{FLOW} more messages before kill {round}"),
            DEADLINE,
            || async {
                let state = stream_state(&js, &case.stream).await?;
                (state.messages >= base + FLOW).then_some(())
            },
        )
        .await;
        let leader = eventually("the stream's leader", DEADLINE, || async {
            cluster.stream_leader(&case.stream)
        })
        .await;
        let node = cluster.node_index_by_name(&leader).unwrap();
        let stored_before = stream_state(&js, &case.stream)
            .await
            .map_or(0, |s| s.messages);

        let killed_at = SystemTime::now();
        let t0 = Instant::now();
        cluster.kill(node);

        let new_leader = eventually("another node to lead the stream", DEADLINE, || async {
            cluster
                .stream_leader(&case.stream)
                .filter(|name| *name != leader)
        })
        .await;
        let election = t0.elapsed();
        // The relay publishes again: a message stored after the kill (its timestamp is the
        // new leader's clock; the old leader is dead).
        eventually(
            &format!("the relay to publish again after kill {round}"),
            DEADLINE,
            || async {
                let state = stream_state(&js, &case.stream).await?;
                (state.last_timestamp.unix_timestamp_nanos() > unix_nanos(killed_at)).then_some(())
            },
        )
        .await;
        let stall = t0.elapsed();
        cluster.start_again(node);
        let node_back = t0.elapsed();
        eprintln!(
            "r3: kill {round}: SIGKILL {leader} (stream leader, {stored_before} stored); {new_leader} led after {election:?}; \
             relay stall {stall:?}; {leader} back and caught up after {node_back:?}"
        );
        kills.push(Kill {
            node: leader,
            new_leader,
            stored_before,
            election,
            stall,
            node_back,
        });
    }

    // More flow with all three nodes back, then stop writing and let the relay catch up.
    let base = stream_state(&js, &case.stream)
        .await
        .map_or(0, |s| s.messages);
    eventually("more messages after the last restart", DEADLINE, || async {
        let state = stream_state(&js, &case.stream).await?;
        (state.messages >= base + FLOW).then_some(())
    })
    .await;
    let log = writers.stop().await;
    let committed = log.committed_rows() as u64;
    eventually(
        &format!("all {committed} committed rows in the stream"),
        DEADLINE,
        || async {
            let state = stream_state(&js, &case.stream).await?;
            (state.messages >= committed).then_some(())
        },
    )
    .await;

    let messages = case.messages(&js).await;
    let findings = check_faithful(&messages, &log);
    let sessions = relay.output().matches("streaming outbox events").count();
    eprintln!(
        "r3: injected {} leader kills ({}); relay sessions {sessions}; {} transactions committed, {} rows rolled back",
        kills.len(),
        kills
            .iter()
            .map(|k| format!("{} -> {}", k.node, k.new_leader))
            .collect::<Vec<_>>()
            .join(", "),
        log.committed_transactions(),
        log.rolled_back.len()
    );
    for (i, kill) in kills.iter().enumerate() {
        eprintln!(
            "r3: kill {i}: stall {:?} (election {:?}, node back {:?}, {} stored before)",
            kill.stall, kill.election, kill.node_back, kill.stored_before
        );
    }
    eprintln!(
        "r3: found {} ({:?} in all)",
        findings.summary(),
        started.elapsed()
    );
    findings.assert_faithful();
    assert_eq!(kills.len(), KILLS);
    // On a replicated stream the fence is the sequence alone (sink P5, `SinkOptions::id_chain`):
    // nats-server wedges a replica that caught up when a message carries the id chain.
    let chained = messages
        .iter()
        .filter(|m| m.headers.contains_key("Nats-Expected-Last-Msg-Id"))
        .count();
    let fenced = messages
        .iter()
        .filter(|m| m.headers.contains_key("Nats-Expected-Last-Sequence"))
        .count();
    assert_eq!(chained, 0, "no id chain on a replicated stream");
    if !case.atomic_transactions() {
        assert_eq!(fenced, messages.len(), "every message fenced by sequence");
    }
    drop(relay);
}
