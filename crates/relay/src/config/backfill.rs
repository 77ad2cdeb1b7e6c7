//! Which rows already in the table the backfill at slot creation publishes
//! (`backfill`, `OUTBOX_RELAY_BACKFILL`; the backfill itself is `crate::setup::backfill`).

/// Which rows already in the table are published when the slot is created.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// Rows whose `status` is `'pending'` (none if the table has no `status` column).
    Pending,
    /// Every row.
    All,
    /// None.
    None,
}

impl Mode {
    /// Parses `pending`, `all` or `none`.
    pub fn parse(value: &str) -> std::result::Result<Mode, String> {
        super::parse::one_of(
            value,
            &[
                ("pending", Mode::Pending),
                ("all", Mode::All),
                ("none", Mode::None),
            ],
        )
    }
}
