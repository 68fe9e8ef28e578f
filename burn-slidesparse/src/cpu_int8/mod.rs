//! The INT8 layers of burn's CPU backends (NdArray, Flex) on an integer kernel: per-token
//! quantization exactly as the reference path does it, INT32 sums of INT8 codes, and the
//! reference's f32 epilogue in the same order. A SlideSparse layer keeps its weight in the
//! compact layout (`compact/rows.rs`: 6 bytes and 5 bits per 8 weights at 6:8) and expands
//! each row's blocks back to dense codes as it goes, so each kept code meets the activation at
//! its own position (no lift); a dense INT8 layer keeps its codes. Either is the layer's one
//! prepared copy, in place of the reference path's `W'^T` in f32 (6x the INT8 codes at 6:8).
//!
//! Exactness: INT32 sums of INT8 products are exact in any order. The reference path sums
//! the same products in f32, which is exact while every partial sum stays below `2^24` (true
//! for `127 * 127 * K` with `K <= 1040`, and in practice far beyond); there both give the same
//! bits. Past it the integer sum is the truer result.
//!
//! FP8 and 16-bit layers keep the reference path: their products are not integers (FP8 codes
//! are decoded to f32, 16-bit ones are floats).
//!
//! Work is split over output rows with rayon, each task a group of rows (a few tasks per
//! thread) whose dense codes it expands into a buffer of its own, then multiplies with every
//! token in tiles of `dot::ROWS` rows by `dot::TOKENS` tokens. A 6:8 forward of up to
//! `fused::TOKENS` tokens on AVX-512 skips the buffer: each row is expanded in the register
//! that multiplies it (`fused.rs`).

mod dot;
mod expand;
mod fused;

use std::sync::Arc;

use cubecl_kernels::rounding::ACTIVATION_EPS;
use rayon::prelude::*;

pub use dot::Isa;
use dot::{LANE, Tokens};
use expand::{CompactRowsRef, ExpandTable};

use crate::{
    compact::CompactWeight,
    error::{Result, SlideSparseError},
    pack::LayerSpec,
    permute::InputPermutation,
    weight_quant::{Precision, QuantizedWeight, WeightCodes},
};

/// Rayon tasks per thread a forward's rows are split into.
const TASKS_PER_THREAD: usize = 4;

/// Up to this many values a forward quantizes and writes its output on the calling thread (a
/// parallel pass would cost more than it saves).
const SERIAL_VALUES: usize = 1 << 16;

/// Up to this many products a forward runs on the calling thread: waking rayon's threads
/// costs tens of microseconds, what one thread takes for a few million products (a decode
/// step's layers of a small model).
const SERIAL_PRODUCTS: usize = 1 << 23;

/// The largest INT8 code of the activations.
const QMAX: f32 = 127.0;

/// A layer's weight as the integer kernel reads it.
#[derive(Clone, Debug)]
enum Weight {
    /// Dense codes, rows of `kp` (zeros past `K`).
    Dense(DenseCodes),
    /// Compact rows (their slack lets the expansion read past a row's last block), shared
    /// with the module that holds them: the layer's one copy.
    Compact {
        table: ExpandTable,
        weight: Arc<CompactWeight>,
    },
}

/// A dense layer's codes as the kernel reads them: rows of `kp`.
#[derive(Clone, Debug)]
enum DenseCodes {
    /// The module's own codes (`K` is already `kp`), shared: the layer's one copy.
    Shared(Arc<QuantizedWeight>),
    /// A copy with each row padded with zeros to `kp`.
    Padded(Vec<i8>),
}

impl DenseCodes {
    fn codes(&self) -> &[i8] {
        match self {
            Self::Shared(weight) => match &weight.codes {
                WeightCodes::I8(codes) => codes,
                // `CpuInt8Layer::dense` shares INT8 codes only.
                _ => unreachable!("a shared dense weight holds INT8 codes"),
            },
            Self::Padded(codes) => codes,
        }
    }
}

/// An INT8 linear layer prepared for the integer kernel.
#[derive(Clone, Debug)]
pub struct CpuInt8Layer {
    weight: Weight,
    /// Input features `K`.
    k: usize,
    /// Output features.
    n: usize,
    /// Columns of a dense row and of the activation codes: the weight's columns (whole blocks
    /// for a compact weight) padded to [`LANE`].
    kp: usize,
    scales: Vec<f32>,
    /// Each row's code sum (the fused kernel's bias correction, `fused.rs`; empty for a dense
    /// weight).
    row_sums: Vec<i32>,
    bias: Option<Vec<f32>>,
    /// Column `j` of the weight reads input channel `order[j]`.
    order: Option<Vec<u32>>,
    isa: Isa,
}

fn not_int8(what: &str, precision: Precision) -> SlideSparseError {
    SlideSparseError::Unsupported {
        what: format!("the CPU integer kernel for {what}"),
        why: format!("precision {precision} (it multiplies INT8 codes)"),
    }
}

impl CpuInt8Layer {
    /// A SlideSparse layer of `spec` from its slid INT8 codes `W' [out, K']` (made compact
    /// here: the kernel multiplies the pruned `W`, whose kept codes are the slid ones).
    pub fn sparse(
        spec: LayerSpec,
        weight: &QuantizedWeight,
        bias: Option<Vec<f32>>,
        order: Option<&InputPermutation>,
    ) -> Result<Self> {
        let (pattern, k, alignment) = (spec.pattern, spec.in_features, spec.alignment);
        match CompactWeight::from_slid(weight, pattern, k, alignment)? {
            Some(compact) if compact.precision == Precision::Int8 => {
                Self::compact(Arc::new(compact), bias, order)
            }
            _ => Err(not_int8("SlideSparseLinear", weight.codes.precision())),
        }
    }

    /// A SlideSparse layer on its compact INT8 weight, shared (not copied).
    pub fn compact(
        weight: Arc<CompactWeight>,
        bias: Option<Vec<f32>>,
        order: Option<&InputPermutation>,
    ) -> Result<Self> {
        if weight.precision != Precision::Int8 {
            return Err(not_int8("SlideSparseLinear", weight.precision));
        }
        let rows = &weight.rows;
        let blocks = rows.k.div_ceil(rows.pattern.block_len());
        // Whole groups of 64 positions (the eight-block expansion's stores), plus room for the
        // 16 bytes the one-block expansion may write past the last block.
        let kp = (blocks * rows.pattern.block_len()).next_multiple_of(64) + LANE;
        let (k, n, scales) = (rows.k, rows.rows, weight.scales.clone());
        let used = blocks * (rows.pattern.block_len() - 2);
        let row_sums = code_sums(&rows.kept, rows.kept_stride, used, n);
        let table = ExpandTable::new(rows.pattern);
        let weight = Weight::Compact { table, weight };
        Self::new(weight, (k, n, kp), (scales, row_sums), bias, order)
    }

    /// A dense INT8 layer from its codes `W [out, K]` and scales: shared (not copied) where
    /// `K` is a whole number of [`LANE`]s, copied into rows padded to one otherwise.
    pub fn dense(weight: Arc<QuantizedWeight>, bias: Option<Vec<f32>>) -> Result<Self> {
        let WeightCodes::I8(codes) = &weight.codes else {
            return Err(not_int8("QuantizedLinear", weight.codes.precision()));
        };
        let (n, k) = (weight.rows, weight.cols);
        let kp = k.next_multiple_of(LANE);
        let scales = weight.scales.clone();
        let codes = if kp == k {
            DenseCodes::Shared(Arc::clone(&weight))
        } else {
            let mut padded = vec![0i8; n * kp];
            for (dst, src) in padded.chunks_mut(kp.max(1)).zip(codes.chunks(k.max(1))) {
                dst[..k].copy_from_slice(src);
            }
            DenseCodes::Padded(padded)
        };
        // The fused kernel does not read dense rows: no code sums.
        Self::new(
            Weight::Dense(codes),
            (k, n, kp),
            (scales, Vec::new()),
            bias,
            None,
        )
    }

    fn new(
        weight: Weight,
        (k, n, kp): (usize, usize, usize),
        (scales, row_sums): (Vec<f32>, Vec<i32>),
        bias: Option<Vec<f32>>,
        order: Option<&InputPermutation>,
    ) -> Result<Self> {
        if scales.len() != n {
            return Err(SlideSparseError::shape("weight scales", n, scales.len()));
        }
        if let Some(b) = &bias
            && b.len() != n
        {
            return Err(SlideSparseError::shape("bias", n, b.len()));
        }
        if let Some(p) = order {
            p.check_len("SlideSparseLinear", k)?;
        }
        Ok(Self {
            weight,
            k,
            n,
            kp,
            scales,
            row_sums,
            bias,
            order: order.map(|p| p.as_slice().to_vec()),
            isa: Isa::detect(),
        })
    }

    /// Input features.
    pub fn in_features(&self) -> usize {
        self.k
    }

    /// Output features.
    pub fn out_features(&self) -> usize {
        self.n
    }

    /// Bytes the layer holds for its weight (codes, ranks, scales, bias).
    pub fn weight_bytes(&self) -> usize {
        let codes = match &self.weight {
            Weight::Dense(codes) => codes.codes().len(),
            Weight::Compact { weight, .. } => weight.rows.device_bytes(),
        };
        codes + 4 * (self.scales.len() + self.bias.as_ref().map_or(0, Vec::len))
    }

    /// The same layer on the instruction set `isa` (the tests compare each with the scalar
    /// one); `None` if this CPU lacks it.
    pub fn with_isa(&self, isa: Isa) -> Option<Self> {
        isa.available().then(|| Self {
            isa,
            ..self.clone()
        })
    }

    /// `Y [m, n]` for `X [m, k]` (row-major f32).
    pub fn forward(&self, x: &[f32], m: usize) -> Vec<f32> {
        assert_eq!(
            x.len(),
            m * self.k,
            "CPU INT8 layer: X is not [{m}, {}]",
            self.k
        );
        let tokens = self.quantize(x, m);
        let acc = self.accumulate(&tokens, m);
        self.epilogue(&acc, &tokens.scales, m)
    }

    /// The tokens' codes (in the weight's column order, zero-padded to `kp`) and scales.
    fn quantize(&self, x: &[f32], m: usize) -> QuantizedTokens {
        let kp = self.kp;
        // The unsigned bytes in the form the kernel that runs reads, written with the codes.
        let form = UnsignedForm::read_by(self.fused_rows(m).is_some());
        let mut codes = vec![0i8; m * kp];
        let mut unsigned = vec![form.of(0); m * kp];
        let mut scales = vec![0f32; m];
        let token = |(((codes, unsigned), scale), row)| {
            self.quantize_token(row, (codes, unsigned, form), scale)
        };
        let (kp, k) = (kp.max(1), self.k.max(1));
        if m * self.k <= SERIAL_VALUES {
            let rows = codes.chunks_mut(kp).zip(unsigned.chunks_mut(kp));
            rows.zip(scales.iter_mut()).zip(x.chunks(k)).for_each(token);
        } else {
            let rows = codes.par_chunks_mut(kp).zip(unsigned.par_chunks_mut(kp));
            rows.zip(scales.par_iter_mut())
                .zip(x.par_chunks(k))
                .for_each(token);
        }
        QuantizedTokens {
            codes,
            unsigned,
            form,
            scales,
        }
    }

    /// One token's scale and codes (their unsigned `form` too), in the weight's column order.
    fn quantize_token(
        &self,
        row: &[f32],
        (codes, unsigned, form): (&mut [i8], &mut [u8], UnsignedForm),
        scale: &mut f32,
    ) {
        *scale = token_scale(row);
        if !scale.is_finite() {
            return; // the row's outputs are NaN through the scale
        }
        for (j, (c, u)) in codes
            .iter_mut()
            .zip(unsigned.iter_mut())
            .take(self.k)
            .enumerate()
        {
            let v = match &self.order {
                Some(order) => row[order[j] as usize],
                None => row[j],
            };
            *c = quantize(v, *scale);
            *u = form.of(*c);
        }
    }

    /// `acc [n, m]` (rows of the weight by tokens), INT32.
    fn accumulate(&self, tokens: &QuantizedTokens, m: usize) -> Vec<i32> {
        let (kp, n) = (self.kp, self.n);
        let mut acc = vec![0i32; n * m];
        if m == 0 || n == 0 {
            return acc;
        }
        let x = Tokens {
            abs: &tokens.unsigned,
            signed: &tokens.codes,
            m,
        };
        let fused = self.fused_rows(m);
        // `quantize` chose the form by the same test.
        debug_assert_eq!(tokens.form, UnsignedForm::read_by(fused.is_some()));
        let biased = &tokens.unsigned;
        let group_rows = |g: usize, acc: &mut [i32], buffer: &mut Vec<i8>, group: usize| {
            let (first, rows) = (g * group, acc.len() / m);
            if let Some((rows_of, groups)) = fused {
                let span = (first, rows);
                let sums = &self.row_sums;
                fused::rows_by_tokens(rows_of, span, groups, biased, (m, kp), sums, acc);
                return;
            }
            let w = self.dense_rows(first, rows, buffer);
            dot::rows_by_tokens(self.isa, w, kp, x, acc);
        };
        if n * kp * m <= SERIAL_PRODUCTS {
            // One group at a time on this thread, each expanded into the same buffer.
            let group = n.min(64);
            let mut buffer = Vec::new();
            for (g, acc) in acc.chunks_mut(group * m).enumerate() {
                group_rows(g, acc, &mut buffer, group);
            }
            return acc;
        }
        let tasks = rayon::current_num_threads() * TASKS_PER_THREAD;
        let group = n.div_ceil(tasks).next_multiple_of(dot::ROWS);
        let chunks = acc.par_chunks_mut(group * m).enumerate();
        chunks.for_each_init(Vec::new, |buffer: &mut Vec<i8>, (g, acc)| {
            group_rows(g, acc, buffer, group);
        });
        acc
    }

    /// The rows and 64-wide groups per row the fused kernel reads for a forward of `m` tokens,
    /// if it runs it: on [`Isa::Avx512`], up to `fused::TOKENS` tokens, `K` within
    /// `fused::MAX_K`, a 6:8 weight.
    fn fused_rows(&self, m: usize) -> Option<(fused::Rows<'_>, usize)> {
        if self.isa != Isa::Avx512 || m > fused::TOKENS || self.k > fused::MAX_K {
            return None;
        }
        let Weight::Compact { table, weight } = &self.weight else {
            return None;
        };
        let rows = &weight.rows;
        let rows_of = fused::Rows {
            kept: &rows.kept,
            kept_stride: rows.kept_stride,
            ranks: &rows.ranks,
            rank_stride: rows.rank_stride,
            kept_bits: table.kept_bits_68()?,
        };
        Some((rows_of, rows.k.div_ceil(64)))
    }

    /// The dense codes of rows `first .. first + rows`: the weight's own, or expanded into
    /// `buffer`.
    fn dense_rows<'a>(&'a self, first: usize, rows: usize, buffer: &'a mut Vec<i8>) -> &'a [i8] {
        let kp = self.kp;
        match &self.weight {
            Weight::Dense(codes) => &codes.codes()[first * kp..(first + rows) * kp],
            Weight::Compact { table, weight } => {
                buffer.resize(rows * kp, 0);
                let compact = &weight.rows;
                let view = CompactRowsRef {
                    kept: &compact.kept,
                    kept_stride: compact.kept_stride,
                    ranks: &compact.ranks,
                    rank_stride: compact.rank_stride,
                    blocks: compact.k.div_ceil(compact.pattern.block_len()),
                };
                table.expand_rows(&view, first, rows, kp, buffer);
                &buffer[..rows * kp]
            }
        }
    }

    /// `Y [m, n] = acc * s_x * s_w + b`, in the reference path's order.
    fn epilogue(&self, acc: &[i32], token_scales: &[f32], m: usize) -> Vec<f32> {
        let n = self.n;
        let mut y = vec![0f32; m * n];
        let token = |(t, (out, &sx)): (usize, (&mut [f32], &f32))| {
            for (j, o) in out.iter_mut().enumerate() {
                let v = acc[j * m + t] as f32 * sx * self.scales[j];
                *o = match &self.bias {
                    Some(b) => v + b[j],
                    None => v,
                };
            }
        };
        if m * n <= SERIAL_VALUES {
            let rows = y.chunks_mut(n.max(1)).zip(token_scales);
            rows.enumerate().for_each(token);
        } else {
            let rows = y.par_chunks_mut(n.max(1)).zip(token_scales.par_iter());
            rows.enumerate().for_each(token);
        }
        y
    }
}

/// The sum of each of `n` rows' first `used` codes (bytes read as INT8), rows of `stride`.
fn code_sums(codes: &[u8], stride: usize, used: usize, n: usize) -> Vec<i32> {
    (0..n)
        .map(|r| {
            codes[r * stride..][..used]
                .iter()
                .map(|&c| i32::from(c as i8))
                .sum()
        })
        .collect()
}

/// Quantized tokens: codes and their magnitudes (`[m, kp]`), scales (`[m]`).
struct QuantizedTokens {
    codes: Vec<i8>,
    /// The codes as the kernel reads them unsigned (`form`).
    unsigned: Vec<u8>,
    form: UnsignedForm,
    scales: Vec<f32>,
}

/// The unsigned bytes a kernel reads beside the signed codes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum UnsignedForm {
    /// `|x|`: the 256-bit tiles (`dot.rs`).
    Abs,
    /// `x + 128`: the fused 6:8 kernel (`fused.rs`).
    Biased,
}

impl UnsignedForm {
    /// The form the fused kernel (`fused`) or the tiles read.
    fn read_by(fused: bool) -> Self {
        if fused { Self::Biased } else { Self::Abs }
    }

    fn of(self, code: i8) -> u8 {
        match self {
            Self::Abs => code.unsigned_abs(),
            Self::Biased => code as u8 ^ 0x80,
        }
    }
}

/// The reference path's per-token scale: `max(absmax, eps) / 127`, NaN for a row holding a
/// NaN or an infinity.
fn token_scale(row: &[f32]) -> f32 {
    let mut absmax = 0f32;
    for &v in row {
        if !v.is_finite() {
            return f32::NAN;
        }
        absmax = absmax.max(v.abs());
    }
    absmax.max(ACTIVATION_EPS) / QMAX
}

/// The reference path's INT8 code: `x / s` rounded half to even, clamped to `[-127, 127]`.
fn quantize(x: f32, scale: f32) -> i8 {
    (x / scale).round_ties_even().clamp(-QMAX, QMAX) as i8
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use burn::{
        backend::NdArray,
        tensor::{Tensor, TensorData},
    };

    use super::*;
    use crate::{
        backend::{DenseTensors, PackedTensors},
        compact::HostCodes,
        pack::{PackOptions, pack_linear},
        pattern::SparsityPattern,
        permute::ChannelPermutation,
        reference,
        test_rng::XorShift32,
    };

    type B = NdArray;

    fn values(rng: &mut XorShift32, len: usize) -> Vec<f32> {
        (0..len)
            .map(|_| (rng.next_u32() % 20001) as f32 / 10000.0 - 1.0)
            .collect()
    }

    fn tensor<const D: usize>(v: Vec<f32>, shape: [usize; D]) -> Tensor<B, D> {
        Tensor::from_data(TensorData::new(v, shape), &Default::default())
    }

    fn host(t: Tensor<B, 2>) -> Vec<f32> {
        t.into_data().into_vec::<f32>().unwrap()
    }

    /// The bits of `got` and `want` agree (NaN rows: NaN in both).
    fn assert_same(got: &[f32], want: &[f32], what: &str) {
        assert_eq!(got.len(), want.len(), "{what}");
        for (i, (g, w)) in got.iter().zip(want).enumerate() {
            assert!(
                g.to_bits() == w.to_bits() || (g.is_nan() && w.is_nan()),
                "{what}: element {i}: {g} vs the reference's {w}"
            );
        }
    }

    /// Every pattern, odd `K` and `N`, 1 to 9 tokens, with and without bias and an input
    /// permutation, a token holding a NaN: the integer kernel on every instruction set gives
    /// the reference path's bits (its f32 sums are exact at these `K`).
    #[test]
    fn sparse_layers_are_the_reference_path_bit_for_bit() {
        let mut rng = XorShift32(71);
        for pattern in SparsityPattern::all() {
            for &(k, n, m) in &[
                (64, 5, 1),
                (100, 33, 9),
                (576, 17, 4),
                (1000, 6, 16),
                (200, 7, 29),
            ] {
                for permuted in [false, true] {
                    let w = values(&mut rng, n * k);
                    let bias = values(&mut rng, n);
                    let with_bias = rng.next_u32().is_multiple_of(2);
                    let mut options = PackOptions::new(pattern, Precision::Int8);
                    if permuted {
                        let mut order: Vec<u32> = (0..k as u32).collect();
                        for i in (1..k).rev() {
                            order.swap(i, rng.next_u32() as usize % (i + 1));
                        }
                        options.permutation =
                            ChannelPermutation::Given(InputPermutation::new(order).unwrap());
                    }
                    let b = with_bias.then_some(&bias[..]);
                    let (packed, _, _) = pack_linear("w", &w, n, k, b, &options).unwrap();
                    let prepared = reference::prepare::<B>(PackedTensors {
                        spec: packed.spec(),
                        weight: HostCodes::Codes(Arc::new(packed.weight.clone())),
                        bias: with_bias.then(|| tensor(bias.clone(), [n])),
                        device: Default::default(),
                        input_permutation: packed.input_permutation.clone(),
                    });
                    let mut x = values(&mut rng, m * k);
                    if m > 2 {
                        x[k + 3] = f32::NAN;
                    }
                    let want = host(reference::forward(tensor(x.clone(), [m, k]), &prepared));
                    let layer = CpuInt8Layer::sparse(
                        packed.spec(),
                        &packed.weight,
                        with_bias.then(|| bias.clone()),
                        packed.input_permutation.as_ref(),
                    )
                    .unwrap();
                    for isa in [Isa::Scalar, Isa::Avx2, Isa::AvxVnni, Isa::Avx512] {
                        let Some(layer) = layer.with_isa(isa) else {
                            continue;
                        };
                        let what = format!("{pattern} k={k} n={n} m={m} {isa:?} perm={permuted}");
                        assert_same(&layer.forward(&x, m), &want, &what);
                    }
                }
            }
        }
    }

    /// The dense INT8 layer likewise against the reference path without a lift.
    #[test]
    fn dense_layers_are_the_reference_path_bit_for_bit() {
        let mut rng = XorShift32(73);
        for &(k, n, m) in &[
            (64, 5, 1),
            (70, 7, 3),
            (100, 33, 9),
            (1000, 17, 16),
            (1000, 9, 8),
        ] {
            let w = values(&mut rng, n * k);
            let bias = values(&mut rng, n);
            let qw = crate::weight_quant::quantize_weight(&w, n, k, Precision::Int8);
            let prepared = reference::prepare_dense::<B>(DenseTensors {
                weight: Arc::new(qw.clone()),
                bias: Some(tensor(bias.clone(), [n])),
                device: Default::default(),
            });
            let x = values(&mut rng, m * k);
            let want = host(reference::forward(tensor(x.clone(), [m, k]), &prepared));
            let layer = CpuInt8Layer::dense(Arc::new(qw), Some(bias)).unwrap();
            for isa in [Isa::Scalar, Isa::Avx2, Isa::AvxVnni, Isa::Avx512] {
                if let Some(layer) = layer.with_isa(isa) {
                    assert_same(&layer.forward(&x, m), &want, &format!("k={k} {isa:?}"));
                }
            }
        }
    }

    /// Past `2^24` the reference's f32 sums round; the kernel's INT32 sums equal the exact
    /// integer product (the epilogue then rounds once, as the reference's does).
    #[test]
    fn sums_past_two_to_the_24_are_exact_integers() {
        let (k, n, m) = (4096, 3, 2);
        let pattern = SparsityPattern::P6_8;
        // Every kept weight at code 127, the activations at 127 (token 0) and -127 (token 1):
        // sums of +-127 * 127 * 3072, past 2^24 after the first 1041 products (and the fused
        // kernel's biased sums near their bound).
        let w = vec![1.0f32; n * k];
        let x: Vec<f32> = (0..m * k).map(|i| if i < k { 1.0 } else { -1.0 }).collect();
        let options = PackOptions::new(pattern, Precision::Int8);
        let (packed, _, _) = pack_linear("w", &w, n, k, None, &options).unwrap();
        let layer = CpuInt8Layer::sparse(packed.spec(), &packed.weight, None, None).unwrap();
        let pruned = packed.unslide().unwrap();
        let WeightCodes::I8(codes) = &pruned.codes else {
            unreachable!()
        };
        for isa in [Isa::Scalar, Isa::Avx2, Isa::AvxVnni, Isa::Avx512] {
            let Some(layer) = layer.with_isa(isa) else {
                continue;
            };
            let tokens = layer.quantize(&x, m);
            let acc = layer.accumulate(&tokens, m);
            for t in 0..m {
                let xc = &tokens.codes[t * layer.kp..][..k];
                for r in 0..n {
                    let exact: i64 = codes[r * k..(r + 1) * k]
                        .iter()
                        .zip(xc)
                        .map(|(&a, &b)| i64::from(a) * i64::from(b))
                        .sum();
                    assert!(
                        exact.abs() > 1 << 24,
                        "the case must leave f32's exact integers"
                    );
                    assert_eq!(
                        i64::from(acc[r * m + t]),
                        exact,
                        "{isa:?} row {r} token {t}"
                    );
                }
            }
        }
    }
}
