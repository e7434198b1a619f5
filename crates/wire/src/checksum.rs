//! The ENRP PE checksum (RFC 5353 §3.6.2): the RFC 1071 Internet checksum over one block per PE
//! (pool handle zero-padded to a multiple of 4, then the PE identifier).
//!
//! The sum is order-independent, so a registrar keeps an accumulator per owner and adds or
//! subtracts one PE's block sum on every change instead of recomputing over the whole set.

/// The sum of the big-endian 16-bit words of one PE's checksum block, before folding.
pub fn pe_block_sum(pool_handle: &[u8], pe_id: u32) -> u64 {
    handle_sum(pool_handle) + u64::from(pe_id >> 16) + u64::from(pe_id & 0xffff)
}

/// The word sum of a pool handle zero-padded to a multiple of 4 (so it can be cached per pool).
pub fn handle_sum(pool_handle: &[u8]) -> u64 {
    let mut chunks = pool_handle.chunks_exact(2);
    let mut sum: u64 = chunks
        .by_ref()
        .map(|w| u64::from(u16::from_be_bytes([w[0], w[1]])))
        .sum();
    if let [last] = chunks.remainder() {
        sum += u64::from(*last) << 8;
    }
    sum
}

/// Incremental RFC 1071 checksum over a set of PE blocks.
///
/// Keeping the plain (unfolded) 64-bit sum makes removal exact; folding happens only when the
/// 16-bit value is read.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PeChecksum {
    sum: u64,
}

impl PeChecksum {
    pub const fn new() -> Self {
        Self { sum: 0 }
    }

    pub fn add(&mut self, block_sum: u64) {
        self.sum = self.sum.wrapping_add(block_sum);
    }

    pub fn remove(&mut self, block_sum: u64) {
        self.sum = self.sum.wrapping_sub(block_sum);
    }

    /// The 16-bit checksum as sent in the PE Checksum parameter.
    pub fn value(&self) -> u16 {
        let mut s = self.sum;
        while s >> 16 != 0 {
            s = (s & 0xffff) + (s >> 16);
        }
        !(s as u16)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reference_worked_example() {
        let mut c = PeChecksum::new();
        assert_eq!(c.value(), 0xffff, "empty set");
        c.add(pe_block_sum(b"EchoPool", 0x1234_5678));
        assert_eq!(c.value(), 0x29a5);
        c.remove(pe_block_sum(b"EchoPool", 0x1234_5678));
        assert_eq!(c.value(), 0xffff);
    }

    /// The incremental value equals RFC 1071 computed over the concatenated blocks.
    #[test]
    fn matches_rfc1071_over_concatenation() {
        fn rfc1071(data: &[u8]) -> u16 {
            let mut sum: u32 = 0;
            for w in data.chunks(2) {
                let word = if w.len() == 2 {
                    u16::from_be_bytes([w[0], w[1]])
                } else {
                    u16::from(w[0]) << 8
                };
                sum += u32::from(word);
                sum = (sum & 0xffff) + (sum >> 16);
            }
            !(sum as u16)
        }
        let pes: [(&[u8], u32); 4] = [
            (b"a", 1),
            (b"abcde", 0xffff_ffff),
            (b"EchoPool", 0x1234_5678),
            (b"xyz", 0x8000_0001),
        ];
        let mut concat = Vec::new();
        let mut c = PeChecksum::new();
        for (h, id) in pes {
            concat.extend_from_slice(h);
            concat.resize(concat.len().next_multiple_of(4), 0);
            concat.extend_from_slice(&id.to_be_bytes());
            c.add(pe_block_sum(h, id));
        }
        assert_eq!(c.value(), rfc1071(&concat));
    }
}
