//! What a model's config.json says: which keys fix its architecture, which change how its
//! weights are used and what they mean when left out ([`meaning`]), and the per-layer lists it
//! writes or implies by its layers' index ([`layers`]).

pub mod keys;
pub mod layers;
pub mod meaning;

pub use keys::{architecture_difference, is_meaning_key, ARCHITECTURE_KEYS, HARMLESS_KEYS};
pub use meaning::{config_differences, ConfigDifference};
