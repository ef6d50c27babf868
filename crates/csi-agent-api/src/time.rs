//! Calendar dates of Unix times, for the times the contract shows as text (a snapshot's
//! `creation_time`, RFC 3339 in UTC) and for reports. Owns the one conversion from days since
//! 1970 to a civil date; must not read the clock.

use std::time::{SystemTime, UNIX_EPOCH};

/// The civil date (year, month 1–12, day 1–31) of `days` since 1970-01-01 (Howard Hinnant's
/// `civil_from_days`, proleptic Gregorian).
pub fn civil_from_days(days: i64) -> (i64, i64, i64) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1_460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    (yoe + era * 400 + i64::from(month <= 2), month, day)
}

/// `2026-12-06T08:17:31.123Z` (UTC, milliseconds) of a clock reading (one before 1970 shows
/// as 1970-01-01): the `collected_at` of volume stats and the benchmark's report dates.
pub fn rfc3339_millis(at: SystemTime) -> String {
    let since = at.duration_since(UNIX_EPOCH).unwrap_or_default();
    let secs = i64::try_from(since.as_secs()).unwrap_or(i64::MAX);
    let (year, month, day) = civil_from_days(secs / 86_400);
    let rest = secs % 86_400;
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}.{:03}Z",
        rest / 3600,
        rest % 3600 / 60,
        rest % 60,
        since.subsec_millis()
    )
}

/// RFC 3339 in UTC (`2026-12-06T08:17:31.5Z`) of Unix `seconds` and `nanos`; `None` before 1970,
/// after 9999 or for nanoseconds out of range (a plugin's nonsense is not shown as a date).
pub fn rfc3339(seconds: i64, nanos: i32) -> Option<String> {
    if !(0..253_402_300_800).contains(&seconds) || !(0..1_000_000_000).contains(&nanos) {
        return None;
    }
    let (year, month, day) = civil_from_days(seconds / 86_400);
    let rem = seconds % 86_400;
    let fraction = if nanos == 0 {
        String::new()
    } else {
        format!(".{nanos:09}").trim_end_matches('0').to_owned()
    };
    Some(format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}{fraction}Z",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60
    ))
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use std::time::{Duration, UNIX_EPOCH};

    use super::{rfc3339, rfc3339_millis};

    #[test]
    fn clock_readings_are_rfc3339_utc_with_milliseconds() {
        let at =
            |secs: u64, ms: u64| UNIX_EPOCH + Duration::from_secs(secs) + Duration::from_millis(ms);
        assert_eq!(rfc3339_millis(at(0, 0)), "1970-01-01T00:00:00.000Z");
        // 2000-02-29 (a leap day of a century leap year) 12:34:56.789.
        assert_eq!(
            rfc3339_millis(at(951_827_696, 789)),
            "2000-02-29T12:34:56.789Z"
        );
        assert_eq!(
            rfc3339_millis(at(1_798_761_599, 0)),
            "2026-12-31T23:59:59.000Z"
        );
        assert_eq!(
            rfc3339_millis(at(4_107_542_400, 0)),
            "2100-03-01T00:00:00.000Z"
        );
    }

    #[test]
    fn times_are_rfc3339_utc_and_nonsense_is_none() {
        assert_eq!(rfc3339(0, 0).as_deref(), Some("1970-01-01T00:00:00Z"));
        assert_eq!(
            rfc3339(1_796_545_051, 500_000_000).as_deref(),
            Some("2026-12-06T08:17:31.5Z")
        );
        assert_eq!(
            rfc3339(951_782_400, 1).as_deref(),
            Some("2000-02-29T00:00:00.000000001Z")
        );
        assert_eq!(rfc3339(-1, 0), None);
        assert_eq!(rfc3339(253_402_300_800, 0), None);
        assert_eq!(rfc3339(0, 1_000_000_000), None);
        assert_eq!(rfc3339(0, -1), None);
    }
}
