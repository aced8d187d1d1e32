//! Reading checkpoints (safetensors, torch zip files) and writing Hugging Face safetensors
//! folders, tile by tile.

pub mod crc;
pub mod cursor;
pub mod dcp;
pub mod dtype;
pub mod files;
pub mod folder_files;
pub mod fp8;
pub mod fsdp_shards;
pub mod lora;
pub mod model;
pub mod mxfp4;
pub mod open_files;
pub mod output_folder;
pub mod pickle;
pub mod pieces;
pub mod positional;
pub mod quantized;
pub mod safetensors_file;
pub mod torch_file;
pub mod weight_file;
pub mod writer;
pub mod zip;

pub use dtype::DType;
pub use model::{ModelFolder, ModelTensor};
pub use output_folder::OutputFolder;
pub use writer::{CheckpointWriter, OutputTensor};
