//! The ways a tensor's tiles can be scanned before its merge pass, as the statistics of the
//! mergekit-family methods need them (rank cuts, norms, Gram sums). The engine implements
//! [`Scans`] over the input files (`engine::scans`); `select` and `method::statistics` use it.

use anyhow::Result;
use std::ops::ControlFlow;
use std::sync::Mutex;

/// One tile's values: `base` = θ₀, `x[t]` = θ_t, `tau[t]` = θ_t − θ₀ in f32; `start` = tensor
/// index of element 0.
pub struct Values<'a> {
    pub start: u64,
    pub base: &'a [f32],
    pub x: &'a [Vec<f32>],
    pub tau: &'a [Vec<f32>],
}

/// What a whole-tile scan does with each tile: `Break` ends the scan early.
pub type Visit<'v> = dyn FnMut(&Values) -> Result<ControlFlow<()>> + 'v;

/// One agent's values over a short run of elements (cache-sized).
pub struct AgentChunk<'a> {
    /// Tensor index of element 0.
    pub start: u64,
    pub base: &'a [f32],
    pub x: &'a [f32],
    pub tau: &'a [f32],
}

impl AgentChunk<'_> {
    pub fn values(&self, delta: bool) -> &[f32] {
        if delta {
            self.tau
        } else {
            self.x
        }
    }
}

/// What a per-agent scan does with agent `t`'s next chunk: `Break` when that agent is done.
pub type AgentVisit<'v> = dyn Fn(usize, &AgentChunk) -> ControlFlow<()> + Sync + 'v;

/// What an any-order scan does with a chunk: `(worker, agent, tensor index of the chunk's first
/// element, the agent's values there)`.
pub type AnyOrderVisit<'v> = dyn Fn(usize, usize, u64, &[f32]) + Sync + 'v;

/// What an any-order scan of every agent at once does with a chunk: `(worker, the chunk's values)`.
pub type ChunkVisit<'v> = dyn Fn(usize, &Values) + Sync + 'v;

/// The ways to scan a tensor's tiles.
pub trait Scans {
    /// Whole tiles in order, every agent at once (for statistics across agents).
    fn tiles(&mut self, visit: &mut Visit) -> Result<()>;
    /// Each agent's values in element order, chunk by chunk, agents in parallel; ends when every
    /// agent is done or the tensor is.
    /// Starting at the chunk holding element `from` (0: the whole tensor); from elsewhere, read in
    /// small tiles, as such a scan is meant to stop soon.
    fn per_agent(&mut self, from: u64, visit: &AgentVisit) -> Result<()>;
    /// Threads an any-order scan runs on: `visit`'s worker argument is below this.
    fn workers(&self) -> usize;
    /// Every agent's values in chunks of [`SCAN_CHUNK`] elements that start at multiples of
    /// [`SCAN_CHUNK`] (the last may be shorter), in any order, on [`Self::workers`] threads at
    /// once — for statistics that do not depend on order (counts), or that keep a result per
    /// chunk and combine them in order. The fastest scan: every core busy, each tile read once.
    /// With `every` > 1, a sample: about one chunk in `every`, spread over the tensor. The values
    /// are task vectors τ with `delta`, else the agents' θ.
    fn any_order(&mut self, every: usize, delta: bool, visit: &AnyOrderVisit) -> Result<()>;
    /// Every agent's values in runs of whole slabs of `slab` elements that start at multiples of
    /// `slab` — as many slabs as fit in [`SCAN_CHUNK`] elements, at least one — in any order, on
    /// [`Self::workers`] threads at once: for statistics made slab by slab (DELLA's ranks), each
    /// run used while it is in the core's cache. τ with `delta`, else θ.
    fn slabs_any_order(&mut self, slab: u64, delta: bool, visit: &AnyOrderVisit) -> Result<()>;
    /// Every agent's values at once (base, θ and τ), in chunks of [`SCAN_CHUNK`] elements that
    /// start at multiples of [`SCAN_CHUNK`], in any order, on [`Self::workers`] threads at once:
    /// for statistics across agents kept per chunk and combined in order (SCE's variance cut and
    /// weights, slerp's moments), which no tiling or thread count then changes.
    fn chunks_any_order(&mut self, visit: &ChunkVisit) -> Result<()>;
}

/// Per-(worker, agent) states of an any-order scan, at `worker * agents + agent`: each is only
/// touched by its worker.
pub(crate) fn worker_states<S>(
    workers: usize,
    agents: usize,
    init: impl Fn(usize) -> S,
) -> Vec<Mutex<S>> {
    (0..workers * agents)
        .map(|i| Mutex::new(init(i % agents)))
        .collect()
}

/// Per-agent state of a per-agent scan: each agent's state is only touched by the thread running
/// that agent, so its lock is never contended.
pub(crate) fn states<S>(items: impl IntoIterator<Item = S>) -> Vec<Mutex<S>> {
    items.into_iter().map(Mutex::new).collect()
}

pub(crate) fn unlock<S>(m: Mutex<S>) -> S {
    m.into_inner().unwrap_or_else(|p| p.into_inner())
}

pub(crate) fn lock<S>(m: &Mutex<S>) -> std::sync::MutexGuard<'_, S> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// Elements per chunk of a per-agent scan: a few arrays of it stay in L1.
pub const SCAN_CHUNK: usize = 4096;

/// A [`Scans`] over task vectors in memory, for unit tests.
#[cfg(test)]
pub(crate) mod memory {
    use super::*;

    /// In-memory task vectors (base 0) cut into tiles of `tile` elements, for the tests of what
    /// scans: the any-order scans give their chunks last first, two workers taking turns.
    pub(crate) struct Memory {
        v: Vec<Vec<f32>>,
        tile: usize,
        zeros: Vec<f32>,
        /// Any-order scans over every chunk so far (samples not counted): what a tensor on disk
        /// would be read for.
        pub(crate) full_passes: usize,
    }

    impl Memory {
        fn chunk(&self, t: usize, start: usize, end: usize) -> AgentChunk<'_> {
            AgentChunk {
                start: start as u64,
                base: &self.zeros[start..end],
                x: &self.v[t][start..end],
                tau: &self.v[t][start..end],
            }
        }

        /// Every agent's values over elements `start..end`, handed to `visit`.
        fn with_values<R>(
            &self,
            (start, end): (usize, usize),
            visit: impl FnOnce(&Values) -> R,
        ) -> R {
            let part: Vec<Vec<f32>> = self.v.iter().map(|a| a[start..end].to_vec()).collect();
            visit(&Values {
                start: start as u64,
                base: &self.zeros[start..end],
                x: &part,
                tau: &part,
            })
        }
    }

    impl Scans for Memory {
        fn tiles(&mut self, visit: &mut Visit) -> Result<()> {
            let len = self.v[0].len();
            for start in (0..len).step_by(self.tile) {
                let end = (start + self.tile).min(len);
                if self.with_values((start, end), |v| visit(v))?.is_break() {
                    break;
                }
            }
            Ok(())
        }

        fn per_agent(&mut self, from: u64, visit: &AgentVisit) -> Result<()> {
            let len = self.v[0].len();
            for t in 0..self.v.len() {
                let first = from as usize / self.tile * self.tile;
                for start in (first..len).step_by(self.tile) {
                    let end = (start + self.tile).min(len);
                    if visit(t, &self.chunk(t, start, end)).is_break() {
                        break;
                    }
                }
            }
            Ok(())
        }

        fn workers(&self) -> usize {
            2
        }

        /// Last chunk first, the two workers taking turns.
        fn any_order(&mut self, every: usize, delta: bool, visit: &AnyOrderVisit) -> Result<()> {
            self.full_passes += usize::from(every == 1);
            let len = self.v[0].len();
            let starts: Vec<usize> = (0..len).step_by(SCAN_CHUNK * every).collect();
            for (i, &start) in starts.iter().rev().enumerate() {
                let end = (start + SCAN_CHUNK).min(len);
                for t in 0..self.v.len() {
                    let c = self.chunk(t, start, end);
                    visit(i % 2, t, start as u64, c.values(delta));
                }
            }
            Ok(())
        }

        fn slabs_any_order(&mut self, slab: u64, delta: bool, visit: &AnyOrderVisit) -> Result<()> {
            self.runs_last_first(slab, delta, visit);
            Ok(())
        }

        /// Last chunk first, the two workers taking turns.
        fn chunks_any_order(&mut self, visit: &ChunkVisit) -> Result<()> {
            let len = self.v[0].len();
            let starts: Vec<usize> = (0..len).step_by(SCAN_CHUNK).collect();
            for (i, &start) in starts.iter().rev().enumerate() {
                let end = (start + SCAN_CHUNK).min(len);
                self.with_values((start, end), |v| visit(i % 2, v));
            }
            Ok(())
        }
    }

    impl Memory {
        /// Last run first, the two workers taking turns (see [`Scans::slabs_any_order`]).
        fn runs_last_first(&self, slab: u64, delta: bool, visit: &AnyOrderVisit) {
            let len = self.v[0].len();
            let slab = slab.max(1) as usize;
            let run = (SCAN_CHUNK / slab).max(1) * slab;
            let starts: Vec<usize> = (0..len).step_by(run).collect();
            for (i, &start) in starts.iter().rev().enumerate() {
                let end = (start + run).min(len);
                for t in 0..self.v.len() {
                    visit(
                        i % 2,
                        t,
                        start as u64,
                        self.chunk(t, start, end).values(delta),
                    );
                }
            }
        }
    }

    pub(crate) fn scan_of(v: Vec<Vec<f32>>, tile: usize) -> Memory {
        let zeros = vec![0.0; v[0].len()];
        Memory {
            v,
            tile,
            zeros,
            full_passes: 0,
        }
    }
}
