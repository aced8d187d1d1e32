//! `rlmerge methods`: the table of every method with its cost and memory classes, in 100
//! columns, and `rlmerge methods NAME`, one method whole (also as JSON).

use super::MethodsArgs;
use crate::error::usage;
use crate::method::catalog::{Cost, Footprint};
use crate::method::listing::{method_json, scope_name, SVC_ABOUT, SVC_REFERENCE, SVC_SUMMARY};
use crate::method::Kind;
use anyhow::Result;
use std::io::Write;

/// The widest line `rlmerge methods` prints.
const METHODS_WIDTH: usize = 100;

/// `text` cut into lines of at most `width` characters at spaces, the first after `first`, the
/// others after `indent` spaces.
fn wrapped(first: &str, text: &str, indent: usize, width: usize) -> String {
    let mut lines = vec![first.to_string()];
    // Whether the last line has no word of `text` yet.
    let mut fresh = true;
    for word in text.split(' ') {
        let line = lines.last_mut().expect("one line at least");
        if !fresh && line.chars().count() + 1 + word.chars().count() > width {
            lines.push(format!("{:indent$}{word}", ""));
        } else {
            if !(fresh && line.ends_with(' ')) {
                line.push(' ');
            }
            line.push_str(word);
        }
        fresh = false;
    }
    lines.join("\n")
}

/// The method `name` names for `rlmerge methods NAME` (`None`: SVC, the modifier).
fn method_named(name: &str) -> Result<Option<Kind>> {
    if name == crate::method::catalog::SVC.name {
        return Ok(None);
    }
    Kind::from_name(name).map(Some).ok_or_else(|| {
        usage(format!(
            "unknown method '{name}'{}; `rlmerge methods` lists them",
            crate::error::did_you_mean(
                name,
                Kind::ALL
                    .iter()
                    .map(|k| k.name())
                    .chain([crate::method::catalog::SVC.name])
            )
        ))
    })
}

pub fn run_methods(args: &MethodsArgs, out: &mut impl Write) -> Result<()> {
    if let Some(name) = &args.name {
        let kind = method_named(name)?;
        if args.json {
            writeln!(out, "{}", serde_json::to_string_pretty(&method_json(kind))?)?;
        } else {
            write_method(kind, out)?;
        }
        return Ok(());
    }
    if args.json {
        let methods = crate::method::listing::all_json();
        writeln!(out, "{}", serde_json::to_string_pretty(&methods)?)?;
        return Ok(());
    }
    writeln!(
        out,
        "{:<17} {:<SUMMARY_WIDTH$} {:<9} memory",
        "method", "what it does", "cost"
    )?;
    let row = |name: &str, summary: &str, cost: Cost, memory: Footprint| {
        format!(
            "{name:<17} {summary:<SUMMARY_WIDTH$} {:<9} {}",
            cost.name(),
            memory.name()
        )
    };
    for kind in Kind::ALL {
        let name = match kind {
            Kind::RamPlus => format!("{} (default)", kind.name()),
            _ => kind.name().to_string(),
        };
        writeln!(
            out,
            "{}",
            row(&name, kind.summary(), kind.cost(), kind.footprint())
        )?;
    }
    let svc = format!("{} (modifier)", crate::method::catalog::SVC.name);
    writeln!(
        out,
        "{}",
        row(&svc, SVC_SUMMARY, Cost::Spectral, Footprint::Matrices)
    )?;
    writeln!(out)?;
    for (i, cost) in [Cost::Stream, Cost::Scan, Cost::Spectral]
        .into_iter()
        .enumerate()
    {
        let head = if i == 0 { "cost:" } else { "" };
        let head = format!("{head:<7} {:<9}", cost.name());
        writeln!(out, "{}", wrapped(&head, cost.about(), 18, METHODS_WIDTH))?;
    }
    for (i, memory) in [Footprint::Tiles, Footprint::Matrices]
        .into_iter()
        .enumerate()
    {
        let head = if i == 0 { "memory:" } else { "" };
        let head = format!("{head:<7} {:<9}", memory.name());
        writeln!(out, "{}", wrapped(&head, memory.about(), 18, METHODS_WIDTH))?;
    }
    writeln!(
        out,
        "\nram+ is also accepted as ramplus and ram_plus.\n`rlmerge methods NAME` gives a method's parameters, defaults and reference; \
         docs/methods.md,\nwhich method to choose. Parameters go in a mergekit recipe \
         (rlmerge run RECIPE.yml -o OUT)\nor on the command line (--param KEY=VALUE)."
    )?;
    Ok(())
}

/// The table's column of what each method does: every summary fits it (tests/front_door.rs).
pub(crate) const SUMMARY_WIDTH: usize = 50;

/// `rlmerge methods NAME`: the method (`None`: SVC) whole — what it does, its reference, its cost
/// and memory classes, every parameter, and a command that runs it.
fn write_method(kind: Option<Kind>, out: &mut impl Write) -> Result<()> {
    let svc = &crate::method::catalog::SVC;
    let (name, about, reference, cost, memory, params) = match kind {
        Some(k) => (
            k.name(),
            k.about(),
            k.reference(),
            k.cost(),
            k.footprint(),
            k.params(),
        ),
        None => (
            svc.name,
            SVC_ABOUT,
            SVC_REFERENCE,
            Cost::Spectral,
            Footprint::Matrices,
            std::slice::from_ref(svc),
        ),
    };
    let w = METHODS_WIDTH;
    writeln!(out, "{}", wrapped(&format!("{name} —"), about, 4, w))?;
    writeln!(out, "reference  {reference}")?;
    writeln!(
        out,
        "{}",
        wrapped(&format!("cost       {}:", cost.name()), cost.about(), 11, w)
    )?;
    writeln!(
        out,
        "{}",
        wrapped(
            &format!("memory     {}:", memory.name()),
            memory.about(),
            11,
            w
        )
    )?;
    if params.is_empty() {
        writeln!(out, "parameters none")?;
    } else {
        writeln!(out, "parameters")?;
    }
    for p in params {
        let default = match p.default {
            crate::method::catalog::ParamDefault::Required => "required".to_string(),
            d => format!("default {}", d.text(p.range)),
        };
        writeln!(
            out,
            "  {:<18} {:<11}  {:<24} {}",
            p.name,
            scope_name(p),
            default,
            p.range.text()
        )?;
        writeln!(out, "{}", wrapped("     ", p.about, 5, w))?;
    }
    let example = match kind {
        None => {
            "rlmerge merge --base BASE --model AGENT … --method ram+ --svc 0.1 -o OUT".to_string()
        }
        Some(k) => {
            let required: String = k
                .params()
                .iter()
                .filter(|p| matches!(p.default, crate::method::catalog::ParamDefault::Required))
                .map(|p| format!(" --param {}=…", p.name))
                .collect();
            format!(
                "rlmerge merge --base BASE --model AGENT … --method {}{required} -o OUT",
                k.name()
            )
        }
    };
    writeln!(out, "{}", wrapped("example   ", &example, 4, w))?;
    Ok(())
}
