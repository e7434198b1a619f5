//! Where HTTP/2 frames begin and end in bytes that pass in pieces of any size: the frame
//! headers (RFC 9113 §4.1) as they go by, for the flood guard on what a client sends and for
//! the write coalescing on what the proxy sends.

/// The client connection preface (RFC 9113 §3.4).
pub(crate) const PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";

/// A position in a stream of frames, after an optional connection preface. Small (16 bytes):
/// every HTTP/2 connection holds two.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Frames {
    /// Payload bytes of the current frame still to pass (a length has 24 bits).
    payload: u32,
    /// Preface bytes still to pass (24 at most).
    preface: u8,
    have: u8,
    head: [u8; 9],
}

/// A frame header: the payload's length, the type, the flags.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct FrameHead {
    pub(crate) len: usize,
    pub(crate) kind: u8,
    pub(crate) flags: u8,
}

impl Frames {
    /// Frames after `preface` bytes (the client's connection preface, or none).
    pub(crate) fn after(preface: usize) -> Self {
        debug_assert!(preface <= PREFACE.len());
        Self {
            payload: 0,
            preface: u8::try_from(preface).unwrap_or(u8::MAX),
            have: 0,
            head: [0; 9],
        }
    }

    /// Passes `data`; `on_head` sees every frame header completed in it.
    pub(crate) fn pass(&mut self, mut data: &[u8], mut on_head: impl FnMut(FrameHead)) {
        while !data.is_empty() {
            if self.preface > 0 {
                let n = usize::from(self.preface).min(data.len());
                self.preface -= n as u8;
                data = &data[n..];
                continue;
            }
            if self.payload > 0 {
                let n = (self.payload as usize).min(data.len());
                self.payload -= n as u32;
                data = &data[n..];
                continue;
            }
            let have = usize::from(self.have);
            let n = (9 - have).min(data.len());
            self.head[have..have + n].copy_from_slice(&data[..n]);
            self.have += n as u8;
            data = &data[n..];
            if self.have < 9 {
                return;
            }
            self.have = 0;
            let h = self.head;
            let len = u32::from(h[0]) << 16 | u32::from(h[1]) << 8 | u32::from(h[2]);
            self.payload = len;
            on_head(FrameHead {
                len: len as usize,
                kind: h[3],
                flags: h[4],
            });
        }
    }

    /// Whether what passed so far ends where a frame (or the preface) ends.
    pub(crate) fn at_boundary(&self) -> bool {
        self.preface == 0 && self.have == 0 && self.payload == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_position_is_small() {
        assert_eq!(std::mem::size_of::<Frames>(), 16);
    }

    #[test]
    fn heads_and_boundaries_are_found_wherever_the_pieces_split() {
        // Preface of 3, a frame of 2 payload bytes (type 0, flags 1), an empty frame (type 4).
        let bytes = [
            b'P', b'R', b'I', 0, 0, 2, 0, 1, 0, 0, 0, 1, 7, 7, 0, 0, 0, 4, 0, 0, 0, 0, 0,
        ];
        let ends = [3, 14, 23];
        for size in 1..bytes.len() {
            let mut f = Frames::after(3);
            let mut heads = Vec::new();
            let mut passed = 0;
            for piece in bytes.chunks(size) {
                f.pass(piece, |h| heads.push(h));
                passed += piece.len();
                assert_eq!(f.at_boundary(), ends.contains(&passed), "at {passed}");
            }
            assert_eq!(
                heads,
                [
                    FrameHead {
                        len: 2,
                        kind: 0,
                        flags: 1
                    },
                    FrameHead {
                        len: 0,
                        kind: 4,
                        flags: 0
                    },
                ]
            );
        }
    }
}
