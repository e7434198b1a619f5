//! What an operator deploys with: `--print-config` on every command, `check-config`, JSON logs,
//! and the systemd units and example configs of `dist/` (verified by `systemd-analyze`).
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::{BIN, KillOnDrop, Logged, free_port, wait_until};
use std::io::BufRead;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::Duration;

fn rserpool(args: &[&str]) -> Output {
    Command::new(BIN).args(args).output().unwrap()
}

fn dist() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../dist")
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

/// The commands `rserpool --help` lists.
fn commands() -> Vec<String> {
    let help = text(&rserpool(&["--help"]).stdout);
    help.lines()
        .skip_while(|l| !l.starts_with("Commands:"))
        .skip(1)
        .take_while(|l| l.starts_with("  "))
        .filter_map(|l| l.split_whitespace().next())
        .filter(|c| *c != "help")
        .map(str::to_owned)
        .collect()
}

#[test]
fn every_command_prints_its_config_as_toml() {
    let file = std::env::temp_dir().join(format!("rserpool-print-{}.toml", free_port()));
    std::fs::write(&file, "").unwrap();
    let file = file.to_str().unwrap();
    // The required arguments of each command.
    let required: &[(&str, &[&str])] = &[
        ("up", &[]),
        ("registrar", &[]),
        ("serve", &["--target", "127.0.0.1:8080", "--pool", "Web"]),
        ("example", &["echo", "--pool", "Echo"]),
        ("resolve", &["Web"]),
        ("connect", &["Web"]),
        ("session", &["Calc"]),
        ("proxy", &["--listen", "127.0.0.1:8080", "--pool", "Web"]),
        ("distributor", &["--pool", "Tier"]),
        (
            "split-splice",
            &[
                "--tier",
                "Tier",
                "--listen",
                "10.0.0.1:80",
                "--interface",
                "eth0",
            ],
        ),
        ("status", &[]),
        ("check-config", &[file]),
        ("cert", &["registrar"]),
        ("attack", &["takeover", "--pool", "Web"]),
        ("drain", &["/tmp/pe.sock"]),
        ("undrain", &["/tmp/pe.sock"]),
        ("completions", &["bash"]),
        ("man", &[]),
    ];
    let listed = commands();
    assert!(listed.len() >= 12, "{listed:?}");
    for c in &listed {
        let (_, args) = required
            .iter()
            .find(|(name, _)| name == c)
            .unwrap_or_else(|| panic!("`{c}`: add its required arguments here"));
        let mut all = vec![c.as_str()];
        all.extend_from_slice(args);
        all.push("--print-config");
        let out = rserpool(&all);
        assert!(out.status.success(), "{all:?}: {}", text(&out.stderr));
        let printed = text(&out.stdout);
        let doc: toml::Table = printed
            .parse()
            .unwrap_or_else(|e| panic!("{all:?} printed no TOML: {e}\n{printed}"));
        assert!(!doc.is_empty(), "{all:?}");
    }
    // The registrar's and the proxy's are config files: read back, they print the same.
    for (cmd, extra) in [
        ("registrar", vec![]),
        ("proxy", vec!["--listen", "127.0.0.1:8080", "--pool", "Web"]),
    ] {
        let mut args = vec![cmd, "--print-config"];
        args.extend(&extra);
        let first = text(&rserpool(&args).stdout);
        std::fs::write(file, &first).unwrap();
        let again = text(&rserpool(&[cmd, "--config", file, "--print-config"]).stdout);
        assert_eq!(first, again, "{cmd}");
        let out = rserpool(&["check-config", "--kind", cmd, file]);
        assert!(out.status.success(), "{cmd}: {}", text(&out.stdout));
    }
    let _ = std::fs::remove_file(file);
}

#[test]
fn check_config_reports_every_error_with_its_line() {
    let file = std::env::temp_dir().join(format!("rserpool-check-{}.toml", free_port()));
    std::fs::write(
        &file,
        "registrars = [\"127.0.0.1:3863\"]\nrefresh-ms = \"soon\"\n\n[[listener]]\nlisten = \
         \"127.0.0.1:80\"\nmode = \"http\"\npool = \"Web\"\ntimeout = 5\n\n[[listener]]\nlisten = \
         \"nowhere\"\nmode = \"tcp\"\npool = \"Echo\"\n",
    )
    .unwrap();
    let out = rserpool(&["check-config", file.to_str().unwrap()]);
    assert!(!out.status.success());
    let report = text(&out.stdout);
    let name = file.display().to_string();
    for line in [2, 8, 11] {
        assert!(report.contains(&format!("{name}:{line}: ")), "{report}");
    }
    assert_eq!(report.lines().count(), 3, "{report}");
    assert!(text(&out.stderr).contains("3 errors in this proxy config"));
    let _ = std::fs::remove_file(&file);

    // The examples shipped in dist/ are good ones.
    for (f, kind) in [("registrar.toml", "registrar"), ("proxy.toml", "proxy")] {
        let path = dist().join(f);
        let out = rserpool(&["check-config", path.to_str().unwrap()]);
        assert!(out.status.success(), "{f}: {}", text(&out.stdout));
        assert!(text(&out.stdout).contains(&format!("ok ({kind} config)")));
    }
}

#[tokio::test]
async fn json_logs_are_one_object_per_line() {
    let asap = format!("127.0.0.1:{}", free_port());
    let enrp = format!("127.0.0.1:{}", free_port());
    let mut child = KillOnDrop(
        Command::new(BIN)
            .args(["--log-format", "json", "registrar", "--asap", &asap])
            .args(["--status", "off", "--enrp", &enrp])
            .env("RUST_LOG", "info")
            .stderr(Stdio::piped())
            .spawn()
            .unwrap(),
    );
    let stderr = child.stderr.take().unwrap();
    // Every line up to the one that says where it listens is a JSON object (a line about the
    // open-file limit may come first).
    let listening = {
        let asap = asap.clone();
        tokio::task::spawn_blocking(move || {
            for line in std::io::BufReader::new(stderr).lines() {
                let line = line.unwrap();
                let v: serde_json::Value =
                    serde_json::from_str(&line).unwrap_or_else(|e| panic!("{e}: {line}"));
                assert!(v["timestamp"].is_string(), "{v}");
                if v["fields"]["message"]
                    .as_str()
                    .is_some_and(|m| m.contains(&asap))
                {
                    return v;
                }
            }
            panic!("the log ended before saying where the registrar listens")
        })
    };
    let v = tokio::time::timeout(Duration::from_secs(10), listening)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(v["level"], "INFO", "{v}");
    common::signal(&child, rustix::process::Signal::TERM);
    wait_until(Duration::from_secs(5), "the registrar exits", || {
        matches!(child.try_wait(), Ok(Some(_)))
    })
    .await;
}

/// A registrar at `asap`, without status listener, its ENRP on a free port.
fn registrar_at(asap: &str) -> KillOnDrop {
    let enrp = format!("127.0.0.1:{}", free_port());
    KillOnDrop(
        Command::new(BIN)
            .args([
                "registrar",
                "--asap",
                asap,
                "--status",
                "off",
                "--enrp",
                &enrp,
            ])
            .env("RUST_LOG", "warn")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    )
}

/// A newcomer's first mistakes, as the log tells them: a PE whose registrar is not there says
/// so once per outage (not at every retry), in plain text when the log is not a terminal, and
/// registers when the registrar comes; a proxy routing to a pool no registrar knows says so,
/// once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreachable_registrar_and_an_unknown_pool_are_logged_once() {
    let asap = format!("127.0.0.1:{}", free_port());
    let pe = Logged::spawn_as_deployed(
        "pe",
        &["example", "http", "--pool", "Lonely", "--registrar", &asap].map(String::from),
        "info",
    );
    // Retries at 0.2, 0.4, 0.8, 1.6 s of back-off: several in the 2.5 s after, one line.
    said_once(&pe, "cannot be reached", Duration::from_secs(5), 2500).await;
    assert!(
        pe.lines_with("\x1b[").is_empty(),
        "colour codes in a piped log"
    );

    let reg = registrar_at(&asap);
    let registered = || {
        let out = rserpool(&["resolve", "Lonely", "--registrar", &asap]);
        out.status.success() && text(&out.stdout).contains("0x")
    };
    wait_until(Duration::from_secs(15), "the PE registers", registered).await;
    // A second outage is said again.
    drop(reg);
    wait_until(Duration::from_secs(15), "the PE says so again", || {
        pe.lines_with("cannot be reached").len() == 2
    })
    .await;

    let proxy = Logged::spawn(
        "proxy",
        &[
            "proxy",
            "--listen",
            &format!("127.0.0.1:{}", free_port()),
            "--pool",
            "Nowhere",
            "--registrar",
            &asap,
            "--status",
            &format!("127.0.0.1:{}", free_port()),
        ]
        .map(String::from),
        "info",
    );
    let _reg = registrar_at(&asap);
    said_once(
        &proxy,
        "no registrar knows pool Nowhere",
        Duration::from_secs(20),
        2000,
    )
    .await;

    // Over SCTP, where a wrong port looks like silence: said as well, with what to check.
    let sctp = format!("sctp+udp://127.0.0.1:{}", free_port());
    let pe = Logged::spawn_as_deployed(
        "pe-sctp",
        &[
            "example",
            "echo",
            "--pool",
            "LonelySctp",
            "--registrar",
            &sctp,
        ]
        .map(String::from),
        "info",
    );
    said_once(&pe, "cannot be reached", Duration::from_secs(10), 2500).await;
    let line = pe.lines_with("cannot be reached").remove(0);
    assert!(line.contains("check the registrar's SCTP port"), "{line}");
}

/// Waits up to `limit` for a line of `log` with `needle`, then `then_ms` more: one there is.
async fn said_once(log: &Logged, needle: &str, limit: Duration, then_ms: u64) {
    wait_until(limit, needle, || !log.lines_with(needle).is_empty()).await;
    tokio::time::sleep(Duration::from_millis(then_ms)).await;
    let lines = log.lines_with(needle);
    assert_eq!(lines.len(), 1, "{lines:?}");
}

/// The distributor and a proxy with the kernel splice started without root say that root is
/// what they need, at once: the distributor used to run on, logging the failed `ip` command
/// about fifteen times a second, and the proxy said only "Operation not permitted".
#[test]
fn without_root_the_distributor_and_the_kernel_splice_say_so() {
    if !rustix::process::geteuid().is_root()
        || Command::new("setpriv").arg("--version").output().is_err()
    {
        eprintln!("skipped: needs root and setpriv to run as nobody");
        return;
    }
    let as_nobody = |args: &[&str]| {
        Command::new("setpriv")
            .args(["--reuid=65534", "--regid=65534", "--clear-groups", BIN])
            .args(args)
            .env_remove("RUST_BACKTRACE")
            .env("RUST_LOG", "warn")
            .output()
            .unwrap()
    };
    let out = as_nobody(&[
        "distributor",
        "--pool",
        "ProxyTier",
        "--group",
        "100",
        "--route",
        "10.0.0.1/32",
    ]);
    assert!(!out.status.success());
    let err = text(&out.stderr);
    assert!(
        err.contains("CAP_NET_ADMIN") && err.contains("root"),
        "{err}"
    );

    let dir = std::env::temp_dir().join(format!("rserpool-noroot-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let cfg = dir.join("proxy.toml");
    std::fs::write(
        &cfg,
        format!(
            "registrars = [\"127.0.0.1:{}\"]\nstatus = \"127.0.0.1:{}\"\n[[listener]]\nlisten = \"127.0.0.1:{}\"\nmode = \"tcp\"\npool = \"P\"\nsplice = \"kernel\"\n[kernel-splice]\ninterfaces = [\"lo\"]\npin-dir = \"{}\"\n[tier]\npool = \"T\"\nlisten = \"127.0.0.1:{}\"\nserver-address = \"127.0.0.2\"\nports = \"21000-21999\"\n",
            free_port(),
            free_port(),
            free_port(),
            dir.join("pins").display(),
            free_port()
        ),
    )
    .unwrap();
    // Readable by nobody.
    let _ = Command::new("chmod")
        .args(["-R", "a+rX"])
        .arg(&dir)
        .status();
    let out = as_nobody(&["proxy", "--config", cfg.to_str().unwrap()]);
    let _ = std::fs::remove_dir_all(&dir);
    assert!(!out.status.success());
    let all = format!("{}{}", text(&out.stdout), text(&out.stderr));
    assert!(
        all.contains("the kernel splice needs root")
            && all.contains("[tier] needs the kernel splice"),
        "{all}"
    );
}

#[test]
fn the_systemd_units_verify() {
    let Ok(out) = Command::new("systemd-analyze").arg("--version").output() else {
        panic!("systemd-analyze (Debian's systemd; .ci/run installs it)");
    };
    assert!(out.status.success());
    // The units point at /usr/bin/rserpool; verified here against the binary under test.
    let dir = std::env::temp_dir().join(format!("rserpool-units-{}", free_port()));
    std::fs::create_dir_all(&dir).unwrap();
    let mut units = Vec::new();
    for e in std::fs::read_dir(dist()).unwrap() {
        let path = e.unwrap().path();
        let name = path.file_name().unwrap().to_str().unwrap().to_owned();
        if !name.ends_with(".service") {
            continue;
        }
        let unit = std::fs::read_to_string(&path)
            .unwrap()
            .replace("/usr/bin/rserpool", BIN);
        // A template is verified as an instance.
        let name = name.replace("@.service", "@web.service");
        std::fs::write(dir.join(&name), unit).unwrap();
        units.push(dir.join(name));
    }
    assert_eq!(units.len(), 3, "{units:?}");
    let out = Command::new("systemd-analyze")
        .arg("verify")
        .args(&units)
        .output()
        .unwrap();
    let complaints = text(&out.stderr);
    assert!(
        out.status.success() && complaints.trim().is_empty(),
        "{complaints}"
    );
    let _ = std::fs::remove_dir_all(dir);
}

/// Shell completions and man pages come from the command line's own definition: bash takes
/// the script and completes every command (and a command's options); zsh's and fish's name
/// every command; each command has a man page that `man` renders without a warning.
#[test]
fn completions_and_man_pages_cover_every_command() {
    let listed = commands();
    let script = std::env::temp_dir().join(format!("rserpool-completion-{}.bash", free_port()));
    std::fs::write(&script, rserpool(&["completions", "bash"]).stdout).unwrap();
    let complete = |words: &str, cword: usize| -> Vec<String> {
        let call = format!(
            "source {}; COMP_WORDS=({words}); COMP_CWORD={cword}; \
             _rserpool rserpool \"${{COMP_WORDS[$COMP_CWORD]}}\" \"${{COMP_WORDS[$COMP_CWORD-1]}}\"; \
             printf '%s\\n' \"${{COMPREPLY[@]}}\"",
            script.display()
        );
        let out = Command::new("bash").args(["-c", &call]).output().unwrap();
        assert!(out.status.success(), "{}", text(&out.stderr));
        text(&out.stdout).lines().map(str::to_owned).collect()
    };
    let offered = complete("rserpool ''", 1);
    for c in &listed {
        assert!(
            offered.contains(c),
            "bash does not complete `{c}`: {offered:?}"
        );
    }
    assert_eq!(complete("rserpool proxy --li", 2), ["--listen"]);
    let _ = std::fs::remove_file(&script);
    for shell in ["zsh", "fish"] {
        let out = rserpool(&["completions", shell]);
        assert!(out.status.success(), "{shell}");
        let script = text(&out.stdout);
        for c in &listed {
            assert!(
                script.contains(c.as_str()),
                "{shell}'s completions lack `{c}`"
            );
        }
    }
    let dir = std::env::temp_dir().join(format!("rserpool-man-{}", free_port()));
    let out = rserpool(&["man", "--dir", dir.to_str().unwrap()]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let pages = std::iter::once("rserpool.1".to_owned())
        .chain(listed.iter().map(|c| format!("rserpool-{c}.1")));
    for page in pages {
        let path = dir.join(&page);
        let out = Command::new("man")
            .args(["--warnings", "-l"])
            .arg(&path)
            .env("MANWIDTH", "80")
            .output()
            .expect("man (Debian's man-db)");
        let shown = text(&out.stdout);
        assert!(
            out.status.success() && shown.contains("NAME") && shown.contains("SYNOPSIS"),
            "{page}: {}",
            text(&out.stderr)
        );
        assert_eq!(text(&out.stderr), "", "{page}: warnings");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// The Debian package (`dist/debian/build.sh`: cargo-deb) installs with dpkg: the binary runs,
/// `man` finds its pages, the installed units pass `systemd-analyze verify`, the settings are
/// conffiles, the completions and dashboards are in place and the system user exists; a purge
/// leaves none of its files. Needs root and cargo-deb (.ci/run installs it): skipped elsewhere,
/// failed under CI. Packs the binary the tests run (no release build of its own: that took
/// CI minutes), in `target/package`, apart from the release binaries a benchmark or soak may
/// be running.
#[test]
fn the_debian_package_installs_and_purges_cleanly() {
    let cargo_deb = Command::new("cargo").args(["deb", "--version"]).output();
    if !cargo_deb.is_ok_and(|o| o.status.success())
        && rserpool_ksplice::testbed::skip("cargo-deb is missing (.ci/run installs it)")
    {
        return;
    }
    if !rustix::process::geteuid().is_root()
        && rserpool_ksplice::testbed::skip("installing a package needs root")
    {
        return;
    }
    // A /usr/bin/rserpool of another origin is not ours to replace.
    let owner = Command::new("dpkg")
        .args(["-S", "/usr/bin/rserpool"])
        .output()
        .unwrap();
    let foreign =
        Path::new("/usr/bin/rserpool").exists() && !text(&owner.stdout).starts_with("rserpool:");
    if foreign && rserpool_ksplice::testbed::skip("/usr/bin/rserpool is not the package's") {
        return;
    }
    let target = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../target/package");
    let built = Command::new(dist().join("debian/build.sh"))
        .env("CARGO_TARGET_DIR", &target)
        .env("RSERPOOL_BIN", BIN)
        .output()
        .unwrap();
    assert!(built.status.success(), "{}", text(&built.stderr));
    let deb = text(&built.stdout)
        .lines()
        .rev()
        .find(|l| l.ends_with(".deb"))
        .map(PathBuf::from)
        .unwrap_or_else(|| panic!("no .deb named: {}", text(&built.stdout)));

    /// Purges the package when the test ends, however it ends.
    struct Purge;
    impl Drop for Purge {
        fn drop(&mut self) {
            let _ = Command::new("dpkg").args(["--purge", "rserpool"]).output();
        }
    }
    let purge = Purge;
    let installed = Command::new("dpkg").arg("-i").arg(&deb).output().unwrap();
    assert!(
        installed.status.success(),
        "dpkg -i: {}",
        text(&installed.stderr)
    );

    let version = Command::new("/usr/bin/rserpool")
        .arg("--version")
        .output()
        .unwrap();
    assert!(
        text(&version.stdout).starts_with("rserpool "),
        "{}",
        text(&version.stdout)
    );
    for page in [
        "rserpool",
        "rserpool-registrar",
        "rserpool-proxy",
        "rserpool-serve",
    ] {
        let found = Command::new("man").args(["-w", page]).output().unwrap();
        assert!(
            found.status.success(),
            "man -w {page}: {}",
            text(&found.stderr)
        );
    }
    let units = [
        "rserpool-registrar.service",
        "rserpool-proxy.service",
        "rserpool-serve@.service",
    ];
    for unit in units {
        let path = Path::new("/lib/systemd/system").join(unit);
        let out = Command::new("systemd-analyze")
            .arg("verify")
            .arg(&path)
            .output()
            .unwrap();
        // An instance-less template is verified as an instance.
        let checked = if unit.ends_with("@.service") {
            let inst = Path::new("/lib/systemd/system").join("rserpool-serve@web.service");
            let _ = std::fs::remove_file(&inst);
            std::os::unix::fs::symlink(&path, &inst).unwrap();
            let out = Command::new("systemd-analyze")
                .arg("verify")
                .arg(&inst)
                .output()
                .unwrap();
            let _ = std::fs::remove_file(&inst);
            out
        } else {
            out
        };
        let complaints: Vec<String> = text(&checked.stderr)
            .lines()
            .filter(|l| l.contains("rserpool"))
            .map(str::to_owned)
            .collect();
        assert!(
            checked.status.success() && complaints.is_empty(),
            "{unit}: {complaints:?}"
        );
    }
    let conffiles = Command::new("dpkg-query")
        .args(["-W", "-f=${Conffiles}", "rserpool"])
        .output()
        .unwrap();
    for f in ["registrar.toml", "proxy.toml", "serve-example.env"] {
        assert!(
            text(&conffiles.stdout).contains(&format!("/etc/rserpool/{f}")),
            "{f} is not a conffile: {}",
            text(&conffiles.stdout)
        );
    }
    for f in [
        "/usr/share/bash-completion/completions/rserpool",
        "/usr/share/zsh/vendor-completions/_rserpool",
        "/usr/share/fish/vendor_completions.d/rserpool.fish",
        "/usr/share/rserpool/grafana/rserpool-proxy.json",
    ] {
        assert!(Path::new(f).exists(), "{f} not installed");
    }
    let user = Command::new("getent")
        .args(["passwd", "rserpool"])
        .output()
        .unwrap();
    assert!(user.status.success(), "no system user rserpool");
    let listed = Command::new("dpkg-query")
        .args(["-L", "rserpool"])
        .output()
        .unwrap();
    let files: Vec<String> = text(&listed.stdout)
        .lines()
        .filter(|f| Path::new(f).is_file())
        .map(str::to_owned)
        .collect();
    assert!(files.len() > 20, "{files:?}");

    drop(purge);
    let left: Vec<&String> = files.iter().filter(|f| Path::new(f).exists()).collect();
    assert!(left.is_empty(), "left after the purge: {left:?}");
    assert!(
        !Path::new("/etc/rserpool").exists(),
        "/etc/rserpool left after the purge"
    );
}

/// The README's command summary ("Using it") and `--help` agree: every command `--help` lists
/// is in it, every command and subcommand it names exists, and every option it shows for one
/// is among that command's (or its subcommands') options.
#[test]
fn the_readme_and_every_commands_help_agree() {
    let readme =
        std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("../../README.md"))
            .unwrap();
    let block: Vec<&str> = readme
        .lines()
        .skip_while(|l| *l != "## Using it")
        .skip_while(|l| !l.starts_with("```sh"))
        .skip(1)
        .take_while(|l| !l.starts_with("```"))
        .collect();
    assert!(block.len() > 10, "no command summary under \"## Using it\"");
    let help = |args: &[&str]| -> Option<String> {
        let mut all = args.to_vec();
        all.push("--help");
        let out = rserpool(&all);
        out.status.success().then(|| text(&out.stdout))
    };
    let global = help(&[]).unwrap();
    let mut named = std::collections::BTreeSet::new();
    for line in &block {
        let line = line.split(" #").next().unwrap_or("");
        let Some(rest) = line.trim().strip_prefix("rserpool ") else {
            continue;
        };
        let words: Vec<&str> = rest.split_whitespace().collect();
        let is_name = |w: &str| {
            w.chars()
                .all(|c| c.is_ascii_lowercase() || c == '-' || c == '|')
        };
        let commands: Vec<&str> = match words.first() {
            Some(w) if is_name(w) && !w.starts_with('-') => w.split('|').collect(),
            _ => Vec::new(), // global options, or COMMAND
        };
        let mut helps = vec![global.clone()];
        for c in &commands {
            named.insert(c.to_string());
            let h = help(&[c]).unwrap_or_else(|| panic!("README names `{c}`, which is no command"));
            // A subcommand (`example echo|http`, `attack takeover`) when the command has some.
            if let Some(subs) = words.get(1).filter(|w| is_name(w) && !w.starts_with('-'))
                && h.contains("Commands:")
            {
                for s in subs.split('|') {
                    let sh = help(&[c, s])
                        .unwrap_or_else(|| panic!("README names `{c} {s}`, which is none"));
                    helps.push(sh);
                }
            }
            helps.push(h);
        }
        for w in &words {
            let Some(start) = w.find("--") else { continue };
            let flag: String = w[start..]
                .chars()
                .take_while(|c| c.is_ascii_alphanumeric() || *c == '-')
                .collect();
            assert!(
                helps
                    .iter()
                    .any(|h| h.contains(&format!("{flag} ")) || h.contains(&format!("{flag}\n"))),
                "README shows `{flag}` for `rserpool {}`, which `--help` does not list",
                commands.join("|")
            );
        }
    }
    for c in commands() {
        assert!(
            named.contains(&c),
            "`{c}` is missing from the README's command summary"
        );
    }
}
