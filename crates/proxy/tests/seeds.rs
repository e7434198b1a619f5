//! Replays the committed seed corpora of the HTTP fuzz targets (fuzz/seeds/http_head and
//! fuzz/seeds/chunked) through the same properties the fuzzer checks, so that a regression
//! shows in an ordinary `cargo test`.

use rserpool_proxy::fuzzing;
use rserpool_wire::fuzzing::replay;
use std::path::{Path, PathBuf};

fn seeds(target: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../fuzz/seeds")
        .join(target)
}

#[test]
fn the_http_head_seed_corpus_passes_the_fuzz_property() {
    replay(&seeds("http_head"), fuzzing::http_head);
}

#[test]
fn the_chunked_seed_corpus_passes_the_fuzz_property() {
    replay(&seeds("chunked"), fuzzing::chunked);
}
