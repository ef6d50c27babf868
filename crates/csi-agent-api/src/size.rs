//! Byte sizes as people type them, one convention for every csi-agent tool (csictl's
//! `--capacity`, csi-testplugin's `--volumes` and `--capacity`): a byte count with an optional
//! SI suffix `k`/`K`, `M`, `G`, `T`, `P` (powers of 1000) or IEC suffix `Ki`, `Mi`, `Gi`, `Ti`,
//! `Pi` (powers of 1024), optionally followed by `B`. `1G` is 10^9 bytes and `1Gi` 2^30: the
//! two are never confused, and sizes are printed in IEC units (`1.5Gi`), which parse back.
//!
//! This module owns parsing and printing only; what a size means is the caller's business.

/// Why a size was refused; the message says what is expected.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum SizeError {
    /// Not digits with one of the suffixes.
    #[error(
        "expected a byte count with an optional suffix k, M, G, T, P (powers of 1000) or Ki, Mi, \
         Gi, Ti, Pi (powers of 1024), e.g. 10Gi"
    )]
    Malformed,
    /// More than `i64::MAX` bytes.
    #[error("too large: at most 2^63-1 bytes (8Ei)")]
    TooLarge,
}

/// A byte count: an integer with an optional suffix, `k M G T P` (powers of 1000) or
/// `Ki Mi Gi Ti Pi` (powers of 1024), optionally followed by `B` (`10GiB`, `500MB`).
pub fn parse_size(raw: &str) -> Result<i64, SizeError> {
    let text = raw.trim();
    let split = text
        .find(|c: char| !c.is_ascii_digit())
        .unwrap_or(text.len());
    let (digits, suffix) = text.split_at(split);
    if digits.is_empty() {
        return Err(SizeError::Malformed);
    }
    let suffix = suffix.strip_suffix('B').unwrap_or(suffix);
    let multiplier: i64 = match suffix {
        "" => 1,
        "k" | "K" => 1_000,
        "M" => 1_000_000,
        "G" => 1_000_000_000,
        "T" => 1_000_000_000_000,
        "P" => 1_000_000_000_000_000,
        "Ki" => 1 << 10,
        "Mi" => 1 << 20,
        "Gi" => 1 << 30,
        "Ti" => 1 << 40,
        "Pi" => 1 << 50,
        _ => return Err(SizeError::Malformed),
    };
    digits
        .parse::<i64>()
        .ok()
        .and_then(|n| n.checked_mul(multiplier))
        .ok_or(SizeError::TooLarge)
}

/// `10Gi`, `1.5Gi`, `512` (bytes below 1 KiB).
pub fn human(bytes: i64) -> String {
    const UNITS: &[(&str, i64)] = &[
        ("Pi", 1 << 50),
        ("Ti", 1 << 40),
        ("Gi", 1 << 30),
        ("Mi", 1 << 20),
        ("Ki", 1 << 10),
    ];
    for (suffix, unit) in UNITS {
        if bytes >= *unit {
            if bytes % unit == 0 {
                return format!("{}{suffix}", bytes / unit);
            }
            // Display only; precision loss of the float is irrelevant at one decimal.
            #[allow(clippy::cast_precision_loss)]
            let value = bytes as f64 / *unit as f64;
            return format!("{value:.1}{suffix}");
        }
    }
    bytes.to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_parse() {
        for (raw, bytes) in [
            ("0", 0),
            ("512", 512),
            ("10k", 10_000),
            ("10K", 10_000),
            ("10M", 10_000_000),
            ("10MB", 10_000_000),
            ("1G", 1_000_000_000),
            ("2T", 2_000_000_000_000),
            ("1P", 1_000_000_000_000_000),
            ("1Ki", 1024),
            ("1Mi", 1 << 20),
            ("1Gi", 1 << 30),
            ("1GiB", 1 << 30),
            ("3Ti", 3 << 40),
            ("1Pi", 1 << 50),
            (" 4Gi ", 4 << 30),
        ] {
            assert_eq!(parse_size(raw), Ok(bytes), "{raw}");
        }
    }

    #[test]
    fn bad_sizes_are_refused() {
        for raw in ["", "Gi", "1.5Gi", "-1", "1X", "1gi", "1 Gi", "1iB"] {
            let Err(err) = parse_size(raw) else {
                panic!("accepted {raw:?}");
            };
            assert_eq!(err, SizeError::Malformed, "{raw}");
            assert!(err.to_string().contains("e.g. 10Gi"), "{raw}: {err}");
        }
        assert_eq!(parse_size("9999999Pi"), Err(SizeError::TooLarge));
        assert_eq!(parse_size("99999999999999999999"), Err(SizeError::TooLarge));
    }

    #[test]
    fn sizes_for_people() {
        assert_eq!(human(0), "0");
        assert_eq!(human(1023), "1023");
        assert_eq!(human(1024), "1Ki");
        assert_eq!(human(10 << 30), "10Gi");
        assert_eq!(human(1536 << 20), "1.5Gi");
    }
}
