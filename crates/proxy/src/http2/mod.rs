//! HTTP/2: from clients ([`front`]), to PEs ([`upstream`]) and the limits on what a client may
//! send ([`guard`]). The framing, HPACK and flow control are the `h2` crate's.

pub(crate) mod front;
pub(crate) mod guard;
pub(crate) mod upstream;
