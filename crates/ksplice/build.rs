//! Two things, both from `bpf/`:
//!
//! - **The ABI check.** `bpf/abi.h` holds what the datapath and this crate share: the maps'
//!   names and sizes, the structs of their values, the flags. A tiny C program, built with the
//!   host's C compiler (`HOST_CC`, `CC`, else `cc`), prints every `#define` of the header and
//!   the size, offset and size of every field of its structs; from that `$OUT_DIR/abi.rs`
//!   gives Rust the constants and asserts at compile time that each Rust mirror (`ABI_STRUCTS`)
//!   has the same size and every field the same offset and size. A mismatch fails the build.
//!   So does a missing C compiler: Rust links with `cc` on Linux anyway, and a skipped check
//!   would hide exactly the change it is for. It needs no clang.
//!   Every struct must be free of implicit padding (checked here): then the host's layout is
//!   the BPF target's too.
//! - **The datapath.** `bpf/splice.c` (and the distributor's `bpf/watch.c`, the sidecar's
//!   `bpf/conncount.c`) compiled with
//!   clang when there is one. Without clang (or when it fails) the crate still builds: it
//!   then says at run time, once, why the kernel splice is unavailable — never a build
//!   failure, never a silent fallback.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::Command;

/// The structs of `bpf/abi.h` and the Rust types that mirror them, field for field by name.
const ABI_STRUCTS: &[(&str, &str)] = &[
    ("flow_key", "crate::FlowKey"),
    ("flow_val", "crate::FlowVal"),
    ("counters", "crate::RawCounters"),
    ("tier_member", "crate::RawTierMember"),
    ("traffic", "crate::watch::Traffic"),
    ("conn_port", "crate::conncount::ConnPort"),
    ("conn_count", "crate::conncount::ConnCount"),
];

fn main() {
    println!("cargo::rerun-if-changed=bpf/abi.h");
    println!("cargo::rerun-if-changed=bpf/splice.c");
    println!("cargo::rerun-if-changed=bpf/watch.c");
    println!("cargo::rerun-if-changed=bpf/conncount.c");
    for var in ["CLANG", "CC", "HOST_CC"] {
        println!("cargo::rerun-if-env-changed={var}");
    }
    println!("cargo::rustc-check-cfg=cfg(ksplice_built)");
    let dir = PathBuf::from(std::env::var_os("OUT_DIR").unwrap_or_default());
    if let Err(why) = abi(&dir) {
        panic!("bpf/abi.h: {why}");
    }
    let clang = std::env::var("CLANG").unwrap_or_else(|_| "clang".into());
    let mut why = None;
    for (source, object, env) in [
        ("bpf/splice.c", "splice.bpf.o", "KSPLICE_OBJECT"),
        ("bpf/watch.c", "watch.bpf.o", "KSPLICE_WATCH_OBJECT"),
        (
            "bpf/conncount.c",
            "conncount.bpf.o",
            "KSPLICE_CONNCOUNT_OBJECT",
        ),
    ] {
        let out = dir.join(object);
        match compile(&clang, source, &out) {
            None => println!("cargo::rustc-env={env}={}", out.display()),
            Some(w) => {
                why = Some(w);
                break;
            }
        }
    }
    match why {
        None => println!("cargo::rustc-cfg=ksplice_built"),
        Some(why) => {
            println!("cargo::warning=kernel splice unavailable: {why}");
            println!("cargo::rustc-env=KSPLICE_UNAVAILABLE={why}");
            // Installing clang or libbpf-dev later must rebuild the datapath: watch where
            // they land (a directory's listing changes when a file is added to it).
            let path = std::env::var_os("PATH").unwrap_or_default();
            for dir in std::env::split_paths(&path).chain([PathBuf::from("/usr/include")]) {
                if dir.is_dir() {
                    println!("cargo::rerun-if-changed={}", dir.display());
                }
            }
        }
    }
}

/// A struct of the header: its name and its fields' names, in order.
struct CStruct {
    name: String,
    fields: Vec<String>,
}

/// Reads the header's `#define NAME VALUE` lines and its structs (one plain field per
/// declaration: what this reader does not understand is an error, not a field skipped).
fn read_header(text: &str) -> Result<(Vec<String>, Vec<CStruct>), String> {
    let mut defines = Vec::new();
    let mut structs = Vec::new();
    let mut lines = text
        .lines()
        .map(|l| l.split("//").next().unwrap_or("").trim());
    while let Some(line) = lines.next() {
        let define = line
            .strip_prefix('#')
            .map(str::trim_start)
            .and_then(|l| l.strip_prefix("define"))
            .filter(|r| r.starts_with(char::is_whitespace));
        if let Some(rest) = define {
            let mut parts = rest.trim_start().splitn(2, char::is_whitespace);
            let name = parts.next().unwrap_or("");
            let has_value = parts.next().is_some_and(|v| !v.trim().is_empty());
            if name.contains('(') {
                return Err(format!("a function-like macro ({name}) cannot go to Rust"));
            }
            if has_value {
                defines.push(name.to_string());
            }
        } else if let Some(rest) = line.strip_prefix("struct ") {
            let Some(name) = rest.strip_suffix('{').map(str::trim) else {
                return Err(format!(
                    "cannot read `{line}`: `struct NAME {{` on one line"
                ));
            };
            let mut body = String::new();
            for l in lines.by_ref() {
                if l == "};" {
                    break;
                }
                body.push_str(l);
                body.push(' ');
            }
            let mut fields = Vec::new();
            for decl in body.split(';').map(str::trim).filter(|d| !d.is_empty()) {
                let decl_name = decl.split('[').next().unwrap_or("").trim();
                let field = decl_name.rsplit(' ').next().unwrap_or("");
                let plain = field.chars().all(|c| c.is_ascii_alphanumeric() || c == '_');
                if field.is_empty() || !plain || decl.contains([',', ':', '(', '{']) {
                    return Err(format!(
                        "cannot read the field `{decl}` of struct {name}: one plain field per \
                         declaration"
                    ));
                }
                fields.push(field.to_string());
            }
            structs.push(CStruct {
                name: name.to_string(),
                fields,
            });
        }
    }
    Ok((defines, structs))
}

/// A constant's Rust type: a map's name (`*_MAP`) is a string, a flag (`FLAG_*`) is the
/// `u16` of `flow_val.flags`, anything else a `u32`.
fn rust_type(define: &str) -> &'static str {
    if define.ends_with("_MAP") {
        "&str"
    } else if define.starts_with("FLAG_") {
        "u16"
    } else {
        "u32"
    }
}

/// Writes `$OUT_DIR/abi.rs` from what the host's C compiler makes of `bpf/abi.h`.
fn abi(dir: &Path) -> Result<(), String> {
    let header = std::fs::read_to_string("bpf/abi.h").map_err(|e| format!("reading: {e}"))?;
    let (defines, structs) = read_header(&header)?;
    let mut c = String::from(
        "#include <stddef.h>\n#include <stdio.h>\n#include \"abi.h\"\n\
         #define STR_(x) #x\n#define STR(x) STR_(x)\nint main(void)\n{\n",
    );
    for d in &defines {
        if rust_type(d) == "&str" {
            let _ = writeln!(c, "\tprintf(\"define {d} %s\\n\", STR({d}));");
        } else {
            let _ = writeln!(
                c,
                "\tprintf(\"define {d} %llu\\n\", (unsigned long long)({d}));"
            );
        }
    }
    for s in &structs {
        let n = &s.name;
        let _ = writeln!(c, "\tprintf(\"struct {n} %zu\\n\", sizeof(struct {n}));");
        for f in &s.fields {
            let _ = writeln!(
                c,
                "\tprintf(\"field {n} {f} %zu %zu\\n\", offsetof(struct {n}, {f}), \
                 sizeof(((struct {n} *)0)->{f}));"
            );
        }
    }
    c.push_str("\treturn 0;\n}\n");
    let source = dir.join("abi_layout.c");
    let program = dir.join("abi_layout");
    std::fs::write(&source, c).map_err(|e| format!("writing {}: {e}", source.display()))?;
    let cc = ["HOST_CC", "CC"]
        .iter()
        .find_map(|v| std::env::var(v).ok().filter(|s| !s.is_empty()))
        .unwrap_or_else(|| "cc".into());
    let out = Command::new(&cc)
        .args(["-std=c11", "-Wall", "-Werror", "-Ibpf", "-o"])
        .arg(&program)
        .arg(&source)
        .output()
        .map_err(|e| {
            format!(
                "no C compiler `{cc}` to check the header's layout against Rust ({e}); \
                 install gcc, or set CC"
            )
        })?;
    if !out.status.success() {
        return Err(format!(
            "{cc} could not compile the layout check:\n{}",
            String::from_utf8_lossy(&out.stderr)
        ));
    }
    let out = Command::new(&program)
        .output()
        .map_err(|e| format!("running {}: {e}", program.display()))?;
    if !out.status.success() {
        return Err(format!("{} failed", program.display()));
    }
    let rust = rust_abi(&String::from_utf8_lossy(&out.stdout))?;
    let path = dir.join("abi.rs");
    std::fs::write(&path, rust).map_err(|e| format!("writing {}: {e}", path.display()))
}

/// The Rust of `$OUT_DIR/abi.rs` from the layout program's output.
fn rust_abi(layout: &str) -> Result<String, String> {
    let mut rust = String::from(
        "// Generated by build.rs from bpf/abi.h, as the host's C compiler lays it out.\n",
    );
    // Per struct: its size, and the bytes its fields cover.
    let mut sizes: Vec<(String, usize, usize)> = Vec::new();
    for line in layout.lines() {
        let words: Vec<&str> = line.split(' ').collect();
        let num = |i: usize| -> Result<usize, String> {
            words
                .get(i)
                .and_then(|w| w.parse().ok())
                .ok_or_else(|| format!("unreadable layout line `{line}`"))
        };
        match words.as_slice() {
            ["define", name, value] => {
                let ty = rust_type(name);
                let value = if ty == "&str" {
                    format!("{value:?}")
                } else {
                    value.to_string()
                };
                let _ = writeln!(rust, "pub const {name}: {ty} = {value};");
            }
            ["struct", name, _] => {
                let rs = ABI_STRUCTS
                    .iter()
                    .find(|(c, _)| c == name)
                    .map(|(_, r)| *r)
                    .ok_or_else(|| {
                        format!(
                            "struct {name} has no Rust mirror: add it to build.rs's ABI_STRUCTS"
                        )
                    })?;
                let size = num(2)?;
                sizes.push((name.to_string(), size, 0));
                let _ = writeln!(
                    rust,
                    "const _: () = assert!(::core::mem::size_of::<{rs}>() == {size}, \
                     \"{rs} is not {size} bytes, as struct {name} in bpf/abi.h is\");"
                );
            }
            ["field", name, field, _, _] => {
                let (offset, size) = (num(3)?, num(4)?);
                let rs = ABI_STRUCTS
                    .iter()
                    .find(|(c, _)| c == name)
                    .map_or("", |(_, r)| *r);
                if let Some(s) = sizes.last_mut() {
                    s.2 += size;
                }
                let _ = writeln!(
                    rust,
                    "const _: () = assert!(::core::mem::offset_of!({rs}, {field}) == {offset} \
                     && crate::abi::field_size(|s: &{rs}| &s.{field}) == {size}, \
                     \"{rs}.{field} is not at offset {offset} with size {size}, as in \
                     struct {name} in bpf/abi.h\");"
                );
            }
            _ => return Err(format!("unreadable layout line `{line}`")),
        }
    }
    for (name, size, covered) in &sizes {
        if size != covered {
            return Err(format!(
                "struct {name} is {size} bytes but its fields cover {covered}: implicit \
                 padding (which could differ between the host and the BPF target; make it an \
                 explicit field) or a field this reader missed"
            ));
        }
    }
    Ok(rust)
}

/// Compiles `source` to the eBPF object `out`; why not, if it could not.
fn compile(clang: &str, source: &str, out: &Path) -> Option<String> {
    let mut cmd = Command::new(clang);
    cmd.args(["-O2", "-g", "-target", "bpf", "-Wall", "-Werror"]);
    // Debian keeps asm/types.h under the multiarch directory.
    for dir in [
        "/usr/include/x86_64-linux-gnu",
        "/usr/include/aarch64-linux-gnu",
    ] {
        if Path::new(dir).is_dir() {
            cmd.arg(format!("-I{dir}"));
        }
    }
    cmd.args(["-c", source, "-o"]).arg(out);
    match cmd.output() {
        Ok(o) if o.status.success() => None,
        Ok(o) => Some(format!(
            "{clang} could not compile {source}: {}",
            String::from_utf8_lossy(&o.stderr)
                .lines()
                .find(|l| l.contains("error"))
                .unwrap_or("unknown error")
                .trim()
        )),
        Err(e) => Some(format!(
            "no {clang} to compile the datapath ({e}); install clang and libbpf-dev and rebuild"
        )),
    }
}
