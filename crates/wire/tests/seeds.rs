//! Replays the committed seed corpus of the `decode` fuzz target (fuzz/seeds/decode) through
//! the same property the fuzzer checks, so a regression shows in an ordinary `cargo test`.

use std::path::Path;

#[test]
fn the_decode_seed_corpus_passes_the_fuzz_property() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fuzz/seeds/decode");
    rserpool_wire::fuzzing::replay(&dir, rserpool_wire::fuzzing::decode);
}
