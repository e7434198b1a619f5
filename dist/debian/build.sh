#!/bin/sh
# Builds the Debian package of rserpool into target/debian/: the release binary (or the one
# RSERPOOL_BIN names), then the man pages and shell completions it generates, then `cargo deb`
# (cargo install cargo-deb) packs them with the units and settings of dist/
# (crates/rserpool/Cargo.toml, [package.metadata.deb]).
set -eu
cd "$(dirname "$0")/../.."
target=$(cargo metadata --format-version 1 --no-deps | sed -n 's/.*"target_directory":"\([^"]*\)".*/\1/p')
out="$target/release"
if [ -n "${RSERPOOL_BIN:-}" ]; then
  # A binary built already (the packaging test packs the one the tests run).
  mkdir -p "$out"
  cp "$RSERPOOL_BIN" "$out/rserpool"
else
  cargo build --release -p rserpool
fi
rm -rf "$out/man" "$out/completions"
"$out/rserpool" man --dir "$out/man" >/dev/null
gzip -9n "$out"/man/*.1
mkdir -p "$out/completions"
"$out/rserpool" completions bash > "$out/completions/rserpool"
"$out/rserpool" completions zsh > "$out/completions/_rserpool"
"$out/rserpool" completions fish > "$out/completions/rserpool.fish"
cargo deb -p rserpool --no-build --strip "$@"
