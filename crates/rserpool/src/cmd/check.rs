//! `rserpool check-config FILE`: every error of a registrar's or a proxy's config file, each
//! with its line, before a deployment finds them one restart at a time.
//!
//! A TOML deserializer stops at the first error. So after each error the lines it points at
//! are blanked (a whole table when the error is the table's, e.g. a missing key) and the file
//! is read again, with the line numbers unchanged, until it reads; then the settings are
//! checked as a whole (those errors have no line of their own), and the TLS files they name
//! are read (an error there is given the line that names the file) — unless a whole table was
//! blanked, whose absence would be reported as errors of its own ("no listener configured").

use anyhow::{Context, Result, bail};
use clap::Args;
use serde::de::DeserializeOwned;
use std::path::PathBuf;

#[derive(Args, Debug, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub struct CheckArgs {
    /// The config file to check.
    pub file: PathBuf,
    /// What it configures: `registrar` or `proxy` (by default, what reads with fewer unknown
    /// keys, then fewer errors).
    #[arg(long, value_parser = ["registrar", "proxy"])]
    pub kind: Option<String>,
}

/// One error: its 1-based line (none for an error of the settings as a whole) and message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigProblem {
    pub line: Option<usize>,
    pub message: String,
}

/// At most this many errors are reported (and as many rereads made).
const MAX_ERRORS: usize = 100;

pub fn run(args: CheckArgs) -> Result<()> {
    let text = std::fs::read_to_string(&args.file)
        .with_context(|| format!("cannot read {}", args.file.display()))?;
    let (kind, problems) = check(&text, args.kind.as_deref());
    let name = args.file.display();
    if problems.is_empty() {
        println!("{name}: ok ({kind} config)");
        if kind == "proxy" {
            for note in host_notes(&text) {
                println!("{name}: note: {note}");
            }
        }
        return Ok(());
    }
    for p in &problems {
        match p.line {
            Some(l) => println!("{name}:{l}: {}", p.message),
            None => println!("{name}: {}", p.message),
        }
    }
    bail!(
        "{name}: {} error{} in this {kind} config",
        problems.len(),
        if problems.len() == 1 { "" } else { "s" }
    )
}

/// What a valid proxy config asks of the host it is checked on, and this host has not: the
/// file may be meant for another, so these are notes, not errors.
fn host_notes(text: &str) -> Vec<String> {
    let Ok(c) = toml::from_str::<rserpool_proxy::ProxyConfig>(text) else {
        return Vec::new();
    };
    let uses_splice = c.listeners.iter().any(|l| l.kernel_splice()) || c.tier.is_some();
    if !uses_splice {
        return Vec::new();
    }
    c.kernel_splice
        .interfaces
        .iter()
        .filter(|i| !std::path::Path::new("/sys/class/net").join(i).exists())
        .map(|i| {
            format!(
                "[kernel-splice] interface {i} is not on this host (in this network namespace): \
                 started here, the proxy would not load the kernel splice (its listeners relay \
                 in user space, and a [tier] does not start)"
            )
        })
        .collect()
}

/// The kind checked and its problems.
pub fn check(text: &str, kind: Option<&str>) -> (&'static str, Vec<ConfigProblem>) {
    let registrar = || {
        problems::<rserpool_registrar::Config>(text, |c| {
            let mut out = Vec::new();
            out.extend(c.asap_tcp().err());
            out.extend(c.enrp_tcp().err());
            match c.tls_files() {
                Err(e) => out.push(e),
                Ok(Some(f)) => out.extend(rserpool_tls::Tls::load(&f).err().map(|e| e.to_string())),
                Ok(None) => {}
            }
            out
        })
    };
    let proxy = || {
        problems::<rserpool_proxy::ProxyConfig>(text, |c| {
            let mut out: Vec<String> = c
                .validate()
                .err()
                .map(|e| e.to_string())
                .into_iter()
                .collect();
            if let Some(f) = &c.registrar_tls {
                out.extend(
                    rserpool_tls::Tls::load(f)
                        .err()
                        .map(|e| format!("[registrar-tls]: {e}")),
                );
            }
            for l in c.listeners.iter().filter(|l| !l.certificates.is_empty()) {
                out.extend(
                    rserpool_tls::https_server(&l.certificates, rserpool_tls::ALPN_H2_HTTP1)
                        .err()
                        .map(|e| format!("listener {}: {e}", l.listen)),
                );
            }
            for (name, p) in &c.pool_settings {
                if let Some(t) = &p.tls {
                    out.extend(t.client().err().map(|e| format!("[pool.{name}.tls]: {e}")));
                }
            }
            out
        })
    };
    match kind {
        Some("registrar") => ("registrar", registrar()),
        Some(_) => ("proxy", proxy()),
        None => {
            // A key of the other kind is an unknown field, which a bad value is not.
            let (r, p) = (registrar(), proxy());
            let weight = |v: &[ConfigProblem]| {
                let unknown = v
                    .iter()
                    .filter(|p| p.message.starts_with("unknown field"))
                    .count();
                (unknown, v.len())
            };
            if weight(&p) < weight(&r) {
                ("proxy", p)
            } else {
                ("registrar", r)
            }
        }
    }
}

fn problems<T: DeserializeOwned>(
    text: &str,
    validate: impl Fn(&T) -> Vec<String>,
) -> Vec<ConfigProblem> {
    let original = text;
    let mut text = text.to_owned();
    let mut out: Vec<ConfigProblem> = Vec::new();
    // Tables a line was blanked in: a key missing there now may be one we blanked.
    let mut touched: Vec<usize> = Vec::new();
    // A whole table was blanked: what the settings as a whole lack may be what it held.
    let mut lost_table = false;
    for _ in 0..MAX_ERRORS {
        match toml::from_str::<T>(&text) {
            Ok(cfg) => {
                if !lost_table {
                    out.extend(validate(&cfg).into_iter().map(|message| ConfigProblem {
                        line: line_naming(original, &message),
                        message,
                    }));
                }
                break;
            }
            Err(e) => {
                let span = e.span();
                let message = e.message().trim().to_owned();
                let table = span.as_ref().map(|s| table_of(&text, s.start));
                let cascade = message.starts_with("missing field")
                    && table.is_some_and(|t| touched.contains(&t));
                if !cascade {
                    out.push(ConfigProblem {
                        line: span.as_ref().map(|s| line_of(&text, s.start)),
                        message,
                    });
                }
                touched.extend(table);
                match span.map(|s| blank(&mut text, s)) {
                    Some(Blanked::Lines) => {}
                    Some(Blanked::Table) => lost_table = true,
                    Some(Blanked::Nothing) | None => break,
                }
            }
        }
    }
    out
}

/// The line that holds a quoted string of `message` (a file name a TLS error names), if any.
fn line_naming(text: &str, message: &str) -> Option<usize> {
    text.lines()
        .position(|l| {
            l.split('"')
                .skip(1)
                .step_by(2)
                .any(|quoted| !quoted.is_empty() && message.contains(quoted))
        })
        .map(|i| i + 1)
}

fn line_of(text: &str, at: usize) -> usize {
    text.as_bytes()[..at.min(text.len())]
        .iter()
        .filter(|b| **b == b'\n')
        .count()
        + 1
}

/// Where the table holding `at` starts: its header's offset (0 for the root table).
fn table_of(text: &str, at: usize) -> usize {
    let mut start = 0;
    let mut offset = 0;
    for line in text.split_inclusive('\n') {
        if offset > at {
            break;
        }
        if is_header(line) {
            start = offset;
        }
        offset += line.len();
    }
    start
}

fn is_header(line: &str) -> bool {
    line.trim_start().starts_with('[')
}

/// What [`blank`] blanked.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Blanked {
    Nothing,
    Lines,
    Table,
}

/// Blanks the lines of `span` (the whole table when it starts at a table's header), keeping
/// every newline.
fn blank(text: &mut String, span: std::ops::Range<usize>) -> Blanked {
    let start = text[..span.start.min(text.len())]
        .rfind('\n')
        .map_or(0, |i| i + 1);
    let mut end = text[span.end.min(text.len())..]
        .find('\n')
        .map_or(text.len(), |i| span.end + i);
    let first = text[start..].lines().next().unwrap_or("");
    let table = is_header(first);
    if table {
        // Up to the next table's header.
        let mut at = text[start..]
            .find('\n')
            .map_or(text.len(), |i| start + i + 1);
        while at < text.len() {
            let line = text[at..].lines().next().unwrap_or("");
            if is_header(line) {
                break;
            }
            at += line.len() + 1;
        }
        end = end.max(at.min(text.len()));
    }
    let blanked: String = text[start..end]
        .chars()
        .map(|c| if c == '\n' { '\n' } else { ' ' })
        .collect();
    if blanked == text[start..end] {
        return Blanked::Nothing;
    }
    text.replace_range(start..end, &blanked);
    if table {
        Blanked::Table
    } else {
        Blanked::Lines
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_error_is_reported_with_its_line() {
        let text = "\
registrars = [\"127.0.0.1:3863\"]
refresh-ms = \"soon\"
no-such-key = 1

[[listener]]
listen = \"127.0.0.1:8080\"
mode = \"http\"
pool = \"Web\"

[[listener]]
mode = \"tcp\"
pool = \"Echo\"

[[listener]]
listen = \"127.0.0.1:7001\"
mode = \"carrier-pigeon\"
pool = \"Echo\"
";
        let (kind, p) = check(text, None);
        assert_eq!(kind, "proxy");
        let lines: Vec<Option<usize>> = p.iter().map(|p| p.line).collect();
        assert_eq!(lines, [Some(2), Some(3), Some(10), Some(16)], "{p:#?}");
        assert!(p[0].message.contains("invalid type"), "{p:#?}");
        assert!(p[1].message.contains("no-such-key"), "{p:#?}");
        assert!(p[2].message.contains("listen"), "{p:#?}");
        assert!(p[3].message.contains("carrier-pigeon"), "{p:#?}");
    }

    #[test]
    fn a_good_file_has_none_and_settings_errors_are_placed_where_they_can_be() {
        let good = "registrars = [\"127.0.0.1:3863\"]\n[[listener]]\nlisten = \"127.0.0.1:8080\"\npool = \"Web\"\nmode = \"http\"\n";
        assert_eq!(check(good, Some("proxy")), ("proxy", vec![]));
        let twice = format!(
            "{good}[[listener]]\nlisten = \"127.0.0.1:8080\"\npool = \"X\"\nmode = \"tcp\"\n"
        );
        let (_, p) = check(&twice, Some("proxy"));
        assert_eq!(p.len(), 1, "{p:#?}");
        // A settings error is given the first line that names what it names, if any.
        assert_eq!(p[0].line, Some(3), "{p:#?}");
        assert!(p[0].message.contains("twice"), "{p:#?}");
        let (_, p) = check("registrars = []\n", Some("proxy"));
        assert_eq!(p[0].line, None, "{p:#?}");
        assert_eq!(check("", Some("registrar")), ("registrar", vec![]));
        // TLS files are read: a missing one is reported at the line that names it.
        let tls = "asap = \"127.0.0.1:3863\"\ntls-cert = \"/nonexistent/r.pem\"\ntls-key = \"/nonexistent/r.key\"\ntls-ca = \"/nonexistent/ca.pem\"\n";
        let (_, p) = check(tls, Some("registrar"));
        assert_eq!(p.len(), 1, "{p:#?}");
        assert_eq!(p[0].line, Some(2), "{p:#?}");
        assert!(
            p[0].message.contains("cannot read /nonexistent/r.pem"),
            "{p:#?}"
        );
        let (_, p) = check("asap = \"sctp+udp://0.0.0.0:3863\"\n", Some("registrar"));
        assert!(
            p.iter().any(|p| p.message.contains("no TCP address")),
            "{p:?}"
        );
        let (_, p) = check("asap = \"tcp://0.0.0.0:3863\"\n", Some("registrar"));
        assert!(p.is_empty(), "{p:?}");
        let (_, p) = check("asap = \"udp://0.0.0.0:3863\"\n", Some("registrar"));
        assert!(
            p.iter().any(|p| p.message.contains("unknown scheme")),
            "{p:?}"
        );
        let (_, p) = check("tls-cert = \"a.pem\"\n", Some("registrar"));
        assert!(p[0].message.contains("all three"), "{p:#?}");
        let (kind, p) = check(
            "keep-alive-interval-ms = -5\nmax-connections = 10\n= broken\n",
            None,
        );
        assert_eq!(kind, "registrar");
        let lines: Vec<Option<usize>> = p.iter().map(|p| p.line).collect();
        assert_eq!(lines, [Some(3), Some(1)], "{p:#?}");
    }

    /// A proxy config with one bad value is checked as a proxy config, and that value is its
    /// one error (read as a registrar's, its tables are "unknown fields").
    #[test]
    fn an_interface_missing_on_this_host_is_a_note() {
        let cfg = |i: &str| {
            format!(
                "registrars = [\"127.0.0.1:3863\"]\n[[listener]]\nlisten = \"127.0.0.1:7000\"\n\
                 mode = \"tcp\"\npool = \"P\"\nsplice = \"kernel\"\n[kernel-splice]\n\
                 interfaces = [\"{i}\"]\n"
            )
        };
        assert!(check(&cfg("nosuchif0"), None).1.is_empty(), "a valid file");
        let notes = host_notes(&cfg("nosuchif0"));
        assert_eq!(notes.len(), 1, "{notes:?}");
        assert!(notes[0].contains("nosuchif0"));
        assert!(host_notes(&cfg("lo")).is_empty());
    }

    #[test]
    fn a_proxy_config_with_a_bad_value_is_a_proxy_config() {
        let text = "\
registrars = [\"127.0.0.1:3863\"]

[[listener]]
listen = \"127.0.0.1:8080\"
mode = \"htp\"
pool = \"Web\"
";
        let (kind, p) = check(text, None);
        assert_eq!(kind, "proxy", "{p:#?}");
        assert_eq!(p.len(), 1, "{p:#?}");
        assert_eq!(p[0].line, Some(5), "{p:#?}");
        assert!(p[0].message.contains("htp"), "{p:#?}");
    }
}
