//! Trace contexts as Debezium's outbox extension writes them (`java.util.Properties.store`),
//! read from files Java itself wrote (`tests/fixtures/java-properties/Store.java`): every
//! escaped `=`, `:`, `#` and `!` of a `tracestate` arrives unescaped (properties JP1).

use outbox::mapping::trace_context;

const TRACEPARENT: &str = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01";

fn stored(name: &str) -> String {
    let path = format!(
        "{}/tests/fixtures/java-properties/{name}.properties",
        env!("CARGO_MANIFEST_DIR")
    );
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("read {path}: {e}"))
}

#[test]
fn tracestate_as_java_stored_it_reads_back_unescaped() {
    let cases = [
        (
            "two-vendors",
            Some("congo=t61rcWkgMzE,rojo=00f067aa0ba902b7"),
        ),
        ("multi-tenant-key", Some("tenant@vendor=a:b=c, other=x#y!z")),
        ("no-tracestate", None),
        ("empty-tracestate", None),
        ("with-baggage", Some("congo=t61rcWkgMzE")),
    ];
    for (name, tracestate) in cases {
        let text = stored(name);
        assert!(text.starts_with('#'), "{name}: Java's date comment first");
        assert_eq!(
            trace_context(&text),
            Some((TRACEPARENT.to_owned(), tracestate.map(str::to_owned))),
            "{name}: {text}"
        );
    }
    let baggage = outbox::properties::parse(&stored("with-baggage"));
    assert!(
        baggage.contains(&(
            "baggage".to_owned(),
            "user=alice, région=eu\\west".to_owned()
        )),
        "{baggage:?}"
    );
}

#[test]
fn windows_line_ends_read_the_same() {
    let text = stored("two-vendors").replace('\n', "\r\n");
    assert_eq!(
        trace_context(&text).and_then(|(_, state)| state).as_deref(),
        Some("congo=t61rcWkgMzE,rojo=00f067aa0ba902b7")
    );
}
