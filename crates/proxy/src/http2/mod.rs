//! HTTP/2: from clients ([`front`]), to PEs ([`upstream`]; for HTTP/1.1 clients
//! [`from_h1`]) and the limits on what a client may
//! send ([`guard`]). The framing, HPACK and flow control are the `h2` crate's.

pub(crate) mod from_h1;
pub(crate) mod front;
pub(crate) mod guard;
pub(crate) mod upstream;
