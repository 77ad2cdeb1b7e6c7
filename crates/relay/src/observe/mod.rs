//! Observation: what the relay counts and shows, and how it logs.

pub mod http;
pub mod logging;
pub mod metrics;
