//! A DTensor as `torch.save` pickles it — one rank's piece of a sharded tensor:
//! `_rebuild_from_type_v2(_rebuild_wrapper_subclass, DTensor, (DTensor, dtype, SIZE, stride, …),
//! {'_local_tensor': PIECE, '_spec': DTensorSpec{mesh, placements, tensor_meta}})`. Read here as
//! the global shape, the placements and the mesh (its dimension names, this rank's coordinate);
//! the piece itself is a plain tensor, read by the caller.

use super::{ints, Value};
use anyhow::{bail, Context, Result};

/// How a DTensor is laid out over one dimension of its mesh.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Placement {
    /// Cut along tensor dimension `.0`, the pieces in the order of the mesh coordinate.
    Shard(usize),
    /// Whole on every rank.
    Replicate,
    /// Anything else (`Partial`, `_StridedShard`): its class name, for the refusal.
    Other(String),
}

/// What a DTensor says of itself beside its local piece.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Spec {
    /// The whole tensor's shape.
    pub shape: Vec<usize>,
    /// One placement per mesh dimension.
    pub placements: Vec<Placement>,
    /// The mesh's dimension names (`("fsdp",)`, `("ddp", "fsdp")`).
    pub mesh_dims: Vec<String>,
    /// This rank's coordinate on each mesh dimension, where the mesh recorded it.
    pub coordinate: Option<Vec<i64>>,
}

/// The classes a DTensor is pickled as (torch 2.5+, and the older private path).
const DTENSOR_CLASSES: [&str; 2] = [
    "torch.distributed.tensor.DTensor",
    "torch.distributed._tensor.api.DTensor",
];

/// The local piece and the spec of a `_rebuild_from_type_v2` call's arguments.
pub fn spec(args: &[Value]) -> Result<(Value, Spec)> {
    let [_func, Value::Global(class), Value::Tuple(meta), state] = args else {
        bail!("a tensor subclass rebuilt from unexpected arguments");
    };
    if !DTENSOR_CLASSES.contains(&&**class) {
        bail!("it is a {class}, a tensor subclass rlmerge does not read");
    }
    let shape = ints(meta.get(2).context("a DTensor without its size")?, "size")?
        .into_iter()
        .map(|d| usize::try_from(d).ok())
        .collect::<Option<Vec<_>>>()
        .context("a DTensor of a negative size")?;
    let state = dict_of(state).context("a DTensor without its fields")?;
    let local = field(&state, "_local_tensor").context("a DTensor without its local tensor")?;
    let spec = field(&state, "_spec").context("a DTensor without its spec")?;
    let spec_state = object_state(&spec).context("a DTensor spec without its fields")?;
    let mesh = field(&spec_state, "mesh").context("a DTensor spec without its mesh")?;
    let mesh_state = object_state(&mesh).context("a device mesh without its fields")?;
    let mesh_dims = match field(&mesh_state, "_mesh_dim_names") {
        Some(Value::Tuple(names)) => names
            .iter()
            .map(|n| match n {
                Value::Str(s) => Ok(s.to_string()),
                other => bail!("a mesh dimension named by {}", other.kind()),
            })
            .collect::<Result<_>>()?,
        _ => bail!("a device mesh without dimension names"),
    };
    let coordinate = match field(&mesh_state, "_coordinate_on_dim") {
        Some(v @ Value::Tuple(_)) => Some(ints(&v, "mesh coordinate")?),
        _ => None,
    };
    let placements = match field(&spec_state, "placements") {
        Some(Value::Tuple(p)) => p.iter().map(placement).collect::<Result<_>>()?,
        _ => bail!("a DTensor spec without its placements"),
    };
    Ok((
        local,
        Spec {
            shape,
            placements,
            mesh_dims,
            coordinate,
        },
    ))
}

/// A placement object: `Shard` with its `dim`, `Replicate`, or another class named.
fn placement(value: &Value) -> Result<Placement> {
    let name = value
        .callable_name()
        .context("a placement that is no object")?;
    let class = name.rsplit('.').next().unwrap_or_default();
    Ok(match class {
        "Shard" => {
            let dim = object_state(value)
                .and_then(|s| field(&s, "dim"))
                .or_else(|| match value {
                    Value::Object(o) => match &o.borrow().args {
                        Value::Tuple(a) => a.first().cloned(),
                        _ => None,
                    },
                    _ => None,
                });
            match dim {
                Some(Value::Int(d)) if d >= 0 => Placement::Shard(d as usize),
                _ => bail!("a Shard placement without its dimension"),
            }
        }
        "Replicate" => Placement::Replicate,
        _ => Placement::Other(class.to_string()),
    })
}

/// The state an object was built with, as a dict ([`dict_of`]).
fn object_state(value: &Value) -> Option<Value> {
    let Value::Object(o) = value else { return None };
    let state = o.borrow().state.clone()?;
    dict_of(&state)
}

/// A state as pickled: a dict, or the dict of a `(dict or None, slots)` pair.
fn dict_of(state: &Value) -> Option<Value> {
    match state {
        d @ Value::Dict(_) => Some(d.clone()),
        Value::Tuple(pair) => pair.iter().find(|v| matches!(v, Value::Dict(_))).cloned(),
        _ => None,
    }
}

/// The value of key `name` in a dict.
fn field(dict: &Value, name: &str) -> Option<Value> {
    let Value::Dict(items) = dict else {
        return None;
    };
    let items = items.borrow();
    items
        .iter()
        .find(|(k, _)| matches!(k, Value::Str(s) if &**s == name))
        .map(|(_, v)| v.clone())
}
