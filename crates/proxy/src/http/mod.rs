//! HTTP: requests from HTTP/1.1 clients ([`h1`]) and HTTP/2 clients (`h2`), each routed,
//! classified, admitted and sent to a PE, over HTTP/1.1 or HTTP/2, with failover. The HTTP/1.1
//! message codec is [`message`]; [`client`] is a small HTTP/1.1 client for tests and
//! benchmarks.

pub mod client;
pub(crate) mod client_stream;
pub(crate) mod downstream;
pub mod h1;
#[cfg(test)]
mod h1_tests;
pub(crate) mod h2;
pub mod message;
pub(crate) mod park;
pub(crate) mod pipeline;
#[cfg(test)]
mod pipeline_tests;
pub(crate) mod rejected;
pub(crate) mod request;
#[cfg(test)]
mod testbed;
pub(crate) mod upstream;
