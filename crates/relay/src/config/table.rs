//! The user's own outbox table: the preset and the column settings become one
//! [`outbox::Mapping`] (docs/own-table.md).
//!
//! # Invariants
//! - TB1 Without any of these settings the mapping is the seed's ([`Mapping::default`]),
//!   so every key, subject and header stays byte-identical.
//! - TB2 A single column setting overrides the preset's column for that role only; every
//!   error names the setting and what it expects.
//! - TB3 Everything that reads or writes the table follows the mapping: streaming,
//!   backfill, verify, replay, marking and retention (their module docs say how); none
//!   reads the seed's columns instead.

use outbox::cloudevents::{self, CloudEvents};
use outbox::mapping::{self, Preset, TraceContext};
use outbox::{Mapping, Role, SubjectTemplate, TableName};

use super::{opt, ConfigError, RawConfig};

/// The mapping the settings describe (TB1, TB2).
pub fn mapping_from(raw: &RawConfig) -> Result<Mapping, ConfigError> {
    let preset = raw.parse(&opt::TABLE_PRESET, Preset::parse)?;
    let mut mapping = preset.mapping();
    let settings = [
        (Role::Id, &opt::ID_COLUMN),
        (Role::EntityId, &opt::ENTITY_ID_COLUMN),
        (Role::EventType, &opt::EVENT_TYPE_COLUMN),
        (Role::Payload, &opt::PAYLOAD_COLUMN),
        (Role::CreatedAt, &opt::CREATED_AT_COLUMN),
    ];
    for (role, spec) in settings {
        if let Some(column) = raw.parse_optional(spec, column_name)? {
            mapping.columns[role as usize] = column;
        }
    }
    if let Some(headers) =
        raw.parse_optional(&opt::HEADER_COLUMNS, mapping::parse_header_columns)?
    {
        mapping.headers = headers;
    }
    if let Some(column) = raw.parse_optional(&opt::TRACE_CONTEXT_COLUMN, |v| {
        if v.is_empty() {
            Ok(None)
        } else {
            column_name(v).map(Some)
        }
    })? {
        mapping.trace_context = column.map(|column| TraceContext {
            column,
            required: true,
        });
    }
    if let Some(template) = raw.parse_optional(&opt::SUBJECT_TEMPLATE, SubjectTemplate::parse)? {
        mapping.template = template;
    }
    if let Some(include) = raw.parse_optional(&opt::INCLUDE_EVENT_TYPES, |v| {
        Ok(mapping::parse_event_types(v))
    })? {
        mapping.filter.include = include;
    }
    if let Some(exclude) = raw.parse_optional(&opt::EXCLUDE_EVENT_TYPES, |v| {
        Ok(mapping::parse_event_types(v))
    })? {
        mapping.filter.exclude = exclude;
    }
    mapping.validate().map_err(|why| {
        ConfigError(format!(
            "the outbox table's mapping ({}, the *_column, header_columns and trace_context_column settings) is invalid: {why}",
            opt::TABLE_PRESET.env
        ))
    })?;
    Ok(mapping)
}

/// The CloudEvents settings (`--cloudevents`, `--cloudevents-source`): `None` when off. A
/// header column may not take an attribute's header name then.
pub fn cloudevents_from(
    raw: &RawConfig,
    database: &str,
    table: &TableName,
    mapping: &Mapping,
) -> Result<Option<CloudEvents>, ConfigError> {
    let source = raw.parse_optional(&opt::CLOUDEVENTS_SOURCE, |v| {
        CloudEvents::new(v).map(|ce| ce.source().to_owned())
    })?;
    if !raw.parse(&opt::CLOUDEVENTS, super::parse_bool)? {
        return Ok(None);
    }
    if let Some(clash) = mapping
        .headers
        .iter()
        .find(|h| cloudevents::is_attribute_header(&h.header))
    {
        return Err(ConfigError(format!(
            "{} maps column {} to header {}, which {} writes (a CloudEvents attribute): name the header otherwise, or leave CloudEvents off",
            opt::HEADER_COLUMNS.how_to_set(),
            clash.column,
            clash.header,
            opt::CLOUDEVENTS.flag()
        )));
    }
    let source =
        source.unwrap_or_else(|| CloudEvents::default_source(database, &table.schema, &table.name));
    CloudEvents::new(source)
        .map(Some)
        .map_err(|why| ConfigError(format!("{}: {why}", opt::CLOUDEVENTS_SOURCE.how_to_set())))
}

impl super::Config {
    /// What shapes every event beside its row: prefix, shard count, subject template,
    /// CloudEvents attributes.
    pub fn shape(&self) -> outbox::event::Shape {
        outbox::event::Shape {
            prefix: self.subject_prefix.clone(),
            partitions: self.partitions,
            template: self.mapping.template.clone(),
            cloudevents: self.cloudevents.clone(),
        }
    }
}

/// A column's name: any non-empty Postgres identifier, as the catalog spells it.
fn column_name(v: &str) -> Result<String, String> {
    if v.is_empty() || v.len() > 63 || v.contains('\0') {
        Err("expected a column name as the catalog spells it (1 to 63 characters)".into())
    } else {
        Ok(v.to_owned())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn mapping(flags: &[(&'static str, &str)]) -> Result<Mapping, ConfigError> {
        crate::config::tests::load(flags, &[("DATABASE_URL", "postgres://u@h/db")], None)
            .map(|c| c.mapping)
    }

    #[test]
    fn no_setting_is_the_seeds_mapping() {
        assert!(mapping(&[]).unwrap().is_default());
    }

    #[test]
    fn a_column_setting_overrides_the_presets() {
        let m = mapping(&[
            ("table_preset", "debezium"),
            ("created_at_column", "occurred_at"),
        ])
        .unwrap();
        assert_eq!(m.column(Role::CreatedAt), "occurred_at");
        assert_eq!(m.column(Role::EntityId), "aggregateid");
        let e = mapping(&[("subject_template", "{shard}")]).unwrap_err();
        assert!(e.0.contains("subject-template"), "{e}");
        let e = mapping(&[("entity_id_column", "id")]).unwrap_err();
        assert!(e.0.contains("column id is mapped both"), "{e}");
    }

    #[test]
    fn cloudevents_take_a_source_and_refuse_a_header_column_of_theirs() {
        let load = |flags: &[(&'static str, &str)]| {
            crate::config::tests::load(flags, &[("DATABASE_URL", "postgres://u@h/app")], None)
                .map(|c| c.cloudevents)
        };
        assert_eq!(load(&[]).unwrap(), None, "off by default");
        let on = load(&[("cloudevents", "true")]).unwrap().unwrap();
        assert_eq!(on.source(), "/app/public/outbox_events");
        let named = load(&[
            ("cloudevents", "true"),
            ("cloudevents_source", "urn:billing"),
        ]);
        assert_eq!(named.unwrap().unwrap().source(), "urn:billing");
        let refusals = [
            (
                ("cloudevents_source", "a b"),
                ["--cloudevents-source", "URI-reference"],
            ),
            (
                ("header_columns", "event_type:Content-Type"),
                ["header Content-Type", "--cloudevents"],
            ),
        ];
        for (setting, named) in refusals {
            let e = load(&[("cloudevents", "true"), setting]).unwrap_err();
            assert!(named.iter().all(|n| e.0.contains(n)), "{e}");
        }
        // Off, a header column may take any name the mapping allows.
        assert!(load(&[("header_columns", "event_type:content-type")]).is_ok());
    }
}
