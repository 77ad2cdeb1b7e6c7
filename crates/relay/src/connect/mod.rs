//! Connecting.
