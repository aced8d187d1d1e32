//! A tensor a folder presents otherwise than it is stored: cut over several files (a sharded
//! trainer checkpoint's ranks, each holding some of its rows) and stored in another dtype (fp32
//! master weights, presented as the bf16 the trainer's converter writes). Reads are in the
//! presented dtype, element ranges of the whole tensor; each file's bytes are read and hashed as
//! stored, in bounded chunks, and rounded to nearest even where the dtypes differ.

use super::dtype::{decode, encode, DType};
use super::weight_file::{TensorEntry, WeightFile};
use anyhow::Result;
use std::path::PathBuf;
use std::sync::Arc;

/// A trainer's checkpoint opened as one model (verl's rank shards, a DCP folder): its files, each
/// tensor as pieces of them, and what the user is told of it.
pub struct Assembled {
    /// The files the pieces are in, in the order they name them.
    pub files: Vec<WeightFile>,
    /// The model's tensors: each as presented, its pieces, the file of its first.
    pub tensors: Vec<(TensorEntry, Arc<Pieces>, usize)>,
    /// (name dropped, name kept) for each tensor saved under two names (tied weights).
    pub aliases: Vec<(Arc<str>, Arc<str>)>,
    /// Entries that are not the model's tensors, not read.
    pub skipped: Vec<String>,
    /// What it was read from, for messages, the record and the card.
    pub described: String,
    /// The folder holding its config.json and tokenizer.
    pub config_dir: PathBuf,
}

/// Elements converted at a time (a bounded scratch whatever the tile).
const CHUNK: u64 = 1 << 14;

/// How a presented tensor's elements are stored.
#[derive(Debug)]
pub enum Stored {
    /// In a dtype rlmerge reads (fp32 masters shown as bf16, or as they are).
    Plain(DType),
    /// As `float8_e4m3fn` bytes, each block of the matrix scaled by one f32 (`weight_scale_inv`):
    /// the value is the byte widened times its block's scale, in f32, as DeepSeek's
    /// `weight_dequant` computes it.
    Fp8Blocks(BlockScales),
    /// gpt-oss's MXFP4 experts, shown transposed as transformers dequantizes them.
    Mxfp4(Mxfp4Experts),
}

/// gpt-oss's MXFP4 experts (`*_blocks` [E, N, G, 16]: 32 FP4 E2M1 values per block, two per
/// byte, low nibble first; `*_scales` [E, N, G]: an E8M0 exponent per block), shown as the bf16
/// tensor [E, G·32, N] transformers' `convert_moe_packed_tensors` makes: element (e, k, n) is
/// FP4 value k of stored row (e, n) times 2^(scale − 127) — exact in bf16.
#[derive(Debug)]
pub struct Mxfp4Experts {
    /// The file (an index into the folder's files) and byte offset of the blocks.
    pub blocks: (usize, u64),
    /// The file and byte offset of the scales.
    pub scales: (usize, u64),
    /// E, N, G.
    pub dims: (usize, usize, usize),
    /// Its key in the held experts' cache.
    pub id: usize,
}

/// The FP4 E2M1 values by nibble.
const FP4: [f32; 16] = [
    0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0,
];

/// One expert's stored bytes: its blocks and its scales.
type Expert = Arc<(Vec<u8>, Vec<u8>)>;

/// The experts read last, by (tensor id, expert): the tiles of one expert reuse its bytes; at
/// most [`HELD_EXPERTS`] held, whatever the model's size.
static HELD: std::sync::Mutex<Vec<((usize, usize), Expert)>> = std::sync::Mutex::new(Vec::new());
const HELD_EXPERTS: usize = 4;

impl Mxfp4Experts {
    /// A fresh id for the held experts' cache.
    pub fn next_id() -> usize {
        static NEXT: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
    }

    /// Expert `e`'s bytes, read (and hashed) unless held.
    fn expert(&self, files: &[WeightFile], e: usize) -> Result<Expert> {
        let key = (self.id, e);
        let mut held = HELD.lock().unwrap_or_else(|p| p.into_inner());
        if let Some((_, x)) = held.iter().find(|(k, _)| *k == key) {
            return Ok(x.clone());
        }
        let (_, n, g) = self.dims;
        let (rows, block_bytes) = (n * g, n * g * 16);
        let mut blocks = vec![0u8; block_bytes];
        let mut scales = vec![0u8; rows];
        for ((file, offset), buf) in [(self.blocks, &mut blocks), (self.scales, &mut scales)] {
            let at = offset + (e * buf.len()) as u64;
            let len = buf.len();
            files[file].read_at(at, buf, || {
                format!("expert {e}'s bytes {at}..{}", at + len as u64)
            })?;
            files[file].record_at(at, buf);
        }
        let x = Arc::new((blocks, scales));
        if held.len() >= HELD_EXPERTS {
            held.remove(0);
        }
        held.push((key, x.clone()));
        Ok(x)
    }

    /// Bytes `start..start + buf.len()` of the shown bf16 tensor, each element's bf16 bits looked
    /// up by (nibble, exponent): 32 shown rows at a time where the range holds them whole (each
    /// stored block read once, in order, its 32 values written down 32 rows), else row by row.
    fn read(&self, files: &[WeightFile], start: u64, buf: &mut [u8]) -> Result<()> {
        let table = mxfp4_table();
        let (_, n, g) = self.dims;
        let per_expert = g * 32 * n;
        let first = (start / 2) as usize;
        let end = first + buf.len() / 2;
        let mut put =
            |at: usize, bits: u16| buf[at * 2..at * 2 + 2].copy_from_slice(&bits.to_le_bytes());
        let mut i = first;
        while i < end {
            let e = i / per_expert;
            let x = self.expert(files, e)?;
            let (blocks, scales) = (&x.0, &x.1);
            let (k, col) = ((i - e * per_expert) / n, (i - e * per_expert) % n);
            let group = k / 32;
            if col == 0 && k % 32 == 0 && end - i >= 32 * n {
                let at = i - first;
                for c in 0..n {
                    let row = c * g + group;
                    let scale = usize::from(scales[row]);
                    for (j, &b) in blocks[row * 16..row * 16 + 16].iter().enumerate() {
                        put(at + 2 * j * n + c, table[usize::from(b & 0xf) << 8 | scale]);
                        put(
                            at + (2 * j + 1) * n + c,
                            table[usize::from(b >> 4) << 8 | scale],
                        );
                    }
                }
                i += 32 * n;
                continue;
            }
            // Row k, columns col..to of it.
            let to = n.min(col + (end - i));
            let (byte, shift) = ((k % 32) / 2, 4 * (k % 2));
            for c in col..to {
                let row = c * g + group;
                let nibble = usize::from((blocks[row * 16 + byte] >> shift) & 0xf);
                put(
                    i - first + c - col,
                    table[nibble << 8 | usize::from(scales[row])],
                );
            }
            i += to - col;
        }
        Ok(())
    }
}

/// The bf16 bits of every (FP4 nibble, E8M0 exponent): FP4[nibble] · 2^(exponent − 127),
/// computed once.
fn mxfp4_table() -> &'static [u16; 4096] {
    static TABLE: std::sync::OnceLock<[u16; 4096]> = std::sync::OnceLock::new();
    TABLE.get_or_init(|| {
        std::array::from_fn(|i| {
            let value = FP4[i >> 8] * exponent((i & 0xff) as u8);
            super::dtype::f32_to_bf16_bits(value)
        })
    })
}

/// 2^(s − 127) for an E8M0 exponent s (255: infinity, as torch's ldexp gives it).
fn exponent(s: u8) -> f32 {
    match s {
        0 => f32::from_bits(0x0040_0000),
        255 => f32::INFINITY,
        s => f32::from_bits(u32::from(s) << 23),
    }
}

/// The scales of an FP8 block-scaled matrix.
#[derive(Debug)]
pub struct BlockScales {
    /// One per block, row-major: `ceil(rows / block.0) × ceil(cols / block.1)`.
    pub scales: Box<[f32]>,
    /// The matrix's columns.
    pub cols: usize,
    /// A block's rows and columns.
    pub block: (usize, usize),
}

impl Stored {
    /// Bytes per stored element.
    pub fn size(&self) -> usize {
        match self {
            Stored::Plain(d) => d.size(),
            Stored::Fp8Blocks(_) | Stored::Mxfp4(_) => 1,
        }
    }

    /// Widens `raw`, the stored bytes of elements `first..`, into `out`.
    fn widen(&self, raw: &[u8], first: u64, out: &mut [f32]) {
        match self {
            Stored::Plain(d) => decode(*d, raw, out),
            Stored::Fp8Blocks(b) => b.widen(raw, first as usize, out),
            Stored::Mxfp4(_) => unreachable!("MXFP4 experts are read by Mxfp4Experts::read"),
        }
    }
}

impl BlockScales {
    /// [`Stored::widen`] of FP8 bytes: a row's run of elements at a time, each block's run
    /// scaled by its one scale, the bytes widened through a table.
    fn widen(&self, raw: &[u8], first: usize, out: &mut [f32]) {
        let table = fp8_table();
        let scale_cols = self.cols.div_ceil(self.block.1);
        let mut i = 0;
        while i < out.len() {
            let (row, col) = ((first + i) / self.cols, (first + i) % self.cols);
            // The run of this row inside one block.
            let run = (self.block.1 - col % self.block.1)
                .min(self.cols - col)
                .min(out.len() - i);
            let scale = self.scales[row / self.block.0 * scale_cols + col / self.block.1];
            for (o, &byte) in out[i..i + run].iter_mut().zip(&raw[i..i + run]) {
                *o = table[usize::from(byte)] * scale;
            }
            i += run;
        }
    }
}

/// Every `float8_e4m3fn` byte's value, computed once.
fn fp8_table() -> &'static [f32; 256] {
    static TABLE: std::sync::OnceLock<[f32; 256]> = std::sync::OnceLock::new();
    TABLE.get_or_init(|| std::array::from_fn(|b| super::dtype::f8_e4m3fn_to_f32(b as u8)))
}

/// Where a presented tensor's elements are stored, in order.
#[derive(Debug)]
pub struct Pieces {
    /// How the files store them.
    pub stored: Stored,
    /// The pieces, in the tensor's element order.
    pub parts: Box<[Piece]>,
}

/// Consecutive elements of a tensor, stored in one file.
#[derive(Clone, Copy, Debug)]
pub struct Piece {
    /// The file, an index into the folder's files.
    pub file: usize,
    /// The byte where the piece starts in that file.
    pub offset: u64,
    /// Its element count.
    pub numel: u64,
}

impl Pieces {
    /// The piece holding element `element` of the tensor.
    pub fn part_at(&self, element: u64) -> Option<&Piece> {
        let mut at = 0;
        self.parts.iter().find(|p| {
            at += p.numel;
            element < at
        })
    }

    /// Reads bytes `start..start + buf.len()` of `entry` (the presented tensor, whose dtype is the
    /// one returned) from `files`, adding the stored bytes to their files' checksums.
    pub fn read(
        &self,
        files: &[WeightFile],
        entry: &TensorEntry,
        start: u64,
        buf: &mut [u8],
    ) -> Result<()> {
        if let Stored::Mxfp4(m) = &self.stored {
            return m.read(files, start, buf);
        }
        let shown = entry.dtype.size() as u64;
        let stored = self.stored.size() as u64;
        let same = matches!(self.stored, Stored::Plain(d) if d == entry.dtype);
        let first = start / shown;
        let end = first + buf.len() as u64 / shown;
        let (mut raw, mut wide) = (Vec::new(), Vec::new());
        let mut at = 0u64;
        for part in self.parts.iter() {
            let (from, to) = (first.max(at), end.min(at + part.numel));
            let mut e = from;
            while e < to {
                let n = (to - e).min(CHUNK);
                let file = &files[part.file];
                let offset = part.offset + (e - at) * stored;
                let out =
                    &mut buf[((e - first) * shown) as usize..((e - first + n) * shown) as usize];
                // The stored bytes read, named for an error.
                let bytes = n * stored;
                let what = || {
                    format!(
                        "tensor '{}' (bytes {offset}..{})",
                        entry.name,
                        offset + bytes
                    )
                };
                if same {
                    file.read_at(offset, out, what)?;
                    file.record_at(offset, out);
                } else {
                    raw.resize(bytes as usize, 0);
                    file.read_at(offset, &mut raw, what)?;
                    file.record_at(offset, &raw);
                    wide.resize(n as usize, 0f32);
                    self.stored.widen(&raw, e - at, &mut wide);
                    encode(entry.dtype, &wide, out);
                }
                e += n;
            }
            at += part.numel;
            if at >= end {
                break;
            }
        }
        Ok(())
    }
}
