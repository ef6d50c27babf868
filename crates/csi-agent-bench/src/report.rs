//! Formatting: a markdown table per benchmark, the `all` subcommand, and the summary of the
//! targets of docs/benchmarks.md with PASS/FAIL.

use std::fmt::Write as _;
use std::path::PathBuf;

use anyhow::Context;
use serde::Serialize;

use crate::cycle::{self, CycleArgs, CycleReport, MountMode, Phase, VariantReport};
use crate::env::{Env, Machine, in_private_mount_namespace};
use crate::restart::{self, RestartArgs, RestartReport};
use crate::supervision::{self, SupervisionArgs, SupervisionReport};
use crate::throughput::{self, ThroughputArgs, ThroughputReport};

#[derive(Clone, Debug, clap::Args)]
pub struct AllArgs {
    /// Write the markdown here instead of stdout.
    #[arg(long)]
    pub markdown: Option<PathBuf>,
    /// Smaller sizes (a smoke test; the figures are not the documented ones).
    #[arg(long)]
    pub quick: bool,
    /// Skip the bind-mode cycle even in a private mount namespace.
    #[arg(long)]
    pub skip_bind: bool,
}

#[derive(Clone, Debug, Serialize)]
pub struct AllReport {
    pub machine: Machine,
    pub cycle: CycleReport,
    pub cycle_bind: Option<CycleReport>,
    pub throughput: ThroughputReport,
    pub restart: RestartReport,
    pub supervision: SupervisionReport,
}

pub async fn run_all(env: &Env, args: &AllArgs) -> anyhow::Result<()> {
    let mut cycle_args = CycleArgs::default();
    let mut throughput_args = ThroughputArgs::default();
    let mut restart_args = RestartArgs::default();
    let supervision_args = SupervisionArgs::default();
    if args.quick {
        cycle_args.iterations = 200;
        cycle_args.warmup = 20;
        cycle_args.block = 50;
        throughput_args.rounds = 1;
        restart_args.volumes = 1000;
        restart_args.settle_ms = 200;
    }
    let cycle = cycle::run(env, &cycle_args).await.context("cycle")?;
    eprint!("{}", cycle_table(&cycle));
    env.write_json("cycle", &cycle)?;
    let cycle_bind = if !args.skip_bind && in_private_mount_namespace() {
        let bind_args = CycleArgs {
            iterations: if args.quick { 50 } else { 500 },
            warmup: 20,
            block: 50,
            mount_mode: MountMode::Bind,
            skip_controller_publish: true,
            count_cycles: 5,
            only: Vec::new(),
        };
        let report = cycle::run(env, &bind_args).await.context("cycle (bind)")?;
        eprint!("{}", cycle_table(&report));
        env.write_json("cycle-bind", &report)?;
        Some(report)
    } else {
        eprintln!(
            "bind-mode cycle skipped (needs a private mount namespace: `unshare -m --propagation private`)"
        );
        None
    };
    let throughput = throughput::run(env, &throughput_args)
        .await
        .context("throughput")?;
    eprint!("{}", throughput_table(&throughput));
    env.write_json("throughput", &throughput)?;
    let restart = restart::run(env, &restart_args).await.context("restart")?;
    eprint!("{}", restart_table(&restart));
    env.write_json("restart", &restart)?;
    let supervision = supervision::run(env, &supervision_args)
        .await
        .context("supervision")?;
    eprint!("{}", supervision_table(&supervision));
    env.write_json("supervision", &supervision)?;

    let all = AllReport {
        machine: cycle.machine.clone(),
        cycle,
        cycle_bind,
        throughput,
        restart,
        supervision,
    };
    env.write_json("all", &all)?;
    let markdown = all_markdown(&all);
    match &args.markdown {
        Some(path) => {
            std::fs::write(path, &markdown)
                .with_context(|| format!("cannot write {}", path.display()))?;
            eprintln!("markdown written to {}", path.display());
        }
        None => print!("{markdown}"),
    }
    Ok(())
}

fn pass(ok: bool) -> &'static str {
    if ok { "**PASS**" } else { "**FAIL**" }
}

fn machine_line(m: &Machine) -> String {
    format!(
        "{} · {} × {} · {} GiB · {} · temp dir on {} ({})",
        m.date_utc, m.cpus, m.cpu_model, m.memory_gib, m.kernel, m.tmp_fs, m.tmp_dir
    )
}

fn phase_row(out: &mut String, name: &str, phase: &Phase, raw: &Phase) {
    let b = &phase.breakdown;
    let _ = writeln!(
        out,
        "| {name} | {:.3} | {:.3} | {:.3} | {:.3} | {:.3} | {:.2}× | {:.1} in {:.3} | {:.3} | {:.3} |",
        phase.cycle.mean_ms,
        phase.cycle.p50_ms,
        phase.cycle.p99_ms,
        phase.publish.mean_ms,
        phase.unpublish.mean_ms,
        phase.cycle.mean_ms / raw.cycle.mean_ms,
        b.rpcs_per_cycle,
        b.rpc_ms,
        b.fsync_ms,
        b.other_ms
    );
}

fn variant_section(out: &mut String, report: &CycleReport, v: &VariantReport) {
    let mode = match report.mount_mode {
        MountMode::None => "none",
        MountMode::Bind => "bind",
    };
    let _ = writeln!(
        out,
        "#### Variant `{}` (`--mount-mode {mode}`, {} RPCs per cycle; {} measured cycles each, {} warm-up)\n",
        v.name, v.rpcs_per_cycle, report.iterations, report.warmup
    );
    let _ = writeln!(
        out,
        "| contender | cycle mean (ms) | p50 | p99 | publish mean | unpublish mean | cycle / raw | RPCs in ms | fsync ms | other ms |"
    );
    let _ = writeln!(out, "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
    phase_row(out, "raw RPC sequence", &v.raw, &v.raw);
    phase_row(
        out,
        "(diagnostic) raw + the same durable writes inline",
        &v.raw_durable,
        &v.raw,
    );
    phase_row(out, "engine in-process", &v.engine, &v.raw);
    phase_row(
        out,
        "daemon over HTTP (`ApiClient`: kept-alive connections)",
        &v.daemon,
        &v.raw,
    );
    phase_row(
        out,
        "(diagnostic) daemon over HTTP, a fresh connection per request (as `csictl`)",
        &v.daemon_fresh,
        &v.raw,
    );
    let w = &v.writes;
    let c = &v.cycle_check;
    let _ = writeln!(
        out,
        "\n- Durable write (`write_atomic` of a {}-byte record, same file system, same run): \
         mean {:.3} ms, p50 {:.3}, p99 {:.3}; through `spawn_blocking` as the engine makes \
         it: mean {:.3}, p50 {:.3}. The daemon's own fsync time per checkpoint write (its \
         histogram, directory fsyncs included): {:.3} ms.",
        record_size(),
        v.durable_write.mean_ms,
        v.durable_write.p50_ms,
        v.durable_write.p99_ms,
        v.durable_write_blocking.mean_ms,
        v.durable_write_blocking.p50_ms,
        v.daemon_fsync_per_write_ms
    );
    let _ = writeln!(
        out,
        "- The engine's durable work of one cycle alone (its `Store`: {} record writes, the \
         first creating the volume's directory, then the delete removing it; no RPC): mean \
         {:.3} ms, p50 {:.3} — vs {:.3} ms by the formula's writes × write.",
        v.writes.daemon_per_publish + v.writes.daemon_per_unpublish,
        v.store_cycle.mean_ms,
        v.store_cycle.p50_ms,
        v.cycle_check.writes_per_cycle * v.durable_write.mean_ms
    );
    let _ = writeln!(
        out,
        "- Durable writes per publish / unpublish: engine {:.2} / {:.2}, daemon {:.2} / {:.2} \
         (daemon, measured cycles: {:.2} per cycle).",
        w.engine_per_publish,
        w.engine_per_unpublish,
        w.daemon_per_publish,
        w.daemon_per_unpublish,
        w.daemon_per_cycle_measured
    );
    let _ = writeln!(
        out,
        "- One `GET /v1/health` round trip: {:.3} ms with a fresh connection, {:.3} ms on a \
         kept-alive one (p50 {:.3} / {:.3}).",
        v.health_fresh.mean_ms,
        v.health_keepalive.mean_ms,
        v.health_fresh.p50_ms,
        v.health_keepalive.p50_ms
    );
    let _ = writeln!(
        out,
        "- Inside the daemon (its operation histogram): publish {:.3} ms, unpublish {:.3} ms; \
         the remaining {:.3} ms of the daemon's cycle are HTTP, JSON and the client.",
        v.daemon_inside_publish_ms,
        v.daemon_inside_unpublish_ms,
        v.daemon.cycle.mean_ms - v.daemon_inside_publish_ms - v.daemon_inside_unpublish_ms
    );
    let _ = writeln!(
        out,
        "- §9 cycle check (means): daemon {:.3} ms ≤ raw {:.3} + {:.0} × {:.3} + {:.1} = \
         {:.3} ms → {} (margin {:+.3} ms). On medians: {:.3} ≤ {:.3} → {}.",
        c.daemon_mean_ms,
        c.raw_mean_ms,
        c.writes_per_cycle,
        c.durable_write_ms,
        c.allowance_ms,
        c.budget_ms,
        pass(c.pass),
        c.margin_ms,
        c.daemon_p50_ms,
        c.budget_p50_ms,
        pass(c.pass_p50)
    );
    let _ = writeln!(
        out,
        "- §9 writes check: {:.0} per publish, {:.0} per unpublish (target ≤ 3; floor with one \
         durable intent per RPC plus the result: {:.0}) → {}.\n",
        v.writes_check.publish,
        v.writes_check.unpublish,
        v.writes_check.floor_per_operation,
        pass(v.writes_check.pass)
    );
}

fn record_size() -> usize {
    cycle::sample_record().map_or(0, |b| b.len())
}

pub fn cycle_table(report: &CycleReport) -> String {
    let mut out = String::new();
    let title = match report.mount_mode {
        MountMode::None => "",
        MountMode::Bind => ", plugin in bind mode (real bind mounts)",
    };
    let _ = writeln!(out, "\n### Publish+unpublish cycle, sequential{title}\n");
    let _ = writeln!(out, "{}\n", machine_line(&report.machine));
    for v in &report.variants {
        variant_section(&mut out, report, v);
    }
    out
}

pub fn throughput_table(r: &ThroughputReport) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "\n### Throughput: {} volumes, {} concurrent clients (median of {} rounds{}{}{})\n",
        r.volumes,
        r.concurrency,
        r.rounds,
        if r.settle_s > 0 {
            format!(", {} s pause before each phase", r.settle_s)
        } else {
            String::new()
        },
        if r.mount_mode == MountMode::Bind {
            ", plugin in bind mode"
        } else {
            ""
        },
        if r.plugin_volatile_state {
            ", plugin state volatile"
        } else {
            ""
        }
    );
    let _ = writeln!(out, "{}\n", machine_line(&r.machine));
    let _ = writeln!(
        out,
        "| contender | publish (volumes/s) | unpublish (volumes/s) | publish+unpublish (volumes/s) | publish / raw | unpublish / raw |"
    );
    let _ = writeln!(out, "|---|---:|---:|---:|---:|---:|");
    for (name, rates) in [
        ("raw RPC sequence", &r.raw),
        ("engine in-process", &r.engine),
        ("daemon over HTTP", &r.daemon),
    ] {
        let _ = writeln!(
            out,
            "| {name} | {:.0} | {:.0} | {:.0} | {:.2}× | {:.2}× |",
            rates.publish_per_s,
            rates.unpublish_per_s,
            rates.cycle_per_s,
            rates.publish_per_s / r.raw.publish_per_s,
            rates.unpublish_per_s / r.raw.unpublish_per_s
        );
    }
    let rounds = |v: &[f64]| {
        v.iter()
            .map(|x| format!("{x:.0}"))
            .collect::<Vec<_>>()
            .join(", ")
    };
    let _ = writeln!(
        out,
        "\n- Every round (publish, volumes/s): raw {}; engine {}; daemon {}.",
        rounds(&r.raw.publish_rounds),
        rounds(&r.engine.publish_rounds),
        rounds(&r.daemon.publish_rounds)
    );
    let _ = writeln!(
        out,
        "- CPU per operation (µs, median of rounds; `/proc/<pid>/task/*/schedstat`), publish / \
         unpublish, and how busy the machine's CPUs were:\n\n\
         | contender | benchmark process (client) | csi-agentd | plugin | total | CPUs busy | \
         wake-ups per op: client, daemon, plugin |\n\
         |---|---:|---:|---:|---:|---:|---:|"
    );
    for (name, rates) in [
        ("raw RPC sequence", &r.raw),
        ("engine in-process", &r.engine),
        ("daemon over HTTP", &r.daemon),
    ] {
        let (p, u) = (&rates.publish_cpu, &rates.unpublish_cpu);
        let _ = writeln!(
            out,
            "| {name} | {:.0} / {:.0} | {:.0} / {:.0} | {:.0} / {:.0} | {:.0} / {:.0} | {:.0} % / {:.0} % | {:.1}, {:.1}, {:.1} / {:.1}, {:.1}, {:.1} |",
            p.client_us,
            u.client_us,
            p.daemon_us,
            u.daemon_us,
            p.plugin_us,
            u.plugin_us,
            p.total_us(),
            u.total_us(),
            p.machine_busy * 100.0,
            u.machine_busy * 100.0,
            p.client_runs,
            p.daemon_runs,
            p.plugin_runs,
            u.client_runs,
            u.daemon_runs,
            u.plugin_runs
        );
    }
    out.push('\n');
    let _ = writeln!(
        out,
        "- Durable writes (store commits) of the daemon under {} clients: {:.3} per publish, \
         {:.3} per unpublish (group commit shares them).",
        r.concurrency, r.daemon_writes_per_publish, r.daemon_writes_per_unpublish
    );
    let _ = writeln!(
        out,
        "- §9 throughput check: daemon publish {:.2}× raw (target ≥ {:.1}×) → {}; unpublish \
         {:.2}× → {}.\n",
        r.daemon_to_raw_publish,
        r.min_ratio,
        pass(r.pass),
        r.daemon_to_raw_unpublish,
        pass(r.pass_unpublish)
    );
    out
}

pub fn restart_table(r: &RestartReport) -> String {
    let mut out = String::new();
    let _ = writeln!(out, "\n### Restart with {} volume records\n", r.volumes);
    let _ = writeln!(out, "{}\n", machine_line(&r.machine));
    let _ = writeln!(out, "| measurement | value | target | result |");
    let _ = writeln!(out, "|---|---:|---:|---|");
    let _ = writeln!(
        out,
        "| spawn → `GET /v1/health` answers | {:.1} ms | ≤ 1000 ms | {} |",
        r.health_ms,
        pass(r.health_ms <= restart::MAX_SERVE_MS)
    );
    let _ = writeln!(
        out,
        "| spawn → a publish answers | {:.1} ms | ≤ 1000 ms | {} |",
        r.first_publish_ms,
        pass(r.first_publish_ms <= restart::MAX_SERVE_MS)
    );
    let _ = writeln!(
        out,
        "| spawn → `GET /v1/volumes` lists all {} as PUBLISHED | {:.1} ms ({} listed) | ≤ 1000 ms, all | {} |",
        r.volumes,
        r.all_listed_ms,
        r.published_listed,
        pass(r.recovered_pass)
    );
    let _ = writeln!(
        out,
        "| recovery (daemon's `csi_agent_recovery_seconds`) | {:.1} ms | | |",
        r.recovery_metric_ms
    );
    let _ = writeln!(
        out,
        "| plugin adopted, not relaunched | {} | yes | {} |",
        if r.plugin_adopted { "yes" } else { "no" },
        pass(r.plugin_adopted)
    );
    let _ = writeln!(
        out,
        "| VmRSS idle (no volume, plugin not launched yet) | {:.1} MiB | ≤ 16 MiB | {} |",
        r.rss_idle_mib,
        pass(r.rss_idle_mib <= restart::MAX_IDLE_MIB)
    );
    let _ = writeln!(
        out,
        "| VmRSS idle after one publish+unpublish (plugin connected) | {:.1} MiB | ≤ 16 MiB | {} |",
        r.rss_idle_after_use_mib,
        pass(r.rss_idle_after_use_mib <= restart::MAX_IDLE_MIB)
    );
    let _ = writeln!(
        out,
        "| VmRSS with {} published (after publishing them; peak {:.1}) | {:.1} MiB | ≤ {:.0} MiB | {} |",
        r.volumes,
        r.hwm_loaded_mib,
        r.rss_loaded_mib,
        r.loaded_bound_mib,
        pass(r.rss_loaded_mib <= r.loaded_bound_mib)
    );
    let _ = writeln!(
        out,
        "| VmRSS with {} published (after the restart; peak {:.1}) | {:.1} MiB | ≤ {:.0} MiB | {} |",
        r.volumes,
        r.hwm_after_restart_mib,
        r.rss_after_restart_mib,
        r.loaded_bound_mib,
        pass(r.rss_after_restart_mib <= r.loaded_bound_mib)
    );
    let _ = writeln!(
        out,
        "\nSet-up: {} volumes published through the API in {:.1} s ({:.0}/s); SIGTERM → exit \
         {:.1} ms.\n",
        r.volumes, r.publish_all_s, r.publish_all_per_s, r.shutdown_ms
    );
    out
}

pub fn supervision_table(r: &SupervisionReport) -> String {
    let mut out = String::new();
    let _ = writeln!(out, "\n### Plugin supervision ({} runs)\n", r.runs);
    let _ = writeln!(out, "{}\n", machine_line(&r.machine));
    let _ = writeln!(
        out,
        "| measurement | mean (ms) | p50 | max | target | result |"
    );
    let _ = writeln!(out, "|---|---:|---:|---:|---:|---|");
    let row = |out: &mut String,
               name: &str,
               s: &crate::stats::Summary,
               target: &str,
               ok: Option<bool>| {
        let _ = writeln!(
            out,
            "| {name} | {:.2} | {:.2} | {:.2} | {target} | {} |",
            s.mean_ms,
            s.p50_ms,
            s.max_ms,
            ok.map_or("", pass)
        );
    };
    row(
        &mut out,
        "plugin's own start (exec → socket)",
        &r.own_start,
        "",
        None,
    );
    row(
        &mut out,
        "socket appears → ready (every launch)",
        &r.socket_to_ready,
        "≤ 5 ms",
        Some(r.socket_pass),
    );
    row(
        &mut out,
        "kill -9 → ready again",
        &r.kill_to_ready,
        &format!("≤ 200 + {:.1} ms", r.own_start.mean_ms),
        Some(r.restart_pass),
    );
    let _ = writeln!(
        out,
        "\n- Socket → ready is judged on the mean; every launch within 5 ms: {} (max {:.2} ms). \
         Connects refused right after the socket appeared (bound, not yet listening; each \
         retried after a ~1 ms sleep): {:.2} per launch.",
        if r.socket_pass_max { "yes" } else { "no" },
        r.socket_to_ready.max_ms,
        r.refused_connects_per_launch
    );
    let _ = writeln!(
        out,
        "- Restart overhead beyond the plugin's own start: mean {:.1} ms, worst {:.1} ms \
         (kill → ready minus the mean own start).",
        r.restart_overhead_mean_ms, r.restart_overhead_max_ms
    );
    let _ = writeln!(
        out,
        "- First launch through the service manager (request → ready): {:.1} ms.\n",
        r.first_launch_ms
    );
    match &r.oci {
        Some(oci) => {
            let _ = writeln!(
                out,
                "| runtime | kill -9 → ready again, mean (ms) | p50 | max | first launch (ms) |"
            );
            let _ = writeln!(out, "|---|---:|---:|---:|---:|");
            let _ = writeln!(
                out,
                "| process | {:.2} | {:.2} | {:.2} | {:.1} |",
                r.kill_to_ready.mean_ms,
                r.kill_to_ready.p50_ms,
                r.kill_to_ready.max_ms,
                r.first_launch_ms
            );
            let _ = writeln!(
                out,
                "| oci (runc) | {:.2} | {:.2} | {:.2} | {:.1} |",
                oci.kill_to_ready.mean_ms,
                oci.kill_to_ready.p50_ms,
                oci.kill_to_ready.max_ms,
                oci.first_launch_ms
            );
            let _ = writeln!(
                out,
                "\n- A container adds {:.1} ms (mean) to a plugin's start → ready: target ≤ {} ms, {}.\n",
                oci.overhead_mean_ms,
                crate::supervision::MAX_CONTAINER_OVERHEAD_MS,
                pass(oci.pass)
            );
        }
        None => {
            let _ = writeln!(out, "- oci runtime not measured: runc is not installed.\n");
        }
    }
    out
}

/// The whole report, ready for docs/benchmarks.md.
pub fn all_markdown(all: &AllReport) -> String {
    let mut out = String::new();
    let _ = writeln!(out, "## Results\n");
    let _ = writeln!(out, "Run: {}\n", machine_line(&all.machine));
    let _ = writeln!(out, "### Targets\n");
    let _ = writeln!(out, "| target | measured | result |");
    let _ = writeln!(out, "|---|---|---|");
    for v in &all.cycle.variants {
        let _ = writeln!(
            out,
            "| durable writes ≤ 3 per publish and ≤ 3 per unpublish (`{}`) | {:.0} / {:.0} | {} |",
            v.name,
            v.writes_check.publish,
            v.writes_check.unpublish,
            pass(v.writes_check.pass)
        );
    }
    for v in &all.cycle.variants {
        let c = &v.cycle_check;
        let _ = writeln!(
            out,
            "| daemon cycle ≤ raw + writes × write + 0.3 ms (`{}`, means) | {:.3} ≤ {:.3} + {:.0} × {:.3} + 0.3 = {:.3} ms; {:.2}× raw | {} |",
            v.name,
            c.daemon_mean_ms,
            c.raw_mean_ms,
            c.writes_per_cycle,
            c.durable_write_ms,
            c.budget_ms,
            v.ratios.daemon_to_raw_mean,
            pass(c.pass)
        );
    }
    let t = &all.throughput;
    let _ = writeln!(
        out,
        "| {} volumes by {} clients: daemon ≥ {:.1}× raw (publish) | {:.0} vs {:.0} volumes/s = {:.2}× | {} |",
        t.volumes,
        t.concurrency,
        t.min_ratio,
        t.daemon.publish_per_s,
        t.raw.publish_per_s,
        t.daemon_to_raw_publish,
        pass(t.pass)
    );
    let r = &all.restart;
    let _ = writeln!(
        out,
        "| restart with {} records: serving in ≤ 1 s | health {:.0} ms, first publish {:.0} ms | {} |",
        r.volumes,
        r.health_ms,
        r.first_publish_ms,
        pass(r.serve_pass)
    );
    let _ = writeln!(
        out,
        "| restart: all records recovered (listed) in ≤ 1 s | {} of {} in {:.0} ms | {} |",
        r.published_listed,
        r.volumes,
        r.all_listed_ms,
        pass(r.recovered_pass)
    );
    let _ = writeln!(
        out,
        "| resident memory idle ≤ 16 MiB | {:.1} MiB (after use {:.1}) | {} |",
        r.rss_idle_mib,
        r.rss_idle_after_use_mib,
        pass(r.idle_pass)
    );
    let _ = writeln!(
        out,
        "| resident memory at {} volumes ≤ {:.0} MiB | {:.1} MiB (after restart {:.1}) | {} |",
        r.volumes,
        r.loaded_bound_mib,
        r.rss_loaded_mib,
        r.rss_after_restart_mib,
        pass(r.loaded_pass)
    );
    let s = &all.supervision;
    let _ = writeln!(
        out,
        "| socket appears → ready ≤ 5 ms (mean) | mean {:.2}, max {:.2} ms | {} |",
        s.socket_to_ready.mean_ms,
        s.socket_to_ready.max_ms,
        pass(s.socket_pass)
    );
    let _ = writeln!(
        out,
        "| kill -9 → ready ≤ 200 ms + own start | mean {:.1} ms, max {:.1} ms; own start {:.1} ms → overhead mean {:.1}, worst {:.1} ms | {} |",
        s.kill_to_ready.mean_ms,
        s.kill_to_ready.max_ms,
        s.own_start.mean_ms,
        s.restart_overhead_mean_ms,
        s.restart_overhead_max_ms,
        pass(s.restart_pass)
    );
    out.push('\n');
    out.push_str(&cycle_table(&all.cycle));
    if let Some(bind) = &all.cycle_bind {
        out.push_str(&cycle_table(bind));
    }
    out.push_str(&throughput_table(&all.throughput));
    out.push_str(&restart_table(&all.restart));
    out.push_str(&supervision_table(&all.supervision));
    out
}
