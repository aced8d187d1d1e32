//! `retention.svg`: per agent, one bar per region (unique, shared, all) as long as its retention
//! r on a round axis from 0, the line r = 1 (the agent's change kept in full) dashed, and — where
//! the merged folder's record gives it — the λ the merge gave the agent marked on its unique bar,
//! since RAM+ keeps r = λ there: r of unique beside λ says how much of the boost survived. r and
//! the share of signs kept are written in a column of their own.

use super::{
    agent_names, k_colour, marker, nice_ticks, short_name, text_width, x_axis, Svg, Swatch, ALL,
    WIDTH,
};
use crate::report::retention::{Retention, REGIONS};

/// λ's marker colour.
const LAMBDA: &str = "#444444";

/// The colour of a region: unique green, shared blue, all grey (as in every figure).
fn region_colour(i: usize) -> &'static str {
    match i {
        0 => k_colour(0),
        1 => k_colour(1),
        _ => ALL,
    }
}

/// `retention.svg`: how much of each agent's change the merged model keeps, λ marked.
pub fn retention(r: &Retention) -> String {
    let n = r.agents.len();
    let names: Vec<String> = agent_names(&r.agents, 28);
    let lambda_notes: Vec<Option<String>> = (0..n)
        .map(|t| r.lambda(t).map(|l| format!("λ = {l:.3}")))
        .collect();
    let column = names
        .iter()
        .map(|a| text_width(a, 13.0))
        .chain(lambda_notes.iter().flatten().map(|s| text_width(s, 11.0)))
        .fold(0.0, f64::max);
    let notes: Vec<Vec<String>> = r
        .regions
        .iter()
        .map(|sums| {
            REGIONS
                .iter()
                .zip(sums)
                .map(|(region, s)| {
                    format!(
                        "{region} r = {:.3}, sign kept {:.1}%",
                        s.retention(),
                        100.0 * s.sign_share()
                    )
                })
                .collect()
        })
        .collect();
    let note_w = notes
        .iter()
        .flatten()
        .map(|s| text_width(s, 10.0))
        .fold(0.0, f64::max);
    let left = 20.0 + column + 16.0;
    let right = (WIDTH - 24.0 - note_w - 14.0).max(left + 120.0);
    let most = r
        .regions
        .iter()
        .flatten()
        .map(|s| s.retention())
        .chain((0..n).filter_map(|t| r.lambda(t)))
        .fold(1.0f64, f64::max);
    let ticks = nice_ticks(0.0, most, 4);
    let max = *ticks.last().expect("ticks");
    let x_of = |v: f64| left + (right - left) * (v / max).clamp(0.0, 1.0);
    let title = format!(
        "Retention r = Σ (θ_out − θ₀)·τ / Σ τ² of each agent in {}",
        short_name(&r.merged, 40)
    );
    let mut svg = Svg::new(&title);
    let mut legend: Vec<(Swatch, String)> = REGIONS
        .iter()
        .enumerate()
        .map(|(i, region)| (Swatch::Box(region_colour(i)), format!("{region} changes")))
        .collect();
    legend.push((
        Swatch::Line("#444444", r#" stroke-dasharray="4 3""#),
        "r = 1: the change kept in full".into(),
    ));
    if lambda_notes.iter().any(Option::is_some) {
        legend.push((
            Swatch::Marker(LAMBDA),
            "λ the merge gave (RAM+ keeps unique at r = λ; far from the bar: the boost was lost)"
                .into(),
        ));
    }
    let top = svg.legend(20.0, 52.0, &legend) + 14.0;
    let (row_h, bar_h) = (52.0, 12.0);
    let bottom = top + row_h * n as f64;
    for (t, sums) in r.regions.iter().enumerate() {
        let y = top + row_h * t as f64;
        svg.text(20.0, y + 18.0, 13.0, "start", &names[t], Some(&r.agents[t]));
        if let Some(note) = &lambda_notes[t] {
            svg.text(20.0, y + 34.0, 11.0, "start", note, None);
        }
        for (i, (region, sum)) in REGIONS.iter().zip(sums).enumerate() {
            let by = y + 6.0 + (bar_h + 3.0) * i as f64;
            let v = sum.retention();
            svg.raw(format!(
                r#"<rect x="{left:.1}" y="{by:.1}" width="{:.2}" height="{bar_h}" fill="{}"><title>{region}: r = {v:.4}, {} changed</title></rect>"#,
                x_of(v.max(0.0)) - left,
                region_colour(i),
                sum.changed
            ));
            svg.text(right + 14.0, by + 10.0, 10.0, "start", &notes[t][i], None);
        }
        if let Some(l) = r.lambda(t) {
            svg.raw(marker(x_of(l), y + 6.0 + bar_h / 2.0, LAMBDA));
        }
    }
    let one = x_of(1.0);
    svg.raw(format!(
        r##"<line x1="{one:.1}" x2="{one:.1}" y1="{:.1}" y2="{bottom:.1}" stroke="#444" stroke-dasharray="4 3"/>"##,
        top - 4.0
    ));
    let title = "retention r (0: nothing kept, 1: kept in full)";
    x_axis(&mut svg, (left, right, bottom), &ticks, title);
    svg.finish(bottom + 48.0)
}
