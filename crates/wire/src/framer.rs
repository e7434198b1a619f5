//! Cuts a byte stream (ASAP or ENRP over TCP) into messages.
//!
//! Messages travel back to back, each delimited by its header's length. A sender pads each
//! message to a multiple of 4; the framer skips that padding when it is there and does not wait
//! for it when it is not (type 0 is reserved, so a zero byte can never start a message).

use crate::error::{DecodeError, DecodeErrorKind};
use bytes::{Buf, Bytes, BytesMut};

/// The largest message the header can describe.
pub const MAX_MESSAGE_SIZE: usize = u16::MAX as usize;

/// A message cut from the stream: borrowed from the caller's read when it arrived whole.
#[derive(Debug)]
pub enum Frame<'a> {
    Borrowed(&'a [u8]),
    Owned(Bytes),
}

impl std::ops::Deref for Frame<'_> {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        match self {
            Frame::Borrowed(b) => b,
            Frame::Owned(b) => b,
        }
    }
}

/// The bytes of the first message of `buf` with its padding to a multiple of 4 (as far as
/// `buf` has it), when `buf` holds the whole message: how a sender with messages back to back
/// (a TCP mapping output buffer) cuts them for a message transport such as SCTP.
pub fn first_message_len(buf: &[u8]) -> Option<usize> {
    let [_, _, l0, l1, ..] = *buf else {
        return None;
    };
    let len = usize::from(u16::from_be_bytes([l0, l1])).max(4);
    (buf.len() >= len).then(|| len.next_multiple_of(4).min(buf.len()))
}

/// Reassembles messages from stream reads.
#[derive(Debug)]
pub struct Framer {
    buf: BytesMut,
    max: usize,
    /// Padding bytes still owed by the previous message.
    pending_pad: usize,
}

impl Framer {
    /// A framer that refuses messages longer than `max_message_size` bytes.
    pub fn new(max_message_size: usize) -> Self {
        Self {
            buf: BytesMut::new(),
            max: max_message_size.clamp(4, MAX_MESSAGE_SIZE),
            pending_pad: 0,
        }
    }

    /// Appends bytes read from the stream.
    pub fn extend(&mut self, data: &[u8]) {
        self.buf.extend_from_slice(data);
    }

    /// The buffer to read into directly (e.g. with `read_buf`).
    pub fn buffer_mut(&mut self) -> &mut BytesMut {
        &mut self.buf
    }

    /// Frees the buffer when it holds nothing: a server with many idle connections then keeps
    /// no buffer memory for them.
    pub fn release_if_empty(&mut self) {
        if self.buf.is_empty() && self.buf.capacity() > 0 {
            self.buf = BytesMut::new();
        }
    }

    /// Bytes received but not yet returned as a message.
    pub fn buffered(&self) -> usize {
        self.buf.len()
    }

    /// Those bytes themselves (a process handing its connections over passes them on).
    pub fn buffered_bytes(&self) -> &[u8] {
        &self.buf
    }

    /// Like [`next_message`](Self::next_message), but takes its bytes from `input` (a fresh
    /// read), advancing it. While nothing is buffered (a read holding whole messages, the common
    /// case) the message is borrowed from `input` without a copy; anything else goes through the
    /// buffer.
    pub fn next_from<'a>(
        &mut self,
        input: &mut &'a [u8],
    ) -> Result<Option<Frame<'a>>, DecodeError> {
        if self.buf.is_empty() {
            while self.pending_pad > 0 && input.first() == Some(&0) {
                *input = &input[1..];
                self.pending_pad -= 1;
            }
            if let Some((_, _, length)) = crate::peek_header(input) {
                let len = usize::from(length);
                if (4..=self.max).contains(&len) && input.len() >= len {
                    let (msg, rest) = input.split_at(len);
                    *input = rest;
                    self.pending_pad = len.next_multiple_of(4) - len;
                    return Ok(Some(Frame::Borrowed(msg)));
                }
            }
        }
        if !input.is_empty() {
            self.buf.extend_from_slice(input);
            *input = &[];
        }
        Ok(self.next_message()?.map(Frame::Owned))
    }

    /// The next complete message, `Ok(None)` if more bytes are needed, or an error when framing
    /// is lost (length below 4 or above the limit): the connection should then be closed.
    pub fn next_message(&mut self) -> Result<Option<Bytes>, DecodeError> {
        while self.pending_pad > 0 && self.buf.first() == Some(&0) {
            self.buf.advance(1);
            self.pending_pad -= 1;
        }
        if !self.buf.is_empty() {
            self.pending_pad = 0;
        }
        let Some((_, _, length)) = crate::peek_header(&self.buf) else {
            return Ok(None);
        };
        let len = usize::from(length);
        if len < 4 {
            return Err(DecodeError::silent(DecodeErrorKind::BadMessageLength(
                length,
            )));
        }
        if len > self.max {
            return Err(DecodeError::silent(DecodeErrorKind::TooLarge {
                length: len,
                limit: self.max,
            }));
        }
        if self.buf.len() < len {
            self.buf.reserve(len - self.buf.len());
            return Ok(None);
        }
        let msg = self.buf.split_to(len).freeze();
        self.pending_pad = len.next_multiple_of(4) - len;
        Ok(Some(msg))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn messages_back_to_back_are_cut_with_their_padding() {
        // Length 7 (padded to 8), then length 4.
        let buf = [1, 0, 0, 7, 9, 9, 9, 0, 2, 0, 0, 4];
        assert_eq!(first_message_len(&buf), Some(8));
        assert_eq!(first_message_len(&buf[8..]), Some(4));
        assert_eq!(first_message_len(&buf[..6]), None);
        assert_eq!(first_message_len(&buf[..7]), Some(7));
        assert_eq!(first_message_len(&[]), None);
    }

    #[test]
    fn splits_back_to_back_and_partial_messages() {
        let hr: &[u8] = b"\x05\x00\x00\x10\x00\x09\x00\x0cEchoPool";
        // A 9-byte message (pool handle "P") followed by 3 zero bytes of padding.
        let short: &[u8] = b"\x05\x00\x00\x09\x00\x09\x00\x05P\x00\x00\x00";
        let mut stream = Vec::new();
        stream.extend_from_slice(hr);
        stream.extend_from_slice(short);
        stream.extend_from_slice(hr);
        let mut f = Framer::new(1024);
        let mut got = Vec::new();
        for chunk in stream.chunks(3) {
            f.extend(chunk);
            while let Some(m) = f.next_message().unwrap() {
                got.push(m);
            }
        }
        assert_eq!(got.len(), 3);
        assert_eq!(&got[0][..], hr);
        assert_eq!(&got[1][..], &short[..9]);
        assert_eq!(&got[2][..], hr);
        assert_eq!(f.buffered(), 0);
    }

    #[test]
    fn next_from_borrows_whole_messages_and_buffers_the_rest() {
        let hr: &[u8] = b"\x05\x00\x00\x10\x00\x09\x00\x0cEchoPool";
        let short: &[u8] = b"\x05\x00\x00\x09\x00\x09\x00\x05P\x00\x00\x00";
        let mut stream = Vec::new();
        for _ in 0..3 {
            stream.extend_from_slice(hr);
            stream.extend_from_slice(short);
        }
        for chunk_len in [1, 3, 7, 12, 16, 28, stream.len()] {
            let mut f = Framer::new(1024);
            let (mut got, mut borrowed) = (Vec::new(), 0);
            for chunk in stream.chunks(chunk_len) {
                let mut input = chunk;
                while let Some(m) = f.next_from(&mut input).unwrap() {
                    borrowed += usize::from(matches!(m, Frame::Borrowed(_)));
                    got.push(m.to_vec());
                }
                assert!(input.is_empty());
            }
            assert_eq!(got.len(), 6, "chunks of {chunk_len}");
            for pair in got.chunks(2) {
                assert_eq!(&pair[0][..], hr);
                assert_eq!(&pair[1][..], &short[..9]);
            }
            if chunk_len == stream.len() {
                assert_eq!(borrowed, 6, "a whole read is never copied");
            }
            assert_eq!(f.buffered(), 0);
        }
        let mut f = Framer::new(64);
        let mut input: &[u8] = b"\x05\x00\x00\x02";
        assert!(f.next_from(&mut input).unwrap_err().loses_framing());
    }

    #[test]
    fn unpadded_sender_is_accepted() {
        let mut f = Framer::new(1024);
        f.extend(b"\x05\x00\x00\x09\x00\x09\x00\x05P\x05\x00\x00\x09\x00\x09\x00\x05Q");
        assert_eq!(f.next_message().unwrap().unwrap().len(), 9);
        assert_eq!(f.next_message().unwrap().unwrap()[8], b'Q');
    }

    #[test]
    fn refuses_bad_lengths() {
        let mut f = Framer::new(64);
        f.extend(b"\x05\x00\x00\x02");
        assert!(f.next_message().unwrap_err().loses_framing());
        let mut f = Framer::new(64);
        f.extend(b"\x05\x00\x01\x00");
        assert!(matches!(
            f.next_message().unwrap_err().kind,
            DecodeErrorKind::TooLarge { .. }
        ));
    }
}
