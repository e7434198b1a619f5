//! `rserpool completions SHELL` and `rserpool man --dir DIR`: shell completions and man pages
//! generated from the command line's own definition (clap's generators), so that they never
//! disagree with `--help`. The Debian package ships both (docs/OPERATIONS.md, "Packaging").

use anyhow::{Context, Result};
use clap::Args;
use clap_complete::Shell;
use std::path::PathBuf;

#[derive(Args, Debug, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub struct CompletionsArgs {
    /// The shell to complete for.
    #[arg(value_enum)]
    #[serde(serialize_with = "shell_name")]
    pub shell: Shell,
}

fn shell_name<S: serde::Serializer>(shell: &Shell, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(&shell.to_string())
}

#[derive(Args, Debug, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub struct ManArgs {
    /// Where to write the pages: rserpool.1, and rserpool-COMMAND.1 for each command.
    #[arg(long, default_value = ".")]
    pub dir: PathBuf,
}

/// Writes the completion script of `cli` for `a.shell` to standard output.
pub fn completions(a: CompletionsArgs, mut cli: clap::Command) -> Result<()> {
    let name = cli.get_name().to_owned();
    clap_complete::generate(a.shell, &mut cli, name, &mut std::io::stdout());
    Ok(())
}

/// Writes the man pages of `cli` and of each of its commands into `a.dir`.
pub fn man_pages(a: ManArgs, cli: clap::Command) -> Result<()> {
    std::fs::create_dir_all(&a.dir).with_context(|| format!("creating {}", a.dir.display()))?;
    clap_mangen::generate_to(cli, &a.dir)
        .with_context(|| format!("writing the man pages into {}", a.dir.display()))?;
    let mut pages: Vec<String> = std::fs::read_dir(&a.dir)?
        .filter_map(|e| e.ok())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with("rserpool") && n.ends_with(".1"))
        .collect();
    pages.sort();
    println!(
        "{} man pages in {}: {}",
        pages.len(),
        a.dir.display(),
        pages.join(" ")
    );
    Ok(())
}
