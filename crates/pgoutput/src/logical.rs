//! pgoutput v1 logical messages (filled in next).
