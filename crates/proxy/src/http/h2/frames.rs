//! Where HTTP/2 frames begin and end in bytes that pass in pieces of any size: the frame
//! headers (RFC 9113 §4.1) as they go by, for the flood guard on what a client sends and for
//! the write coalescing on what the proxy sends.

/// A position in a stream of frames, after an optional connection preface.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Frames {
    /// Preface bytes still to pass.
    preface: usize,
    head: [u8; 9],
    have: usize,
    /// Payload bytes of the current frame still to pass.
    payload: usize,
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
        Self {
            preface,
            head: [0; 9],
            have: 0,
            payload: 0,
        }
    }

    /// Passes `data`; `on_head` sees every frame header completed in it.
    pub(crate) fn pass(&mut self, mut data: &[u8], mut on_head: impl FnMut(FrameHead)) {
        while !data.is_empty() {
            if self.preface > 0 {
                let n = self.preface.min(data.len());
                self.preface -= n;
                data = &data[n..];
                continue;
            }
            if self.payload > 0 {
                let n = self.payload.min(data.len());
                self.payload -= n;
                data = &data[n..];
                continue;
            }
            let n = (9 - self.have).min(data.len());
            self.head[self.have..self.have + n].copy_from_slice(&data[..n]);
            self.have += n;
            data = &data[n..];
            if self.have < 9 {
                return;
            }
            self.have = 0;
            let h = self.head;
            let len = usize::from(h[0]) << 16 | usize::from(h[1]) << 8 | usize::from(h[2]);
            self.payload = len;
            on_head(FrameHead {
                len,
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
