//! The README.md model card of a merged folder: YAML front matter the Hub reads (the inputs' Hub
//! ids, the method as a tag), what was merged and how, how to load it, and the mergekit recipe
//! where the merge has one. Every name read from files or given by users passes `crate::escape`
//! for the context it lands in: YAML strings, Markdown code spans, Markdown text, code blocks.

use super::{MergeRecord, OVERLAP_FIGURE, RECORD_FILE};
use crate::checkpoint::output_folder::MERGEKIT_CONFIG_FILE;
use crate::method::{Method, SharedRule};
use std::fmt::Write;
use std::path::Path;

/// The Hugging Face model card: YAML front matter, then what was merged and how; `config` is the
/// merged folder's config.json (which class loads it).
pub fn model_card(
    r: &MergeRecord,
    recipe: Option<&str>,
    config: Option<&serde_json::Value>,
) -> String {
    let mut s = String::new();
    front_matter(&mut s, r);
    if r.is_conversion() {
        conversion(&mut s, r);
    } else {
        let _ = writeln!(s, "# Merged with {}\n", r.merging.text());
        summary(&mut s, r);
        inputs(&mut s, r);
        stages(&mut s, r);
    }
    if r.outputs.iter().any(|f| f.file == OVERLAP_FIGURE) {
        let _ = writeln!(
            s,
            "\nEach agent's changed elements by how many other agents changed them too (k = 0: \
             unique; the paper's Figure 1):\n\n![overlap]({OVERLAP_FIGURE})"
        );
    }
    output(&mut s, r);
    vocabulary(&mut s, r);
    loading(&mut s, config);
    if let Some(recipe) = recipe {
        configuration(&mut s, r, recipe);
    }
    if !r.warnings.is_empty() {
        let _ = writeln!(s, "\n## Notes\n");
        for w in &r.warnings {
            let _ = writeln!(s, "- {}", crate::escape::markdown_text(w));
        }
    }
    s
}

/// An input's Hub id (`org/name`, no revision) when it came from the Hugging Face cache: the only
/// names the front matter's `base_model` holds (a local folder's path is not a Hub id).
fn hub_id(path: &str) -> Option<String> {
    let id = snapshot_id(path)?;
    Some(id.split('@').next().unwrap_or(&id).to_string())
}

/// `org/name@commit` of a record's name for a cache snapshot ([`super::HUB_PREFIX`], or an
/// absolute snapshot path in older records).
fn snapshot_id(path: &str) -> Option<String> {
    match path.strip_prefix(super::HUB_PREFIX) {
        Some(id) => Some(id.to_string()),
        None => crate::hub::id_of_snapshot(Path::new(path)),
    }
}

/// How the card's text names an input: a snapshot by `org/name@commit`, a folder by its path
/// (relative to this folder).
fn shown_name(path: &str) -> String {
    snapshot_id(path).unwrap_or_else(|| path.to_string())
}

/// "1 model", "3 models".
fn models(n: usize) -> String {
    match n {
        1 => "1 model".into(),
        n => format!("{n} models"),
    }
}

/// The YAML front matter: `base_model` (the inputs that are Hub ids, each once; none when every
/// input is a local folder), the library and the tags.
fn front_matter(s: &mut String, r: &MergeRecord) {
    let _ = writeln!(s, "---");
    let mut ids: Vec<String> = Vec::new();
    for path in std::iter::once(&r.base).chain(r.agents.iter().map(|a| &a.path)) {
        if let Some(id) = hub_id(path).filter(|id| !ids.contains(id)) {
            ids.push(id);
        }
    }
    if !ids.is_empty() {
        let _ = writeln!(s, "base_model:");
        for id in &ids {
            let _ = writeln!(s, "- {}", yaml_str(id));
        }
    }
    let tags = match r.is_conversion() {
        true => "- rlmerge\n- converted".to_string(),
        false => format!(
            "- merge\n- mergekit\n- rlmerge\n- {}",
            r.merging.method.name()
        ),
    };
    let _ = writeln!(s, "library_name: transformers\ntags:\n{tags}\n---\n");
}

/// What a conversion (`rlmerge convert`) read and wrote: the source, its format, and that the
/// tensors are its own.
fn conversion(s: &mut String, r: &MergeRecord) {
    let source = &r.agents[0].path;
    let read_from = match r.inputs.get(1).and_then(|c| c.format.as_deref()) {
        Some(f) => format!(", read from {f}"),
        None => String::new(),
    };
    let _ = writeln!(
        s,
        "# Converted with rlmerge\n\nThis folder is {}{read_from}, written as Hugging Face \
         safetensors by `rlmerge convert` (rlmerge {}): the source's tensors under \
         transformers' names{}, nothing merged.",
        code(&shown_name(source)),
        r.version,
        match r.adapter_applied() {
            true => format!(
                " (the adapter applied to its base {})",
                code(&shown_name(&r.base))
            ),
            false => String::new(),
        }
    );
}

/// What the method did, in a sentence or two; SVC's calibration after it.
fn summary(s: &mut String, r: &MergeRecord) {
    let _ = match &r.merging.method {
        Method::Combine(c) => {
            let semantics = if c.kind.in_mergekit() {
                ", with mergekit's semantics"
            } else {
                " (rlmerge's implementation; mergekit has no such method)"
            };
            let wide = settings_text(&c.parameters);
            writeln!(
                s,
                "This model merges {} with rlmerge {} using **{}** — {} ({}){semantics}. \
                 Parameters: {}.",
                models(r.agents.len()),
                r.version,
                c.kind.name(),
                c.kind.about(),
                c.kind.reference(),
                if wide.is_empty() {
                    defaults_text(c.kind)
                } else {
                    wide
                }
            )
        }
        _ => writeln!(
            s,
            "This model merges {} into their common base \
             with rlmerge {} using **{}**: parameters no agent changed (|τ| ≤ ε = {:e}) keep the \
             base value, parameters changed by several agents take the mean of their task \
             vectors over those agents only{}, and parameters changed by one agent keep that \
             agent's update{} (Reinforced Agent Merging, \
             [arXiv:2601.13572](https://arxiv.org/abs/2601.13572)).",
            match r.agents.len() {
                1 => "1 reinforcement-learning-trained agent".to_string(),
                n => format!("{n} reinforcement-learning-trained agents"),
            },
            r.version,
            r.merging.method,
            r.epsilon,
            match r.merging.method.shared() {
                SharedRule::Mean => "",
                SharedRule::Consensus => " whose change has the sign of the changes' sum",
            },
            if r.merging.method.boost().is_some() {
                ", scaled by λ_t"
            } else {
                ""
            }
        ),
    };
    if let Some(alpha) = r.merging.svc {
        let _ = writeln!(
            s,
            "\nThen **SVC** calibrated the spectrum of every matrix the method merged (α = \
             {alpha}; [arXiv:2602.05536](https://arxiv.org/abs/2602.05536)): each singular value \
             of the merged update was rescaled by T / Σ_t max(α, s_r^t), so that directions \
             several agents share are not counted several times."
        );
    }
    let _ = writeln!(s);
}

/// Parameters as `key = value`, comma-separated, in their order (empty: none).
fn settings_text(settings: &crate::method::settings::Settings) -> String {
    settings
        .iter()
        .map(|(k, v)| {
            let value = serde_json::to_string(v).unwrap_or_else(|_| "?".into());
            format!("{} = {}", code(k), code(&value))
        })
        .collect::<Vec<_>>()
        .join(", ")
}

/// A method's defaults, as `rlmerge methods NAME` gives them, where the merge set none.
fn defaults_text(kind: crate::method::Kind) -> String {
    let shown: Vec<String> = kind
        .params()
        .iter()
        .filter(|p| !matches!(p.default, crate::method::catalog::ParamDefault::Required))
        .map(|p| format!("{} = {}", code(p.name), code(&p.default.text(p.range))))
        .collect();
    match shown.is_empty() {
        true => "none".into(),
        false => format!("the method's defaults, {}", shown.join(", ")),
    }
}

/// The base and each agent, with its λ or where its parameters are, and its changed counts.
/// A multi-stage recipe's earlier stages, in the order they ran: each one's method, base and
/// models (a model that is an earlier stage named `stage:NAME`).
fn stages(s: &mut String, r: &MergeRecord) {
    if r.stages.is_empty() {
        return;
    }
    let _ = writeln!(
        s,
        "\n## Stages\n\nThis merge is the last of {} stages of a multi-stage recipe \
         (mergekit-multi's); the earlier ones, in the order they ran:\n",
        r.stages.len() + 1
    );
    for stage in &r.stages {
        let models: Vec<String> = stage
            .record
            .agents
            .iter()
            .map(|a| code(&shown_name(&a.path)))
            .collect();
        let _ = writeln!(
            s,
            "- {}: {} of {} over {}",
            code(&stage.name),
            crate::escape::markdown_text(&stage.record.merging.text()),
            models.join(", "),
            code(&shown_name(&stage.record.base)),
        );
    }
    if r.inputs
        .iter()
        .any(|i| i.path.to_string_lossy().starts_with(super::STAGE_PREFIX))
    {
        let _ = writeln!(
            s,
            "\nAn input named `stage:NAME` is that stage's output, made in scratch and removed \
             after the merge; `rlmerge run {MERGEKIT_CONFIG_FILE} OUT` makes every stage again."
        );
    }
}

fn inputs(s: &mut String, r: &MergeRecord) {
    // The format each input was read from where it is not safetensors (inputs: base, agents).
    let read_from = |i: usize| match r.inputs.get(i).and_then(|c| c.format.as_deref()) {
        Some(f) => format!(" (read from {f})"),
        None => String::new(),
    };
    let _ = writeln!(
        s,
        "## Inputs\n\n- base: {}{}",
        code(&shown_name(&r.base)),
        read_from(0)
    );
    for (t, a) in r.agents.iter().enumerate() {
        // Its own parameters, or λ; nothing where it has none of its own.
        let lambda = match (a.lambda, &r.merging.method) {
            (_, Method::Combine(c)) => c
                .models
                .get(t)
                .map(settings_text)
                .filter(|own| !own.is_empty())
                .map(|own| format!(" — {own}"))
                .unwrap_or_default(),
            (Some(l), _) => format!(" — λ = {l:.6}"),
            (None, m) => format!(
                " — λ per {} (see {RECORD_FILE})",
                m.scope().map_or("tensor", |s| s.name())
            ),
        };
        let counts = match a.counts {
            Some(c) => format!(
                ", {} unique and {} shared changed elements",
                c.unique, c.shared
            ),
            None => String::new(),
        };
        let name = match &a.name {
            Some(n) => format!(" ({})", code(n)),
            None => String::new(),
        };
        let counts = match a.kept {
            Some(k) => format!("{counts}; the merge kept {k:.3} of its update (Σ Δ·τ / Σ τ²)"),
            None => counts,
        };
        let _ = writeln!(
            s,
            "- agent {}{name}: {}{}{lambda}{counts}",
            t + 1,
            code(&shown_name(&a.path)),
            read_from(t + 1)
        );
    }
}

/// The shards, the dtype, and the files that say how the merge was made.
fn output(s: &mut String, r: &MergeRecord) {
    let dtype = r
        .main_dtype
        .as_deref()
        .or(r.out_dtype.as_deref())
        .unwrap_or("as the base's");
    let _ = writeln!(
        s,
        "\n## Output\n\n{} shard(s), dtype {dtype}. How it was made is recorded in \
         `{RECORD_FILE}`{}.",
        r.shards().count(),
        if r.outputs.iter().any(|f| f.file == MERGEKIT_CONFIG_FILE) {
            format!(" and the mergekit configuration in `{MERGEKIT_CONFIG_FILE}`")
        } else {
            String::new()
        }
    );
}

/// The output's vocabulary, when a tokenizer source set it.
fn vocabulary(s: &mut String, r: &MergeRecord) {
    use crate::vocabulary::TokenizerSource;
    let Some(t) = &r.tokenizer else {
        return;
    };
    let source = match &t.source {
        TokenizerSource::Base => "the base's".to_string(),
        TokenizerSource::Union => "the union of every model's".to_string(),
        TokenizerSource::Model(p) => format!("{}'s", code(&shown_name(&p.display().to_string()))),
    };
    let tokens = if t.tokens.is_empty() {
        String::new()
    } else {
        let names: Vec<String> = t.tokens.iter().map(|k| code(&k.token)).collect();
        format!(", with {}", names.join(", "))
    };
    let _ = writeln!(
        s,
        "\nVocabulary: {source} tokenizer{tokens}{}; each model's embedding and output rows \
         follow it token by token (a token a model lacks takes another model's row, as mergekit \
         does).",
        t.pad_to_multiple_of.map_or(String::new(), |m| format!(
            ", rows padded to a multiple of {m}"
        ))
    );
}

/// The transformers class that loads a model of `config` (issue #44): `AutoModelForCausalLM` for
/// a `…ForCausalLM` (or no config), `AutoModelForImageTextToText` for a model with a vision
/// tower, else the class `architectures` names (a Python identifier, or `AutoModel`).
fn loading_class(config: Option<&serde_json::Value>) -> String {
    let arch = config
        .and_then(|c| c.get("architectures"))
        .and_then(|a| a.get(0))
        .and_then(|a| a.as_str());
    let vision = config.is_some_and(|c| c.get("vision_config").is_some());
    match arch {
        None => "AutoModelForCausalLM".into(),
        Some(a) if a.ends_with("ForCausalLM") => "AutoModelForCausalLM".into(),
        Some(_) if vision => "AutoModelForImageTextToText".into(),
        Some(a)
            if a.chars().next().is_some_and(|c| c.is_ascii_alphabetic())
                && a.chars().all(|c| c.is_ascii_alphanumeric() || c == '_') =>
        {
            a.to_string()
        }
        Some(_) => "AutoModel".into(),
    }
}

/// How to load the merged model with transformers: the class its config names, and for a model
/// with a vision tower its processor.
fn loading(s: &mut String, config: Option<&serde_json::Value>) {
    let class = loading_class(config);
    let vision = class == "AutoModelForImageTextToText";
    let (reader, name) = match vision {
        true => ("AutoProcessor", "processor"),
        false => ("AutoTokenizer", "tokenizer"),
    };
    let _ = writeln!(
        s,
        "\n## Use\n\n```python\nfrom transformers import {class}, {reader}\n\n\
         path = \"path/to/this/folder\"  # or its Hub id once uploaded\n\
         {name} = {reader}.from_pretrained(path)\n\
         model = {class}.from_pretrained(path, torch_dtype=\"auto\")\n```"
    );
}

/// The recipe that makes this merge again (the one it came from, or the command line's flags as
/// one, its model paths relative to this folder), as mergekit's cards show theirs: in a code
/// block no line of it can leave (a fence longer than any run of backticks in it), hidden
/// characters made visible. Whether mergekit runs it too is said, not promised.
fn configuration(s: &mut String, r: &MergeRecord, recipe: &str) {
    let _ = write!(
        s,
        "\n## Reproduce\n\n`rlmerge run {MERGEKIT_CONFIG_FILE} -o OUT` makes this merge again, \
         byte for byte, from any folder: the model paths in it are relative to this one. {} \
         `rlmerge verify THIS_FOLDER --against` recomputes it and compares.\n\n{}",
        mergekit_note(r, recipe),
        crate::escape::markdown_block("yaml", recipe)
    );
}

/// What mergekit makes of the recipe: nothing, for a method or modifier it does not have;
/// otherwise it runs it from this folder, ignoring rlmerge's own keys (named), and drawing its
/// own random masks.
fn mergekit_note(r: &MergeRecord, recipe: &str) -> String {
    let kind = r.merging.method.kind();
    if !kind.in_mergekit() {
        return format!(
            "mergekit cannot run it: `{}` is rlmerge's method.",
            kind.name()
        );
    }
    if r.merging.svc.is_some() {
        return "mergekit cannot run it: SVC is rlmerge's.".into();
    }
    const OWN_KEYS: [&str; 8] = [
        "layout_model",
        "config_from",
        "seed",
        "shard_size",
        "allow_nonfinite",
        "allow_missing_tensors",
        "raw_f32_agents",
        "svc",
    ];
    let value: serde_yaml::Value = serde_yaml::from_str(recipe).unwrap_or_default();
    let own: Vec<String> = OWN_KEYS
        .iter()
        .filter(|k| value.get(**k).is_some())
        .map(|k| format!("`{k}`"))
        .collect();
    let mut note =
        format!("`mergekit-yaml {MERGEKIT_CONFIG_FILE} OUT`, run in this folder, takes it too");
    if !own.is_empty() {
        let _ = write!(note, ", ignoring rlmerge's own keys ({})", own.join(", "));
        if own.iter().any(|k| k == "`layout_model`") {
            note.push_str(": it takes the layout and config from the first model");
        }
    }
    if kind.is_seeded() {
        note.push_str(", with random masks of its own");
    }
    note.push('.');
    note
}

/// A name in the card's YAML front matter: double-quoted (JSON's escapes are YAML's), hidden
/// characters escaped first ([`crate::escape::terminal`]).
fn yaml_str(s: &str) -> String {
    serde_json::to_string(&crate::escape::terminal(s)).expect("strings serialize")
}

/// A name in the card's Markdown: a code span it cannot leave ([`crate::escape::markdown_code`]).
fn code(s: &str) -> String {
    crate::escape::markdown_code(s)
}

#[cfg(test)]
mod tests {
    use super::loading_class;
    use serde_json::json;

    /// Issue #44 item 7: the card loads a model with the class its config names.
    #[test]
    fn the_card_loads_with_the_class_the_config_names() {
        let class = |c: serde_json::Value| loading_class(Some(&c));
        assert_eq!(loading_class(None), "AutoModelForCausalLM");
        assert_eq!(
            class(json!({"architectures": ["Qwen3MoeForCausalLM"]})),
            "AutoModelForCausalLM"
        );
        assert_eq!(
            class(
                json!({"architectures": ["Qwen2_5_VLForConditionalGeneration"],
                         "vision_config": {}})
            ),
            "AutoModelForImageTextToText"
        );
        assert_eq!(
            class(json!({"architectures": ["Gemma3ForConditionalGeneration"]})),
            "Gemma3ForConditionalGeneration"
        );
        assert_eq!(
            class(json!({"architectures": ["X; import os"]})),
            "AutoModel",
            "a name from a file is code only when it is an identifier"
        );
    }
}
