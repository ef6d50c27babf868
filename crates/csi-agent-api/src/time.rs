//! Timestamps of the API: RFC 3339 in UTC, without a date library (and the calendar
//! arithmetic the benchmark's report dates share). Owns formatting only.

use std::time::{SystemTime, UNIX_EPOCH};

/// `2026-12-06T08:17:31.123Z`: UTC, milliseconds.
pub fn rfc3339(at: SystemTime) -> String {
    let since = at.duration_since(UNIX_EPOCH).unwrap_or_default();
    let secs = since.as_secs();
    let (days, rest) = (secs / 86_400, secs % 86_400);
    // Howard Hinnant's civil_from_days, for days since 1970-01-01 (never negative here).
    let z = days + 719_468;
    let era = z / 146_097;
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + u64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}.{:03}Z",
        rest / 3600,
        rest % 3600 / 60,
        rest % 60,
        since.subsec_millis()
    )
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    #[test]
    fn rfc3339_dates() {
        let at =
            |secs: u64, ms: u64| UNIX_EPOCH + Duration::from_secs(secs) + Duration::from_millis(ms);
        assert_eq!(rfc3339(at(0, 0)), "1970-01-01T00:00:00.000Z");
        // 2000-02-29 (a leap day of a century leap year) 12:34:56.789.
        assert_eq!(rfc3339(at(951_827_696, 789)), "2000-02-29T12:34:56.789Z");
        assert_eq!(rfc3339(at(1_798_761_599, 0)), "2026-12-31T23:59:59.000Z");
        assert_eq!(rfc3339(at(4_107_542_400, 0)), "2100-03-01T00:00:00.000Z");
    }
}
