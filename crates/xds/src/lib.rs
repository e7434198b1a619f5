//! The registrar cluster as an xDS control plane.
//!
//! Envoy and gRPC clients that balance by themselves ("proxyless gRPC") learn their upstreams
//! over xDS (the aggregated discovery service, ADS). A registrar already knows every pool, its
//! live PEs and their policy information, and hears of each change; this crate serves that as
//! xDS resources ([`resources`]), to any number of ADS streams ([`ads`]).
#![allow(clippy::module_name_repetitions)]

pub mod ads;
mod delta;
mod limits;
pub mod publish;
pub mod resources;
pub mod snapshot;
mod sotw;
mod stream;
