//! Row plans: how a token-indexed tensor (embeddings, lm_head) is read for each model, row by
//! output row.

use super::*;

/// How a token-indexed tensor is read for each model (see [`Vocabulary::plan_tensor`]).
#[derive(Debug)]
pub struct VocabTensor {
    pub(super) vocabulary: Arc<Vocabulary>,
    /// Elements per row.
    pub row_len: usize,
    /// Default rows by output row, for the tokens some model lacks (or forced).
    pub(super) defaults: HashMap<u32, RowDefault>,
    /// The (model, row) lists that [`RowDefault::Mean`] ranges index.
    pub(super) means: Vec<(Source, u32)>,
    /// Each input's mean row (base first), for padding rows; made on first use.
    pub(super) pad_means: Vec<Mutex<Option<Arc<[f32]>>>>,
    /// Tokens no model entering this tensor has (zero rows).
    pub missing_everywhere: Vec<String>,
}

/// Where one output row of one model comes from.
#[derive(Debug, PartialEq)]
pub enum RowFrom<'a> {
    /// Row `row` of model `source`'s tensor.
    Row(Source, u32),
    /// A row of zeros.
    Zero,
    /// The mean of these rows (an f32 sum in order, then one division, as mergekit does).
    Mean(&'a [(Source, u32)]),
    /// A padding row: the mean of the model's token rows.
    Pad,
}

impl VocabTensor {
    /// Output rows.
    pub fn rows(&self) -> usize {
        self.vocabulary.rows
    }

    /// Token rows (the rest are padding).
    pub fn token_rows(&self) -> usize {
        self.vocabulary.len()
    }

    /// Where model `m`'s output row `r` comes from.
    pub fn row_from(&self, m: Source, r: usize) -> RowFrom<'_> {
        if r >= self.vocabulary.len() {
            return RowFrom::Pad;
        }
        let own = self.vocabulary.perms[slot(m)][r];
        let forced = self
            .vocabulary
            .configs
            .get(&(r as u32))
            .is_some_and(|c| c.1);
        if own != ABSENT && !forced {
            return RowFrom::Row(m, own);
        }
        match self.defaults.get(&(r as u32)) {
            Some(RowDefault::Row(s, row)) => RowFrom::Row(*s, *row),
            Some(RowDefault::Mean(a, b)) => RowFrom::Mean(&self.means[*a as usize..*b as usize]),
            // Zero, or no default (the token only in models that are not merged here).
            _ => RowFrom::Zero,
        }
    }

    /// Model `m`'s padding row, computed by `compute` on first use.
    pub fn pad_mean(
        &self,
        m: Source,
        compute: impl FnOnce() -> Result<Vec<f32>>,
    ) -> Result<Arc<[f32]>> {
        let cell = &self.pad_means[slot(m)];
        let mut guard = cell.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(v) = guard.as_ref() {
            return Ok(v.clone());
        }
        let v: Arc<[f32]> = compute()?.into();
        *guard = Some(v.clone());
        Ok(v)
    }
}
