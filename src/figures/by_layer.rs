//! `layers.svg` and `lambda.svg`: a value per agent for each layer group. The groups outside the
//! decoder layers (embed, norm, lm_head) are categories and are drawn as bars; the layers are
//! ordered and are drawn as one line per agent along the layer index. Each panel has its axis
//! titles and round ticks; the legend shows each agent's line as it is drawn.

use super::{
    agent_colour, agent_dash, agent_names, nice_ticks, text_width, tick_label, Svg, Swatch, WIDTH,
};
use crate::report::ProbeReport;

/// One panel of values per agent: the categories' (name, value per agent) and the layers'
/// (index, value per agent) in index order.
struct Series {
    categories: Vec<(String, Vec<f64>)>,
    layers: Vec<(usize, Vec<f64>)>,
}

impl Series {
    /// Groups as the report names them ("layer N", or a category), with a value per agent.
    fn of(groups: Vec<(String, Vec<f64>)>) -> Series {
        let mut series = Series {
            categories: Vec::new(),
            layers: Vec::new(),
        };
        for (name, values) in groups {
            match name.strip_prefix("layer ").and_then(|i| i.parse().ok()) {
                Some(i) => series.layers.push((i, values)),
                None => series.categories.push((name, values)),
            }
        }
        series.layers.sort_by_key(|(i, _)| *i);
        series
    }
}

/// How a panel's y axis reads: its title, its ticks, percent or plain labels.
struct Axis<'a> {
    title: &'a str,
    ticks: Vec<f64>,
    percent: bool,
}

/// A panel's plot area and its y scale.
struct Plot {
    left: f64,
    right: f64,
    top: f64,
    bottom: f64,
    lo: f64,
    hi: f64,
}

impl Plot {
    /// The y of value `v` (clamped to the axis).
    fn y(&self, v: f64) -> f64 {
        let share = ((v - self.lo) / (self.hi - self.lo).max(1e-12)).clamp(0.0, 1.0);
        self.bottom - (self.bottom - self.top) * share
    }
}

/// Draws one panel with its plot area from `top` down; returns the y below its x-axis titles.
fn panel(svg: &mut Svg, top: f64, axis: &Axis, series: &Series, agents: usize) -> f64 {
    let plot = Plot {
        left: 64.0,
        right: WIDTH - 24.0,
        top,
        bottom: top + 190.0,
        lo: axis.ticks[0],
        hi: *axis.ticks.last().expect("ticks"),
    };
    let (left, right, bottom) = (plot.left, plot.right, plot.bottom);
    svg.text(left, top - 10.0, 12.0, "start", axis.title, None);
    let step = axis.ticks.get(1).map_or(1.0, |t| t - plot.lo);
    for &v in &axis.ticks {
        let y = plot.y(v);
        svg.raw(format!(
            r##"<line x1="{left}" x2="{right}" y1="{y:.1}" y2="{y:.1}" stroke="#e3e3e3"/>"##
        ));
        let label = if axis.percent {
            format!("{}%", tick_label(100.0 * v, 100.0 * step))
        } else {
            tick_label(v, step)
        };
        svg.text(left - 6.0, y + 4.0, 11.0, "end", &label, None);
    }
    svg.raw(format!(
        r##"<path d="M{left} {top} V{bottom} H{right}" stroke="#444" fill="none"/>"##
    ));
    let x = category_bars(svg, &plot, &series.categories, agents);
    layer_lines(svg, &plot, x + 8.0, &series.layers, agents);
    bottom + 42.0
}

/// The categories from the panel's left: a group of bars each (one per agent), as wide as its
/// label needs. Returns the x where the layers' part begins.
fn category_bars(
    svg: &mut Svg,
    plot: &Plot,
    categories: &[(String, Vec<f64>)],
    agents: usize,
) -> f64 {
    let bar = 9.0;
    let mut x = plot.left + 10.0;
    for (name, values) in categories {
        let width = (bar * agents as f64).max(text_width(name, 11.0));
        let x0 = x + (width - bar * agents as f64) / 2.0;
        for (t, &v) in values.iter().enumerate() {
            let y = plot.y(v);
            svg.raw(format!(
                r#"<rect x="{:.1}" y="{y:.1}" width="{bar}" height="{:.1}" fill="{}"><title>{name}: {v:.4}</title></rect>"#,
                x0 + bar * t as f64,
                (plot.bottom - y).max(0.0),
                agent_colour(t)
            ));
        }
        svg.text(
            x + width / 2.0,
            plot.bottom + 16.0,
            11.0,
            "middle",
            name,
            None,
        );
        x += width + 12.0;
    }
    if categories.is_empty() {
        return x;
    }
    let mid = (plot.left + x) / 2.0;
    svg.text(
        mid,
        plot.bottom + 33.0,
        11.0,
        "middle",
        "outside the layers",
        None,
    );
    svg.raw(format!(
        r##"<line x1="{x:.1}" x2="{x:.1}" y1="{}" y2="{}" stroke="#bbb" stroke-dasharray="3 3"/>"##,
        plot.top, plot.bottom
    ));
    x + 14.0
}

/// The layers from `x0` to the panel's right: a line per agent along the layer index, the layer
/// numbers as far apart as their labels need.
fn layer_lines(svg: &mut Svg, plot: &Plot, x0: f64, layers: &[(usize, Vec<f64>)], agents: usize) {
    let (l0, l1) = (x0, plot.right - 8.0);
    let (Some(first), Some(last)) = (layers.first().map(|l| l.0), layers.last().map(|l| l.0))
    else {
        return;
    };
    let x_of = |i: usize| {
        if last == first {
            (l0 + l1) / 2.0
        } else {
            l0 + (l1 - l0) * (i - first) as f64 / (last - first) as f64
        }
    };
    let label_w = text_width(&last.to_string(), 11.0) + 10.0;
    let per = ((label_w * (last - first + 1) as f64) / (l1 - l0))
        .ceil()
        .max(1.0) as usize;
    let every = [1, 2, 5, 10, 20, 50, 100]
        .into_iter()
        .find(|&e| e >= per)
        .unwrap_or(per);
    for (i, _) in layers {
        if (i - first).is_multiple_of(every) {
            svg.text(
                x_of(*i),
                plot.bottom + 16.0,
                11.0,
                "middle",
                &i.to_string(),
                None,
            );
        }
    }
    svg.text(
        (l0 + l1) / 2.0,
        plot.bottom + 33.0,
        11.0,
        "middle",
        "layer",
        None,
    );
    for t in 0..agents {
        let points: Vec<String> = layers
            .iter()
            .map(|(i, v)| format!("{:.1},{:.1}", x_of(*i), plot.y(v[t])))
            .collect();
        svg.raw(format!(
            r#"<polyline points="{}" fill="none" stroke="{}" stroke-width="2"{}/>"#,
            points.join(" "),
            agent_colour(t),
            agent_dash(t)
        ));
        if layers.len() <= 48 {
            for (i, v) in layers {
                svg.raw(format!(
                    r#"<circle cx="{:.1}" cy="{:.1}" r="2.5" fill="{}"/>"#,
                    x_of(*i),
                    plot.y(v[t]),
                    agent_colour(t)
                ));
            }
        }
    }
}

/// The legend of agents: each one's line as drawn, its short name.
fn agent_legend(svg: &mut Svg, y: f64, agents: &[String]) -> f64 {
    let entries: Vec<(Swatch, String)> = agent_names(agents, 30)
        .into_iter()
        .enumerate()
        .map(|(t, name)| (Swatch::Line(agent_colour(t), agent_dash(t)), name))
        .collect();
    svg.legend(20.0, y, &entries)
}

/// Per agent, its density and the unique share of its changes, per layer group.
pub fn layers(report: &ProbeReport) -> String {
    let profile = report.layer_profile();
    let pick = |which: fn(&(f64, f64)) -> f64| {
        Series::of(
            profile
                .iter()
                .map(|(g, rows)| (g.clone(), rows.iter().map(which).collect()))
                .collect(),
        )
    };
    let n = report.agents.len();
    let mut svg = Svg::new("Where each agent changed the model, per layer");
    let density = Axis {
        title: "density: share of the group's elements the agent changed",
        ticks: nice_ticks(0.0, 1.0, 4),
        percent: true,
    };
    let below = panel(&mut svg, 72.0, &density, &pick(|r| r.0), n);
    let unique = Axis {
        title: "unique share: share of the agent's changes no other agent made",
        ticks: nice_ticks(0.0, 1.0, 4),
        percent: true,
    };
    let below = panel(&mut svg, below + 34.0, &unique, &pick(|r| r.1), n);
    let bottom = agent_legend(&mut svg, below + 16.0, &report.agents);
    svg.finish(bottom + 8.0)
}

/// Per agent, λ of RAM+ in layer scope (the paper rule with its global defaults) for each layer
/// group — where a per-layer boost would differ from one per model.
pub fn lambdas(report: &ProbeReport) -> String {
    let rule = crate::report::group_rule();
    let groups = report.group_agent_counts(crate::method::BoostScope::Layer);
    let series = Series::of(
        groups
            .iter()
            .map(|(g, c)| (g.clone(), c.iter().map(|&c| rule.lambda(c)).collect()))
            .collect(),
    );
    let top = match rule {
        crate::method::BoostRule::Paper { r, alpha } => 1.0 + r * alpha,
        crate::method::BoostRule::Official { rescale_factor } => rescale_factor,
    };
    // What λ would be per layer, whatever scope a merge used: said so in the title.
    let mut svg = Svg::new("λ each agent would get per layer (ram+ --scope layer)");
    let axis = Axis {
        title: "λ (rule paper, r = 0.1, α = 2: from 1, no boost, to the cap 1.2)",
        // A step above the cap: a λ at its cap is drawn inside the frame, not on it.
        ticks: {
            let mut ticks = nice_ticks(1.0, top, 4);
            let step = ticks[1] - ticks[0];
            ticks.push(ticks[ticks.len() - 1] + step);
            ticks
        },
        percent: false,
    };
    let below = panel(&mut svg, 72.0, &axis, &series, report.agents.len());
    let bottom = agent_legend(&mut svg, below + 16.0, &report.agents);
    svg.finish(bottom + 8.0)
}
