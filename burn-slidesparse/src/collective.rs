//! The collectives that tensor-parallel layers combine their shards' outputs with, as a
//! trait ([`Collective`]), and ranks simulated in one process for the reference path
//! ([`SimulatedRanks`]). The GPU ones are `cuda::NcclRanks` and `cuda::BurnRanks`.
//!
//! One process drives every rank (one device each), as a single-controller server does:
//! a collective takes one tensor per rank and gives one back per rank, on that rank's
//! device. [`SimulatedRanks`] does this with tensor operations in rank order, which is what
//! the CPU tests check the sharding math with.

use burn::tensor::{Tensor, backend::Backend};

use crate::error::{Result, SlideSparseError};

/// The collectives tensor-parallel layers need, over the ranks of one process. Each takes
/// one `[M, n]` tensor per rank (rank 0 first, each on its rank's device) and returns one
/// per rank, on the same devices.
pub trait Collective<B: Backend> {
    /// Number of ranks.
    fn ranks(&self) -> usize;

    /// Every rank gets the element-wise sum of all ranks' tensors (row-parallel layers).
    fn all_reduce_sum(&self, parts: Vec<Tensor<B, 2>>) -> Result<Vec<Tensor<B, 2>>>;

    /// Every rank gets all ranks' tensors concatenated along the last dimension, rank 0's
    /// columns first (column-parallel layers whose output is needed whole).
    fn all_gather(&self, parts: Vec<Tensor<B, 2>>) -> Result<Vec<Tensor<B, 2>>>;
}

/// Ranks simulated in one process with tensor operations: the reference path's collective.
/// The sum is taken in rank order on rank 0's device, then copied to every rank's device.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SimulatedRanks {
    ranks: usize,
}

impl SimulatedRanks {
    /// `ranks` simulated ranks (at least one).
    pub fn new(ranks: usize) -> Result<Self> {
        if ranks == 0 {
            return Err(SlideSparseError::InvalidSplit {
                layer: "SimulatedRanks".into(),
                ranks,
                detail: "at least one rank is needed".into(),
            });
        }
        Ok(Self { ranks })
    }

    fn check<B: Backend>(&self, what: &str, parts: &[Tensor<B, 2>]) -> Result<()> {
        if parts.len() != self.ranks {
            return Err(SlideSparseError::shape(
                format!("{what}: tensors (one per rank)"),
                self.ranks,
                parts.len(),
            ));
        }
        Ok(())
    }

    /// `value` copied to the device of every part.
    fn to_every_rank<B: Backend>(value: Tensor<B, 2>, parts: &[Tensor<B, 2>]) -> Vec<Tensor<B, 2>> {
        parts
            .iter()
            .map(|p| value.clone().to_device(&p.device()))
            .collect()
    }
}

impl<B: Backend> Collective<B> for SimulatedRanks {
    fn ranks(&self) -> usize {
        self.ranks
    }

    fn all_reduce_sum(&self, parts: Vec<Tensor<B, 2>>) -> Result<Vec<Tensor<B, 2>>> {
        self.check("all_reduce_sum", &parts)?;
        let dims = parts[0].dims();
        if let Some(p) = parts.iter().find(|p| p.dims() != dims) {
            return Err(SlideSparseError::shape(
                "all_reduce_sum: a rank's tensor",
                dims,
                p.dims(),
            ));
        }
        let device = parts[0].device();
        let sum = parts[1..].iter().fold(parts[0].clone(), |acc, p| {
            acc + p.clone().to_device(&device)
        });
        Ok(Self::to_every_rank(sum, &parts))
    }

    fn all_gather(&self, parts: Vec<Tensor<B, 2>>) -> Result<Vec<Tensor<B, 2>>> {
        self.check("all_gather", &parts)?;
        let rows = parts[0].dims()[0];
        if let Some(p) = parts.iter().find(|p| p.dims()[0] != rows) {
            return Err(SlideSparseError::shape(
                "all_gather: a rank's rows",
                rows,
                p.dims()[0],
            ));
        }
        let device = parts[0].device();
        let whole = Tensor::cat(
            parts.iter().map(|p| p.clone().to_device(&device)).collect(),
            1,
        );
        Ok(Self::to_every_rank(whole, &parts))
    }
}
