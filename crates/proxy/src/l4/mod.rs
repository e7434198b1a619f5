//! Layer 4: a client connection carried whole to one PE. TCP mode ([`tcp`]), the byte relay
//! with splice(2) ([`splice`]), and the hand-over of a connection to the eBPF kernel splice
//! (`kernel`, docs/KSPLICE.md). HTTP routes that pin a connection to its PE end here too.

pub(crate) mod kernel;
pub mod splice;
pub mod tcp;
