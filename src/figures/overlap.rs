//! `overlap.svg`: per agent, a bar as long as its changed elements — one scale for every agent, so
//! an agent that changed 17× fewer parameters draws a 17× shorter bar — split by k, the number of
//! other agents that changed the same elements (k = 0: unique), each segment with its share of
//! the agent's changes written on it where it fits (and in its tooltip).

use super::{agent_names, k_colour, nice_ticks, text_width, x_axis, Svg, Swatch, WIDTH};
use crate::report::ProbeReport;

/// Characters of an agent's name shown (the full name is its tooltip).
const NAME_CHARS: usize = 30;

/// `overlap.svg`: each agent's changed parameters, unique and shared, on one absolute scale.
pub fn overlap(report: &ProbeReport) -> String {
    let n = report.agents.len();
    let total = report.total();
    let rows: Vec<Vec<u64>> = (0..n).map(|t| total.row(t).to_vec()).collect();
    let changed: Vec<u64> = rows.iter().map(|r| r.iter().sum()).collect();
    let notes: Vec<String> = (0..n)
        .map(|t| {
            let unique = 100.0 * rows[t][0] as f64 / changed[t].max(1) as f64;
            format!("{} changed, {unique:.1}% unique", changed[t])
        })
        .collect();
    let names: Vec<String> = agent_names(&report.agents, NAME_CHARS);
    let column = names
        .iter()
        .map(|a| text_width(a, 13.0))
        .chain(notes.iter().map(|s| text_width(s, 11.0)))
        .fold(0.0, f64::max);
    let (left, right, top, row_h) = (20.0 + column + 16.0, WIDTH - 30.0, 50.0, 48.0);
    let ticks = nice_ticks(
        0.0,
        changed.iter().copied().max().unwrap_or(0).max(1) as f64,
        5,
    );
    let max = *ticks.last().expect("one tick at least");
    let x_of = |v: f64| left + (right - left) * v / max;
    let mut svg =
        Svg::new("Changed elements of each agent, by how many other agents changed them too");
    for t in 0..n {
        let y = top + row_h * t as f64;
        svg.text(
            20.0,
            y + 14.0,
            13.0,
            "start",
            &names[t],
            Some(&report.agents[t]),
        );
        svg.text(20.0, y + 30.0, 11.0, "start", &notes[t], None);
        let mut x = left;
        for (k, &count) in rows[t].iter().enumerate() {
            if count == 0 {
                continue;
            }
            let w = x_of(count as f64) - left;
            let share = 100.0 * count as f64 / changed[t] as f64;
            svg.raw(format!(
                r#"<rect x="{x:.2}" y="{:.1}" width="{w:.2}" height="24" fill="{}"><title>k = {k}: {count} elements ({share:.1}%)</title></rect>"#,
                y + 4.0,
                k_colour(k)
            ));
            let label = format!("{share:.0}%");
            if text_width(&label, 11.0) + 6.0 <= w {
                // White on the dark green and blue, black on the light blues.
                let ink = if k <= 1 { "white" } else { "black" };
                svg.raw(format!(
                    r#"<text x="{:.1}" y="{:.1}" font-size="11" text-anchor="middle" fill="{ink}">{label}</text>"#,
                    x + w / 2.0,
                    y + 20.0
                ));
            }
            x += w;
        }
    }
    let axis = top + row_h * n as f64 + 2.0;
    let title = "changed elements (|τ| > ε) of each agent";
    x_axis(&mut svg, (left, right, axis), &ticks, title);
    let mut legend = vec![(
        Swatch::Box(k_colour(0)),
        "unique: this agent only".to_string(),
    )];
    for k in 1..n {
        let others = if k == 1 { "agent" } else { "agents" };
        legend.push((
            Swatch::Box(k_colour(k)),
            format!("shared with {k} other {others}"),
        ));
    }
    let bottom = svg.legend(20.0, axis + 62.0, &legend);
    svg.finish(bottom + 8.0)
}
