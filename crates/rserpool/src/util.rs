//! Small helpers shared by the subcommands.

/// The UTC date now: (year, month, day, seconds since midnight).
pub fn utc_now() -> (i64, u32, u32, u64) {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    // Civil date from days since 1970-01-01 (Howard Hinnant's algorithm).
    let z = (secs / 86_400) as i64 + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let m = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    let y = yoe + era * 400 + i64::from(m <= 2);
    (y, m, d, secs % 86_400)
}

/// Raises the open-file limit as far as allowed (root: to `want`): a registrar or a benchmark
/// with tens of thousands of connections needs one descriptor each.
pub fn raise_nofile_limit(want: u64) -> u64 {
    use rlimit::Resource;
    let (soft, hard) = Resource::NOFILE.get().unwrap_or((1024, 1024));
    if soft >= want {
        return soft;
    }
    if hard < want && Resource::NOFILE.set(want, want).is_ok() {
        return want;
    }
    let _ = Resource::NOFILE.set(hard.min(want).max(soft), hard);
    Resource::NOFILE.get().map_or(soft, |(s, _)| s)
}
