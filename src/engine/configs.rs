//! Whose config.json a merged folder takes, and what the agents' configs say against the base's
//! (issue #44): a key that changes how the weights are used must not be dropped silently.

use crate::error::usage;
use crate::inputs::Inputs;
use crate::model_config::ConfigDifference;
use crate::slices::Source;
use anyhow::Result;

/// What a merge says of the agents' configs against the base's (issue #44): keys that change how
/// the weights are used (`model_config::is_meaning_key`, compared by meaning) refuse the merge unless `config_from`
/// names whose config the output takes; every other difference that is not harmless is named.
/// Returns the warnings, for stderr and the card.
pub fn config_choice(inputs: &Inputs, config_from: Option<Source>) -> Result<Vec<String>> {
    use crate::model_config::config_differences;
    let Some(base) = inputs.base.own_config().map(|c| c.json()) else {
        return Ok(Vec::new());
    };
    let taken = match config_from {
        None | Some(Source::Base) => "the base's".to_string(),
        Some(Source::Agent(t)) => format!("{}'s", inputs.agents[t].dir.display()),
    };
    let mut warnings = Vec::new();
    for agent in &inputs.agents {
        let Some(config) = agent.own_config().map(|c| c.json()) else {
            // A LoRA agent runs with its base's config; any other is said to be unchecked.
            if agent.lora.is_none() {
                warnings.push(format!(
                    "agent {} has no config.json: nothing says it was trained with the base's \
                     positions, windows and norms, and its config was not compared with the \
                     base's",
                    agent.dir.display()
                ));
            }
            continue;
        };
        let mut differences = config_differences(base, config);
        // Slices rebuild the per-layer lists from the layers each output layer comes from.
        if inputs.slices.is_some() {
            differences.retain(|d| {
                let key = d.key.rsplit('.').next().unwrap_or(&d.key);
                !crate::model_config::layers::PER_LAYER_LISTS.contains(&key)
            });
        }
        if differences.is_empty() {
            continue;
        }
        let meaning: Vec<&ConfigDifference> = differences.iter().filter(|d| d.meaning).collect();
        if let (Some(first), None) = (meaning.first(), config_from) {
            let names: Vec<&str> = meaning.iter().map(|d| d.key.as_str()).collect();
            let choose = |whose: &str| {
                crate::error::Arg::named(
                    &format!("--config-from {whose}"),
                    &format!("config_from=\"{whose}\""),
                )
            };
            return Err(usage(crate::message![
                format!(
                    "agent {}'s config.json differs from the base's in {} — keys that change how \
                     the weights are used ('{}' is {} there and {} in the base); say whose config \
                     the merged model takes: ",
                    agent.dir.display(),
                    names.join(", "),
                    first.key,
                    shown(&first.agent),
                    shown(&first.base),
                ),
                choose("base"),
                ", or ",
                choose(&agent.dir.display().to_string()),
                " (a recipe: config_from:)",
            ]));
        }
        let keys: Vec<&str> = differences.iter().map(|d| d.key.as_str()).collect();
        warnings.push(format!(
            "agent {}'s config.json differs from the base's in {}: the merged model takes {taken}",
            agent.dir.display(),
            keys.join(", ")
        ));
    }
    Ok(warnings)
}

/// A config value in a message: long ones (a per-layer list) cut at 120 characters.
fn shown(value: &str) -> String {
    match value.char_indices().nth(120) {
        Some((at, _)) => format!("{}…", &value[..at]),
        None => value.to_string(),
    }
}
