//! Exact parsing of Postgres' text output for `timestamptz`.
//!
//! The replication session pins `DateStyle=ISO` and `TimeZone=UTC`, so pgoutput renders a
//! `timestamptz` as `YYYY-MM-DD HH:MM:SS[.ffffff]+00` (years may have more than four digits,
//! and dates before year 1 end in ` BC`). Other offsets (`+02`, `+04:30`, `-03:30:15`) are
//! accepted too, so the result does not depend on the session's time zone at all.
//!
//! # Invariants
//! - TS1 Integer arithmetic only: microseconds are exact, and milliseconds are their floor
//!   (`div_euclid`), also before 1970, where the seed's float expression would round
//!   toward zero instead.
//! - TS2 Total: any input yields a value or a [`TimestampError`]; `infinity` is an error (no
//!   key can be derived from it).

/// Microseconds since 1970-01-01 00:00:00 UTC. `i128`, because Postgres' latest
/// timestamp (294276 AD) does not fit an `i64` once shifted from its 2000 epoch to 1970.
pub type UnixMicros = i128;

/// The text is not a finite `timestamptz` in ISO style.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TimestampError {
    /// `infinity` or `-infinity`.
    #[error("created_at is {0}, which has no epoch milliseconds")]
    Infinite(&'static str),
    /// Not in the expected shape.
    #[error("created_at {text:?} is not an ISO timestamptz ({reason})")]
    Malformed {
        /// The offending text (a timestamp, never row payload).
        text: String,
        /// What did not match.
        reason: &'static str,
    },
}

/// The exact floor of `micros / 1000`.
pub fn epoch_millis(micros: UnixMicros) -> i64 {
    // |micros| < 2^63 * 1.01 for every timestamp Postgres accepts, so the milliseconds
    // always fit; saturate rather than wrap if that ever changed.
    i64::try_from(micros.div_euclid(1000)).unwrap_or(if micros < 0 { i64::MIN } else { i64::MAX })
}

/// Parses a `timestamptz` rendered with `DateStyle=ISO` into Unix microseconds: the
/// fields as written ([`Cursor::timestamp`]), then their ranges and the instant they name
/// ([`Fields::unix_micros`]).
pub fn parse_timestamptz(text: &[u8]) -> Result<UnixMicros, TimestampError> {
    match text {
        b"infinity" => return Err(TimestampError::Infinite("infinity")),
        b"-infinity" => return Err(TimestampError::Infinite("-infinity")),
        _ => {}
    }
    let malformed = |reason| TimestampError::Malformed {
        text: String::from_utf8_lossy(&text[..text.len().min(64)]).into_owned(),
        reason,
    };
    let (body, bc) = match text.strip_suffix(b" BC") {
        Some(body) => (body, true),
        None => (text, false),
    };
    let fields = Cursor { text: body, at: 0 }
        .timestamp()
        .map_err(malformed)?;
    fields.unix_micros(bc).map_err(malformed)
}

/// A timestamp's fields as written, not yet checked against the calendar.
struct Fields {
    year: i64,
    month: i64,
    day: i64,
    hour: i64,
    minute: i64,
    second: i64,
    micros: i64,
    /// The UTC offset, signed.
    offset_seconds: i64,
}

impl Fields {
    /// The instant, once the date exists (`bc`: before Christ) and the time is one of a day
    /// (`24:00:00` and a leap second allowed, as Postgres allows them); `Err` names what is
    /// out of range.
    #[inline]
    fn unix_micros(&self, bc: bool) -> Result<UnixMicros, &'static str> {
        let (year, month, day) = (self.year, self.month, self.day);
        let (hour, minute, second, micros) = (self.hour, self.minute, self.second, self.micros);
        if !(1..=12).contains(&month) || day < 1 || day > days_in_month(year, month, bc) {
            return Err("date out of range");
        }
        if hour > 24
            || minute > 59
            || second > 60
            || (hour == 24 && (minute, second, micros) != (0, 0, 0))
        {
            return Err("time out of range");
        }
        // Postgres counts 1 BC as astronomical year 0.
        let astronomical_year = if bc { 1 - year } else { year };
        let days = days_from_civil(astronomical_year, month, day);
        let seconds = days * 86_400 + hour * 3600 + minute * 60 + second - self.offset_seconds;
        Ok(i128::from(seconds) * 1_000_000 + i128::from(micros))
    }
}

struct Cursor<'a> {
    text: &'a [u8],
    at: usize,
}

impl Cursor<'_> {
    /// `YYYY-MM-DD HH:MM:SS[.ffffff]±HH[:MM[:SS]]`, the whole text; `Err` names what did
    /// not match.
    #[inline]
    fn timestamp(&mut self) -> Result<Fields, &'static str> {
        let year = self.number(4, 9).ok_or("year")?;
        self.expect(b'-').ok_or("'-' after year")?;
        let month = self.number(2, 2).ok_or("month")?;
        self.expect(b'-').ok_or("'-' after month")?;
        let day = self.number(2, 2).ok_or("day")?;
        self.expect(b' ').ok_or("' ' after date")?;
        let hour = self.number(2, 2).ok_or("hour")?;
        self.expect(b':').ok_or("':' after hour")?;
        let minute = self.number(2, 2).ok_or("minute")?;
        self.expect(b':').ok_or("':' after minute")?;
        let second = self.number(2, 2).ok_or("second")?;
        let micros = self.fraction()?;
        let offset_seconds = self.offset()?;
        if self.at != self.text.len() {
            return Err("trailing characters");
        }
        Ok(Fields {
            year,
            month,
            day,
            hour,
            minute,
            second,
            micros,
            offset_seconds,
        })
    }

    /// `.f` to `.ffffff` after the seconds, in microseconds (0 when there is none).
    #[inline]
    fn fraction(&mut self) -> Result<i64, &'static str> {
        if self.peek() != Some(b'.') {
            return Ok(0);
        }
        self.at += 1;
        let start = self.at;
        let fraction = self.number(1, 6).ok_or("fraction")?;
        let digits = self.at - start;
        Ok(fraction * 10i64.pow(6 - digits as u32))
    }

    /// `±HH[:MM[:SS]]`, in seconds east of UTC.
    #[inline]
    fn offset(&mut self) -> Result<i64, &'static str> {
        let sign = match self.peek() {
            Some(b'+') => 1,
            Some(b'-') => -1,
            _ => return Err("UTC offset"),
        };
        self.at += 1;
        let mut offset_seconds = self.number(2, 2).ok_or("offset hours")? * 3600;
        if self.peek() == Some(b':') {
            self.at += 1;
            offset_seconds += self.number(2, 2).ok_or("offset minutes")? * 60;
            if self.peek() == Some(b':') {
                self.at += 1;
                offset_seconds += self.number(2, 2).ok_or("offset seconds")?;
            }
        }
        Ok(sign * offset_seconds)
    }

    fn peek(&self) -> Option<u8> {
        self.text.get(self.at).copied()
    }

    fn expect(&mut self, byte: u8) -> Option<()> {
        (self.peek()? == byte).then(|| self.at += 1)
    }

    /// Reads `min..=max` ASCII digits.
    fn number(&mut self, min: usize, max: usize) -> Option<i64> {
        let start = self.at;
        let mut value = 0i64;
        while let Some(digit @ b'0'..=b'9') = self.peek() {
            if self.at - start == max {
                return None;
            }
            value = value * 10 + i64::from(digit - b'0');
            self.at += 1;
        }
        (self.at - start >= min).then_some(value)
    }
}

fn is_leap(year: i64) -> bool {
    (year % 4 == 0 && year % 100 != 0) || year % 400 == 0
}

fn days_in_month(year: i64, month: i64, bc: bool) -> i64 {
    let astronomical = if bc { 1 - year } else { year };
    match month {
        2 if is_leap(astronomical) => 29,
        2 => 28,
        4 | 6 | 9 | 11 => 30,
        _ => 31,
    }
}

/// Days since 1970-01-01 in the proleptic Gregorian calendar (Howard Hinnant's algorithm).
fn days_from_civil(year: i64, month: i64, day: i64) -> i64 {
    let year = if month <= 2 { year - 1 } else { year };
    let era = year.div_euclid(400);
    let year_of_era = year - era * 400;
    let shifted_month = (month + 9) % 12;
    let day_of_year = (153 * shifted_month + 2) / 5 + day - 1;
    let day_of_era = year_of_era * 365 + year_of_era / 4 - year_of_era / 100 + day_of_year;
    era * 146_097 + day_of_era - 719_468
}

/// The civil date (proleptic Gregorian, astronomical years) of a day count since
/// 1970-01-01: [`days_from_civil`] inverted (Howard Hinnant's algorithm).
pub fn civil_from_days(days: i64) -> (i64, i64, i64) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let day_of_era = z - era * 146_097;
    let year_of_era =
        (day_of_era - day_of_era / 1460 + day_of_era / 36_524 - day_of_era / 146_096) / 365;
    let day_of_year = day_of_era - (365 * year_of_era + year_of_era / 4 - year_of_era / 100);
    let shifted_month = (5 * day_of_year + 2) / 153;
    let day = day_of_year - (153 * shifted_month + 2) / 5 + 1;
    let month = if shifted_month < 10 {
        shifted_month + 3
    } else {
        shifted_month - 9
    };
    (year_of_era + era * 400 + i64::from(month <= 2), month, day)
}

/// Unix milliseconds as RFC 3339 in UTC, `2025-01-31T12:34:56.789Z`; `None` for an instant
/// outside the years 0000 to 9999, which RFC 3339 cannot write.
pub fn rfc3339_millis(ms: i64) -> Option<String> {
    let (year, month, day) = civil_from_days(ms.div_euclid(86_400_000));
    let in_day = ms.rem_euclid(86_400_000);
    (0..=9999).contains(&year).then(|| {
        format!(
            "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}.{:03}Z",
            in_day / 3_600_000,
            in_day / 60_000 % 60,
            in_day / 1000 % 60,
            in_day % 1000
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn parses_iso_output() {
        assert_eq!(parse_timestamptz(b"1970-01-01 00:00:00+00"), Ok(0));
        assert_eq!(
            parse_timestamptz(b"2000-01-01 00:00:00+00"),
            Ok(946_684_800_000_000)
        );
        assert_eq!(parse_timestamptz(b"1969-12-31 23:59:59.999999+00"), Ok(-1));
        assert_eq!(
            parse_timestamptz(b"2026-11-30 09:30:42.174849+02"),
            Ok(1_796_023_842_174_849)
        );
        assert_eq!(
            parse_timestamptz(b"2026-11-29 21:00:42.17+04:30"),
            Ok(1_795_969_842_170_000)
        );
        assert_eq!(
            parse_timestamptz(b"2026-11-30 07:30:42.123-00:00:01"),
            Ok(1_796_023_843_123_000)
        );
        // 0001-01-01 BC is astronomical year 0, one leap year before 0001-01-01 AD.
        let ad1 = parse_timestamptz(b"0001-01-01 00:00:00+00").unwrap();
        let bc1 = parse_timestamptz(b"0001-01-01 00:00:00+00 BC").unwrap();
        assert_eq!(ad1 - bc1, 366 * 86_400 * 1_000_000);
        assert!(parse_timestamptz(b"294276-12-31 23:59:59.999999+00").is_ok());
    }

    #[test]
    fn floor_not_truncation() {
        assert_eq!(epoch_millis(-1), -1);
        assert_eq!(epoch_millis(-500), -1);
        assert_eq!(epoch_millis(-1000), -1);
        assert_eq!(epoch_millis(-1001), -2);
        assert_eq!(epoch_millis(999), 0);
    }

    #[test]
    fn rejects_what_is_not_a_finite_iso_timestamptz() {
        assert_eq!(
            parse_timestamptz(b"infinity"),
            Err(TimestampError::Infinite("infinity"))
        );
        assert_eq!(
            parse_timestamptz(b"-infinity"),
            Err(TimestampError::Infinite("-infinity"))
        );
        for bad in [
            &b""[..],
            b"2026-11-30",
            b"2026-11-30 09:30:42",
            b"2026-11-30T09:30:42+00",
            b"2026-13-30 09:30:42+00",
            b"2026-02-29 09:30:42+00",
            b"2026-11-30 09:30:42.1234567+00",
            b"2026-11-30 09:30:42+00 ",
            b"Mon Nov 30 09:30:42 2026 UTC",
            b"30.11.2026 09:30:42+00",
        ] {
            assert!(
                parse_timestamptz(bad).is_err(),
                "{:?} parsed",
                String::from_utf8_lossy(bad)
            );
        }
    }

    proptest! {
        #[test]
        fn total_on_any_input(raw in proptest::collection::vec(any::<u8>(), 0..48)) {
            let _ = parse_timestamptz(&raw);
        }

        #[test]
        fn agrees_with_a_naive_day_count(days in -800_000i64..800_000, micros_of_day in 0i64..86_400_000_000) {
            // Render (days, micros) the way Postgres does, then parse it back.
            let (year, month, day) = civil_from_days(days);
            let secs = micros_of_day / 1_000_000;
            let text = format!(
                "{:04}-{:02}-{:02} {:02}:{:02}:{:02}.{:06}+00{}",
                if year <= 0 { 1 - year } else { year }, month, day,
                secs / 3600, secs / 60 % 60, secs % 60, micros_of_day % 1_000_000,
                if year <= 0 { " BC" } else { "" },
            );
            prop_assert_eq!(parse_timestamptz(text.as_bytes()), Ok(i128::from(days * 86_400_000_000 + micros_of_day)));
        }

        #[test]
        fn rfc3339_round_trips_through_the_parser(ms in -62_135_596_800_000i64..253_402_300_800_000) {
            let text = rfc3339_millis(ms).expect("a year from 0001 to 9999 (Postgres writes 0000 as 1 BC)");
            let postgres = format!("{} {}+00", &text[..10], &text[11..23]);
            prop_assert_eq!(parse_timestamptz(postgres.as_bytes()).map(epoch_millis), Ok(ms));
        }
    }

    #[test]
    fn rfc3339_has_four_digit_years_only() {
        assert_eq!(
            rfc3339_millis(0).as_deref(),
            Some("1970-01-01T00:00:00.000Z")
        );
        assert_eq!(
            rfc3339_millis(951_782_400_001).as_deref(),
            Some("2000-02-29T00:00:00.001Z")
        );
        assert_eq!(
            rfc3339_millis(-1).as_deref(),
            Some("1969-12-31T23:59:59.999Z")
        );
        assert_eq!(rfc3339_millis(253_402_300_800_000), None);
        assert_eq!(rfc3339_millis(-62_167_219_200_001), None);
    }
}
