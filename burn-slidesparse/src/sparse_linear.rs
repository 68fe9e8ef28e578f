//! `SlideSparseLinear`: a drop-in replacement for `burn::nn::Linear` running a packed
//! `(2N-2):2N` weight.

use std::sync::Arc;

use burn::{
    config::Config,
    module::{Module, Param},
    nn::Linear,
    tensor::{DType, Tensor, TensorCreationOptions, TensorData, backend::Backend},
};

use crate::{
    backend::{PackedTensors, PreparedSlot, SlideSparseBackend},
    codes::WeightCodesModule,
    compact::HostCodes,
    error::{Result, SlideSparseError},
    pack::{DEFAULT_ALIGNMENT, LayerSpec, PackOptions, PackedLinear, check_alignment, pack_linear},
    pattern::SparsityPattern,
    prune::PruneMethod,
    weight_quant::{Precision, QuantizedWeight, WeightCodes},
};

/// Configuration of a [`SlideSparseLinear`]; `init` gives an all-zero (valid) packed layer
/// into which a record can be loaded, the usual burn way.
#[derive(Config, Debug)]
pub struct SlideSparseLinearConfig {
    /// Input width `K`.
    pub d_input: usize,
    /// Output width.
    pub d_output: usize,
    /// The `(2N-2):2N` pattern of the packed weight.
    pub pattern: SparsityPattern,
    /// Element type of `W'` (and of the quantized activations).
    pub precision: Precision,
    #[config(default = true)]
    /// Whether the layer has a bias.
    pub bias: bool,
    /// `K'` alignment (power of two, >= 32 for 8-bit, >= 16 for 16-bit precisions).
    #[config(default = 64)]
    pub alignment: usize,
}

impl SlideSparseLinearConfig {
    /// The layer spec this config describes.
    pub fn spec(&self) -> LayerSpec {
        LayerSpec {
            pattern: self.pattern,
            precision: self.precision,
            in_features: self.d_input,
            out_features: self.d_output,
            alignment: self.alignment,
        }
    }

    /// An all-zero packed layer (scales 1, bias 0).
    pub fn try_init<B: Backend>(&self, device: &B::Device) -> Result<SlideSparseLinear<B>> {
        check_alignment(self.alignment, self.precision)?;
        let spec = self.spec();
        let kp = spec.k_prime();
        let n = spec.out_features;
        let codes = match self.precision {
            Precision::Int8 => WeightCodes::I8(vec![0; n * kp]),
            Precision::Fp8 => WeightCodes::Fp8(vec![0; n * kp]),
            Precision::Bf16 => WeightCodes::Bf16(vec![half::bf16::ZERO; n * kp]),
            Precision::F16 => WeightCodes::F16(vec![half::f16::ZERO; n * kp]),
            Precision::F32 => WeightCodes::F32(vec![0.0; n * kp]),
        };
        let packed = PackedLinear {
            name: "init".into(),
            pattern: self.pattern,
            in_features: self.d_input,
            alignment: self.alignment,
            weight: QuantizedWeight {
                rows: n,
                cols: kp,
                codes,
                scales: vec![1.0; n],
            },
            bias: self.bias.then(|| vec![0.0; n]),
            input_permutation: None,
        };
        Ok(SlideSparseLinear::from_packed_owned(packed, device))
    }

    /// [`try_init`](Self::try_init), panicking on an invalid alignment like burn's own
    /// config `init`s do.
    pub fn init<B: Backend>(&self, device: &B::Device) -> SlideSparseLinear<B> {
        self.try_init(device)
            .unwrap_or_else(|e| panic!("SlideSparseLinearConfig::init: {e}"))
    }
}

/// A linear layer `[..., K] -> [..., out]` whose weight is a slid `(2N-2):2N` matrix.
///
/// The slid `W' [out, K']` codes and their per-channel scales stay on the host
/// ([`WeightCodesModule`]; INT8 / FP8 codes in the compact layout, which the CPU backends'
/// integer kernel reads in place); the device holds only what the backend prepares from them
/// on the first forward (on CUDA, cuSPARSELt's compressed weight and the scales) and the bias. The
/// record holds the codes in their own width (INT8 as `I8`, FP8 as E4M3 bytes, 16-bit
/// precisions as 16-bit), the scales in f32 and the bias in the record's float type: records
/// round-trip bit-exactly. The layout comes from the config.
///
/// Hold it (or [`MaybeSparseLinear`](crate::MaybeSparseLinear)) in a plain field, a `Vec` or
/// an enum module, not in an `Option` field of a model that loads records: burn 0.21's
/// `Option` treats a module with no float `Param` (a layer without bias: its codes are not
/// float parameters) as a constant and silently keeps it when a record is loaded.
#[derive(Module, Debug)]
pub struct SlideSparseLinear<B: Backend> {
    /// `W' [out, K']` codes (INT8 / FP8 held compact) and per-output-channel scales, on the
    /// host.
    pub weight: WeightCodesModule<B>,
    /// Bias `[out]`, if the layer has one.
    pub bias: Option<Param<Tensor<B, 1>>>,
    /// Pattern, precision and sizes (not persisted: the config carries them).
    pub spec: LayerSpec,
    /// The backend's prepared weights, built on first use.
    prepared: PreparedSlot,
}

impl<B: Backend> SlideSparseLinear<B> {
    /// A packed layer on `device` (the codes are copied; see
    /// [`from_packed_owned`](Self::from_packed_owned)). Only the bias is uploaded here: the
    /// weight is prepared on the first forward (or by [`prepared`](Self::prepared)).
    pub fn from_packed(packed: &PackedLinear, device: &B::Device) -> Self {
        Self::from_packed_owned(packed.clone(), device)
    }

    /// [`from_packed`](Self::from_packed) taking the packed layer, its codes moved.
    pub fn from_packed_owned(packed: PackedLinear, device: &B::Device) -> Self {
        let spec = packed.spec();
        let rows = packed.weight.rows;
        let codes = HostCodes::sparse(
            packed.weight,
            spec.pattern,
            spec.in_features,
            spec.alignment,
        );
        Self {
            weight: WeightCodesModule::held(codes, device)
                .with_input_permutation(packed.input_permutation),
            bias: packed.bias.map(|b| float_param(b, &[rows], device)),
            spec,
            prepared: PreparedSlot::default(),
        }
    }

    /// Loads layer `name` (its source weight name or prefix) from a packed safetensors file;
    /// the file is fully checked first.
    pub fn from_packed_file(
        path: &std::path::Path,
        name: &str,
        device: &B::Device,
    ) -> Result<Self> {
        let file = crate::format::PackedFile::load(path)?;
        let layer = file
            .layer(name)
            .ok_or_else(|| SlideSparseError::MissingTensor {
                name: name.to_string(),
                path: path.display().to_string(),
            })?;
        Ok(Self::from_packed(layer, device))
    }

    /// Prunes, quantizes and packs a `burn::nn::Linear` (weight layout `[in, out]`).
    pub fn from_linear(linear: &Linear<B>, options: &PackOptions) -> Result<Self> {
        let host = LinearOnHost::read(linear)?;
        let (packed, _, _) = pack_linear(
            "linear.weight",
            &host.weight,
            host.out_features,
            host.in_features,
            host.bias.as_deref(),
            options,
        )?;
        Ok(Self::from_packed_owned(packed, &host.device))
    }

    /// Shorthand for [`from_linear`](Self::from_linear) with magnitude pruning.
    pub fn from_linear_with(
        linear: &Linear<B>,
        pattern: SparsityPattern,
        precision: Precision,
        prune: PruneMethod,
    ) -> Result<Self> {
        Self::from_linear(
            linear,
            &PackOptions {
                pattern,
                precision,
                prune,
                alignment: DEFAULT_ALIGNMENT,
                permutation: Default::default(),
            },
        )
    }

    /// The layer in its portable packed form (the codes from the host; the bias is read
    /// from the device, which synchronizes).
    pub fn to_packed(&self, name: &str) -> Result<PackedLinear> {
        let spec = self.spec;
        let packed = PackedLinear {
            name: name.to_string(),
            pattern: spec.pattern,
            in_features: spec.in_features,
            alignment: spec.alignment,
            weight: Arc::unwrap_or_clone(self.weight.weight()),
            bias: match &self.bias {
                Some(b) => Some(to_vec_f32(b.val().into_data(), "bias")?),
                None => None,
            },
            input_permutation: self.weight.input_permutation().cloned(),
        };
        packed.validate()?;
        Ok(packed)
    }

    /// The layer's weights, for a backend's preparation.
    pub fn packed_tensors(&self) -> PackedTensors<B> {
        PackedTensors {
            spec: self.spec,
            weight: self.weight.codes().clone(),
            bias: self.bias.as_ref().map(|b| b.val()),
            device: self.weight.device().clone(),
            input_permutation: self.weight.input_permutation().cloned(),
        }
    }
}

impl<B: SlideSparseBackend> SlideSparseLinear<B> {
    /// The backend's prepared weights, built once per device and parameter set.
    pub fn prepared(&self) -> Result<B::Prepared> {
        self.prepared
            .get_or_try_init(prepared_key(&self.weight), || {
                B::slidesparse_prepare(self.packed_tensors())
            })
    }

    /// Applies the layer to `[..., K]`, returning `[..., out]`, or an error (wrong input
    /// width, preparation failure on the backend).
    pub fn try_forward<const D: usize>(&self, input: Tensor<B, D>) -> Result<Tensor<B, D>> {
        on_rows(
            input,
            (self.spec.in_features, self.spec.out_features),
            "SlideSparseLinear input (last dimension)",
            |x| B::slidesparse_forward(x, &self.prepared()?),
        )
    }

    /// Applies the layer to `[..., K]`, returning `[..., out]`. Panics with the error of
    /// [`try_forward`](Self::try_forward), like `burn::nn::Linear` panics on bad shapes.
    pub fn forward<const D: usize>(&self, input: Tensor<B, D>) -> Tensor<B, D> {
        self.try_forward(input)
            .unwrap_or_else(|e| panic!("SlideSparseLinear::forward: {e}"))
    }
}

/// A parameter in the backend's float type, named explicitly: burn 0.21 otherwise uses the
/// device's default dtype, which another backend on the same device may have set.
pub(crate) fn float_param<B: Backend, const D: usize>(
    values: Vec<f32>,
    shape: &[usize],
    device: &B::Device,
) -> Param<Tensor<B, D>> {
    param_of(
        values,
        shape,
        device,
        <B::FloatElem as burn::tensor::Element>::dtype(),
    )
}

fn param_of<B: Backend, const D: usize>(
    values: Vec<f32>,
    shape: &[usize],
    device: &B::Device,
    dtype: DType,
) -> Param<Tensor<B, D>> {
    let options = TensorCreationOptions::default()
        .with_device(device.clone())
        .with_dtype(dtype);
    Param::from_tensor(Tensor::from_data(
        TensorData::new(values, shape.to_vec()),
        options,
    ))
}

/// What a layer's prepared weights depend on: its codes and device.
pub(crate) fn prepared_key<B: Backend>(
    codes: &WeightCodesModule<B>,
) -> crate::backend::PreparedKey {
    (
        codes.id(),
        burn::tensor::backend::DeviceOps::id(codes.device()),
    )
}

/// Applies a `[M, in] -> [M, out]` op to `[..., in]`, returning `[..., out]`; a wrong last
/// dimension is a shape error named `what`.
pub(crate) fn on_rows<B: Backend, const D: usize>(
    input: Tensor<B, D>,
    (in_features, out_features): (usize, usize),
    what: &'static str,
    op: impl FnOnce(Tensor<B, 2>) -> Result<Tensor<B, 2>>,
) -> Result<Tensor<B, D>> {
    let mut dims = input.dims();
    let k = dims[D - 1];
    if k != in_features {
        return Err(SlideSparseError::shape(what, in_features, k));
    }
    let m: usize = dims[..D - 1].iter().product();
    let y = op(input.reshape([m, k]))?;
    dims[D - 1] = out_features;
    Ok(y.reshape(dims))
}

/// A `burn::nn::Linear` read to the host, its weight in the packer's `[out, in]` layout
/// (burn stores `[in, out]`).
pub(crate) struct LinearOnHost<B: Backend> {
    pub weight: Vec<f32>,
    pub bias: Option<Vec<f32>>,
    pub out_features: usize,
    pub in_features: usize,
    pub device: B::Device,
}

impl<B: Backend> LinearOnHost<B> {
    pub fn read(linear: &Linear<B>) -> Result<Self> {
        let weight = linear.weight.val();
        let device = weight.device();
        let [in_features, out_features] = weight.dims();
        Ok(Self {
            weight: to_vec_f32(weight.transpose().into_data(), "linear weight")?,
            bias: match &linear.bias {
                Some(b) => Some(to_vec_f32(b.val().into_data(), "linear bias")?),
                None => None,
            },
            out_features,
            in_features,
            device,
        })
    }
}

pub(crate) fn to_vec_f32(data: TensorData, what: &str) -> Result<Vec<f32>> {
    data.convert::<f32>()
        .into_vec::<f32>()
        .map_err(|e| SlideSparseError::Backend(format!("reading {what}: {e:?}")))
}
