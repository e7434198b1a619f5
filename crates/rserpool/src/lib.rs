//! The part of the `rserpool` binary that other workspace tools link: the benchmarks
//! (crates/bench) start the same runtime, watch the same signals and date their reports the
//! same way as the subcommands.

pub mod util;
