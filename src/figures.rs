//! SVG figures of a probe report (issue #15): `overlap.svg`, the paper's Figure 1 — each agent's
//! changed elements by how many other agents changed them too —, `layers.svg`, each agent's
//! density and unique share by layer, `lambda.svg`, each agent's λ per layer, and
//! `retention.svg`, how much of each agent a merge kept. Plain SVG written here (rectangles,
//! polylines, text): no dependency, no font files, and any browser or model page renders it.

use crate::report::retention::{Retention, REGIONS};
use crate::report::ProbeReport;
use anyhow::Result;
use std::fmt::Write;
use std::path::{Path, PathBuf};

/// Colour of series `i` of `n`: hues around the wheel, unique (i = 0) a dark green.
pub fn colour(i: usize, n: usize) -> String {
    if i == 0 {
        return "#1b7837".into();
    }
    let h = 30.0 + 300.0 * (i - 1) as f64 / n.max(2) as f64;
    hsl_hex(h, 0.65, 0.55)
}

fn hsl_hex(h: f64, s: f64, l: f64) -> String {
    let c = (1.0 - (2.0 * l - 1.0).abs()) * s;
    let x = c * (1.0 - ((h / 60.0) % 2.0 - 1.0).abs());
    let (r, g, b) = match (h / 60.0) as u32 {
        0 => (c, x, 0.0),
        1 => (x, c, 0.0),
        2 => (0.0, c, x),
        3 => (0.0, x, c),
        4 => (x, 0.0, c),
        _ => (c, 0.0, x),
    };
    let m = l - c / 2.0;
    let byte = |v: f64| ((v + m) * 255.0).round().clamp(0.0, 255.0) as u8;
    format!("#{:02x}{:02x}{:02x}", byte(r), byte(g), byte(b))
}

/// Text as XML (the one escaping rule: [`crate::escape::xml`]).
fn xml(text: &str) -> String {
    crate::escape::xml(text)
}

/// A figure's opening: the 900-pixel-wide canvas `height` high, white, text of `font_size`, and
/// its title at (20, y).
fn svg_start(height: f64, font_size: u32, (y, title): (u32, &str)) -> String {
    let mut s = String::new();
    let _ = writeln!(
        s,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="900" height="{height}" viewBox="0 0 900 {height}" font-family="sans-serif" font-size="{font_size}">"#
    );
    let _ = writeln!(s, r#"<rect width="900" height="{height}" fill="white"/>"#);
    let _ = writeln!(
        s,
        r#"<text x="20" y="{y}" font-size="16">{}</text>"#,
        xml(title)
    );
    s
}

/// The short name of an agent: its folder's last component.
fn label(agent: &str) -> String {
    Path::new(agent)
        .file_name()
        .map_or_else(|| agent.to_string(), |n| n.to_string_lossy().into_owned())
}

/// Per agent, a bar of its changed elements split by k, the number of other agents that changed
/// the same element (k = 0: unique), with the unique share printed; a legend of k below.
pub fn overlap(report: &ProbeReport) -> String {
    let n = report.agents.len();
    let total = report.total();
    let (left, bar_w, row_h, top) = (230.0, 640.0, 44.0, 56.0);
    let legend_rows = n.div_ceil(8);
    let height = top + row_h * n as f64 + 30.0 + 22.0 * legend_rows as f64;
    let mut s = svg_start(
        height,
        13,
        (
            28,
            "Changed elements of each agent, by how many other agents changed them too",
        ),
    );
    for t in 0..n {
        let row = total.row(t);
        let changed: u64 = row.iter().sum();
        let y = top + row_h * t as f64;
        let _ = writeln!(
            s,
            r#"<text x="20" y="{}">{}</text>"#,
            y + 13.0,
            xml(&label(&report.agents[t]))
        );
        let mut x = left;
        for (k, &count) in row.iter().enumerate() {
            if count == 0 || changed == 0 {
                continue;
            }
            let w = bar_w * count as f64 / changed as f64;
            let _ = writeln!(
                s,
                r#"<rect x="{x:.2}" y="{y}" width="{w:.2}" height="24" fill="{}"><title>k = {k}: {count} elements ({:.1}%)</title></rect>"#,
                colour(k, n),
                100.0 * count as f64 / changed as f64
            );
            x += w;
        }
        let unique = if changed > 0 {
            100.0 * row[0] as f64 / changed as f64
        } else {
            0.0
        };
        let _ = writeln!(
            s,
            r##"<text x="20" y="{}" font-size="11" fill="#555">{changed} changed, {unique:.1}% unique</text>"##,
            y + 28.0
        );
    }
    let ly = top + row_h * n as f64 + 24.0;
    for k in 0..n {
        let (col, line) = (k % 8, k / 8);
        let x = 20.0 + 105.0 * col as f64;
        let y = ly + 22.0 * line as f64;
        let name = if k == 0 {
            "k = 0 (unique)".to_string()
        } else {
            format!("k = {k}")
        };
        let _ = writeln!(
            s,
            r#"<rect x="{x}" y="{}" width="12" height="12" fill="{}"/><text x="{}" y="{}" font-size="11">{name}</text>"#,
            y - 10.0,
            colour(k, n),
            x + 16.0,
            y
        );
    }
    s.push_str("</svg>\n");
    s
}

/// Per agent, its density (solid) and the unique share of its changes (dashed) in each layer,
/// the tensors outside the layers (embed, norm, lm_head) as their own ticks first.
pub fn layers(report: &ProbeReport) -> String {
    let profile = report.layer_profile();
    let ticks: Vec<String> = profile.iter().map(|(g, _)| g.clone()).collect();
    let series = (0..report.agents.len())
        .flat_map(|t| {
            let values = |pick: fn(&(f64, f64)) -> f64| -> Vec<f64> {
                profile.iter().map(|(_, rows)| pick(&rows[t])).collect()
            };
            [(t, false, values(|r| r.0)), (t, true, values(|r| r.1))]
        })
        .collect();
    line_chart(
        "Where each agent changed the model: density (solid) and unique share (dashed) per layer",
        &ticks,
        (0.0, 1.0),
        &report.agents,
        series,
    )
}

/// Per agent, λ of RAM+ in layer scope (the paper rule with its global defaults) for each layer
/// and the groups outside the layers — where a per-layer boost would differ from one per model.
pub fn lambdas(report: &ProbeReport) -> String {
    let rule = crate::report::group_rule();
    let groups = report.group_agent_counts(crate::method::BoostScope::Layer);
    let ticks: Vec<String> = groups.iter().map(|(g, _)| g.clone()).collect();
    let series: Vec<(usize, bool, Vec<f64>)> = (0..report.agents.len())
        .map(|t| {
            let values = groups.iter().map(|(_, c)| rule.lambda(c[t])).collect();
            (t, false, values)
        })
        .collect();
    let top = match rule {
        crate::method::BoostRule::Paper { r, alpha } => 1.0 + r * alpha,
        crate::method::BoostRule::Official { rescale_factor } => rescale_factor,
    };
    line_chart(
        "λ of each agent under ram+ --scope layer (rule paper, r = 0.1, α = 2) per layer",
        &ticks,
        (1.0, top),
        &report.agents,
        series,
    )
}

/// A line chart over `ticks` (layer groups: "layer N" ticks show N, thinned to about 40), y from
/// `range.0` to `range.1`, one polyline per series (agent, dashed, values), a legend of agents.
fn line_chart(
    title: &str,
    ticks: &[String],
    range: (f64, f64),
    agents: &[String],
    series: Vec<(usize, bool, Vec<f64>)>,
) -> String {
    let n = agents.len();
    let (left, right, top, bottom) = (60.0, 880.0, 50.0, 330.0);
    let height = bottom + 50.0 + 20.0 * n.div_ceil(4) as f64;
    let groups = ticks.len().max(1);
    let x_of = |i: usize| left + (right - left) * (i as f64 + 0.5) / groups as f64;
    let span = (range.1 - range.0).max(1e-12);
    let y_of = |v: f64| bottom - (bottom - top) * ((v - range.0) / span).clamp(0.0, 1.0);
    let mut s = svg_start(height, 11, (26, title));
    let _ = writeln!(
        s,
        r##"<path d="M{left} {top} V{bottom} H{right}" stroke="#444" fill="none"/>"##
    );
    for q in 0..=4 {
        let v = range.0 + span * q as f64 / 4.0;
        let _ = writeln!(
            s,
            r##"<text x="{}" y="{}" text-anchor="end">{:.3}</text><line x1="{left}" x2="{right}" y1="{y}" y2="{y}" stroke="#ddd"/>"##,
            left - 6.0,
            y_of(v) + 4.0,
            v,
            y = y_of(v)
        );
    }
    // At most ~40 tick labels, so 100+ layers stay readable.
    let every = groups.div_ceil(40);
    for (i, name) in ticks.iter().enumerate() {
        if i % every == 0 || !name.starts_with("layer ") {
            let tick = name.strip_prefix("layer ").unwrap_or(name);
            let _ = writeln!(
                s,
                r#"<text x="{:.1}" y="{}" text-anchor="middle">{}</text>"#,
                x_of(i),
                bottom + 16.0,
                xml(tick)
            );
        }
    }
    for (t, dashed, values) in series {
        let points: Vec<String> = values
            .iter()
            .enumerate()
            .map(|(i, &v)| format!("{:.1},{:.1}", x_of(i), y_of(v)))
            .collect();
        let dash = if dashed {
            r#" stroke-dasharray="5 3""#
        } else {
            ""
        };
        let _ = writeln!(
            s,
            r#"<polyline points="{}" fill="none" stroke="{}" stroke-width="2"{dash}/>"#,
            points.join(" "),
            colour(t + 1, n + 1)
        );
    }
    for (t, agent) in agents.iter().enumerate() {
        let (col, line) = (t % 4, t / 4);
        let (x, y) = (
            20.0 + 215.0 * col as f64,
            bottom + 40.0 + 20.0 * line as f64,
        );
        let _ = writeln!(
            s,
            r#"<rect x="{x}" y="{}" width="12" height="12" fill="{}"/><text x="{}" y="{y}">{}</text>"#,
            y - 10.0,
            colour(t + 1, n + 1),
            x + 16.0,
            xml(&label(agent))
        );
    }
    s.push_str("</svg>\n");
    s
}

/// Per agent, one bar per region (unique, shared, all) as long as its retention r, from 0 to the
/// largest r (at least 1, drawn dashed: the agent's change kept in full), with r and the share
/// of signs kept written beside it. A negative r (a merge that reversed the agent) draws no bar.
pub fn retention(r: &Retention) -> String {
    let n = r.agents.len();
    let (left, right, top, row_h, bar_h) = (230.0, 700.0, 70.0, 50.0, 12.0);
    let max = r
        .regions
        .iter()
        .flatten()
        .map(|s| s.retention())
        .fold(1.0f64, f64::max);
    let x_of = |v: f64| left + (right - left) * (v / max).clamp(0.0, 1.0);
    let height = top + row_h * n as f64 + 40.0;
    let title = format!(
        "Retention r = Σ (θ_out − θ₀)·τ / Σ τ² of each agent in {}",
        label(&r.merged)
    );
    let mut s = svg_start(height, 11, (26, &title));
    for (i, region) in REGIONS.iter().enumerate() {
        let x = left + 110.0 * i as f64;
        let _ = writeln!(
            s,
            r#"<rect x="{x}" y="38" width="12" height="12" fill="{}"/><text x="{}" y="48">{region}</text>"#,
            colour(i, REGIONS.len()),
            x + 16.0
        );
    }
    let bottom = top + row_h * n as f64;
    for q in 0..=4 {
        let v = max * q as f64 / 4.0;
        let _ = writeln!(
            s,
            r##"<line x1="{x:.1}" x2="{x:.1}" y1="{}" y2="{bottom}" stroke="#ddd"/><text x="{x:.1}" y="{}" text-anchor="middle">{v:.2}</text>"##,
            top - 6.0,
            bottom + 14.0,
            x = x_of(v)
        );
    }
    let _ = writeln!(
        s,
        r##"<line x1="{x:.1}" x2="{x:.1}" y1="{}" y2="{bottom}" stroke="#444" stroke-dasharray="4 3"/>"##,
        top - 6.0,
        x = x_of(1.0)
    );
    for (t, (agent, sums)) in r.agents.iter().zip(&r.regions).enumerate() {
        let y = top + row_h * t as f64;
        let _ = writeln!(
            s,
            r#"<text x="20" y="{}" font-size="13">{}</text>"#,
            y + 22.0,
            xml(&label(agent))
        );
        for (i, (region, sum)) in REGIONS.iter().zip(sums).enumerate() {
            let by = y + 4.0 + (bar_h + 2.0) * i as f64;
            let v = sum.retention();
            let w = x_of(v) - left;
            let _ = writeln!(
                s,
                r#"<rect x="{left}" y="{by}" width="{w:.2}" height="{bar_h}" fill="{}"><title>{region}: r = {v:.4}, {} changed</title></rect>"#,
                colour(i, REGIONS.len()),
                sum.changed
            );
            let _ = writeln!(
                s,
                r##"<text x="{:.1}" y="{}" font-size="10" fill="#333">{region} r = {v:.3}, sign kept {:.1}%</text>"##,
                x_of(v.max(0.0)) + 4.0,
                by + 10.0,
                100.0 * sum.sign_share()
            );
        }
    }
    s.push_str("</svg>\n");
    s
}

/// Writes `overlap.svg` and `layers.svg` into `dir` (created if missing), with `per_tensor`
/// `lambda.svg`, and with a merged folder's `retention` `retention.svg`, through the output rules
/// of [`crate::checkpoint::output_folder::write_files`] (never into or over `protect`, never
/// through a link or into a FIFO, all at once); returns their paths.
pub fn write_all(
    report: &ProbeReport,
    retained: Option<&Retention>,
    dir: &Path,
    per_tensor: bool,
    protect: &[PathBuf],
) -> Result<Vec<PathBuf>> {
    let mut figures = vec![
        ("overlap.svg", overlap(report)),
        ("layers.svg", layers(report)),
    ];
    if per_tensor {
        figures.push(("lambda.svg", lambdas(report)));
    }
    if let Some(r) = retained {
        figures.push(("retention.svg", retention(r)));
    }
    let files: Vec<(&str, Vec<u8>)> = figures
        .into_iter()
        .map(|(name, svg)| (name, svg.into_bytes()))
        .collect();
    crate::checkpoint::output_folder::write_files(dir, &files, protect)
}
