//! `analyze --plot DIR`: the SVG figures are rendered here with a real SVG renderer (resvg), and
//! what they draw is checked against the probe's counts — not just that files exist.

mod common;
use common::*;
use resvg::{tiny_skia, usvg};
use rlmerge::figures::{agent_colour, k_colour, ALL};
use safetensors::tensor::Dtype;
use serde_json::Value;
use std::path::Path;

/// The SVG at `path` rendered to RGBA pixels.
fn render(path: &Path) -> tiny_skia::Pixmap {
    let text = std::fs::read_to_string(path).unwrap();
    let tree = usvg::Tree::from_str(&text, &usvg::Options::default())
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let size = tree.size().to_int_size();
    let mut pixmap = tiny_skia::Pixmap::new(size.width(), size.height()).unwrap();
    resvg::render(&tree, tiny_skia::Transform::default(), &mut pixmap.as_mut());
    pixmap
}

/// Pixels of exactly this `#rrggbb` colour.
fn pixels_of(p: &tiny_skia::Pixmap, hex: &str) -> usize {
    let v = u32::from_str_radix(&hex[1..], 16).unwrap();
    let (r, g, b) = ((v >> 16) as u8, (v >> 8) as u8, v as u8);
    p.pixels()
        .iter()
        .filter(|c| c.alpha() == 255 && (c.red(), c.green(), c.blue()) == (r, g, b))
        .count()
}

fn analyze(f: &Fixture, extra: &[&str]) -> Value {
    let mut cmd = rlmerge();
    cmd.args(["analyze", "--json", "-q", "--base"]).arg(&f.base);
    for a in &f.agents {
        cmd.arg("--model").arg(a);
    }
    let o = cmd.args(extra).output().unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    serde_json::from_slice(&o.stdout).unwrap()
}

/// overlap.svg draws, per agent, one segment per k on one absolute scale — the same pixels per
/// element for every segment of every agent, so bars compare across agents — labelled with the
/// counts of the report, and the rendered pixels of each k's colour are the segments' areas.
#[test]
fn overlap_bars_have_the_probe_counts() {
    for agents in [2, 4] {
        let f = fixture(61, Dtype::BF16, &odd_shapes(), &DENSITIES[..agents], 1);
        let dir = f.dir.path().join("plots");
        let report = analyze(&f, &["--plot", dir.to_str().unwrap()]);
        let svg = std::fs::read_to_string(dir.join("overlap.svg")).unwrap();
        let segments = titled_rects(&svg);
        let mut drawn = Vec::new();
        let mut area = vec![0.0; agents];
        for (t, a) in report["agents"].as_array().unwrap().iter().enumerate() {
            let row: Vec<u64> = a["shared_with_k_others"]
                .as_array()
                .unwrap()
                .iter()
                .map(|v| v.as_u64().unwrap())
                .collect();
            let changed: u64 = row.iter().sum();
            assert!(svg.contains(&format!("{changed} changed")), "agent {t}");
            for (k, &c) in row.iter().enumerate() {
                if c == 0 {
                    continue;
                }
                let prefix = format!("k = {k}: {c} elements");
                let (w, h) = segments
                    .iter()
                    .find(|(title, _)| title.starts_with(&prefix))
                    .unwrap_or_else(|| panic!("agent {t}, k {k}: no segment"))
                    .1;
                drawn.push((t, k, c, w));
                area[k] += w * h;
            }
        }
        // One scale: every segment is c elements × the same pixels per element (widths are
        // written to 1/100 pixel).
        let scale =
            drawn.iter().map(|d| d.3).sum::<f64>() / drawn.iter().map(|d| d.2 as f64).sum::<f64>();
        for (t, k, c, w) in drawn {
            assert!(
                (w - scale * c as f64).abs() <= 0.011,
                "agent {t}, k {k}: {w} px for {c} elements, not {scale} px each"
            );
        }
        let pixmap = render(&dir.join("overlap.svg"));
        for (k, &want) in area.iter().enumerate() {
            // The legend's swatch (14 × 12) too; edges fall between pixels (anti-aliasing).
            let want = want + 168.0;
            let got = pixels_of(&pixmap, k_colour(k)) as f64;
            assert!(
                (got - want).abs() <= 0.03 * want + 60.0,
                "{agents} agents, k = {k}: {got} pixels drawn, {want} expected"
            );
        }
    }
}

/// The rectangles of an SVG that carry a tooltip: (tooltip, (width, height)).
fn titled_rects(svg: &str) -> Vec<(String, (f64, f64))> {
    let doc = roxmltree::Document::parse(svg).unwrap();
    doc.descendants()
        .filter(|n| n.has_tag_name("rect"))
        .filter_map(|n| {
            let title = n
                .children()
                .find(|c| c.has_tag_name("title"))?
                .text()?
                .to_string();
            let num = |a: &str| n.attribute(a).unwrap().parse::<f64>().unwrap();
            Some((title, (num("width"), num("height"))))
        })
        .collect()
}

/// Every text of an SVG as the box it takes (x0, y0, x1, y1) — 0.6 em a character, DejaVu
/// Sans's average advance, from 0.8 em above the baseline to 0.25 em below — with its text.
fn text_boxes(svg: &str) -> Vec<((f64, f64, f64, f64), String)> {
    let doc = roxmltree::Document::parse(svg).unwrap();
    doc.descendants()
        .filter(|n| n.has_tag_name("text"))
        .map(|n| {
            let text: String = n
                .children()
                .filter(|c| c.is_text())
                .map(|c| c.text().unwrap())
                .collect();
            let num = |a: &str| n.attribute(a).unwrap().parse::<f64>().unwrap();
            let (x, y, size) = (num("x"), num("y"), num("font-size"));
            let w = text.chars().count() as f64 * 0.6 * size;
            let x0 = match n.attribute("text-anchor") {
                Some("middle") => x - w / 2.0,
                Some("end") => x - w,
                _ => x,
            };
            ((x0, y - 0.8 * size, x0 + w, y + 0.25 * size), text)
        })
        .collect()
}

/// No text of `figure` overlaps another or leaves the canvas.
fn assert_text_fits(path: &Path) {
    let svg = std::fs::read_to_string(path).unwrap();
    let doc = roxmltree::Document::parse(&svg).unwrap();
    let root = doc.root_element();
    let (w, h) = (
        root.attribute("width").unwrap().parse::<f64>().unwrap(),
        root.attribute("height").unwrap().parse::<f64>().unwrap(),
    );
    let boxes = text_boxes(&svg);
    assert!(boxes.len() > 5, "{}: texts found", path.display());
    for (i, (a, ta)) in boxes.iter().enumerate() {
        assert!(
            a.0 >= 0.0 && a.1 >= 0.0 && a.2 <= w && a.3 <= h,
            "{}: {ta:?} leaves the {w}×{h} canvas: {a:?}",
            path.display()
        );
        for (b, tb) in &boxes[i + 1..] {
            let apart = a.2 <= b.0 || b.2 <= a.0 || a.3 <= b.1 || b.3 <= a.1;
            assert!(
                apart,
                "{}: {ta:?} {a:?} overlaps {tb:?} {b:?}",
                path.display()
            );
        }
    }
}

/// Every figure, on the demo and on three agents with long folder names (as real checkpoints
/// are named): no text overlaps another or leaves the canvas, long names are cut in the middle
/// with the full name in a tooltip, and every agent is in the legend or labelled.
#[test]
fn figure_text_never_overlaps_or_leaves_the_canvas() {
    let d = tempfile::tempdir().unwrap();
    let root = d.path();
    rlmerge()
        .args(["demo", "--write-only", "--quiet"])
        .arg(root.join("demo"))
        .assert()
        .success();
    let long = [
        "Qwen2.5-7B-Instruct-coder-grpo-step1200",
        "Qwen2.5-7B-Instruct-toolcall-dapo-step800-final",
        "Qwen2.5-7B-Instruct-memory-agent-rl-longcontext-v2",
    ];
    for (a, name) in ["coding-agent", "tool-agent", "memory-agent"]
        .iter()
        .zip(long)
    {
        std::fs::rename(root.join("demo").join(a), root.join("demo").join(name)).unwrap();
    }
    let models: Vec<std::path::PathBuf> = long.iter().map(|n| root.join("demo").join(n)).collect();
    for (case, agents) in [("three", &models[..]), ("one", &models[..1])] {
        let merged = root.join(format!("merged-{case}-with-a-long-output-folder-name"));
        let mut cmd = rlmerge();
        cmd.args(["merge", "-q", "--device", "cpu", "--base"])
            .arg(root.join("demo/base"));
        for a in agents {
            cmd.arg("--model").arg(a);
        }
        cmd.arg("-o").arg(&merged).assert().success();
        let plots = root.join(format!("plots-{case}"));
        let mut cmd = rlmerge();
        cmd.args(["analyze", "-q", "--device", "cpu", "--per-tensor", "--base"])
            .arg(root.join("demo/base"));
        for a in agents {
            cmd.arg("--model").arg(a);
        }
        cmd.arg("--merged").arg(&merged).arg("--plot").arg(&plots);
        cmd.assert().success();
        for figure in ["overlap.svg", "layers.svg", "lambda.svg", "retention.svg"] {
            let path = plots.join(figure);
            assert_text_fits(&path);
            let svg = std::fs::read_to_string(&path).unwrap();
            assert!(svg.contains("Qwen2.5-7B-Inst"), "{figure}: names shown");
            assert!(svg.contains('…'), "{figure}: long names cut");
            if figure == "overlap.svg" || figure == "retention.svg" {
                assert!(
                    svg.contains(&format!("<title>{}</title>", models[0].display())),
                    "{figure}: full name as tooltip"
                );
            }
        }
        assert_text_fits(&merged.join("overlap.svg"));
    }
}

/// layers.svg draws one line per agent in its colour, with every layer as a tick.
#[test]
fn layers_figure_draws_every_agent() {
    let shapes: Vec<(&str, Vec<usize>)> = vec![
        ("model.embed_tokens.weight", vec![16, 8]),
        ("model.layers.0.mlp.up_proj.weight", vec![32, 8]),
        ("model.layers.1.mlp.up_proj.weight", vec![32, 8]),
        ("model.layers.2.self_attn.q_proj.weight", vec![8, 8]),
        ("model.norm.weight", vec![8]),
    ];
    let f = fixture(62, Dtype::BF16, &shapes, &DENSITIES[..3], 1);
    let dir = f.dir.path().join("plots");
    analyze(&f, &["--plot", dir.to_str().unwrap()]);
    let svg = std::fs::read_to_string(dir.join("layers.svg")).unwrap();
    for tick in [">embed<", ">norm<", ">0<", ">1<", ">2<"] {
        assert!(svg.contains(tick), "tick {tick} missing");
    }
    let pixmap = render(&dir.join("layers.svg"));
    for t in 0..3 {
        let c = agent_colour(t);
        assert!(pixels_of(&pixmap, c) > 50, "agent {t} ({c}) not drawn");
    }
}

/// A merge of the RAM family writes overlap.svg beside the weights, lists it in the record, shows
/// it in the model card and verifies. RAM+ has it from its probe; plain RAM from its merge
/// kernels' counts (no probe pass) — the same figure as analyze's, whatever the tiling and
/// backend. A method outside the family writes none.
#[test]
fn ram_family_merges_show_their_overlap_figure() {
    let f = fixture(63, Dtype::BF16, &odd_shapes(), &DENSITIES[..3], 1);
    let plots = f.dir.path().join("plots");
    analyze(&f, &["--plot", plots.to_str().unwrap()]);
    let want = std::fs::read_to_string(plots.join("overlap.svg")).unwrap();
    for (name, args) in [
        ("plus", &["--method", "ram+"][..]),
        ("ram", &["--method", "ram"]),
        ("ram-tiles", &["--method", "ram", "--tile-elems", "33"]),
        (
            "ram-consensus",
            &["--method", "ram", "--shared", "consensus"],
        ),
    ] {
        let out = f.dir.path().join(name);
        merge_cmd(&f, &out, args).assert().success();
        let svg = std::fs::read_to_string(out.join("overlap.svg")).unwrap();
        assert_eq!(svg, want, "{name}");
        render(&out.join("overlap.svg"));
        let card = std::fs::read_to_string(out.join("README.md")).unwrap();
        assert!(card.contains("![overlap](overlap.svg)"), "{name}: {card}");
        let record = std::fs::read_to_string(out.join("rlmerge_record.json")).unwrap();
        assert!(record.contains("\"overlap.svg\""), "{name}: {record}");
        rlmerge().arg("verify").arg(&out).assert().success();
    }
    let ties = f.dir.path().join("ties");
    merge_cmd(&f, &ties, &["--method", "ties", "--param", "weight=1"])
        .assert()
        .success();
    assert!(!ties.join("overlap.svg").exists());
}

/// With --per-tensor, lambda.svg draws each agent's λ per layer (one line per agent, every
/// layer a tick) within the rule's range [1, 1 + r·α].
#[test]
fn lambda_figure_draws_every_agent_per_layer() {
    let shapes: Vec<(&str, Vec<usize>)> = vec![
        ("model.embed_tokens.weight", vec![16, 8]),
        ("model.layers.0.mlp.up_proj.weight", vec![32, 8]),
        ("model.layers.1.mlp.up_proj.weight", vec![32, 8]),
    ];
    let f = fixture(64, Dtype::BF16, &shapes, &DENSITIES[..3], 1);
    let dir = f.dir.path().join("plots");
    let report = analyze(&f, &["--per-tensor", "--plot", dir.to_str().unwrap()]);
    let svg = std::fs::read_to_string(dir.join("lambda.svg")).unwrap();
    for tick in [">embed<", ">0<", ">1<", ">1.00<", ">1.20<", ">layer<"] {
        assert!(svg.contains(tick), "{tick} missing");
    }
    assert_eq!(report["lambda_by_layer"].as_array().unwrap().len(), 3);
    let pixmap = render(&dir.join("lambda.svg"));
    for t in 0..3 {
        let c = agent_colour(t);
        assert!(pixels_of(&pixmap, c) > 50, "agent {t} ({c}) not drawn");
    }
}

/// With --merged, retention.svg draws per agent one bar per region as long as its r on an axis
/// from 0 to 1 (no r above 1 here), measured in rendered pixels against the JSON's r; a
/// task_arithmetic merge with weight 0.5 keeps r = 0.5 on every agent's unique elements.
#[test]
fn retention_bars_are_as_long_as_r() {
    let f = fixture(65, Dtype::F32, &odd_shapes(), &DENSITIES[..3], 1);
    let merged = f.dir.path().join("ta");
    merge_cmd(
        &f,
        &merged,
        &["--method", "task_arithmetic", "--param", "weight=0.5"],
    )
    .assert()
    .success();
    let dir = f.dir.path().join("plots");
    let report = analyze(
        &f,
        &[
            "--merged",
            merged.to_str().unwrap(),
            "--plot",
            dir.to_str().unwrap(),
        ],
    );
    let svg = std::fs::read_to_string(dir.join("retention.svg")).unwrap();
    assert!(
        svg.contains("in ta</text>"),
        "the merged folder's name is in the title"
    );
    assert_eq!(svg.matches("unique r = 0.500,").count(), 3, "{svg}");
    // The axis: where the ticks 0 and 1 are written.
    let tick_x = |value: f64| {
        text_boxes(&svg)
            .into_iter()
            .find(|(_, t)| t.parse::<f64>() == Ok(value))
            .map(|(b, _)| (b.0 + b.2) / 2.0)
            .unwrap_or_else(|| panic!("no tick {value}"))
    };
    let axis = tick_x(1.0) - tick_x(0.0);
    assert!(axis > 200.0, "{axis}");
    let pixmap = render(&dir.join("retention.svg"));
    for (i, region) in ["unique", "shared", "all"].iter().enumerate() {
        // Each agent's 12-pixel bar over r of the axis, and the legend's 14 × 12 swatch.
        let mut want = 168.0;
        for a in report["retention"]["agents"].as_array().unwrap() {
            let r = a[region]["retention"].as_f64().unwrap();
            assert!((0.0..=1.0).contains(&r), "{region}: {r}");
            want += 12.0 * axis * r;
        }
        let colour = [k_colour(0), k_colour(1), ALL][i];
        let got = pixels_of(&pixmap, colour) as f64;
        assert!(
            (got - want).abs() < 0.03 * want,
            "{region}: {got} px, want {want}"
        );
    }
}

/// Every figure of a 1 GiB bf16 base with three agents (the demo's generator at full size):
/// a RAM merge's overlap.svg, and analyze's overlap, layers, lambda and retention figures, each
/// rendered and drawing every agent. Writes about 4.5 GiB into a temporary folder, so it runs on
/// request: `cargo test --release --test figures -- --ignored`.
#[test]
#[ignore = "writes 4.5 GiB; run with --ignored"]
fn figures_of_a_1_gib_merge() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path();
    rlmerge()
        .args(["demo", "--model-size", "1GiB", "--write-only", "--quiet"])
        .arg(root)
        .assert()
        .success();
    let agents = ["coding-agent", "tool-agent", "memory-agent"];
    let merged = root.join("merged");
    let mut cmd = rlmerge();
    cmd.args(["merge", "--quiet", "--method", "ram", "--base"])
        .arg(root.join("base"));
    for a in agents {
        cmd.arg("--model").arg(root.join(a));
    }
    cmd.arg("-o").arg(&merged).assert().success();
    let plots = root.join("plots");
    let mut cmd = rlmerge();
    cmd.args(["analyze", "--quiet", "--per-tensor", "--base"])
        .arg(root.join("base"));
    for a in agents {
        cmd.arg("--model").arg(root.join(a));
    }
    cmd.arg("--merged").arg(&merged).arg("--plot").arg(&plots);
    cmd.assert().success();
    assert_eq!(
        std::fs::read(merged.join("overlap.svg")).unwrap(),
        std::fs::read(plots.join("overlap.svg")).unwrap()
    );
    for (figure, colours) in [
        ("overlap.svg", (0..3).map(k_colour).collect::<Vec<_>>()),
        ("layers.svg", (0..3).map(agent_colour).collect()),
        ("lambda.svg", (0..3).map(agent_colour).collect()),
        ("retention.svg", vec![k_colour(0), k_colour(1), ALL]),
    ] {
        let pixmap = render(&plots.join(figure));
        for c in colours {
            assert!(pixels_of(&pixmap, c) > 50, "{figure}: {c} not drawn");
        }
        for a in agents {
            let svg = std::fs::read_to_string(plots.join(figure)).unwrap();
            assert!(svg.contains(a), "{figure}: {a} not labelled");
        }
    }
}
