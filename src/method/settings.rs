//! Method parameters as mergekit recipes write them: a scalar, a gradient over the layers, or a
//! list of `{filter, value}` picked by tensor name — resolved per tensor.

use anyhow::{bail, Result};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// One value of a setting.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum Scalar {
    /// A truth value.
    Bool(bool),
    /// A number.
    Number(f64),
    /// A word.
    Text(String),
}

/// A parameter setting (mergekit's `ParameterSetting`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum Setting {
    /// One value for every tensor.
    Scalar(Scalar),
    /// Values spread evenly over the layers: layer position t ∈ [0, 1] interpolates numbers
    /// linearly and picks booleans and strings by index.
    Gradient(Vec<Scalar>),
    /// The first entry whose filter is absent, `*`, or a substring of the tensor name.
    Conditional(Vec<Conditional>),
}

/// A value for the tensors whose name contains `filter` (mergekit's `filter:`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Conditional {
    /// The part of a tensor name the value applies to (`None`: every tensor).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub filter: Option<String>,
    /// The value there.
    pub value: ConditionalValue,
}

/// A conditional's value: a scalar or a gradient (conditions do not nest).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum ConditionalValue {
    /// One value.
    Scalar(Scalar),
    /// Values spread over the layers (mergekit's gradient).
    Gradient(Vec<Scalar>),
}

/// Named settings, as under `parameters:`.
pub type Settings = BTreeMap<String, Setting>;

/// Where a tensor sits, for resolving settings: its name, its layer position t ∈ [0, 1]
/// (layer i of L: i / (L − 1); tensors outside the layers: 0, as mergekit does; with slices, i and
/// L within its slice) and its slice, whose parameters come first.
#[derive(Clone, Copy, Debug)]
pub struct TensorPlace<'a> {
    /// The tensor's name.
    pub name: &'a str,
    /// Its place among the layers, from 0 (first) to 1 (last), for gradients.
    pub t: f64,
    /// The slice it is in, for a sliced merge.
    pub slice: Option<usize>,
}

fn gradient(values: &[Scalar], t: f64) -> Option<Scalar> {
    if values.is_empty() {
        return None;
    }
    let numbers: Option<Vec<f64>> = values
        .iter()
        .map(|v| match v {
            Scalar::Number(x) => Some(*x),
            _ => None,
        })
        .collect();
    let Some(numbers) = numbers else {
        return Some(values[(t * (values.len() - 1) as f64) as usize].clone());
    };
    let scaled = t * (numbers.len() - 1) as f64;
    let i0 = scaled as usize;
    let i1 = (i0 + 1).min(numbers.len() - 1);
    let frac = scaled - i0 as f64;
    Some(Scalar::Number(
        (1.0 - frac) * numbers[i0] + frac * numbers[i1],
    ))
}

impl Setting {
    /// The value for one tensor; `None` when no conditional matches (the parameter is unset).
    pub fn resolve(&self, at: TensorPlace) -> Option<Scalar> {
        match self {
            Setting::Scalar(s) => Some(s.clone()),
            Setting::Gradient(v) => gradient(v, at.t),
            Setting::Conditional(list) => list
                .iter()
                .find(|c| match c.filter.as_deref() {
                    None | Some("*") => true,
                    Some(f) => at.name.contains(f),
                })
                .and_then(|c| match &c.value {
                    ConditionalValue::Scalar(s) => Some(s.clone()),
                    ConditionalValue::Gradient(v) => gradient(v, at.t),
                }),
        }
    }
}

impl Scalar {
    /// The value as a number; an error naming parameter `name` otherwise.
    pub fn as_f64(&self, name: &str) -> Result<f64> {
        match self {
            Scalar::Number(x) => Ok(*x),
            Scalar::Text(s) => match s.trim().parse::<f64>() {
                Ok(x) => Ok(x),
                Err(_) => bail!("parameter '{name}' must be a number, got '{s}'"),
            },
            Scalar::Bool(b) => bail!("parameter '{name}' must be a number, got {b}"),
        }
    }

    /// The value as a truth value; an error naming parameter `name` otherwise.
    pub fn as_bool(&self, name: &str) -> Result<bool> {
        match self {
            Scalar::Bool(b) => Ok(*b),
            Scalar::Number(x) if *x == 0.0 || *x == 1.0 => Ok(*x == 1.0),
            Scalar::Text(s) if s == "true" || s == "false" => Ok(s == "true"),
            Scalar::Number(x) => bail!("parameter '{name}' must be true or false, got {x}"),
            Scalar::Text(t) => bail!("parameter '{name}' must be true or false, got '{t}'"),
        }
    }
}

/// t for layer `i` of `layers` (mergekit: i / (L − 1), 1 for a single layer; 0 outside layers).
pub fn layer_t(layer: Option<usize>, layers: usize) -> f64 {
    match layer {
        None => 0.0,
        Some(_) if layers <= 1 => 1.0,
        Some(i) => i as f64 / (layers - 1) as f64,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(name: &str, t: f64) -> TensorPlace<'_> {
        TensorPlace {
            name,
            t,
            slice: None,
        }
    }

    #[test]
    fn gradients_interpolate_over_layers() {
        let g = Setting::Gradient(vec![
            Scalar::Number(0.0),
            Scalar::Number(0.5),
            Scalar::Number(1.0),
        ]);
        // t = 0.25 → halfway between the first two points.
        assert_eq!(g.resolve(at("x", 0.25)), Some(Scalar::Number(0.25)));
        assert_eq!(g.resolve(at("x", 1.0)), Some(Scalar::Number(1.0)));
        let g = Setting::Gradient(vec![
            Scalar::Number(0.0),
            Scalar::Number(0.3),
            Scalar::Number(0.5),
            Scalar::Number(0.7),
            Scalar::Number(1.0),
        ]);
        // mergekit's slerp example: 5 points, layer 3 of 5 → t = 0.75 → 0.7.
        let v = g.resolve(at("x", 0.75)).unwrap().as_f64("t").unwrap();
        assert!((v - 0.7).abs() < 1e-12);
    }

    #[test]
    fn filters_pick_the_first_match() {
        let s: Setting = serde_yaml::from_str(
            "- filter: self_attn\n  value: [0, 1]\n- filter: mlp\n  value: 0.3\n- value: 0.5\n",
        )
        .unwrap();
        assert_eq!(
            s.resolve(at("model.layers.0.self_attn.q_proj.weight", 1.0)),
            Some(Scalar::Number(1.0))
        );
        assert_eq!(
            s.resolve(at("model.layers.0.mlp.up_proj.weight", 0.0)),
            Some(Scalar::Number(0.3))
        );
        assert_eq!(
            s.resolve(at("lm_head.weight", 0.0)),
            Some(Scalar::Number(0.5))
        );
    }

    #[test]
    fn layer_positions() {
        assert_eq!(layer_t(Some(3), 4), 1.0);
        assert_eq!(layer_t(None, 4), 0.0);
        assert_eq!(layer_t(Some(0), 1), 1.0);
    }
}
