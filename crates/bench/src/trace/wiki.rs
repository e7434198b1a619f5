//! A Wikipedia-like request trace in the wikibench format, and the cost of each request.
//!
//! The wikibench format (the traces of Urdaneta, Pierre and van Steen, "Wikipedia Workload
//! Analysis for Decentralized Hosting", 2009) has one request per line:
//! `<counter> <unix time with ms> <url> <save flag>`, the flag `-` or `save`. A real trace file
//! can be replayed with `--trace FILE`; without one, [`generate`] writes a synthetic one:
//!
//! - **popularity**: Zipf (s = 1) over 20,000 pages and 40,000 images;
//! - **mix**: 2/3 images (`upload.wikimedia.org`), 1/3 pages (`en.wikipedia.org/wiki/…`);
//! - **arrivals**: bursty, a Markov-modulated Poisson process that alternates, after
//!   exponentially distributed spells of 2 s on average, between `1 + burst` and `1 − burst`
//!   times the mean rate.
//!
//! What a request costs the server is a function of its URL alone ([`work`]), so a real trace
//! gets costs the same way: lognormal service time and size, by kind — images cheap and small
//! (median 4 ms, σ 0.8; 10 KB, σ 1.0), pages costlier and larger (median 60 ms, σ 1.0; 30 KB,
//! σ 0.7). The benchmark then scales all costs by one factor to load the pool as asked.

use anyhow::{Context, Result, bail};
use rand_core::{RngCore, SeedableRng};
use rand_xoshiro::Xoshiro256PlusPlus;
use std::io::{BufRead, BufWriter, Write};
use std::path::Path;

/// The start time of the synthetic trace (September 2007, as the public wikibench traces).
const EPOCH: f64 = 1_190_146_243.0;
const PAGES: usize = 20_000;
const IMAGES: usize = 40_000;

/// One request of a trace: when, relative to the trace's first, and what.
#[derive(Debug, Clone)]
pub struct Entry {
    pub seq: u64,
    pub at: f64,
    pub url: String,
}

fn unit(rng: &mut Xoshiro256PlusPlus) -> f64 {
    (rng.next_u64() >> 11) as f64 / (1u64 << 53) as f64
}

/// Cumulative Zipf weights (s = 1) of `n` items.
fn zipf_table(n: usize) -> Vec<f64> {
    let mut acc = 0.0;
    let mut v: Vec<f64> = (1..=n)
        .map(|k| {
            acc += 1.0 / k as f64;
            acc
        })
        .collect();
    for x in &mut v {
        *x /= acc;
    }
    v
}

fn zipf(table: &[f64], u: f64) -> usize {
    table.partition_point(|&c| c < u).min(table.len() - 1)
}

/// Writes a synthetic trace of `duration_s` seconds at `rate` requests/s on average.
pub fn generate(path: &Path, duration_s: f64, rate: f64, burst: f64, seed: u64) -> Result<u64> {
    let mut rng = Xoshiro256PlusPlus::seed_from_u64(seed);
    let (pages, images) = (zipf_table(PAGES), zipf_table(IMAGES));
    let file = std::fs::File::create(path).with_context(|| format!("{}", path.display()))?;
    let mut out = BufWriter::new(file);
    let (mut t, mut seq) = (0.0f64, 0u64);
    let mut high = true;
    let mut spell_end = -2.0 * unit(&mut rng).max(1e-12).ln();
    while t < duration_s {
        let r = rate * if high { 1.0 + burst } else { 1.0 - burst };
        t += -unit(&mut rng).max(1e-12).ln() / r.max(1e-9);
        if t >= duration_s - 0.001 {
            break;
        }
        if t >= spell_end {
            // Memoryless: the next arrival is drawn afresh in the new spell.
            t = spell_end;
            high = !high;
            spell_end = t - 2.0 * unit(&mut rng).max(1e-12).ln();
            continue;
        }
        let url = if unit(&mut rng) < 2.0 / 3.0 {
            let k = zipf(&images, unit(&mut rng));
            format!(
                "http://upload.wikimedia.org/wikipedia/commons/thumb/{:x}/{:02x}/Image_{k}.png",
                k % 16,
                k % 256
            )
        } else {
            format!(
                "http://en.wikipedia.org/wiki/Page_{}",
                zipf(&pages, unit(&mut rng))
            )
        };
        seq += 1;
        writeln!(out, "{seq} {:.3} {url} -", EPOCH + t)?;
    }
    out.flush()?;
    Ok(seq)
}

/// The requests of a trace file in `[0, duration_s)` from its first, kept with probability
/// `factor` each (by a hash of the counter, so the requests of a smaller factor are among
/// those of a larger one). Lines that are not requests are skipped; a file without any fails.
pub fn read(path: &Path, factor: f64, duration_s: f64) -> Result<Vec<Entry>> {
    let file = std::fs::File::open(path).with_context(|| format!("{}", path.display()))?;
    let mut v = Vec::new();
    let mut first = None;
    let (mut lines, mut bad) = (0u64, 0u64);
    for line in std::io::BufReader::new(file).lines() {
        let line = line?;
        lines += 1;
        let mut f = line.split_ascii_whitespace();
        let (Some(seq), Some(ts), Some(url)) = (f.next(), f.next(), f.next()) else {
            bad += 1;
            continue;
        };
        let (Ok(seq), Ok(ts)) = (seq.parse::<u64>(), ts.parse::<f64>()) else {
            bad += 1;
            continue;
        };
        let at = ts - *first.get_or_insert(ts);
        if at >= duration_s {
            break;
        }
        if at < 0.0 || (mix(seq) as f64) >= factor * u64::MAX as f64 {
            continue;
        }
        v.push(Entry {
            seq,
            at,
            url: url.to_string(),
        });
    }
    if v.is_empty() {
        bail!(
            "{}: no request in the first {duration_s} s ({lines} lines, {bad} not in the wikibench format)",
            path.display()
        );
    }
    Ok(v)
}

/// A 64-bit mix (splitmix64's finaliser).
fn mix(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

fn hash(s: &str) -> u64 {
    mix(s.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3)
    }))
}

/// A standard normal value from a hash (Box-Muller).
fn normal(h: u64) -> f64 {
    let u1 = ((h >> 32) as f64 + 0.5) / (1u64 << 32) as f64;
    let u2 = ((h & 0xffff_ffff) as f64 + 0.5) / (1u64 << 32) as f64;
    (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()
}

pub fn is_image(url: &str) -> bool {
    url.contains("upload.wikimedia.org")
        || [".png", ".jpg", ".jpeg", ".gif", ".svg"]
            .iter()
            .any(|e| url.to_ascii_lowercase().ends_with(e))
}

/// What serving `url` costs, before scaling: (service time in µs, response bytes).
pub fn work(url: &str) -> (f64, u64) {
    let h = hash(url);
    let (t_median, t_sigma, b_median, b_sigma) = if is_image(url) {
        (4_000.0, 0.8, 10_000.0, 1.0)
    } else {
        (60_000.0, 1.0, 30_000.0, 0.7)
    };
    let t = (t_median * (t_sigma * normal(h)).exp()).min(2_000_000.0);
    let b = (b_median * (b_sigma * normal(mix(h))).exp()).min(1_000_000.0);
    (t, b as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_synthetic_trace_has_the_asked_rate_mix_and_sampling() {
        let dir = std::env::temp_dir().join(format!("wiki-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap_or_default();
        let path = dir.join("trace");
        let n = generate(&path, 60.0, 500.0, 0.5, 7).unwrap_or(0);
        assert!((25_000..35_000).contains(&n), "{n}");
        let all = read(&path, 1.0, 60.0).unwrap_or_default();
        assert_eq!(all.len() as u64, n);
        let images = all.iter().filter(|e| is_image(&e.url)).count() as f64;
        assert!((images / n as f64 - 2.0 / 3.0).abs() < 0.02);
        let eighth = read(&path, 0.125, 60.0).unwrap_or_default();
        assert!((eighth.len() as f64 / n as f64 - 0.125).abs() < 0.01);
        let sixteenth = read(&path, 0.0625, 60.0).unwrap_or_default();
        assert!(
            sixteenth
                .iter()
                .all(|e| eighth.iter().any(|x| x.seq == e.seq))
        );
        let mean: f64 = all.iter().map(|e| work(&e.url).0).sum::<f64>() / n as f64;
        assert!((25_000.0..50_000.0).contains(&mean), "{mean}");
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn a_file_in_another_format_is_refused() {
        let path = std::env::temp_dir().join(format!("wiki-bad-{}", std::process::id()));
        std::fs::write(&path, "GET / HTTP/1.1\n").unwrap_or_default();
        let e = read(&path, 1.0, 10.0).map(|v| v.len());
        assert!(e.is_err());
        let _ = std::fs::remove_file(&path);
    }
}
