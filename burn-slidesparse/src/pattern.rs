//! The `(2N-2):2N` sparsity pattern: parsing, printing and the layer geometry it implies.

use std::{fmt, str::FromStr};

use cubecl_kernels::geometry::{MAX_N, MIN_N, SlideGeometry};
use serde::{Deserialize, Serialize};

use crate::error::{Result, SlideSparseError};

/// A SlideSparse pattern `(2N-2):2N`, written *nonzeros:block* ("6:8" keeps 6 of every 8).
///
/// The paper's reference code writes zeros:block ("2:8" for our 6:8); such strings are
/// rejected rather than guessed at.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct SparsityPattern {
    n: u32,
}

impl SparsityPattern {
    /// 2:4, the native pattern (slide is the identity).
    pub const P2_4: Self = Self { n: 2 };
    /// 4:6.
    pub const P4_6: Self = Self { n: 3 };
    /// 6:8.
    pub const P6_8: Self = Self { n: 4 };
    /// 8:10.
    pub const P8_10: Self = Self { n: 5 };

    /// The pattern `(2N-2):2N`; `n` must lie in 2..=16.
    pub fn from_n(n: u32) -> Result<Self> {
        if (MIN_N..=MAX_N).contains(&n) {
            Ok(Self { n })
        } else {
            Err(SlideSparseError::InvalidPattern {
                input: format!("N = {n}"),
                hint: String::new(),
            })
        }
    }

    /// Every supported pattern, 2:4 to 30:32.
    pub fn all() -> impl Iterator<Item = Self> {
        (MIN_N..=MAX_N).map(|n| Self { n })
    }

    /// `N`.
    pub fn n(&self) -> u32 {
        self.n
    }

    /// Nonzeros allowed per block, `2N-2`.
    pub fn nonzeros(&self) -> usize {
        2 * self.n as usize - 2
    }

    /// Block length `2N`.
    pub fn block_len(&self) -> usize {
        2 * self.n as usize
    }

    /// Expansion of K, `gamma = (2N-2)/N`.
    pub fn gamma(&self) -> f64 {
        (2.0 * self.n as f64 - 2.0) / self.n as f64
    }

    /// Theoretical GEMM speedup over dense, `N/(N-1)`.
    pub fn theoretical_speedup(&self) -> f64 {
        self.n as f64 / (self.n as f64 - 1.0)
    }

    /// Geometry of a layer with input width `k` and `K'` alignment `alignment`.
    pub fn geometry(&self, k: usize, alignment: usize) -> SlideGeometry {
        SlideGeometry::new(self.n, k, alignment)
    }
}

impl fmt::Display for SparsityPattern {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.pad(&format!("{}:{}", self.nonzeros(), self.block_len()))
    }
}

impl FromStr for SparsityPattern {
    type Err = SlideSparseError;

    fn from_str(input: &str) -> Result<Self> {
        let invalid = |hint: String| SlideSparseError::InvalidPattern {
            input: input.to_string(),
            hint,
        };
        let (nz, block) = input
            .trim()
            .split_once(':')
            .ok_or_else(|| invalid(String::new()))?;
        let nz: u32 = nz.trim().parse().map_err(|_| invalid(String::new()))?;
        let block: u32 = block.trim().parse().map_err(|_| invalid(String::new()))?;
        if !block.is_multiple_of(2) || block < 4 || nz + 2 != block {
            let hint = if block.is_multiple_of(2)
                && block >= 4
                && nz + nz < block
                && block >= nz + 2
            {
                let zeros = nz;
                format!(
                    "; note that {input:?} means {nz} nonzeros in {block}, not a SlideSparse pattern \
                     (if you meant {zeros} zeros per {block}, write \"{}:{block}\")",
                    block - zeros
                )
            } else {
                String::new()
            };
            return Err(invalid(hint));
        }
        Self::from_n(block / 2).map_err(|_| invalid(String::new()))
    }
}

impl TryFrom<String> for SparsityPattern {
    type Error = SlideSparseError;
    fn try_from(s: String) -> Result<Self> {
        s.parse()
    }
}

impl From<SparsityPattern> for String {
    fn from(p: SparsityPattern) -> String {
        p.to_string()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_and_prints_every_supported_pattern() {
        for p in SparsityPattern::all() {
            let s = p.to_string();
            assert_eq!(s.parse::<SparsityPattern>().unwrap(), p);
        }
        assert_eq!("6:8".parse::<SparsityPattern>().unwrap().n(), 4);
        assert_eq!(" 2:4 ".parse::<SparsityPattern>().unwrap().n(), 2);
        assert_eq!("30:32".parse::<SparsityPattern>().unwrap().n(), 16);
    }

    #[test]
    fn rejects_everything_else_with_the_accepted_forms() {
        for bad in [
            "", "6", "6:", ":8", "6:8:10", "a:b", "5:8", "8:8", "6:7", "0:2", "32:34", "-2:0",
            "6 8", "4:4", "2:2",
        ] {
            let err = bad.parse::<SparsityPattern>().unwrap_err().to_string();
            assert!(err.contains("(2N-2):2N"), "{bad}: {err}");
        }
    }

    #[test]
    fn zeros_block_notation_is_explained() {
        let err = "2:8".parse::<SparsityPattern>().unwrap_err().to_string();
        assert!(err.contains("2 nonzeros in 8"), "{err}");
        assert!(err.contains("\"6:8\""), "{err}");
    }

    #[test]
    fn serde_round_trip_uses_the_string_form() {
        let json = serde_json::to_string(&SparsityPattern::P6_8).unwrap();
        assert_eq!(json, "\"6:8\"");
        assert!(serde_json::from_str::<SparsityPattern>("\"2:8\"").is_err());
    }
}
