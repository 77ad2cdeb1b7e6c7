//! The commands users run once.

pub mod replay;
pub mod status;
pub mod verify;
