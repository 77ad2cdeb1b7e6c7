//! The spans handlers run in, and the producer's trace they continue.
//!
//! Every event a [`crate::Handler`] handles runs inside an `outbox.handle` span
//! ([`handle_span`]), and every call of a [`crate::BatchHandler`] inside an
//! `outbox.handle_batch` span ([`batch_span`]), so a handler's own spans and logs are
//! children of it and name the event.
//!
//! # Invariants
//! - TR1 The span's fields name the event without its payload: `dedupe_key`,
//!   `stream_sequence`, `outbox_id`, `shard`, and `traceparent` (the event's decoded
//!   [`crate::Event::trace_context`], empty without one); a batch's span has `event_count`
//!   and the stream sequences of its first and last events.
//! - TR2 With the cargo feature `opentelemetry`, an event's span has as its OpenTelemetry
//!   parent the remote span context of its `traceparent` and `tracestate` (W3C
//!   TraceContextPropagator), so it continues the producer's trace: same trace id, the
//!   producer's span as parent. A batch's span links each of its events' contexts. An event
//!   without a (well-formed) traceparent, or a subscriber without the tracing-opentelemetry
//!   layer, leaves the span as tracing made it: a trace context is advisory and never fails
//!   an event.
//! - TR3 Without the feature nothing of OpenTelemetry is compiled or depended on.

use tracing::field::Empty;
use tracing::Span;

use crate::event::Event;

/// The span an event's handler runs in (TR1, TR2).
pub fn handle_span(event: &Event) -> Span {
    let span = tracing::info_span!(
        "outbox.handle",
        dedupe_key = %event.keys.dedupe_key,
        stream_sequence = event.stream_sequence,
        outbox_id = %event.id,
        shard = event.shard,
        traceparent = Empty,
    );
    if span.is_disabled() {
        return span;
    }
    if let Some((parent, state)) = event.trace_context() {
        span.record("traceparent", &*parent);
        otel::set_parent(&span, &parent, state.as_deref());
    }
    span
}

/// The span a batch handler runs in over `events` (TR1, TR2).
pub fn batch_span(events: &[Event]) -> Span {
    let span = tracing::info_span!(
        "outbox.handle_batch",
        event_count = events.len(),
        first_stream_sequence = events.first().map_or(0, |e| e.stream_sequence),
        last_stream_sequence = events.last().map_or(0, |e| e.stream_sequence),
    );
    for event in events.iter().filter(|_| !span.is_disabled()) {
        if let Some((parent, state)) = event.trace_context() {
            otel::add_link(&span, &parent, state.as_deref());
        }
    }
    span
}

#[cfg(feature = "opentelemetry")]
mod otel {
    use opentelemetry::propagation::{Extractor, TextMapPropagator as _};
    use opentelemetry::trace::TraceContextExt as _;
    use opentelemetry_sdk::propagation::TraceContextPropagator;
    use tracing::Span;
    use tracing_opentelemetry::OpenTelemetrySpanExt as _;

    use outbox::mapping::{TRACEPARENT, TRACESTATE};

    /// The two W3C headers, as the propagator reads them.
    struct TraceHeaders<'a> {
        parent: &'a str,
        state: Option<&'a str>,
    }

    impl Extractor for TraceHeaders<'_> {
        fn get(&self, key: &str) -> Option<&str> {
            match key {
                TRACEPARENT => Some(self.parent),
                TRACESTATE => self.state,
                _ => None,
            }
        }

        fn keys(&self) -> Vec<&str> {
            match self.state {
                Some(_) => vec![TRACEPARENT, TRACESTATE],
                None => vec![TRACEPARENT],
            }
        }
    }

    fn context(parent: &str, state: Option<&str>) -> opentelemetry::Context {
        TraceContextPropagator::new().extract(&TraceHeaders { parent, state })
    }

    /// TR2: the producer's span becomes the parent.
    pub(super) fn set_parent(span: &Span, parent: &str, state: Option<&str>) {
        // Err: the subscriber has no OpenTelemetry layer, so there is nothing to continue.
        let _ = span.set_parent(context(parent, state));
    }

    /// TR2: a batch links its events' producer spans.
    pub(super) fn add_link(span: &Span, parent: &str, state: Option<&str>) {
        let context = context(parent, state);
        span.add_link(context.span().span_context().clone());
    }
}

#[cfg(not(feature = "opentelemetry"))]
mod otel {
    use tracing::Span;

    /// TR3: without the feature a trace context only shows as the span's field.
    pub(super) fn set_parent(_span: &Span, _parent: &str, _state: Option<&str>) {}

    /// TR3.
    pub(super) fn add_link(_span: &Span, _parent: &str, _state: Option<&str>) {}
}

#[cfg(test)]
mod tests {
    use async_nats::HeaderMap;
    use bytes::Bytes;
    use outbox::headers;

    use super::*;

    const TRACE_ID: &str = "0af7651916cd43dd8448eb211c80319c";
    const PARENT_SPAN_ID: &str = "b7ad6b7169203331";

    /// An event as the relay publishes it, with a producer's trace context.
    fn traced_event(stream_sequence: u64) -> Event {
        let keys = outbox::compute_keys(7, "order-1", "OrderPaid", 1_700_000_000_123);
        let mut map = HeaderMap::new();
        for (name, value) in [
            (headers::NATS_MSG_ID, keys.dedupe_key.as_str()),
            (headers::OUTBOX_ID, "7"),
            (headers::OUTBOX_ENTITY_ID, "order-1"),
            (headers::OUTBOX_EVENT_TYPE, "OrderPaid"),
            (headers::OUTBOX_PARTITION_KEY, "order-1"),
            (headers::OUTBOX_ORDERING_KEY, keys.ordering_key.as_str()),
            (headers::OUTBOX_SHARD, "3"),
        ] {
            map.insert(name, value);
        }
        let traceparent = format!("00-{TRACE_ID}-{PARENT_SPAN_ID}-01");
        map.insert("traceparent", traceparent.as_str());
        map.insert("tracestate", "congo=t61rcWkgMzE");
        Event::decode(
            "outbox.3.OrderPaid",
            Some(&map),
            Bytes::from_static(b"{}"),
            stream_sequence,
            1,
        )
        .unwrap()
    }

    #[test]
    fn a_span_is_made_with_or_without_a_subscriber() {
        let event = traced_event(42);
        let (parent, _) = event.trace_context().unwrap();
        assert!(parent.contains(TRACE_ID));
        // No subscriber: a disabled span, and nothing fails.
        let _ = handle_span(&event).entered();
        let _ = batch_span(&[event.clone(), event]).entered();
    }

    #[cfg(feature = "opentelemetry")]
    #[test]
    fn the_handlers_span_continues_the_producers_trace() {
        use opentelemetry::trace::{SpanId, TraceId, TracerProvider as _};
        use opentelemetry_sdk::trace::{InMemorySpanExporter, SdkTracerProvider};
        use tracing_subscriber::layer::SubscriberExt as _;

        let exporter = InMemorySpanExporter::default();
        let provider = SdkTracerProvider::builder()
            .with_simple_exporter(exporter.clone())
            .build();
        let subscriber = tracing_subscriber::registry()
            .with(tracing_opentelemetry::layer().with_tracer(provider.tracer("consumer-test")));
        let event = traced_event(42);
        let other = {
            let mut other = traced_event(43);
            other.headers.insert(
                "traceparent",
                "00-11111111111111111111111111111111-2222222222222222-01",
            );
            other
        };
        tracing::subscriber::with_default(subscriber, || {
            let span = handle_span(&event);
            span.in_scope(|| tracing::info_span!("handler.work").in_scope(|| {}));
            drop(span);
            drop(batch_span(&[event.clone(), other]));
        });
        provider.force_flush().unwrap();
        let spans = exporter.get_finished_spans().unwrap();
        let by_name = |name: &str| {
            spans
                .iter()
                .find(|s| s.name == name)
                .unwrap_or_else(|| panic!("no span {name} in {spans:?}"))
        };
        let handle = by_name("outbox.handle");
        let trace_id = TraceId::from_hex(TRACE_ID).unwrap();
        assert_eq!(handle.span_context.trace_id(), trace_id);
        assert_eq!(
            handle.parent_span_id,
            SpanId::from_hex(PARENT_SPAN_ID).unwrap()
        );
        assert!(handle.parent_span_is_remote);
        assert_eq!(
            handle.span_context.trace_state().header(),
            "congo=t61rcWkgMzE"
        );
        // The handler's own spans are children in the same trace.
        let work = by_name("handler.work");
        assert_eq!(work.span_context.trace_id(), trace_id);
        assert_eq!(work.parent_span_id, handle.span_context.span_id());
        // A batch links every event's producer span.
        let batch = by_name("outbox.handle_batch");
        let linked: Vec<TraceId> = batch
            .links
            .iter()
            .map(|l| l.span_context.trace_id())
            .collect();
        assert_eq!(
            linked,
            [
                trace_id,
                TraceId::from_hex("11111111111111111111111111111111").unwrap()
            ]
        );
    }
}
