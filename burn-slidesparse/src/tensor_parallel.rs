//! Running a layer split over tensor-parallel ranks: a layer that runs its shards, each on
//! its rank's device, and combines their outputs with a [`Collective`] (`collective.rs`),
//! and the split of any [`MaybeSparseLinear`] into per-device layers.
//!
//! What is exact (see `docs/decisions/tensor-parallel.md`): column-parallel gives every
//! output element from the same codes and scales as the un-sharded layer, for every
//! precision. Row-parallel is exact for the float precisions wherever the partial sums are
//! exact (integer-valued data), but not for INT8/FP8: each rank quantizes its slice of a
//! token with a per-token scale over that slice, which is at most the un-sharded scale over
//! the whole row, so the codes differ (each within its own, finer, quantization step).

use burn::tensor::{Tensor, backend::Backend};

use crate::{
    backend::SlideSparseBackend,
    collective::Collective,
    error::{Result, SlideSparseError},
    maybe_sparse::MaybeSparseLinear,
    pack::PackedLinear,
    quantized_linear::QuantizedLinear,
    shard::{Parallelism, input_range, shard_packed, shard_quantized},
    sparse_linear::{SlideSparseLinear, on_rows},
    weight_quant::QuantizedWeight,
};

/// The shards of one layer, one per rank, each on its rank's device.
#[derive(Debug)]
enum Shards<B: Backend> {
    Sparse(Vec<SlideSparseLinear<B>>),
    Dense(Vec<QuantizedLinear<B>>),
}

/// A linear layer split over tensor-parallel ranks: the shards of a packed layer
/// ([`SlideSparseLinear`]) or of the dense baseline ([`QuantizedLinear`]), run each on its
/// own device and combined with a [`Collective`].
#[derive(Debug)]
pub struct TensorParallelLinear<B: Backend> {
    parallelism: Parallelism,
    in_features: usize,
    out_features: usize,
    shards: Shards<B>,
}

impl<B: Backend> TensorParallelLinear<B> {
    /// Splits a packed layer over `devices` (one rank per device, rank 0 first).
    pub fn from_packed(
        layer: &PackedLinear,
        parallelism: Parallelism,
        devices: &[B::Device],
    ) -> Result<Self> {
        let shards = shard_packed(layer, parallelism, devices.len())?
            .into_iter()
            .zip(devices)
            .map(|(shard, device)| SlideSparseLinear::from_packed_owned(shard, device))
            .collect();
        Ok(Self {
            parallelism,
            in_features: layer.in_features,
            out_features: layer.out_features(),
            shards: Shards::Sparse(shards),
        })
    }

    /// Splits a dense quantized `[out, K]` weight and its bias over `devices`.
    pub fn from_quantized(
        name: &str,
        weight: &QuantizedWeight,
        bias: Option<&[f32]>,
        parallelism: Parallelism,
        devices: &[B::Device],
    ) -> Result<Self> {
        let shards = shard_quantized(name, weight, bias, parallelism, devices.len())?
            .into_iter()
            .zip(devices)
            .map(|(shard, device)| {
                QuantizedLinear::from_quantized_owned(shard.weight, shard.bias.as_deref(), device)
            })
            .collect();
        Ok(Self {
            parallelism,
            in_features: weight.cols,
            out_features: weight.rows,
            shards: Shards::Dense(shards),
        })
    }

    /// How the layer is split.
    pub fn parallelism(&self) -> Parallelism {
        self.parallelism
    }

    /// Number of ranks.
    pub fn ranks(&self) -> usize {
        match &self.shards {
            Shards::Sparse(s) => s.len(),
            Shards::Dense(s) => s.len(),
        }
    }

    /// Input width of the whole layer.
    pub fn in_features(&self) -> usize {
        self.in_features
    }

    /// Output width of the whole layer.
    pub fn out_features(&self) -> usize {
        self.out_features
    }

    fn device(&self, rank: usize) -> B::Device {
        match &self.shards {
            Shards::Sparse(s) => s[rank].weight.device().clone(),
            Shards::Dense(s) => s[rank].weight.device().clone(),
        }
    }

    /// Each rank's input from the whole `X [M, K]`: all of it (column-parallel) or its
    /// slice of `K` (row-parallel), on the rank's device.
    pub fn scatter_input(&self, x: Tensor<B, 2>) -> Vec<Tensor<B, 2>> {
        (0..self.ranks())
            .map(|rank| {
                let range = input_range(self.parallelism, self.in_features, self.ranks(), rank);
                x.clone()
                    .narrow(1, range.start, range.len())
                    .to_device(&self.device(rank))
            })
            .collect()
    }
}

impl<B: SlideSparseBackend> TensorParallelLinear<B> {
    /// Runs every rank's shard on its input (from [`scatter_input`](Self::scatter_input)),
    /// without communication: column-parallel ranks' slices of the output, or row-parallel
    /// ranks' partial sums (rank 0's with the bias).
    pub fn forward_shards(&self, inputs: Vec<Tensor<B, 2>>) -> Result<Vec<Tensor<B, 2>>> {
        if inputs.len() != self.ranks() {
            return Err(SlideSparseError::shape(
                "TensorParallelLinear inputs (one per rank)",
                self.ranks(),
                inputs.len(),
            ));
        }
        match &self.shards {
            Shards::Sparse(s) => s
                .iter()
                .zip(inputs)
                .map(|(l, x)| l.try_forward(x))
                .collect(),
            Shards::Dense(s) => s
                .iter()
                .zip(inputs)
                .map(|(l, x)| l.try_forward(x))
                .collect(),
        }
    }

    /// The whole output `[M, out]` on every rank: the shards' outputs gathered
    /// (column-parallel) or summed (row-parallel) by `collective`.
    pub fn forward_ranks(
        &self,
        x: Tensor<B, 2>,
        collective: &impl Collective<B>,
    ) -> Result<Vec<Tensor<B, 2>>> {
        if collective.ranks() != self.ranks() {
            return Err(SlideSparseError::shape(
                "TensorParallelLinear: the collective's ranks",
                self.ranks(),
                collective.ranks(),
            ));
        }
        let partial = self.forward_shards(self.scatter_input(x))?;
        match self.parallelism {
            Parallelism::Column => collective.all_gather(partial),
            Parallelism::Row => collective.all_reduce_sum(partial),
        }
    }

    /// Applies the whole layer to `[..., K]`, returning rank 0's `[..., out]`.
    pub fn try_forward<const D: usize>(
        &self,
        input: Tensor<B, D>,
        collective: &impl Collective<B>,
    ) -> Result<Tensor<B, D>> {
        on_rows(
            input,
            (self.in_features, self.out_features),
            "TensorParallelLinear input (last dimension)",
            |x| {
                let mut outputs = self.forward_ranks(x, collective)?;
                Ok(outputs.swap_remove(0))
            },
        )
    }
}

/// Splits a layer of a model over `devices` (rank 0 first): one shard per rank, on its
/// device, each a complete layer (what a tensor-parallel model's ranks hold; the caller
/// combines their outputs with a [`Collective`]). `name` is the layer's name in errors.
///
/// SlideSparse layers split as [`shard_packed`], dense quantized ones as
/// [`shard_quantized`], `nn::Linear` the same way on its weight (`[in, out]`: columns of it
/// for column-parallel, rows for row-parallel; the bias with its channels, or on rank 0).
/// Masked (training) layers are an error: split after packing.
pub fn shard_linear<B: Backend>(
    layer: &MaybeSparseLinear<B>,
    name: &str,
    parallelism: Parallelism,
    devices: &[B::Device],
) -> Result<Vec<MaybeSparseLinear<B>>> {
    let ranks = devices.len();
    match layer {
        MaybeSparseLinear::Sparse(l) => Ok(shard_packed(&l.to_packed(name)?, parallelism, ranks)?
            .into_iter()
            .zip(devices)
            .map(|(shard, device)| SlideSparseLinear::from_packed_owned(shard, device).into())
            .collect()),
        MaybeSparseLinear::Quantized(l) => {
            let (weight, bias) = l.to_quantized()?;
            Ok(
                shard_quantized(name, &weight, bias.as_deref(), parallelism, ranks)?
                    .into_iter()
                    .zip(devices)
                    .map(|(shard, device)| {
                        QuantizedLinear::from_quantized_owned(
                            shard.weight,
                            shard.bias.as_deref(),
                            device,
                        )
                        .into()
                    })
                    .collect(),
            )
        }
        MaybeSparseLinear::Dense(l) => shard_dense(l, name, parallelism, devices),
        MaybeSparseLinear::Masked(_) => Err(SlideSparseError::InvalidSplit {
            layer: name.into(),
            ranks,
            detail: "a masked (training) layer is not split; pack it first".into(),
        }),
    }
}

/// A copy of `t` on `device` in `t`'s own dtype (`from_data` alone would convert to the
/// device's default).
fn copy_to<B: Backend, const D: usize>(t: Tensor<B, D>, device: &B::Device) -> Tensor<B, D> {
    let dtype = t.dtype();
    Tensor::from_data(t.into_data(), (device, dtype))
}

/// [`shard_linear`] of an `nn::Linear` (weight `[in, out]`).
fn shard_dense<B: Backend>(
    layer: &burn::nn::Linear<B>,
    name: &str,
    parallelism: Parallelism,
    devices: &[B::Device],
) -> Result<Vec<MaybeSparseLinear<B>>> {
    use burn::module::Param;
    let ranks = devices.len();
    let [k, out] = layer.weight.dims();
    let invalid = |what: &str, n: usize| SlideSparseError::InvalidSplit {
        layer: name.into(),
        ranks,
        detail: format!("{what} {n} is not a multiple of {ranks}"),
    };
    if ranks == 0 {
        return Err(SlideSparseError::InvalidSplit {
            layer: name.into(),
            ranks,
            detail: "at least one rank is needed".into(),
        });
    }
    let (axis, width) = match parallelism {
        Parallelism::Column if out % ranks == 0 => (1, out / ranks),
        Parallelism::Column => return Err(invalid("out", out)),
        Parallelism::Row if k % ranks == 0 => (0, k / ranks),
        Parallelism::Row => return Err(invalid("K", k)),
    };
    Ok(devices
        .iter()
        .enumerate()
        .map(|(r, device)| {
            // Copies, not views: a narrowed view (and `to_device` on the same device) would
            // keep the whole weight alive and read it strided.
            let weight = copy_to(layer.weight.val().narrow(axis, r * width, width), device);
            let bias = layer.bias.as_ref().and_then(|b| match parallelism {
                Parallelism::Column => Some(copy_to(b.val().narrow(0, r * width, width), device)),
                Parallelism::Row => (r == 0).then(|| copy_to(b.val(), device)),
            });
            burn::nn::Linear {
                weight: Param::from_tensor(weight),
                bias: bias.map(Param::from_tensor),
            }
            .into()
        })
        .collect())
}
