//! What a method costs: its work per byte read ([`Cost`]) and what it holds in memory
//! ([`Footprint`]) — the classes `rlmerge methods` shows and `--device auto` chooses by.

/// How much work a method does per byte it reads: what sets its time. The rates are the medians
/// measured at Llama-7B's shapes (a bf16 base and 3 agents, 2 cores; docs/benchmarks.md, README's
/// cost table).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Cost {
    /// One read of every input, a few operations per element: bound by reading the files.
    Stream,
    /// Statistics of each tensor first (rank cuts, norms, Gram sums, RAM+'s probe), then the
    /// merge: each tensor read twice or more.
    Scan,
    /// A singular value or eigendecomposition of every matrix: bound by arithmetic.
    Spectral,
}

impl Cost {
    /// The class's name in `rlmerge methods`.
    pub fn name(self) -> &'static str {
        match self {
            Cost::Stream => "stream",
            Cost::Scan => "scan",
            Cost::Spectral => "spectral",
        }
    }

    /// What the class means, with its measured rate.
    pub fn about(self) -> &'static str {
        match self {
            Cost::Stream => {
                "one read of every input, elementwise: bound by the disk (0.1-0.3 s/GB at 7B, 2 cores)"
            }
            Cost::Scan => {
                "statistics of each tensor, then the merge: reads it twice or more (0.25-0.6 s/GB at 7B; \
                 arcee_fusion's row softmaxes about 6)"
            }
            Cost::Spectral => {
                "an SVD or eigendecomposition per matrix: bound by arithmetic (≈20-200 s/GB at 7B, \
                 2 cores)"
            }
        }
    }
}

/// What a method holds in memory besides the files' pages, which the OS may drop.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Footprint {
    /// A few tiles per worker: megabytes, whatever the model's size.
    Tiles,
    /// A few copies of the matrix being decomposed, in f64: about 1 GB at 7B shapes.
    Matrices,
}

impl Footprint {
    /// The class's name in `rlmerge methods`.
    pub fn name(self) -> &'static str {
        match self {
            Footprint::Tiles => "tiles",
            Footprint::Matrices => "matrices",
        }
    }

    /// What the class means.
    pub fn about(self) -> &'static str {
        match self {
            Footprint::Tiles => "a few tiles per worker: megabytes, whatever the model's size",
            Footprint::Matrices => {
                "a few copies of the matrix being decomposed, in f64: ≈1 GB at 7B shapes"
            }
        }
    }
}
