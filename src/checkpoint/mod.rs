//! Reading and writing Hugging Face safetensors checkpoints, tile by tile.

pub mod crc;
pub mod dtype;
pub mod files;
pub mod folder_files;
pub mod lora;
pub mod model;
pub mod open_files;
pub mod output_folder;
pub mod positional;
pub mod safetensors_file;
pub mod writer;

pub use dtype::DType;
pub use model::{ModelFolder, ModelTensor};
pub use output_folder::OutputFolder;
pub use writer::{CheckpointWriter, OutputTensor};
