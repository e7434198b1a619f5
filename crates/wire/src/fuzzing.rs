//! What the fuzz targets check, kept in the library so that an ordinary `cargo test` replays
//! the committed seed corpora through the same code as the fuzzer (`fuzz/`, docs/FUZZING.md).
//! A property fails by panicking, which is what libFuzzer looks for. Not an API.

use crate::mapping::{Chunk, ChunkReader, Reassembly};
use crate::{AsapMessage, EnrpMessage, Framer, Message};
use std::path::Path;

/// The `decode` target: arbitrary bytes go to both decoders and, cut into 7-byte pieces, to the
/// stream framer and to the data channel's chunk reader (after an INIT whose flags are the first
/// byte). No panic, and every message that decodes re-encodes and decodes to itself.
pub fn decode(data: &[u8]) {
    if let Ok(m) = AsapMessage::decode(data)
        && let Ok(bytes) = m.to_bytes()
    {
        assert_eq!(AsapMessage::decode(&bytes).as_ref(), Ok(&m));
    }
    if let Ok(m) = EnrpMessage::decode(data)
        && let Ok(bytes) = m.to_bytes()
    {
        assert_eq!(EnrpMessage::decode(&bytes).as_ref(), Ok(&m));
    }
    let mut framer = Framer::new(4096);
    for chunk in data.chunks(7) {
        framer.extend(chunk);
        while let Ok(Some(msg)) = framer.next_message() {
            let _ = AsapMessage::decode(&msg);
            let _ = EnrpMessage::decode(&msg);
        }
    }
    let (flags, rest) = data.split_first().map_or((0, data), |(f, r)| (*f, r));
    let mut chunks = ChunkReader::new();
    let mut reassembly = Reassembly::new(4096);
    chunks.buffer_mut().extend_from_slice(&[1, flags, 0, 4]);
    for piece in rest.chunks(7) {
        chunks.buffer_mut().extend_from_slice(piece);
        while let Ok(Some(c)) = chunks.next_chunk() {
            if let Chunk::Data {
                flags,
                ppid,
                payload,
            } = c
                && let Ok(Some((_, m))) = reassembly.push(flags, ppid, payload)
            {
                let _ = AsapMessage::decode(&m);
            }
        }
    }
}

/// Runs every file in `dir` through `property`; panics naming the files that failed, or when
/// there are none to run (a replay of nothing would pass whatever the code does).
pub fn replay(dir: &Path, property: fn(&[u8])) {
    let mut files: Vec<_> = match std::fs::read_dir(dir) {
        Ok(entries) => entries.filter_map(|e| e.ok().map(|e| e.path())).collect(),
        Err(e) => panic!("seed corpus {}: {e}", dir.display()),
    };
    files.sort();
    assert!(!files.is_empty(), "seed corpus {} is empty", dir.display());
    let failed: Vec<String> = files
        .iter()
        .filter(|f| {
            let data = std::fs::read(f).unwrap_or_else(|e| panic!("{}: {e}", f.display()));
            std::panic::catch_unwind(|| property(&data)).is_err()
        })
        .map(|f| f.display().to_string())
        .collect();
    assert!(failed.is_empty(), "property failed on {failed:?}");
}
