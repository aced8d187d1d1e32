//! Re-indexing token-indexed tensors (embeddings, lm_head) for the output's vocabulary.

use super::*;

/// Re-indexing token-indexed tensors for the output's vocabulary.
pub(super) struct Reindex<'a> {
    pub(super) vocabulary: &'a Arc<Vocabulary>,
    pub(super) with_base: bool,
}

impl Reindex<'_> {
    /// Whether tensor `bt` of model `of` is indexed by token (an embedding or output head of that
    /// model's vocab_size rows), and agent tensor `at` its counterpart: the same dimensions but
    /// the first.
    pub(super) fn indexed_by_token(&self, bt: &ModelTensor, of: Source, at: &ModelTensor) -> bool {
        self.is_token_tensor(bt, of)
            && at.entry.shape.len() == bt.entry.shape.len()
            && at.entry.shape[1..] == bt.entry.shape[1..]
    }

    pub(super) fn is_token_tensor(&self, bt: &ModelTensor, of: Source) -> bool {
        is_token_indexed(&bt.entry.name)
            && bt.entry.shape.len() >= 2
            && bt.entry.shape[0] == self.vocabulary.vocab_size(of)
    }

    /// Plans the re-indexed reads of every token-indexed tensor in `plans` (those whose rows
    /// all stay where they are are read as they are).
    pub(super) fn plan_all(
        &self,
        base: &ModelFolder,
        agents: &[ModelFolder],
        plans: &mut [TensorPlan],
        warnings: &mut Vec<String>,
    ) -> Result<()> {
        for plan in plans.iter_mut() {
            if !self.is_token_tensor(&plan.base, plan.base_source()) {
                continue;
            }
            let lead = plan.base_source();
            let mut models: Vec<Source> = Vec::new();
            if self.with_base || plan.present().is_empty() {
                models.push(lead);
            }
            for t in plan.present() {
                if !models.contains(&Source::Agent(t)) {
                    models.push(Source::Agent(t));
                }
            }
            let rows_of = |s: Source| -> usize {
                if s == lead {
                    return plan.base.entry.shape[0];
                }
                match s {
                    Source::Agent(t) => {
                        plan.agents[t].map_or(0, |i| agents[t].tensors[i as usize].entry.shape[0])
                    }
                    Source::Base => base
                        .get(&plan.base.entry.name)
                        .map_or(0, |t| t.entry.shape[0]),
                }
            };
            let row_len: usize = plan.base.entry.shape[1..].iter().product();
            let rows = self
                .vocabulary
                .plan_tensor(plan.name(), &models, row_len, &rows_of)?;
            if self.vocabulary.keeps_rows(&rows, &models, &rows_of) {
                continue;
            }
            if !rows.missing_everywhere.is_empty() {
                warnings.push(format!(
                    "tensor '{}': no merged model has token(s) {:?}; their rows are zero",
                    plan.name(),
                    rows.missing_everywhere
                ));
            }
            if rows.rows() < plan.base.entry.shape[0]
                && self.vocabulary.settings.pad_to_multiple_of.is_none()
            {
                warnings.push(format!(
                    "tensor '{}' gets {} rows, one per token of the output's tokenizer, where \
                     the base has {} (as mergekit sizes it); a recipe's tokenizer.pad_to_multiple_of \
                     (e.g. 64) keeps padding rows",
                    plan.name(),
                    rows.rows(),
                    plan.base.entry.shape[0]
                ));
            }
            let mut shape = plan.base.entry.shape.to_vec();
            shape[0] = rows.rows();
            plan.vocab = Some(VocabPlan {
                rows,
                shape: shape.into(),
            });
        }
        Ok(())
    }
}
