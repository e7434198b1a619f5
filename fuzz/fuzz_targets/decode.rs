//! Feeds arbitrary bytes to both decoders and the stream framer. Any panic is a finding; so is
//! a decoded message that does not survive encode → decode unchanged.
#![no_main]

use libfuzzer_sys::fuzz_target;
use rserpool_wire::{AsapMessage, EnrpMessage, Framer, Message};

fuzz_target!(|data: &[u8]| {
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
});
