//! `csictl stats PLUGIN VOLUME_ID`: a published volume's usage and condition, through
//! `GET /v1/volumes/{plugin}/{volume_id}/stats` (the plugin's NodeGetVolumeStats), and the
//! condition note of `csictl volumes`.
//!
//! This module owns that command's call and text; like the rest of csictl it must not link
//! the engine. Figures the plugin did not report are shown as `-`, never as 0.

use csi_agent_api::{ApiClient, UsageFigures, VolumeCondition, VolumeStats};

use crate::args::{OutputFormat, VolumeRef};
use crate::commands::render;
use crate::failure::Failure;
use crate::output::{bytes_with_human, cell, fields};

pub async fn stats(
    client: &ApiClient,
    format: OutputFormat,
    volume: &VolumeRef,
) -> Result<String, Failure> {
    let (plugin, volume_id) = volume.resolve()?;
    render(
        format,
        &client.volume_stats(&plugin, &volume_id).await?,
        table,
    )
}

fn figure(value: Option<u64>, bytes: bool) -> String {
    match value {
        None => "-".to_owned(),
        Some(v) if bytes => bytes_with_human(i64::try_from(v).unwrap_or(i64::MAX)),
        Some(v) => v.to_string(),
    }
}

fn usage(u: Option<&UsageFigures>, bytes: bool) -> String {
    match u {
        None => "not reported".to_owned(),
        Some(u) => format!(
            "used {}, available {}, total {}",
            figure(u.used, bytes),
            figure(u.available, bytes),
            figure(u.total, bytes)
        ),
    }
}

/// `abnormal: <message>`, `normal`.
pub fn condition(c: &VolumeCondition) -> String {
    match (c.abnormal, c.message.is_empty()) {
        (true, true) => "abnormal".to_owned(),
        (true, false) => format!("abnormal: {}", cell(&c.message)),
        (false, true) => "normal".to_owned(),
        (false, false) => format!("normal: {}", cell(&c.message)),
    }
}

fn table(s: &VolumeStats) -> String {
    let mut pairs = vec![
        ("bytes", usage(s.bytes.as_ref(), true)),
        ("inodes", usage(s.inodes.as_ref(), false)),
    ];
    pairs.push((
        "condition",
        s.condition
            .as_ref()
            .map_or_else(|| "not reported".to_owned(), condition),
    ));
    pairs.push(("collected at", s.collected_at.clone()));
    fields(&pairs)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn absent_figures_are_not_zero() {
        let s = VolumeStats {
            bytes: Some(UsageFigures {
                total: Some(16 << 20),
                used: None,
                available: Some(0),
            }),
            inodes: None,
            condition: Some(VolumeCondition {
                abnormal: true,
                message: "disk\non fire".into(),
            }),
            collected_at: "2026-12-06T08:00:00.000Z".into(),
        };
        let text = table(&s);
        assert!(
            text.contains("used -, available 0, total 16777216 (16Mi)"),
            "{text}"
        );
        assert!(
            text.contains("inodes") && text.contains("not reported"),
            "{text}"
        );
        assert!(
            !text.contains("disk\non"),
            "control characters escaped: {text}"
        );
        assert!(text.contains("abnormal: disk"), "{text}");
    }
}
