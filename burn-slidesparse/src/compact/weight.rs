//! A layer's weight on the host in the form a module keeps it: the compact rows of a
//! SlideSparse layer's INT8 / FP8 codes (its one copy: the CPU kernel reads it in place, the
//! Hopper compact GEMM uploads it as it is, the slid codes are rebuilt from it when
//! cuSPARSELt or a record asks for them), or the codes as they are (a dense layer's `W`, a
//! 16- or 32-bit layer's slid `W'`).
//!
//! Why the compact form: at 6:8 it takes 0.83 bytes per weight where the slid INT8 codes take
//! 1.5, and the CPU's integer kernel multiplies it directly, so a CPU model holds nothing else.
//! Why not for 16- and 32-bit codes: the CPU runs those on the reference path, which reads the
//! slid codes; a compact copy would sit beside them.

use std::sync::Arc;

use cubecl_kernels::geometry::SlideGeometry;

use super::{CodeByte, CompactCodes, CompactRows};
use crate::{
    error::Result,
    pattern::SparsityPattern,
    slide::SlideElement,
    weight_quant::{Precision, QuantizedWeight, WeightCodes},
};

/// A SlideSparse layer's INT8 or FP8 weight in the compact layout, with its per-row scales.
#[derive(Clone, Debug, PartialEq)]
pub struct CompactWeight {
    /// INT8 or FP8.
    pub precision: Precision,
    /// The `K'` alignment of the slid codes this weight stands for.
    pub alignment: usize,
    /// Kept codes and packed ranks, row-major.
    pub rows: CompactRows,
    /// Per-output-channel scales.
    pub scales: Vec<f32>,
}

impl CompactWeight {
    /// The compact form of slid codes `weight` (`[out, K']`) of a `pattern` layer of `k` input
    /// features and `K'` alignment `alignment`; `None` for 16- and 32-bit codes (module docs).
    /// Errors: slid codes that do not un-slide.
    pub fn from_slid(
        weight: &QuantizedWeight,
        pattern: SparsityPattern,
        k: usize,
        alignment: usize,
    ) -> Result<Option<Self>> {
        let geometry = pattern.geometry(k, alignment);
        let n = weight.rows;
        let rows = match &weight.codes {
            WeightCodes::I8(codes) => compact_rows(codes, n, &geometry, pattern)?,
            WeightCodes::Fp8(codes) => compact_rows(codes, n, &geometry, pattern)?,
            _ => return Ok(None),
        };
        Ok(Some(Self {
            precision: weight.codes.precision(),
            alignment,
            rows,
            scales: weight.scales.clone(),
        }))
    }

    /// The slid geometry of this weight.
    pub fn geometry(&self) -> SlideGeometry {
        self.rows.pattern.geometry(self.rows.k, self.alignment)
    }

    /// The slid codes `[out, K']` and scales, as the packer writes them.
    pub fn to_slid(&self) -> QuantizedWeight {
        let geometry = self.geometry();
        let codes = match self.precision {
            Precision::Fp8 => WeightCodes::Fp8(slid(self.rows.to_codes::<u8>(), &geometry)),
            _ => WeightCodes::I8(slid(self.rows.to_codes::<i8>(), &geometry)),
        };
        QuantizedWeight {
            rows: self.rows.rows,
            cols: geometry.k_prime(),
            codes,
            scales: self.scales.clone(),
        }
    }

    /// Bytes held: both arrays (with padding and slack) and the scales.
    pub fn host_bytes(&self) -> usize {
        self.rows.device_bytes() + 4 * self.scales.len()
    }
}

/// The compact rows of slid byte codes `[n, K']`.
fn compact_rows<T: CodeByte>(
    slid: &[T],
    n: usize,
    geometry: &SlideGeometry,
    pattern: SparsityPattern,
) -> Result<CompactRows> {
    let codes = CompactCodes::from_slid(slid, n, geometry, pattern, "SlideSparseLinear weight")?;
    Ok(CompactRows::new(&codes))
}

/// The slid codes of a compact layout.
fn slid<T: SlideElement>(codes: CompactCodes<T>, geometry: &SlideGeometry) -> Vec<T> {
    codes
        .to_slid(geometry)
        .unwrap_or_else(|(row, block, nonzeros)| {
            // Every block of a compact layout holds two zeros, and a block with two zeros slides.
            unreachable!("compact row {row}, block {block} ({nonzeros} nonzeros) does not slide")
        })
}

/// A layer's codes and scales on the host (module docs).
#[derive(Clone, Debug)]
pub enum HostCodes {
    /// The codes as they are: a dense layer's `W`, or slid `W'` of a 16- or 32-bit layer.
    Codes(Arc<QuantizedWeight>),
    /// A SlideSparse INT8 / FP8 layer's compact rows.
    Compact(Arc<CompactWeight>),
}

impl HostCodes {
    /// A SlideSparse layer's slid codes, kept compact where the precision allows (module
    /// docs). Codes that do not un-slide (not a valid slid matrix of `pattern`) have no
    /// compact form and are kept as they are: the backend's preparation checks them.
    pub fn sparse(
        weight: QuantizedWeight,
        pattern: SparsityPattern,
        k: usize,
        alignment: usize,
    ) -> Self {
        match CompactWeight::from_slid(&weight, pattern, k, alignment) {
            Ok(Some(compact)) => Self::Compact(Arc::new(compact)),
            Ok(None) | Err(_) => Self::Codes(Arc::new(weight)),
        }
    }

    /// The same kind of holding for `weight`, read as slid codes of this weight's pattern
    /// where this one is compact (a loaded record's codes replacing these).
    pub fn like(&self, weight: QuantizedWeight) -> Self {
        match self {
            Self::Codes(_) => Self::Codes(Arc::new(weight)),
            Self::Compact(c) => Self::sparse(weight, c.rows.pattern, c.rows.k, c.alignment),
        }
    }

    /// The codes in their full form (`W`, or slid `W'`): shared where held so, rebuilt from
    /// the compact rows otherwise.
    pub fn full(&self) -> Arc<QuantizedWeight> {
        match self {
            Self::Codes(weight) => Arc::clone(weight),
            Self::Compact(compact) => Arc::new(compact.to_slid()),
        }
    }

    /// The compact rows, if held so.
    pub fn compact(&self) -> Option<&Arc<CompactWeight>> {
        match self {
            Self::Codes(_) => None,
            Self::Compact(compact) => Some(compact),
        }
    }

    /// `(rows, cols)` of the full form.
    pub fn shape(&self) -> (usize, usize) {
        match self {
            Self::Codes(weight) => (weight.rows, weight.cols),
            Self::Compact(compact) => (compact.rows.rows, compact.geometry().k_prime()),
        }
    }

    /// The per-output-channel scales.
    pub fn scales(&self) -> &[f32] {
        match self {
            Self::Codes(weight) => &weight.scales,
            Self::Compact(compact) => &compact.scales,
        }
    }

    /// The codes' precision.
    pub fn precision(&self) -> Precision {
        match self {
            Self::Codes(weight) => weight.codes.precision(),
            Self::Compact(compact) => compact.precision,
        }
    }

    /// Codes and scales of the full form (what a module counts as its parameters).
    pub fn full_len(&self) -> usize {
        let (rows, cols) = self.shape();
        rows * cols + rows
    }

    /// Bytes held on the host.
    pub fn host_bytes(&self) -> usize {
        match self {
            Self::Codes(weight) => {
                weight.codes.len() * weight.codes.precision().element_bytes()
                    + 4 * weight.scales.len()
            }
            Self::Compact(compact) => compact.host_bytes(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{
        compact::{
            rows::{KEPT_SLACK, RANK_SLACK},
            tests::random_pruned,
        },
        fp8::f32_to_e4m3,
        slide::slide_matrix,
        test_rng::XorShift32,
    };

    /// Every pattern, INT8 and FP8, odd and even widths, two alignments: the compact form
    /// rebuilds the packer's slid codes bit for bit, and takes what `host_bytes` says.
    #[test]
    fn compact_weight_gives_back_the_slid_codes() {
        let mut rng = XorShift32(71);
        for pattern in SparsityPattern::all() {
            for &(n, k) in &[(3, 70), (4, 512), (2, 1000)] {
                for alignment in [32, 64] {
                    let pruned = random_pruned(&mut rng, n, k, pattern, true);
                    let geometry = pattern.geometry(k, alignment);
                    let slid = slide_matrix(&pruned, n, &geometry).unwrap();
                    let fp8_slid: Vec<u8> =
                        slid.iter().map(|&v| f32_to_e4m3(f32::from(v))).collect();
                    for codes in [WeightCodes::I8(slid.clone()), WeightCodes::Fp8(fp8_slid)] {
                        let weight = QuantizedWeight {
                            rows: n,
                            cols: geometry.k_prime(),
                            codes,
                            scales: (0..n).map(|i| 0.5 + i as f32).collect(),
                        };
                        let held = HostCodes::sparse(weight.clone(), pattern, k, alignment);
                        let compact = held.compact().expect("8-bit codes are held compact");
                        assert_eq!(*held.full(), weight, "{pattern} {n}x{k} /{alignment}");
                        assert_eq!(held.shape(), (n, geometry.k_prime()));
                        assert_eq!(held.precision(), weight.codes.precision());
                        let (kept_stride, rank_stride) = CompactRows::strides(pattern, k);
                        assert_eq!(
                            held.host_bytes(),
                            n * (kept_stride + rank_stride) + KEPT_SLACK + RANK_SLACK + 4 * n
                        );
                        assert_eq!(compact.scales, weight.scales);
                    }
                }
            }
        }
    }

    /// 16- and 32-bit codes stay as they are, and so do codes that do not un-slide.
    #[test]
    fn wide_codes_and_codes_that_do_not_unslide_stay_as_they_are() {
        let pattern = SparsityPattern::from_n(4).unwrap();
        let geometry = pattern.geometry(8, 32);
        let weight = QuantizedWeight {
            rows: 1,
            cols: geometry.k_prime(),
            codes: WeightCodes::F32(vec![0.0; geometry.k_prime()]),
            scales: vec![1.0],
        };
        let held = HostCodes::sparse(weight.clone(), pattern, 8, 32);
        assert!(held.compact().is_none());
        assert_eq!(*held.full(), weight);
        let full = QuantizedWeight {
            codes: WeightCodes::I8(vec![1; geometry.k_prime()]),
            ..weight
        };
        let held = HostCodes::sparse(full.clone(), pattern, 8, 32);
        assert!(held.compact().is_none());
        assert_eq!(*held.full(), full);
    }
}
