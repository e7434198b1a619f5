//! The RSerPool registrar (RFC 5351/5352, and ENRP, RFC 5353, between registrars).
//!
//! [`core::Registrar`] is the protocol logic, sans-IO: events and time in, [`core::Action`]s
//! and a timer out. [`driver`] runs it over sockets (one mio event loop). [`config::Config`]
//! holds every setting with rsplib's defaults; [`status::Status`] is what `rserpool status`
//! shows.

pub mod config;
pub mod core;
pub mod driver;
pub mod status;

pub use config::{Config, ConfigFlags, DEFAULT_STATUS, StatusListen};
pub use core::{Action, ConnId, Instant, Registrar};
pub use driver::{Inherited, Observer, RegistrarThread, Server, StopHandle, XdsCounterSource};
pub use status::{Status, XdsCounters};
