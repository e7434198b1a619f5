//! HTTP/2 from clients ([`front`]), one stream each ([`stream`]), with limits on what a client
//! may send ([`guard`]); WebSocket over HTTP/2 ([`tunnel`]); a stream's DATA taken as it
//! comes, for the relays of either side ([`inflow`]); frames written together
//! ([`coalesce`]), their boundaries found in passing bytes ([`frames`]). The framing, HPACK
//! and flow control are the `h2` crate's; the PE side is `crate::http::upstream`.

pub(crate) mod coalesce;
pub(crate) mod frames;
pub(crate) mod front;
pub(crate) mod guard;
pub(crate) mod inflow;
pub(crate) mod stream;
pub(crate) mod tunnel;
