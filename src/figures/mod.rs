//! SVG figures of a probe report: `overlap.svg`, the paper's Figure 1 — each agent's changed
//! elements on one absolute scale, split by how many other agents changed them too —,
//! `layers.svg`, each agent's density and unique share (categories as bars, layers as lines along
//! the layer index), `lambda.svg`, each agent's λ the same way, and `retention.svg`, how much of
//! each agent a merge kept, with λ marked. Plain SVG written here (rectangles, lines, text): no
//! dependency, no font files; any browser or model page renders it.
//!
//! One palette, one meaning per colour across every figure (Okabe–Ito, safe for colour-blind
//! readers): green is always "unique", blues always "shared" (darker: fewer other agents), grey
//! "all", and agents get the remaining hues. Text is laid out by an estimate of its width
//! ([`text_width`], generous for common sans-serif fonts) so no two labels overlap and none
//! leaves the canvas — `tests/figures.rs` checks both on every figure.

mod by_layer;
mod overlap;
mod retention;

pub use by_layer::{lambdas, layers};
pub use overlap::overlap;
pub use retention::retention;

use crate::report::retention::Retention;
use crate::report::ProbeReport;
use anyhow::Result;
use std::fmt::Write;
use std::path::{Path, PathBuf};

/// "Unique": an agent's changes no other agent made (bluish green).
pub const UNIQUE: &str = "#009E73";
/// "All" of an agent's changes (grey).
pub const ALL: &str = "#8C8C8C";
/// "Shared with k other agents", k = 1, 2, …: blues, darker for fewer others.
const SHARED: [&str; 4] = ["#0072B2", "#56B4E9", "#9ECAE1", "#C6DBEF"];
/// Agents' colours, in order (none of them green, blue or grey).
/// Amber and vermillion, the two closest, are first and last.
const AGENTS: [&str; 6] = [
    "#E69F00", "#CC79A7", "#000000", "#882255", "#999933", "#D55E00",
];

/// The colour of "changed by this agent and k others" (k = 0: [`UNIQUE`]).
pub fn k_colour(k: usize) -> &'static str {
    match k {
        0 => UNIQUE,
        k => SHARED[(k - 1).min(SHARED.len() - 1)],
    }
}

/// Agent `t`'s colour in the line figures (cycles after six agents; its dash pattern then
/// differs, [`agent_dash`]).
pub fn agent_colour(t: usize) -> &'static str {
    AGENTS[t % AGENTS.len()]
}

/// Agent `t`'s dash pattern: solid for the first six, dashed for the next six, and so on.
fn agent_dash(t: usize) -> &'static str {
    match (t / AGENTS.len()) % 3 {
        0 => "",
        1 => r#" stroke-dasharray="6 3""#,
        _ => r#" stroke-dasharray="2 2""#,
    }
}

/// The figures' width in pixels (the Hub shows README images up to about this wide).
const WIDTH: f64 = 900.0;

/// An estimate of `text`'s width at `size` pixels: 0.62 em a character, a little more than
/// DejaVu Sans's (the widest common sans-serif) average, so labels laid out by it do not touch.
pub fn text_width(text: &str, size: f64) -> f64 {
    text.chars().count() as f64 * 0.62 * size
}

/// How a figure names an agent: its Hub id where the folder is a Hub cache snapshot, else its
/// folder's last component; longer than `max` characters, cut in the middle with "…".
pub fn short_name(agent: &str, max: usize) -> String {
    let name = match crate::hub::id_of_snapshot(Path::new(agent)) {
        Some(id) => id.split('@').next().unwrap_or(&id).to_string(),
        None => Path::new(agent)
            .file_name()
            .map_or_else(|| agent.to_string(), |n| n.to_string_lossy().into_owned()),
    };
    cut_middle(&name, max)
}

/// How the figures name several agents: by the parts of their paths that tell them apart — the
/// path components all of them share at the start and at the end dropped (whole components,
/// keeping at least one), Hub snapshots by their id — each at most `max` characters (cut in the
/// middle), and distinct: `runs/{coder,tool}-grpo/checkpoint-1200` are `coder-grpo` and
/// `tool-grpo`. Names that are still equal get their agent's number.
pub fn agent_names(agents: &[String], max: usize) -> Vec<String> {
    let parts: Vec<Vec<String>> = agents
        .iter()
        .map(|a| match crate::hub::id_of_snapshot(Path::new(a)) {
            Some(id) => vec![id.split('@').next().unwrap_or(&id).to_string()],
            None => Path::new(a)
                .components()
                .filter(|c| !matches!(c, std::path::Component::CurDir))
                .map(|c| c.as_os_str().to_string_lossy().into_owned())
                .collect(),
        })
        .collect();
    let shortest = parts.iter().map(Vec::len).min().unwrap_or(0);
    let same_at = |at: &dyn Fn(&Vec<String>) -> Option<&String>| {
        parts.len() > 1
            && parts
                .iter()
                .all(|p| at(p).is_some() && at(p) == at(&parts[0]))
    };
    let mut front = 0;
    while front + 1 < shortest && same_at(&|p: &Vec<String>| p.get(front)) {
        front += 1;
    }
    let mut back = 0;
    while front + back + 1 < shortest && same_at(&|p: &Vec<String>| p.get(p.len() - 1 - back)) {
        back += 1;
    }
    let mut names: Vec<String> = parts
        .iter()
        .map(|p| match p.len() {
            0 => String::new(),
            // One agent: its last component, as a figure of one agent names it.
            _ if parts.len() == 1 => p[p.len() - 1].clone(),
            n => p[front..n - back].join("/"),
        })
        .map(|n| cut_middle(&n, max))
        .collect();
    let dup: Vec<bool> = names
        .iter()
        .map(|n| names.iter().filter(|m| *m == n).count() > 1)
        .collect();
    for (t, n) in names.iter_mut().enumerate() {
        if dup[t] {
            *n = format!("{} {n}", t + 1);
        }
    }
    names
}

/// `name` cut in the middle with "…" when it is longer than `max` (at least 5) characters.
fn cut_middle(name: &str, max: usize) -> String {
    let chars: Vec<char> = name.chars().collect();
    if chars.len() <= max.max(5) {
        return name.to_string();
    }
    let keep = max.max(5) - 1;
    let head: String = chars[..keep.div_ceil(2)].iter().collect();
    let tail: String = chars[chars.len() - keep / 2..].iter().collect();
    format!("{head}…{tail}")
}

/// Text as XML (the one escaping rule: [`crate::escape::xml`]).
fn xml(text: &str) -> String {
    crate::escape::xml(text)
}

/// Round axis ticks from `lo` up to at least `hi`: steps of 1, 2, 2.5 or 5 × 10ⁿ, about `count`
/// of them.
fn nice_ticks(lo: f64, hi: f64, count: usize) -> Vec<f64> {
    let span = (hi - lo).max(1e-9);
    let raw = span / count.max(1) as f64;
    let power = 10f64.powf(raw.log10().floor());
    let step = [1.0, 2.0, 2.5, 5.0, 10.0]
        .iter()
        .map(|m| m * power)
        .find(|&s| s >= raw)
        .unwrap_or(10.0 * power);
    let first = (lo / step).floor() * step;
    let mut ticks = Vec::new();
    let mut k = 0;
    loop {
        let v = first + step * k as f64;
        ticks.push(v);
        if v >= hi - step * 1e-9 {
            break;
        }
        k += 1;
    }
    ticks
}

/// A tick's label: no more digits than its step needs; thousands as k, millions as M.
fn tick_label(v: f64, step: f64) -> String {
    if v == 0.0 {
        return "0".into();
    }
    let (v, step, unit) = match v.abs().max(step) {
        m if m >= 1e9 => (v / 1e9, step / 1e9, "G"),
        m if m >= 1e6 => (v / 1e6, step / 1e6, "M"),
        m if m >= 1e4 => (v / 1e3, step / 1e3, "k"),
        _ => (v, step, ""),
    };
    // As many decimals as the step has (1.05 → 2, 0.5 → 1, 20 → 0).
    let digits = (0..4)
        .find(|&d| {
            let scaled = step * 10f64.powi(d);
            (scaled - scaled.round()).abs() < 1e-6 * scaled.max(1.0)
        })
        .unwrap_or(4) as usize;
    format!("{v:.digits$}{unit}")
}

/// An SVG being written: its elements, until [`Svg::finish`] puts them on a canvas.
struct Svg {
    body: String,
}

impl Svg {
    /// A white canvas [`WIDTH`] wide, its title at the top left.
    fn new(title: &str) -> Svg {
        let mut svg = Svg {
            body: String::new(),
        };
        svg.text(20.0, 26.0, 15.0, "start", title, None);
        svg
    }

    /// A text at (x, y) (its baseline), anchored "start", "middle" or "end", with a tooltip.
    fn text(&mut self, x: f64, y: f64, size: f64, anchor: &str, text: &str, tip: Option<&str>) {
        let tip = tip.map_or(String::new(), |t| format!("<title>{}</title>", xml(t)));
        let _ = writeln!(
            self.body,
            r#"<text x="{x:.1}" y="{y:.1}" font-size="{size}" text-anchor="{anchor}">{}{tip}</text>"#,
            xml(text)
        );
    }

    /// A raw SVG element.
    fn raw(&mut self, element: impl AsRef<str>) {
        self.body.push_str(element.as_ref());
        self.body.push('\n');
    }

    /// A legend from (x0, y): each entry its swatch then its text, laid out by text width and
    /// wrapped before the right edge. Returns the y below it.
    fn legend(&mut self, x0: f64, y: f64, entries: &[(Swatch, String)]) -> f64 {
        let (size, gap) = (12.0, 22.0);
        let (mut x, mut y) = (x0, y);
        for (swatch, label) in entries {
            let w = 24.0 + text_width(label, size);
            if x + w > WIDTH - 20.0 && x > x0 {
                x = x0;
                y += 20.0;
            }
            let element = match *swatch {
                Swatch::Box(c) => format!(
                    r#"<rect x="{x:.1}" y="{:.1}" width="14" height="12" fill="{c}"/>"#,
                    y - 10.0
                ),
                Swatch::Line(c, dash) => format!(
                    r#"<line x1="{x:.1}" x2="{:.1}" y1="{ly:.1}" y2="{ly:.1}" stroke="{c}" stroke-width="2.5"{dash}/>"#,
                    x + 18.0,
                    ly = y - 4.0
                ),
                Swatch::Marker(c) => marker(x + 7.0, y - 4.0, c),
            };
            self.raw(element);
            self.text(x + 22.0, y, size, "start", label, None);
            x += w + gap;
        }
        y + 12.0
    }

    /// The finished SVG, `height` high.
    fn finish(self, height: f64) -> String {
        format!(
            "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{WIDTH}\" height=\"{height}\" viewBox=\"0 0 {WIDTH} {height}\" font-family=\"DejaVu Sans, Verdana, sans-serif\">\n<rect width=\"{WIDTH}\" height=\"{height}\" fill=\"white\"/>\n{}</svg>\n",
            self.body
        )
    }
}

/// A horizontal axis at `y` from `left` to `right` (value `ticks[last]` at `right`, 0 at
/// `left`): its line, each tick and its label, and `title` centred below.
fn x_axis(svg: &mut Svg, (left, right, y): (f64, f64, f64), ticks: &[f64], title: &str) {
    let max = *ticks.last().expect("ticks");
    svg.raw(format!(
        r##"<line x1="{left:.1}" x2="{right:.1}" y1="{y:.1}" y2="{y:.1}" stroke="#444"/>"##
    ));
    let step = ticks.get(1).map_or(1.0, |t| t - ticks[0]);
    for &v in ticks {
        let x = left + (right - left) * v / max;
        svg.raw(format!(
            r##"<line x1="{x:.1}" x2="{x:.1}" y1="{y:.1}" y2="{:.1}" stroke="#444"/>"##,
            y + 4.0
        ));
        svg.text(x, y + 17.0, 11.0, "middle", &tick_label(v, step), None);
    }
    svg.text((left + right) / 2.0, y + 35.0, 12.0, "middle", title, None);
}

/// What a legend entry shows beside its text.
#[derive(Clone, Copy)]
enum Swatch {
    /// A filled square (bars).
    Box(&'static str),
    /// A short line with a dash pattern (lines).
    Line(&'static str, &'static str),
    /// A diamond (a marked value).
    Marker(&'static str),
}

/// A diamond centred at (x, y).
fn marker(x: f64, y: f64, colour: &str) -> String {
    format!(
        r#"<path d="M{:.1} {y:.1} L{x:.1} {:.1} L{:.1} {y:.1} L{x:.1} {:.1} Z" fill="{colour}" stroke="white" stroke-width="1"/>"#,
        x - 6.0,
        y - 6.0,
        x + 6.0,
        y + 6.0
    )
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

#[cfg(test)]
mod tests {
    /// Issue #45: three agents whose paths differ only in a middle component keep distinct
    /// labels, made of that component; shared prefixes and suffixes go, whole components only.
    #[test]
    fn agent_names_keep_agents_apart() {
        let agents: Vec<String> = ["coder", "tool", "memory"]
            .iter()
            .map(|a| format!("/home/u/runs/{a}-grpo/checkpoint-1200"))
            .collect();
        assert_eq!(
            agent_names(&agents, 30),
            ["coder-grpo", "tool-grpo", "memory-grpo"]
        );
        // Different depths: what follows the shared start.
        let agents = vec!["runs/a/x".to_string(), "runs/b".to_string()];
        assert_eq!(agent_names(&agents, 30), ["a/x", "b"]);
        // One agent: its folder's name.
        assert_eq!(agent_names(&["runs/a/ckpt".to_string()], 30), ["ckpt"]);
        // Long names differing in the middle: cut, and numbered where the cut made them equal.
        let long: Vec<String> = ["alpha", "beta"]
            .iter()
            .map(|m| format!("r/{}{m}{}/c", "x".repeat(20), "y".repeat(20)))
            .collect();
        let names = agent_names(&long, 12);
        assert_ne!(names[0], names[1], "{names:?}");
        assert!(names.iter().all(|n| n.chars().count() <= 14), "{names:?}");
    }

    use super::*;

    #[test]
    fn ticks_are_round_and_cover_the_range() {
        assert_eq!(
            nice_ticks(0.0, 90351.0, 5),
            [0.0, 20000.0, 40000.0, 60000.0, 80000.0, 100000.0]
        );
        assert_eq!(nice_ticks(1.0, 1.2, 4), [1.0, 1.05, 1.1, 1.15, 1.2]);
        assert_eq!(nice_ticks(0.0, 1.24, 4), [0.0, 0.5, 1.0, 1.5]);
        assert_eq!(tick_label(20000.0, 20000.0), "20k");
        assert_eq!(tick_label(1.05, 0.05), "1.05");
        assert_eq!(tick_label(0.5, 0.5), "0.5");
        assert_eq!(tick_label(2.5e6, 5e5), "2.5M");
    }

    #[test]
    fn long_names_are_cut_in_the_middle() {
        let name = "/m/Qwen2.5-7B-Instruct-coder-grpo-step1200";
        assert_eq!(
            short_name(name, 60),
            "Qwen2.5-7B-Instruct-coder-grpo-step1200"
        );
        let short = short_name(name, 24);
        assert_eq!(short.chars().count(), 24);
        assert!(
            short.starts_with("Qwen2.5-7B-") && short.ends_with("step1200") && short.contains('…')
        );
    }
}
