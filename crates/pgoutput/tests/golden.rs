//! Decodes pgoutput v1 messages captured from a real PostgreSQL 15 (see
//! `fixtures/capture.sh`) and checks every decoded field.
//!
//! LSNs, xids, OIDs and clock-derived values differ between captures, so they are checked
//! through their relations (Begin.final_lsn == Commit.commit_lsn, Insert.rel_id ==
//! Relation.rel_id, created_at close to the commit time, ...); everything the scenario
//! determines (row values, column names and types, jsonb text, ...) is checked exactly.

use std::collections::{HashMap, HashSet};

use bytes::Bytes;
use pgoutput::logical::{
    Column, ColumnValue, LogicalMessage, OldTuple, Relation, TupleData, REPLICA_IDENTITY_DEFAULT,
    REPLICA_IDENTITY_FULL,
};
use pgoutput::{Lsn, PgTimestamp};

/// One captured message: the LSN the server reported for it, its bytes, and its decoding.
struct Captured {
    lsn: Lsn,
    raw: Bytes,
    msg: LogicalMessage,
}

fn load(name: &str, text: &str) -> Vec<Captured> {
    text.lines()
        .filter(|line| !line.starts_with('#') && !line.trim().is_empty())
        .map(|line| {
            let (lsn, hex) = line
                .split_once(' ')
                .unwrap_or_else(|| panic!("{name}: bad line {line:?}"));
            let raw = Bytes::from(hex::decode(hex).expect("hex"));
            let msg = LogicalMessage::decode(raw.clone())
                .unwrap_or_else(|e| panic!("{name}: {lsn}: {e}"));
            Captured {
                lsn: lsn.parse().expect("lsn"),
                raw,
                msg,
            }
        })
        .collect()
}

macro_rules! fixture {
    ($name:literal) => {
        load($name, include_str!(concat!("fixtures/", $name, ".hex")))
    };
}

fn all_fixtures() -> Vec<(&'static str, Vec<Captured>)> {
    vec![
        ("01_insert_single", fixture!("01_insert_single")),
        ("02_insert_multi", fixture!("02_insert_multi")),
        ("03_update", fixture!("03_update")),
        ("04_delete", fixture!("04_delete")),
        ("05_message", fixture!("05_message")),
        ("06_unicode", fixture!("06_unicode")),
        ("07_toast", fixture!("07_toast")),
        ("08_origin", fixture!("08_origin")),
        ("09_truncate", fixture!("09_truncate")),
        ("10_binary", fixture!("10_binary")),
    ]
}

// ---- shape of the captured schema ---------------------------------------------------------

const INT4: u32 = 23;
const INT8: u32 = 20;
const TEXT: u32 = 25;
const VARCHAR: u32 = 1043;
const NUMERIC: u32 = 1700;
const JSONB: u32 = 3802;
const TIMESTAMPTZ: u32 = 1184;
/// The first OID the server hands out to user objects.
const FIRST_NORMAL_OBJECT_ID: u32 = 16_384;

const OUTBOX_COLUMNS: [(&str, u32); 12] = [
    ("id", INT8),
    ("entity_id", TEXT),
    ("event_type", TEXT),
    ("dedupe_key", TEXT),
    ("partition_key", TEXT),
    ("ordering_key", TEXT),
    ("payload", JSONB),
    ("status", TEXT),
    ("attempts", INT4),
    ("last_error", TEXT),
    ("created_at", TIMESTAMPTZ),
    ("published_at", TIMESTAMPTZ),
];
const CREATED_AT: usize = 10;

fn assert_outbox_relation(r: &Relation) {
    assert_eq!(
        (r.namespace.as_str(), r.name.as_str()),
        ("public", "outbox_events")
    );
    assert!(r.rel_id >= FIRST_NORMAL_OBJECT_ID);
    assert_eq!(r.replica_identity, REPLICA_IDENTITY_DEFAULT);
    let expected: Vec<Column> = OUTBOX_COLUMNS
        .iter()
        .map(|&(name, type_oid)| Column {
            flags: u8::from(name == "id"), // the primary key is the replica identity
            name: name.to_owned(),
            type_oid,
            type_modifier: -1,
        })
        .collect();
    assert_eq!(r.columns, expected);
    assert!(r.columns[0].is_key() && r.columns[1..].iter().all(|c| !c.is_key()));
}

/// `other_table (id int primary key, feeling mood, label varchar(20), amount numeric(10,2))`
/// with `REPLICA IDENTITY FULL`.
fn assert_other_relation(r: &Relation, mood_oid: u32) {
    assert_eq!(
        (r.namespace.as_str(), r.name.as_str()),
        ("public", "other_table")
    );
    assert_eq!(r.replica_identity, REPLICA_IDENTITY_FULL);
    let column = |name: &str, type_oid, type_modifier| Column {
        flags: 1, // with REPLICA IDENTITY FULL every column is flagged as key
        name: name.to_owned(),
        type_oid,
        type_modifier,
    };
    assert_eq!(
        r.columns,
        vec![
            column("id", INT4, -1),
            column("feeling", mood_oid, -1),
            column("label", VARCHAR, 20 + 4), // VARHDRSZ + length
            column("amount", NUMERIC, ((10 << 16) | 2) + 4), // precision 10, scale 2
        ]
    );
}

// ---- structure every capture must have ----------------------------------------------------

/// What [`check_stream`] learned from one file.
#[derive(Default)]
struct Stream {
    relations: HashMap<u32, Relation>,
    types: HashMap<u32, String>,
    xids: Vec<u32>,
    commit_times: Vec<PgTimestamp>,
}

/// Transactions are well formed and every reference resolves:
/// - `Begin` .. `Commit` pair up: `final_lsn == commit_lsn`, same commit time,
///   `end_lsn > commit_lsn`, and the server reports the Commit at its `end_lsn`;
/// - `Origin` only right after `Begin`; changes only inside a transaction;
/// - a `Type` precedes the `Relation` that uses it; a `Relation` precedes the changes that
///   reference it, and every tuple has exactly its relation's column count;
/// - reported LSNs never go backwards; column values are slices of the message bytes.
fn check_stream(name: &str, messages: &[Captured]) -> Stream {
    let mut s = Stream::default();
    let mut open: Option<(pgoutput::logical::Begin, Lsn)> = None;
    let mut previous = None;
    let mut last_lsn = Lsn::ZERO;
    for (i, c) in messages.iter().enumerate() {
        assert!(c.lsn >= last_lsn, "{name}[{i}]: LSN went backwards");
        last_lsn = c.lsn;
        let tuples: Vec<(u32, &TupleData)> = match &c.msg {
            LogicalMessage::Begin(b) => {
                assert!(open.is_none(), "{name}[{i}]: nested Begin");
                assert!(
                    c.lsn <= b.final_lsn,
                    "{name}[{i}]: Begin reported after its commit"
                );
                s.xids.push(b.xid);
                open = Some((*b, c.lsn));
                vec![]
            }
            LogicalMessage::Commit(commit) => {
                let (begin, _) = open.take().expect("Commit without Begin");
                assert_eq!(commit.flags, 0);
                assert_eq!(begin.final_lsn, commit.commit_lsn, "{name}[{i}]");
                assert_eq!(begin.commit_time, commit.commit_time, "{name}[{i}]");
                assert!(commit.end_lsn > commit.commit_lsn, "{name}[{i}]");
                assert_eq!(
                    c.lsn, commit.end_lsn,
                    "{name}[{i}]: Commit reported at end_lsn"
                );
                s.commit_times.push(commit.commit_time);
                vec![]
            }
            LogicalMessage::Origin(_) => {
                assert!(
                    matches!(previous, Some(LogicalMessage::Begin(_))),
                    "{name}[{i}]: Origin not right after Begin"
                );
                vec![]
            }
            LogicalMessage::Type(t) => {
                assert!(
                    t.type_oid >= FIRST_NORMAL_OBJECT_ID,
                    "builtin types are not sent"
                );
                s.types.insert(t.type_oid, t.name.clone());
                vec![]
            }
            LogicalMessage::Relation(r) => {
                for col in &r.columns {
                    assert!(
                        col.type_oid < FIRST_NORMAL_OBJECT_ID
                            || s.types.contains_key(&col.type_oid),
                        "{name}[{i}]: column {} of unannounced type {}",
                        col.name,
                        col.type_oid
                    );
                }
                s.relations.insert(r.rel_id, r.clone());
                vec![]
            }
            LogicalMessage::Insert(ins) => vec![(ins.rel_id, &ins.new_tuple)],
            LogicalMessage::Update(u) => {
                let mut t = vec![(u.rel_id, &u.new_tuple)];
                t.extend(u.old_tuple.as_ref().map(|o| (u.rel_id, o.tuple())));
                t
            }
            LogicalMessage::Delete(d) => vec![(d.rel_id, d.old_tuple.tuple())],
            LogicalMessage::Truncate(t) => {
                for id in &t.rel_ids {
                    assert!(
                        s.relations.contains_key(id),
                        "{name}[{i}]: unknown relation"
                    );
                }
                vec![]
            }
            LogicalMessage::Message(m) => {
                assert_eq!(
                    m.lsn, c.lsn,
                    "{name}[{i}]: a message is reported at its own LSN"
                );
                assert_eq!(m.transactional(), open.is_some(), "{name}[{i}]");
                assert_slice_of(&m.content, &c.raw);
                vec![]
            }
        };
        if matches!(
            c.msg,
            LogicalMessage::Insert(_)
                | LogicalMessage::Update(_)
                | LogicalMessage::Delete(_)
                | LogicalMessage::Truncate(_)
        ) {
            assert!(open.is_some(), "{name}[{i}]: change outside a transaction");
        }
        for (rel_id, tuple) in tuples {
            let rel = s
                .relations
                .get(&rel_id)
                .unwrap_or_else(|| panic!("{name}[{i}]: change before its Relation"));
            assert_eq!(tuple.len(), rel.columns.len(), "{name}[{i}]");
            assert_eq!(tuple.iter().len(), tuple.len());
            for value in tuple {
                if let ColumnValue::Text(v) | ColumnValue::Binary(v) = value {
                    assert_slice_of(&v, &c.raw);
                }
            }
        }
        previous = Some(c.msg.clone());
    }
    assert!(open.is_none(), "{name}: transaction left open");
    s
}

fn assert_slice_of(part: &Bytes, whole: &Bytes) {
    if part.is_empty() {
        return;
    }
    let range = whole.as_ptr_range();
    assert!(
        range.contains(&part.as_ptr()) && part.as_ptr_range().end <= range.end,
        "not a zero-copy slice of the message"
    );
}

// ---- value helpers --------------------------------------------------------------------------

fn text(v: &ColumnValue) -> &str {
    match v {
        ColumnValue::Text(b) => std::str::from_utf8(b).expect("UTF-8"),
        other => panic!("expected a text value, got {other:?}"),
    }
}

/// A row as strings, `None` for NULL (fails on `u` and `b`).
fn row(t: &TupleData) -> Vec<Option<String>> {
    t.iter()
        .map(|v| match v {
            ColumnValue::Null => None,
            v => Some(text(&v).to_owned()),
        })
        .collect()
}

fn some(values: &[&str]) -> Vec<Option<String>> {
    values.iter().map(|v| Some((*v).to_owned())).collect()
}

fn messages(c: &[Captured]) -> Vec<&LogicalMessage> {
    c.iter().map(|c| &c.msg).collect()
}

/// Days from 1970-01-01 to the civil date (proleptic Gregorian).
fn days_from_civil(y: i64, m: i64, d: i64) -> i64 {
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let doy = (153 * (m + if m > 2 { -3 } else { 9 }) + 2) / 5 + d - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

/// Parses the server's `timestamptz` text output under `TimeZone=UTC, DateStyle=ISO`
/// (`2026-01-02 03:04:05.678901+00`, fraction optional and without trailing zeros) into a
/// [`PgTimestamp`]. Panics on anything else: the format is part of what is asserted.
fn parse_utc_timestamp(s: &str) -> PgTimestamp {
    let body = s
        .strip_suffix("+00")
        .unwrap_or_else(|| panic!("{s:?}: not UTC"));
    let (date, time) = body.split_once(' ').expect("date and time");
    let (time, fraction) = time.split_once('.').unwrap_or((time, ""));
    let numbers = |s: &str, sep| -> Vec<i64> {
        s.split(sep)
            .map(|n| {
                assert!(
                    !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()),
                    "{s:?}"
                );
                n.parse().expect("number")
            })
            .collect()
    };
    let (d, t) = (numbers(date, '-'), numbers(time, ':'));
    assert_eq!(
        (d.len(), t.len(), date.len(), time.len()),
        (3, 3, 10, 8),
        "{s:?}"
    );
    assert!(
        fraction.len() <= 6 && !fraction.ends_with('0'),
        "{s:?}: fraction"
    );
    let micros = if fraction.is_empty() {
        0
    } else {
        numbers(fraction, '.')[0]
            * 10_i64.pow(6 - u32::try_from(fraction.len()).expect("at most 6 digits"))
    };
    let days = days_from_civil(d[0], d[1], d[2]) - days_from_civil(2000, 1, 1);
    ((days * 24 + t[0]) * 60 + t[1]) * 60_000_000 + t[2] * 1_000_000 + micros
}

/// `created_at` is `now()`: the transaction's start, shortly before its commit.
fn assert_created_before_commit(created_at: &ColumnValue, commit_time: PgTimestamp) {
    let created = parse_utc_timestamp(text(created_at));
    assert!(
        created <= commit_time && commit_time - created < 60_000_000,
        "created_at {created} vs commit {commit_time}"
    );
}

// ---- the scenarios --------------------------------------------------------------------------

#[test]
fn timestamp_parser_matches_the_server_epoch() {
    assert_eq!(parse_utc_timestamp("2000-01-01 00:00:00+00"), 0);
    assert_eq!(parse_utc_timestamp("2000-01-01 00:00:01+00"), 1_000_000);
    assert_eq!(
        parse_utc_timestamp("2026-01-01 00:00:00+00"),
        820_540_800_000_000
    );
    assert_eq!(
        parse_utc_timestamp("2026-01-02 03:04:05.678901+00")
            - parse_utc_timestamp("2026-01-02 03:04:05.6789+00"),
        1
    );
}

#[test]
fn every_fixture_is_well_formed_and_consistent_across_files() {
    let mut outbox_ids = HashSet::new();
    let mut xids = Vec::new();
    for (name, fixture) in all_fixtures() {
        assert!(!fixture.is_empty(), "{name} is empty");
        let s = check_stream(name, &fixture);
        for r in s.relations.values() {
            if r.name == "outbox_events" {
                assert_outbox_relation(r);
                outbox_ids.insert(r.rel_id);
            }
        }
        xids.extend(s.xids);
    }
    assert_eq!(outbox_ids.len(), 1, "one table, one OID, in every file");
    assert!(
        xids.windows(2).all(|w| w[0] < w[1]),
        "scenarios ran in order"
    );
}

#[test]
fn single_insert() {
    let f = fixture!("01_insert_single");
    let s = check_stream("01", &f);
    let [LogicalMessage::Begin(_), LogicalMessage::Relation(rel), LogicalMessage::Insert(ins), LogicalMessage::Commit(commit)] =
        messages(&f)[..]
    else {
        panic!("unexpected sequence {:?}", messages(&f))
    };
    assert_outbox_relation(rel);
    assert_eq!(ins.rel_id, rel.rel_id);
    let values = row(&ins.new_tuple);
    assert_eq!(
        values[..CREATED_AT],
        [
            some(&[
                "1",
                "order-42",
                "order.created",
                "order-42:created",
                "p-7",
                "order-42",
                // jsonb renders normalized: keys by length then bytes, ", " and ": ".
                r#"{"amount": "9.99", "currency": "EUR", "order_id": 42}"#,
                "pending",
                "0",
            ]),
            vec![None], // last_error
        ]
        .concat()[..]
    );
    assert_eq!(ins.new_tuple.get(11), Some(ColumnValue::Null)); // published_at
    assert_created_before_commit(&ins.new_tuple.get(CREATED_AT).unwrap(), commit.commit_time);
    assert_eq!(s.commit_times, [commit.commit_time]);
}

#[test]
fn multi_row_transaction_with_enum_type() {
    let f = fixture!("02_insert_multi");
    check_stream("02", &f);
    let [LogicalMessage::Begin(begin), LogicalMessage::Relation(outbox), LogicalMessage::Insert(a), LogicalMessage::Insert(b), LogicalMessage::Type(mood), LogicalMessage::Relation(other), LogicalMessage::Insert(c), LogicalMessage::Commit(commit)] =
        messages(&f)[..]
    else {
        panic!("unexpected sequence {:?}", messages(&f))
    };
    assert_eq!(begin.final_lsn, commit.commit_lsn);
    assert_outbox_relation(outbox);
    assert_eq!(
        (mood.namespace.as_str(), mood.name.as_str()),
        ("public", "mood")
    );
    assert_other_relation(other, mood.type_oid);
    assert_eq!(
        (a.rel_id, b.rel_id, c.rel_id),
        (outbox.rel_id, outbox.rel_id, other.rel_id)
    );
    // Three changes, three distinct reported LSNs, all before the commit record.
    assert!(f[2].lsn < f[3].lsn && f[3].lsn < f[6].lsn && f[6].lsn < commit.commit_lsn);

    let mut ra = row(&a.new_tuple);
    let mut rb = row(&b.new_tuple);
    // now() is the transaction start: both rows share created_at.
    assert_eq!(ra[CREATED_AT], rb[CREATED_AT]);
    assert_created_before_commit(&a.new_tuple.get(CREATED_AT).unwrap(), commit.commit_time);
    ra.remove(CREATED_AT);
    rb.remove(CREATED_AT);
    assert_eq!(
        ra,
        some(&[
            "2",
            "order-43",
            "order.created",
            "order-43:created",
            "p-1",
            "order-43",
            r#"{"n": 1}"#,
            "failed",
            "3",
            "boom",
            "2026-01-02 03:04:05.678901+00",
        ])
    );
    assert_eq!(
        rb,
        [
            some(&[
                "3",
                "order-44",
                "order.paid",
                "order-44:paid",
                "p-2",
                "order-44",
                "[1, 2, 3]",
                "pending",
                "0"
            ]),
            vec![None, None]
        ]
        .concat()
    );
    assert_eq!(row(&c.new_tuple), some(&["1", "happy", "hello", "12.50"]));
}

#[test]
fn updates_without_old_tuple_with_key_and_with_full_row() {
    let f = fixture!("03_update");
    let s = check_stream("03", &f);
    assert_eq!(s.xids.len(), 3);
    let updates: Vec<_> = messages(&f)
        .into_iter()
        .filter_map(|m| match m {
            LogicalMessage::Update(u) => Some(u),
            _ => None,
        })
        .collect();
    let [plain, key_change, full] = updates[..] else {
        panic!("expected three updates")
    };

    // Key unchanged under REPLICA IDENTITY DEFAULT: no old tuple.
    assert_eq!(plain.old_tuple, None);
    let new = row(&plain.new_tuple);
    assert_eq!(new[0].as_deref(), Some("1"));
    assert_eq!(new[7].as_deref(), Some("published"));
    assert_eq!(new[8].as_deref(), Some("1"));
    assert_eq!(new[9], None);
    // No fractional part when it is zero.
    assert_eq!(new[11].as_deref(), Some("2026-01-02 03:04:06+00"));

    // Key changed: the old key, with every non-key column null.
    let Some(OldTuple::Key(old)) = &key_change.old_tuple else {
        panic!("expected a K tuple, got {:?}", key_change.old_tuple)
    };
    assert_eq!(old.len(), OUTBOX_COLUMNS.len());
    assert_eq!([some(&["2"]), vec![None; 11]].concat(), row(old));
    let new = row(&key_change.new_tuple);
    assert_eq!(new[0].as_deref(), Some("100"));
    assert_eq!(new[1].as_deref(), Some("order-43"));

    // REPLICA IDENTITY FULL: the whole old row.
    let Some(OldTuple::Full(old)) = &full.old_tuple else {
        panic!("expected an O tuple, got {:?}", full.old_tuple)
    };
    assert_eq!(row(old), some(&["1", "happy", "hello", "12.50"]));
    assert_eq!(row(&full.new_tuple), some(&["1", "happy", "bye", "12.50"]));
    assert_eq!(s.relations[&full.rel_id].name, "other_table");
}

#[test]
fn deletes_with_key_and_full_row() {
    let f = fixture!("04_delete");
    let s = check_stream("04", &f);
    let deletes: Vec<_> = messages(&f)
        .into_iter()
        .filter_map(|m| match m {
            LogicalMessage::Delete(d) => Some(d),
            _ => None,
        })
        .collect();
    let [outbox, other] = deletes[..] else {
        panic!("expected two deletes")
    };
    assert_eq!(s.relations[&outbox.rel_id].name, "outbox_events");
    let OldTuple::Key(key) = &outbox.old_tuple else {
        panic!("expected K")
    };
    assert_eq!(row(key), [some(&["100"]), vec![None; 11]].concat());
    let OldTuple::Full(full) = &other.old_tuple else {
        panic!("expected O")
    };
    assert_eq!(row(full), some(&["1", "happy", "bye", "12.50"]));
    assert_eq!(s.xids.len(), 2);
}

#[test]
fn logical_decoding_messages() {
    let f = fixture!("05_message");
    check_stream("05", &f);
    let [LogicalMessage::Begin(begin), LogicalMessage::Message(m1), LogicalMessage::Message(m2), LogicalMessage::Commit(commit), LogicalMessage::Message(m3)] =
        messages(&f)[..]
    else {
        panic!("unexpected sequence {:?}", messages(&f))
    };
    assert_eq!(begin.final_lsn, commit.commit_lsn);
    assert!(m1.transactional() && m2.transactional() && !m3.transactional());
    assert_eq!((m1.flags, m3.flags), (1, 0));
    assert_eq!(
        (m1.prefix.as_str(), &m1.content[..]),
        ("prefix", &b"content"[..])
    );
    assert_eq!(
        (m2.prefix.as_str(), &m2.content[..]),
        ("bin", &b"\x00\xff"[..])
    );
    assert_eq!(
        (m3.prefix.as_str(), &m3.content[..]),
        ("prefix", &b"non-transactional"[..])
    );
    // A message's LSN is the end of its WAL record (what pg_logical_emit_message returns):
    // inside the transaction, before its commit record starts; the non-transactional one
    // was emitted after the commit.
    assert!(m1.lsn < m2.lsn && m2.lsn <= commit.commit_lsn);
    assert!(m3.lsn > commit.end_lsn);
}

#[test]
fn unicode_text_and_jsonb() {
    let f = fixture!("06_unicode");
    check_stream("06", &f);
    let LogicalMessage::Insert(ins) = &f[2].msg else {
        panic!("expected Insert, got {:?}", f[2].msg)
    };
    let values = row(&ins.new_tuple);
    assert_eq!(
        values[..7],
        some(&[
            "4",
            "Zürich-東京-🚀",
            "entity.renamed",
            "Zürich-東京-🚀:renamed",
            "p-ü",
            "Zürich-東京-🚀",
            r#"{"emoji": "🚀", "greeting": "grüß dich"}"#,
        ])[..]
    );
    // Text values are raw UTF-8 bytes, not escaped.
    assert_eq!(
        ins.new_tuple.get(1),
        Some(ColumnValue::Text(Bytes::from_static(
            b"Z\xc3\xbcrich-\xe6\x9d\xb1\xe4\xba\xac-\xf0\x9f\x9a\x80"
        )))
    );
}

#[test]
fn toasted_payload_then_unchanged_toast() {
    let f = fixture!("07_toast");
    let s = check_stream("07", &f);
    assert_eq!(s.xids.len(), 2);
    let [LogicalMessage::Begin(_), LogicalMessage::Relation(_), LogicalMessage::Insert(ins), LogicalMessage::Commit(_), LogicalMessage::Begin(_), LogicalMessage::Update(upd), LogicalMessage::Commit(_)] =
        messages(&f)[..]
    else {
        panic!("unexpected sequence {:?}", messages(&f))
    };

    // The insert carries the whole (detoasted) value: {"blob": md5(1) || ... || md5(512)}.
    let payload = text(&ins.new_tuple.get(6).unwrap()).to_owned();
    let blob = payload
        .strip_prefix(r#"{"blob": ""#)
        .and_then(|p| p.strip_suffix(r#""}"#))
        .expect("payload shape");
    assert_eq!(blob.len(), 512 * 32);
    assert!(blob.bytes().all(|b| b.is_ascii_hexdigit()));
    assert!(blob.starts_with("c4ca4238a0b923820dcc509a6f75849bc81e728d9d4c2f636f067f89cc14862c"));
    assert!(f[2].raw.len() > 16 * 1024);

    // The update leaves the payload alone: it is 'u', everything else is sent.
    assert_eq!(upd.old_tuple, None);
    assert_eq!(upd.rel_id, ins.rel_id);
    let mut before: Vec<ColumnValue> = ins.new_tuple.iter().collect();
    let after: Vec<ColumnValue> = upd.new_tuple.iter().collect();
    assert_eq!(after[6], ColumnValue::UnchangedToast);
    assert_eq!(text(&after[7]), "published");
    before[6] = ColumnValue::UnchangedToast;
    before[7] = after[7].clone();
    assert_eq!(before, after);
    assert!(f[5].raw.len() < 512, "the unchanged value is not resent");
}

#[test]
fn replication_origin() {
    let f = fixture!("08_origin");
    check_stream("08", &f);
    let [LogicalMessage::Begin(begin), LogicalMessage::Origin(origin), LogicalMessage::Relation(_), LogicalMessage::Insert(ins), LogicalMessage::Commit(commit)] =
        messages(&f)[..]
    else {
        panic!("unexpected sequence {:?}", messages(&f))
    };
    assert_eq!(origin.name, "upstream_node");
    // The origin's LSN from pg_replication_origin_xact_setup, not a local position.
    assert_eq!(origin.commit_lsn, "0/ABCDEF01".parse::<Lsn>().unwrap());
    // ... and the commit time is the origin's timestamp (2026-01-01 00:00:00 UTC), not ours.
    let origin_time = parse_utc_timestamp("2026-01-01 00:00:00+00");
    assert_eq!(
        (begin.commit_time, commit.commit_time),
        (origin_time, origin_time)
    );
    assert_eq!(text(&ins.new_tuple.get(0).unwrap()), "6");
    assert_eq!(text(&ins.new_tuple.get(6).unwrap()), "{}");
}

#[test]
fn truncate_both_tables() {
    let f = fixture!("09_truncate");
    check_stream("09", &f);
    let [LogicalMessage::Begin(_), LogicalMessage::Relation(outbox), LogicalMessage::Type(mood), LogicalMessage::Relation(other), LogicalMessage::Truncate(t), LogicalMessage::Commit(_)] =
        messages(&f)[..]
    else {
        panic!("unexpected sequence {:?}", messages(&f))
    };
    assert_outbox_relation(outbox);
    assert_other_relation(other, mood.type_oid);
    assert!(t.cascade() && t.restart_identity());
    assert_eq!(t.options, 3);
    assert_eq!(t.rel_ids, [outbox.rel_id, other.rel_id]);
}

#[test]
fn binary_mode_values() {
    let f = fixture!("10_binary");
    check_stream("10", &f);
    let [LogicalMessage::Begin(_), LogicalMessage::Relation(outbox), LogicalMessage::Insert(a), LogicalMessage::Type(mood), LogicalMessage::Relation(other), LogicalMessage::Insert(b), LogicalMessage::Commit(commit)] =
        messages(&f)[..]
    else {
        panic!("unexpected sequence {:?}", messages(&f))
    };
    assert_outbox_relation(outbox);
    assert_other_relation(other, mood.type_oid);
    let bin = |v: &[u8]| ColumnValue::Binary(Bytes::copy_from_slice(v));
    let va: Vec<ColumnValue> = a.new_tuple.iter().collect();
    let expected = [
        bin(&1i64.to_be_bytes()), // bigserial restarted by TRUNCATE ... RESTART IDENTITY
        bin(b"order-46"),
        bin(b"order.created"),
        bin(b"order-46:created"),
        bin(b"p-4"),
        bin(b"order-46"),
        bin(b"\x01{\"k\": \"v\"}"), // jsonb binary: version byte 1, then the text
        bin(b"pending"),
        bin(&0i32.to_be_bytes()),
        ColumnValue::Null,
    ];
    assert_eq!(va[..CREATED_AT], expected);
    // timestamptz binary is the PgTimestamp itself: microseconds since 2000-01-01 UTC.
    let ColumnValue::Binary(created) = &va[CREATED_AT] else {
        panic!("created_at not binary")
    };
    let created = i64::from_be_bytes(created[..].try_into().expect("8 bytes"));
    assert!(created <= commit.commit_time && commit.commit_time - created < 60_000_000);
    assert_eq!(va[11], bin(&1_000_000i64.to_be_bytes())); // 2000-01-01 00:00:01+00

    // numeric -3.25: ndigits 2, weight 0, sign NEG (0x4000), dscale 2, base-10000 digits 3, 2500.
    let numeric = [0u8, 2, 0, 0, 0x40, 0, 0, 2, 0, 3, 0x09, 0xC4];
    assert_eq!(
        b.new_tuple.iter().collect::<Vec<_>>(),
        [
            bin(&2i32.to_be_bytes()),
            bin(b"sad"), // an enum's binary form is its label
            ColumnValue::Null,
            bin(&numeric),
        ]
    );
}
