//! Whose config.json a merged folder takes, and what the agents' configs say against the base's
//! (issue #44): a key that changes how the weights are used must not be dropped silently.

use crate::error::usage;
use crate::inputs::Inputs;
use anyhow::Result;

/// The model whose config.json a merged folder takes (`--config-from`, a recipe's
/// `config_from:`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ConfigFrom {
    /// The base's.
    Base,
    /// Agent t's.
    Agent(usize),
}

/// What a merge says of the agents' configs against the base's (issue #44): keys that change how
/// the weights are used (`folder_files::MEANING_KEYS`) refuse the merge unless `config_from`
/// names whose config the output takes; every other difference that is not harmless is named.
/// Returns the warnings, for stderr and the card.
pub fn config_choice(inputs: &Inputs, config_from: Option<ConfigFrom>) -> Result<Vec<String>> {
    use crate::checkpoint::folder_files::config_differences;
    use crate::inputs::own_config;
    let Some(base) = own_config(&inputs.base)? else {
        return Ok(Vec::new());
    };
    let taken = match config_from {
        None | Some(ConfigFrom::Base) => "the base's".to_string(),
        Some(ConfigFrom::Agent(t)) => format!("{}'s", inputs.agents[t].dir.display()),
    };
    let mut warnings = Vec::new();
    for agent in &inputs.agents {
        let Some(config) = own_config(agent)? else {
            continue;
        };
        let mut differences = config_differences(&base, &config);
        // Slices rebuild the per-layer lists from the layers each output layer comes from.
        if inputs.slices.is_some() {
            differences.retain(|(k, _)| {
                let key = k.rsplit('.').next().unwrap_or(k);
                !crate::slices::PER_LAYER_LISTS.contains(&key)
            });
        }
        if differences.is_empty() {
            continue;
        }
        let meaning: Vec<&str> = differences
            .iter()
            .filter(|(_, m)| *m)
            .map(|(k, _)| k.as_str())
            .collect();
        if !meaning.is_empty() && config_from.is_none() {
            let key = meaning[0].rsplit('.').next().unwrap_or(meaning[0]);
            let show = |c: &serde_json::Value| {
                let v = match meaning[0].strip_prefix("text_config.") {
                    Some(k) => c.get("text_config").and_then(|n| n.get(k)),
                    None => c.get(key),
                };
                v.map_or("absent".to_string(), |v| v.to_string())
            };
            return Err(usage(format!(
                "agent {}'s config.json differs from the base's in {} — keys that change how the \
                 weights are used ('{}' is {} there and {} in the base); say whose config the \
                 merged model takes: --config-from base, or --config-from {} (a recipe: \
                 config_from:)",
                agent.dir.display(),
                meaning.join(", "),
                meaning[0],
                show(&config),
                show(&base),
                agent.dir.display()
            )));
        }
        let keys: Vec<&str> = differences.iter().map(|(k, _)| k.as_str()).collect();
        warnings.push(format!(
            "agent {}'s config.json differs from the base's in {}: the merged model takes {taken}",
            agent.dir.display(),
            keys.join(", ")
        ));
    }
    Ok(warnings)
}
