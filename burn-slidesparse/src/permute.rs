//! Input-channel permutations chosen before pruning (Pool and Yu, "Channel Permutations for
//! N:M Sparsity", NeurIPS 2021), applied exactly.
//!
//! A `(2N-2):2N` pattern drops two weights in every block of `2N` consecutive input channels,
//! so two important weights of a row that share a block cannot both stay. Reordering the
//! input channels before pruning puts them into different blocks. A permuted layer holds its
//! weight in the permuted order, `W_p[:, j] = W[:, order[j]]`, and reads its input in the
//! same order, `X_p[:, j] = X[:, order[j]]`; then `X_p W_p^T = X W^T` term by term (the same
//! products of the same values), so the layer computes the pruned weight's function in the
//! original channel order. In SlideSparse the reordering of the input costs nothing extra:
//! the activation lift is already a gather, whose index map becomes `order[src(o)]`.
//!
//! The search ([`search_permutation`], in `search.rs`) scores every weight with the pruning
//! criterion in use and looks for the order that keeps the most of it.

use std::{fmt, sync::Arc};

use serde::{Deserialize, Serialize};

use crate::{
    error::{Result, SlideSparseError},
    prune::PruneMethod,
};

mod search;

pub use search::{PermutationOutcome, search_permutation};

/// An order of a layer's `K` input channels: position `j` of the permuted layer reads input
/// channel `order[j]`. Always a permutation of `0..K` (checked when built).
#[derive(Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(try_from = "Vec<u32>", into = "Vec<u32>")]
pub struct InputPermutation(Arc<[u32]>);

impl InputPermutation {
    /// The permutation `order` (position `j` reads channel `order[j]`); an error unless every
    /// value of `0..order.len()` appears exactly once.
    pub fn new(order: Vec<u32>) -> Result<Self> {
        let k = order.len();
        if k > u32::MAX as usize {
            return Err(invalid(format!("{k} channels do not fit u32 indices")));
        }
        let mut seen = vec![false; k];
        for (j, &c) in order.iter().enumerate() {
            match seen.get_mut(c as usize) {
                None => {
                    return Err(invalid(format!(
                        "position {j} reads channel {c}, but there are only {k} channels"
                    )));
                }
                Some(s) if *s => {
                    return Err(invalid(format!(
                        "channel {c} appears twice (at position {j})"
                    )));
                }
                Some(s) => *s = true,
            }
        }
        Ok(Self(order.into()))
    }

    /// The identity order of `k` channels.
    pub fn identity(k: usize) -> Self {
        Self((0..k as u32).collect())
    }

    /// Number of channels `K`.
    pub fn len(&self) -> usize {
        self.0.len()
    }

    /// Whether it orders no channel.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// `order[j]`: the input channel position `j` reads.
    pub fn as_slice(&self) -> &[u32] {
        &self.0
    }

    /// Whether every channel stays where it is.
    pub fn is_identity(&self) -> bool {
        self.0.iter().enumerate().all(|(j, &c)| j == c as usize)
    }

    /// `inverse[c]`: the position channel `c` moves to.
    pub fn inverse(&self) -> Vec<u32> {
        let mut inverse = vec![0u32; self.len()];
        for (j, &c) in self.0.iter().enumerate() {
            inverse[c as usize] = j as u32;
        }
        inverse
    }

    /// Checks that the permutation orders a layer of `k` inputs; `what` names the layer.
    pub fn check_len(&self, what: &str, k: usize) -> Result<()> {
        if self.len() != k {
            return Err(SlideSparseError::shape(
                format!("{what}: input permutation"),
                [k],
                [self.len()],
            ));
        }
        Ok(())
    }

    /// The columns of a row-major `[rows, K]` matrix in the permuted order:
    /// `out[r, j] = values[r, order[j]]`.
    pub fn permute_columns<T: Copy + Send + Sync>(&self, values: &[T]) -> Vec<T> {
        gather_rows(values, &self.0)
    }

    /// The inverse of [`permute_columns`](Self::permute_columns): `out[r, order[j]] =
    /// values[r, j]`, the original column order of a permuted matrix.
    pub fn unpermute_columns<T: Copy + Send + Sync>(&self, values: &[T]) -> Vec<T> {
        gather_rows(values, &self.inverse())
    }

    /// A per-channel vector (activation norms) in the permuted order.
    pub fn permute_vector<T: Copy>(&self, values: &[T]) -> Vec<T> {
        self.0.iter().map(|&c| values[c as usize]).collect()
    }

    /// A `[K, K]` row-major Gram matrix `X^T X` of the inputs in the permuted order:
    /// `out[i, j] = gram[order[i], order[j]]` (the Gram matrix of `X_p`).
    pub fn permute_gram(&self, gram: &[f64]) -> Vec<f64> {
        let k = self.len();
        let mut out = Vec::with_capacity(k * k);
        for &ci in self.0.iter() {
            let row = &gram[ci as usize * k..(ci as usize + 1) * k];
            out.extend(self.0.iter().map(|&cj| row[cj as usize]));
        }
        out
    }

    /// `method` for the permuted weight: its per-channel calibration (Wanda's norms,
    /// SparseGPT's Gram matrix) in the permuted order, so that pruning the permuted weight
    /// scores every weight exactly as the unpermuted method would.
    pub fn permute_method(&self, method: &PruneMethod) -> PruneMethod {
        match method {
            PruneMethod::ActivationAware { input_norms } if input_norms.len() == self.len() => {
                PruneMethod::ActivationAware {
                    input_norms: self.permute_vector(input_norms),
                }
            }
            PruneMethod::SparseGpt(c) if c.gram.len() == self.len() * self.len() => {
                PruneMethod::SparseGpt(crate::prune::SparseGptCalibration {
                    gram: self.permute_gram(&c.gram),
                    ..c.clone()
                })
            }
            // Mismatched lengths are left for the pruner to report with the layer's name.
            other => other.clone(),
        }
    }

    /// A lift map (`map[o]` = input column of slid column `o`, `K` for a zero) composed with
    /// the permutation: `order[map[o]]`, `K` staying `K`.
    pub fn compose_lift_map(&self, map: &[usize]) -> Vec<usize> {
        let k = self.len();
        map.iter()
            .map(|&m| if m < k { self.0[m] as usize } else { k })
            .collect()
    }
}

/// `out[r, j] = values[r, index[j]]` for a row-major matrix of rows of `index.len()`.
fn gather_rows<T: Copy + Send + Sync>(values: &[T], index: &[u32]) -> Vec<T> {
    use rayon::prelude::*;
    let k = index.len();
    if k == 0 {
        return Vec::new();
    }
    // Written row by row in parallel into a copy (the copy only sizes the output).
    let mut out = values.to_vec();
    out.par_chunks_mut(k)
        .zip(values.par_chunks(k))
        .for_each(|(dst, src)| {
            for (d, &c) in dst.iter_mut().zip(index) {
                *d = src[c as usize];
            }
        });
    out
}

fn invalid(detail: String) -> SlideSparseError {
    SlideSparseError::InvalidPermutation { detail }
}

impl TryFrom<Vec<u32>> for InputPermutation {
    type Error = SlideSparseError;
    fn try_from(order: Vec<u32>) -> Result<Self> {
        Self::new(order)
    }
}

impl From<InputPermutation> for Vec<u32> {
    fn from(p: InputPermutation) -> Self {
        p.0.to_vec()
    }
}

impl fmt::Debug for InputPermutation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // A layer's order is thousands of numbers: its length and head say which one it is.
        let head: Vec<u32> = self.0.iter().take(8).copied().collect();
        write!(f, "InputPermutation(K = {}, {head:?}", self.len())?;
        f.write_str(if self.len() > 8 { "...)" } else { ")" })
    }
}

/// Settings of the permutation search (see [`search_permutation`]).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct PermutationSearch {
    /// At most this many rounds of block-pair swaps after the initial order.
    pub rounds: usize,
    /// Stops once a round removes less than this fraction of the pruned score that is left.
    pub tolerance: f64,
    /// Seed of the random pairing of blocks (the search is deterministic given it).
    pub seed: u64,
}

impl PermutationSearch {
    /// Default rounds: enough for the objective to settle on LLM shapes (`docs/accuracy.md`).
    pub const DEFAULT_ROUNDS: usize = 100;
    /// Default tolerance: a round that gains less than 0.01% of what is left ends the search.
    pub const DEFAULT_TOLERANCE: f64 = 1e-4;
}

impl Default for PermutationSearch {
    fn default() -> Self {
        Self {
            rounds: Self::DEFAULT_ROUNDS,
            tolerance: Self::DEFAULT_TOLERANCE,
            seed: 0,
        }
    }
}

/// How a layer's input channels are ordered before it is pruned
/// ([`PackOptions::permutation`](crate::pack::PackOptions::permutation)).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub enum ChannelPermutation {
    /// As they are (no permutation stored).
    #[default]
    Identity,
    /// Searched for this layer alone, scored with its prune method. Layers that share an
    /// input (q/k/v, gate/up) and are to be fused need one order: search it over the group
    /// with [`search_permutation`] and pass it as [`Given`](Self::Given).
    Search(PermutationSearch),
    /// This order. With [`PruneMethod::None`] the weight must satisfy the pattern in it.
    Given(InputPermutation),
}

impl ChannelPermutation {
    /// The order for one layer: searched, given (its length checked), or `None` for the
    /// identity (an identity order found or given is stored as none: no gather at all).
    pub fn resolve(
        &self,
        name: &str,
        weight: &[f32],
        (rows, cols): (usize, usize),
        pattern: crate::pattern::SparsityPattern,
        method: &PruneMethod,
    ) -> Result<Option<InputPermutation>> {
        let order = match self {
            ChannelPermutation::Identity => return Ok(None),
            ChannelPermutation::Given(p) => {
                p.check_len(name, cols)?;
                p.clone()
            }
            ChannelPermutation::Search(search) => {
                search_permutation(name, &[(weight, rows, method)], cols, pattern, search)?
                    .permutation
            }
        };
        Ok((!order.is_identity()).then_some(order))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_permutations_are_accepted() {
        assert!(InputPermutation::new(vec![2, 0, 1]).is_ok());
        assert!(InputPermutation::new(vec![]).is_ok());
        let err = InputPermutation::new(vec![0, 3, 1])
            .unwrap_err()
            .to_string();
        assert!(err.contains("channel 3"), "{err}");
        let err = InputPermutation::new(vec![1, 0, 1])
            .unwrap_err()
            .to_string();
        assert!(err.contains("channel 1 appears twice"), "{err}");
        let parsed: std::result::Result<InputPermutation, _> = serde_json::from_str("[0, 0]");
        assert!(parsed.is_err());
    }

    #[test]
    fn permuting_then_unpermuting_columns_is_the_identity() {
        let p = InputPermutation::new(vec![3, 0, 2, 1]).unwrap();
        let m: Vec<i32> = (0..12).collect();
        let permuted = p.permute_columns(&m);
        assert_eq!(permuted, [3, 0, 2, 1, 7, 4, 6, 5, 11, 8, 10, 9]);
        assert_eq!(p.unpermute_columns(&permuted), m);
        assert_eq!(p.inverse(), [1, 3, 2, 0]);
    }

    /// The permuted Gram matrix is the Gram matrix of the permuted inputs.
    #[test]
    fn permuted_gram_is_the_gram_of_permuted_inputs() {
        let (t, k) = (5, 4);
        let x: Vec<f32> = (0..t * k).map(|i| ((i * 7) % 11) as f32 - 5.0).collect();
        let p = InputPermutation::new(vec![2, 3, 0, 1]).unwrap();
        let gram = |x: &[f32]| {
            let mut g = vec![0.0f64; k * k];
            for row in x.chunks(k) {
                for i in 0..k {
                    for j in 0..k {
                        g[i * k + j] += row[i] as f64 * row[j] as f64;
                    }
                }
            }
            g
        };
        assert_eq!(p.permute_gram(&gram(&x)), gram(&p.permute_columns(&x)));
    }

    #[test]
    fn composed_lift_map_keeps_the_zero_column() {
        let p = InputPermutation::new(vec![1, 2, 0]).unwrap();
        assert_eq!(p.compose_lift_map(&[0, 1, 2, 3, 3]), [1, 2, 0, 3, 3]);
    }
}
