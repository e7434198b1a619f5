//! The packet codec against generated input: every packet round-trips, and no byte string —
//! with a right checksum, so that it reaches the chunk parser — makes the decoder panic.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod strategies;

use proptest::prelude::*;
use rserpool_sctp::Packet;
use rserpool_sctp::packet::checksum;
use strategies::chunk;

proptest! {
    #[test]
    fn packets_round_trip(
        ports in any::<(u16, u16)>(),
        tag in any::<u32>(),
        chunks in prop::collection::vec(chunk(), 1..6),
    ) {
        let p = Packet::new(ports.0, ports.1, tag, chunks);
        let wire = p.encode();
        prop_assert_eq!(wire.len() % 4, 0);
        prop_assert_eq!(Packet::decode(&wire).unwrap(), p);
    }

    #[test]
    fn any_bytes_with_a_right_checksum_decode_or_fail_cleanly(
        body in prop::collection::vec(any::<u8>(), 0..200),
    ) {
        let mut p = vec![0u8; 12];
        p.extend_from_slice(&body);
        let sum = checksum(&p);
        p[8..12].copy_from_slice(&sum.to_le_bytes());
        let _ = Packet::decode(&p);
    }

    #[test]
    fn a_chunk_cut_anywhere_is_an_error_not_a_panic(c in chunk(), cut in 0usize..200) {
        let wire = Packet::new(1, 2, 3, vec![c]).encode();
        let cut = cut.min(wire.len());
        let mut p = wire[..cut].to_vec();
        if p.len() >= 12 {
            let sum = checksum(&p);
            p[8..12].copy_from_slice(&sum.to_le_bytes());
        }
        let _ = Packet::decode(&p);
    }
}
