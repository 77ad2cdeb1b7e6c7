//! The log sequence number, Postgres' byte position in the write-ahead log.
//!
//! # Invariants
//! - `Lsn` orders exactly as the server orders positions (a plain `u64` comparison).
//! - `Display` and `FromStr` use the server's `X/X` notation (upper-case hex, no padding),
//!   and round-trip: `s.parse::<Lsn>()?.to_string() == s` for every canonical `s`.

use std::fmt;
use std::str::FromStr;

/// A position in the write-ahead log. `Lsn::ZERO` (`0/0`) is the server's `InvalidXLogRecPtr`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct Lsn(pub u64);

impl Lsn {
    /// `0/0`: "no position"; in `START_REPLICATION` it means "from the slot's confirmed position".
    pub const ZERO: Lsn = Lsn(0);

    /// The raw 64-bit position.
    pub const fn get(self) -> u64 {
        self.0
    }

    /// Bytes of WAL between `self` and a later `other` (0 when `other` is not later).
    pub fn bytes_until(self, other: Lsn) -> u64 {
        other.0.saturating_sub(self.0)
    }
}

impl fmt::Display for Lsn {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:X}/{:X}", self.0 >> 32, self.0 & 0xFFFF_FFFF)
    }
}

/// The text is not an LSN in `X/X` notation.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "invalid LSN {text:?}: expected two hexadecimal numbers separated by '/', like 16/B374D848"
)]
pub struct ParseLsnError {
    text: String,
}

impl FromStr for Lsn {
    type Err = ParseLsnError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let err = || ParseLsnError { text: s.to_owned() };
        let (hi, lo) = s.split_once('/').ok_or_else(err)?;
        let valid = |part: &str| {
            !part.is_empty() && part.len() <= 8 && part.bytes().all(|b| b.is_ascii_hexdigit())
        };
        if !valid(hi) || !valid(lo) {
            return Err(err());
        }
        let hi = u64::from_str_radix(hi, 16).map_err(|_| err())?;
        let lo = u64::from_str_radix(lo, 16).map_err(|_| err())?;
        Ok(Lsn((hi << 32) | lo))
    }
}

impl From<u64> for Lsn {
    fn from(value: u64) -> Self {
        Lsn(value)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn display_uses_server_notation() {
        assert_eq!(Lsn(0).to_string(), "0/0");
        assert_eq!(Lsn(0x16_B374_D848).to_string(), "16/B374D848");
        assert_eq!(Lsn(u64::MAX).to_string(), "FFFFFFFF/FFFFFFFF");
    }

    #[test]
    fn parse_accepts_lower_case_and_rejects_garbage() {
        assert_eq!("16/b374d848".parse::<Lsn>(), Ok(Lsn(0x16_B374_D848)));
        for bad in [
            "",
            "/",
            "1/",
            "/1",
            "1/2/3",
            "g/1",
            "123456789/0",
            "1 /2",
            "-1/0",
        ] {
            assert!(bad.parse::<Lsn>().is_err(), "{bad:?} parsed");
        }
    }

    #[test]
    fn order_is_numeric() {
        assert!("1/0".parse::<Lsn>().unwrap() > "0/FFFFFFFF".parse::<Lsn>().unwrap());
    }

    proptest! {
        #[test]
        fn display_parse_round_trip(raw in any::<u64>()) {
            let lsn = Lsn(raw);
            prop_assert_eq!(lsn.to_string().parse::<Lsn>(), Ok(lsn));
        }
    }
}
