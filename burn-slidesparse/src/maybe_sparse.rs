//! Swapping a model's `nn::Linear` layers for `SlideSparseLinear` (or for a trainable
//! [`MaskedLinear`] first, to fine-tune under the sparsity pattern).
//!
//! Rust models have fixed field types, so a model that wants to choose per layer holds
//! [`MaybeSparseLinear`] fields and lists them through [`VisitLinears`]; [`sparsify`] then
//! packs every listed layer that the filter accepts (e.g. everything but the LM head).

use std::{
    any::Any,
    collections::HashMap,
    panic::AssertUnwindSafe,
    path::{Path, PathBuf},
};

use burn::{
    module::{Module, ModuleVisitor},
    nn::Linear,
    record::FileRecorder,
    tensor::{Tensor, backend::Backend},
};

use crate::{
    backend::SlideSparseBackend,
    error::{Result, SlideSparseError},
    format::PackedFile,
    masked_linear::MaskedLinear,
    pack::{PackOptions, PackedLinear},
    pattern::SparsityPattern,
    prune::PruneMethod,
    quantized_linear::QuantizedLinear,
    sparse_linear::SlideSparseLinear,
    weight_quant::Precision,
};

/// A linear layer that is dense (`burn::nn::Linear`), dense under a training mask
/// ([`MaskedLinear`]), SlideSparse, or the dense quantized baseline ([`QuantizedLinear`]).
///
/// Its record is an enum too: a record saved from a sparsified model only loads into a model
/// sparsified the same way. burn's derived `load_record` panics on a variant mismatch, so
/// load through [`load_record`] or [`load_file`], which turn that into an error.
#[derive(Module, Debug)]
pub enum MaybeSparseLinear<B: Backend> {
    /// A dense `burn::nn::Linear`, as the model was built.
    Dense(Linear<B>),
    /// Dense, trainable under a (2N-2):2N mask.
    Masked(MaskedLinear<B>),
    /// Packed SlideSparse.
    Sparse(SlideSparseLinear<B>),
    /// Quantized without pruning (the baseline SlideSparse is measured against).
    Quantized(QuantizedLinear<B>),
}

impl<B: Backend> From<Linear<B>> for MaybeSparseLinear<B> {
    fn from(linear: Linear<B>) -> Self {
        Self::Dense(linear)
    }
}

impl<B: Backend> From<SlideSparseLinear<B>> for MaybeSparseLinear<B> {
    fn from(layer: SlideSparseLinear<B>) -> Self {
        Self::Sparse(layer)
    }
}

impl<B: Backend> From<MaskedLinear<B>> for MaybeSparseLinear<B> {
    fn from(layer: MaskedLinear<B>) -> Self {
        Self::Masked(layer)
    }
}

impl<B: Backend> From<QuantizedLinear<B>> for MaybeSparseLinear<B> {
    fn from(layer: QuantizedLinear<B>) -> Self {
        Self::Quantized(layer)
    }
}

impl<B: Backend> MaybeSparseLinear<B> {
    /// Whether the layer is SlideSparse.
    pub fn is_sparse(&self) -> bool {
        matches!(self, Self::Sparse(_))
    }

    /// The dense layer, if it is dense.
    pub fn dense(&self) -> Option<&Linear<B>> {
        match self {
            Self::Dense(layer) => Some(layer),
            _ => None,
        }
    }

    /// The sparse layer, if it is sparse.
    pub fn sparse(&self) -> Option<&SlideSparseLinear<B>> {
        match self {
            Self::Sparse(layer) => Some(layer),
            _ => None,
        }
    }

    /// The masked (trainable sparse) layer, if it is one.
    pub fn masked(&self) -> Option<&MaskedLinear<B>> {
        match self {
            Self::Masked(layer) => Some(layer),
            _ => None,
        }
    }

    /// The dense quantized baseline layer, if it is one.
    pub fn quantized(&self) -> Option<&QuantizedLinear<B>> {
        match self {
            Self::Quantized(layer) => Some(layer),
            _ => None,
        }
    }

    /// The variant's name, as burn's module tree and records spell it.
    pub fn kind(&self) -> &'static str {
        match self {
            Self::Dense(_) => "Dense",
            Self::Masked(_) => "Masked",
            Self::Sparse(_) => "Sparse",
            Self::Quantized(_) => "Quantized",
        }
    }

    /// `(in_features, out_features)` of the layer, whichever kind it is (without
    /// initializing a lazily initialized dense weight).
    pub fn features(&self) -> (usize, usize) {
        let linear = |l: &Linear<B>| {
            let shape = l.weight.lazy_shape();
            (shape[0], shape[1])
        };
        match self {
            Self::Dense(layer) => linear(layer),
            Self::Masked(layer) => linear(&layer.linear),
            Self::Sparse(layer) => (layer.spec.in_features, layer.spec.out_features),
            Self::Quantized(layer) => (layer.spec.in_features, layer.spec.out_features),
        }
    }

    /// Whether the layer has a bias.
    pub fn has_bias(&self) -> bool {
        match self {
            Self::Dense(layer) => layer.bias.is_some(),
            Self::Masked(layer) => layer.linear.bias.is_some(),
            Self::Sparse(layer) => layer.bias.is_some(),
            Self::Quantized(layer) => layer.bias.is_some(),
        }
    }

    /// The device the layer lives on (without initializing a lazy dense weight).
    pub fn device(&self) -> B::Device {
        match self {
            Self::Dense(layer) => layer.weight.lazy_device(),
            Self::Masked(layer) => layer.linear.weight.lazy_device(),
            Self::Sparse(layer) => layer.weight.device().clone(),
            Self::Quantized(layer) => layer.weight.device().clone(),
        }
    }

    /// Quantizes a dense layer in place without pruning (the like-for-like baseline of
    /// SlideSparse); other kinds are left as they are.
    pub fn quantize(&mut self, precision: Precision) -> Result<()> {
        if let Self::Dense(dense) = self {
            *self = QuantizedLinear::from_linear(dense, precision)?.into();
        }
        Ok(())
    }

    /// Packs a dense layer (pruning it with `options`) or a masked layer (checking its
    /// pattern instead of pruning) in place; a sparse layer is left as it is.
    pub fn sparsify(&mut self, options: &PackOptions) -> Result<()> {
        match self {
            Self::Dense(dense) => *self = SlideSparseLinear::from_linear(dense, options)?.into(),
            Self::Masked(masked) => *self = masked.to_sparse(options)?.into(),
            Self::Sparse(_) | Self::Quantized(_) => {}
        }
        Ok(())
    }

    /// Prunes a dense layer to `pattern` with `method` and keeps it trainable under the mask
    /// (other kinds are left as they are). On error the layer stays dense.
    pub fn mask(&mut self, pattern: SparsityPattern, method: &PruneMethod) -> Result<()> {
        if let Self::Dense(dense) = self {
            // `from_linear` consumes its layer; the clone shares the tensors, and keeping the
            // original in place means an error leaves the model as it was.
            *self = MaskedLinear::from_linear(dense.clone(), pattern, method)?.into();
        }
        Ok(())
    }
}

impl<B: SlideSparseBackend> MaybeSparseLinear<B> {
    /// The layer's CUDA pipeline, if it is SlideSparse or quantized on burn-cuda (plain or
    /// under fusion); `None` for a dense or masked layer and on every other backend.
    #[cfg(feature = "cuda")]
    pub(crate) fn native(&self) -> Result<Option<crate::native_ops::NativeLinear>> {
        Ok(match self {
            Self::Sparse(layer) => B::native_linear(layer.prepared()?),
            Self::Quantized(layer) => B::native_dense_linear(layer.prepared()?),
            Self::Dense(_) | Self::Masked(_) => None,
        })
    }

    /// `[..., in] -> [..., out]` through whichever layer this is, or the error of a
    /// SlideSparse or quantized layer (a dense one panics on a bad shape, as burn's does).
    pub fn try_forward<const D: usize>(&self, input: Tensor<B, D>) -> Result<Tensor<B, D>> {
        match self {
            Self::Dense(layer) => Ok(layer.forward(input)),
            Self::Masked(layer) => Ok(layer.forward(input)),
            Self::Sparse(layer) => layer.try_forward(input),
            Self::Quantized(layer) => layer.try_forward(input),
        }
    }

    /// `[..., in] -> [..., out]` through whichever layer this is.
    pub fn forward<const D: usize>(&self, input: Tensor<B, D>) -> Tensor<B, D> {
        match self {
            Self::Dense(layer) => layer.forward(input),
            Self::Masked(layer) => layer.forward(input),
            Self::Sparse(layer) => layer.forward(input),
            Self::Quantized(layer) => layer.forward(input),
        }
    }
}

/// Loads `record` into `model`, like burn's `Module::load_record`, but returns an error where
/// burn would panic: when a [`MaybeSparseLinear`] of the record is another kind than the
/// model's (e.g. a sparsified model's record loaded into a dense-built model). Build the model
/// and swap its layers the same way as the saved one (`sparsify`, `quantize_dense`,
/// `mask_with`) before loading.
///
/// burn's derived enum records offer no check before loading, so the mismatch is caught as the
/// unwinding panic of burn's `load_record` (its message still reaches the panic hook, i.e.
/// stderr); under `panic = "abort"` it aborts as burn's own call would.
pub fn load_record<B: Backend, M: Module<B>>(model: M, record: M::Record) -> Result<M> {
    let kinds = layer_kinds(&model);
    std::panic::catch_unwind(AssertUnwindSafe(|| model.load_record(record))).map_err(|panic| {
        SlideSparseError::Record {
            detail: format!(
                "{} (the model's layer kinds: {}); build and swap the model's \
             layers the same way as the saved model's before loading",
                panic_message(panic.as_ref()),
                if kinds.is_empty() {
                    "none".to_string()
                } else {
                    kinds.join(", ")
                },
            ),
        }
    })
}

/// Loads `path` with `recorder` into `model`, like burn's `Module::load_file`, with the
/// record checked as in [`load_record`].
pub fn load_file<B: Backend, M: Module<B>, R: FileRecorder<B>>(
    model: M,
    path: impl Into<PathBuf>,
    recorder: &R,
    device: &B::Device,
) -> Result<M> {
    let path = path.into();
    let record = recorder
        .load(path.clone(), device)
        .map_err(|e| SlideSparseError::Record {
            detail: format!("{}: {e}", path.display()),
        })?;
    load_record(model, record)
}

fn panic_message(panic: &(dyn Any + Send)) -> &str {
    panic
        .downcast_ref::<&str>()
        .copied()
        .or_else(|| panic.downcast_ref::<String>().map(String::as_str))
        .unwrap_or("the record does not fit the model")
}

/// `path=Kind` for every [`MaybeSparseLinear`] in `model`, for error messages.
fn layer_kinds<B: Backend, M: Module<B>>(model: &M) -> Vec<String> {
    let mut visitor = KindVisitor::default();
    model.visit(&mut visitor);
    visitor.kinds
}

/// Follows burn's module tree: an enum module is entered by its variant's name with the
/// container type `Enum:<name>` (burn-derive's convention).
#[derive(Default)]
struct KindVisitor {
    path: Vec<String>,
    kinds: Vec<String>,
}

impl<B: Backend> ModuleVisitor<B> for KindVisitor {
    fn enter_module(&mut self, name: &str, container_type: &str) {
        if container_type == "Enum:MaybeSparseLinear" {
            self.kinds.push(format!("{}={name}", self.path.join(".")));
        }
        self.path.push(name.to_string());
    }

    fn exit_module(&mut self, _name: &str, _container_type: &str) {
        self.path.pop();
    }
}

/// A model that can list its swappable linear layers by name.
pub trait VisitLinears<B: Backend> {
    /// Calls `f` with the name and layer of every swappable linear layer.
    fn visit_linears(
        &mut self,
        f: &mut dyn FnMut(&str, &mut MaybeSparseLinear<B>) -> Result<()>,
    ) -> Result<()>;
}

/// Packs every linear layer of `model` for which `include(name)` holds; returns the names
/// packed. Errors name the layer that failed.
pub fn sparsify<B: Backend, M: VisitLinears<B>>(
    model: &mut M,
    options: &PackOptions,
    include: impl Fn(&str) -> bool,
) -> Result<Vec<String>> {
    sparsify_with(model, |name| include(name).then(|| options.clone()))
}

/// Like [`sparsify`], with options chosen per layer (`None` keeps the layer dense), e.g.
/// activation-aware pruning with each layer's calibration norms.
pub fn sparsify_with<B: Backend, M: VisitLinears<B>>(
    model: &mut M,
    options_for: impl Fn(&str) -> Option<PackOptions>,
) -> Result<Vec<String>> {
    let mut packed = Vec::new();
    model.visit_linears(&mut |name, layer| {
        if let Some(options) = options_for(name).filter(|_| !layer.is_sparse()) {
            layer
                .sparsify(&options)
                .map_err(|e| SlideSparseError::Backend(format!("{name}: {e}")))?;
            packed.push(name.to_string());
        }
        Ok(())
    })?;
    Ok(packed)
}

/// Replaces the linear layers of `model` by the packed layers of `file` (the output of
/// `slidesparse pack`, [`pack_checkpoint`](crate::pack_checkpoint) or
/// [`save_layers`](crate::save_layers)); returns the model's names of the layers replaced.
/// `file_name(model_name)` gives the file's name (its tensor's prefix, e.g.
/// `model.layers.0.self_attn.q_proj`) of a model layer; layers the file does not hold are
/// left as they are (e.g. an unpacked LM head).
///
/// Every layer of the file must be used and fit: a file layer no model layer maps to, or one
/// whose sizes or bias differ from the model's layer, is a
/// [`SlideSparseError::PackedMismatch`] and the model is left unchanged. The codes are moved
/// out of `file`, not copied.
pub fn load_packed<B: Backend, M: VisitLinears<B>>(
    model: &mut M,
    file: PackedFile,
    path: &str,
    file_name: impl Fn(&str) -> String,
) -> Result<Vec<String>> {
    let mismatch = |detail: String| SlideSparseError::PackedMismatch {
        path: path.to_string(),
        detail,
    };
    let mut layers: HashMap<String, PackedLinear> = file
        .layers
        .into_iter()
        .map(|l| (crate::format::prefix_of(&l.name), l))
        .collect();
    // Check every layer before replacing any, so an error leaves the model as it was.
    let mut assignment = Vec::new();
    model.visit_linears(&mut |name, layer| {
        let key = file_name(name);
        if let Some(packed) = layers.get(&key) {
            let packed_features = (packed.in_features, packed.out_features());
            if packed_features != layer.features() || packed.bias.is_some() != layer.has_bias() {
                return Err(mismatch(format!(
                    "{key} is (in, out) = {packed_features:?} {}, the model's {name} is {:?} {}",
                    bias_word(packed.bias.is_some()),
                    layer.features(),
                    bias_word(layer.has_bias()),
                )));
            }
            assignment.push((name.to_string(), key));
        }
        Ok(())
    })?;
    let mut used = std::collections::HashSet::new();
    for (name, key) in &assignment {
        if !used.insert(key) {
            return Err(mismatch(format!(
                "two model layers (one of them {name}) map to the file's layer {key}"
            )));
        }
    }
    let mut unused: Vec<&String> = layers.keys().filter(|k| !used.contains(k)).collect();
    if !unused.is_empty() {
        unused.sort();
        return Err(mismatch(format!(
            "no model layer maps to the file's layer(s) {}",
            unused
                .iter()
                .map(|s| s.as_str())
                .collect::<Vec<_>>()
                .join(", ")
        )));
    }
    let mut loaded = Vec::new();
    model.visit_linears(&mut |name, layer| {
        if let Some(packed) = layers.remove(&file_name(name)) {
            let device = layer.device();
            *layer = SlideSparseLinear::from_packed_owned(packed, &device).into();
            loaded.push(name.to_string());
        }
        Ok(())
    })?;
    Ok(loaded)
}

/// [`load_packed`] from a file on disk (fully checked as it is read).
pub fn load_packed_file<B: Backend, M: VisitLinears<B>>(
    model: &mut M,
    path: &Path,
    file_name: impl Fn(&str) -> String,
) -> Result<Vec<String>> {
    let file = PackedFile::load(path)?;
    load_packed(model, file, &path.display().to_string(), file_name)
}

fn bias_word(bias: bool) -> &'static str {
    if bias { "with bias" } else { "without bias" }
}

/// Builds every SlideSparse and dense-quantized layer's prepared weights now (on the CUDA
/// backend: compression and upload), so the first forward does not pay for it; returns how
/// many layers were prepared.
pub fn prepare_all<B: SlideSparseBackend, M: VisitLinears<B>>(model: &mut M) -> Result<usize> {
    let mut prepared = 0;
    model.visit_linears(&mut |name, layer| {
        let context = |e: SlideSparseError| SlideSparseError::Backend(format!("{name}: {e}"));
        match layer {
            MaybeSparseLinear::Sparse(sparse) => {
                sparse.prepared().map_err(context)?;
                prepared += 1;
            }
            MaybeSparseLinear::Quantized(quantized) => {
                quantized.prepared().map_err(context)?;
                prepared += 1;
            }
            MaybeSparseLinear::Dense(_) | MaybeSparseLinear::Masked(_) => {}
        }
        Ok(())
    })?;
    Ok(prepared)
}

/// Quantizes every dense linear layer of `model` for which `include(name)` holds, without
/// pruning ([`QuantizedLinear`], the baseline SlideSparse is measured against); returns the
/// names quantized.
pub fn quantize_dense<B: Backend, M: VisitLinears<B>>(
    model: &mut M,
    precision: Precision,
    include: impl Fn(&str) -> bool,
) -> Result<Vec<String>> {
    let mut quantized = Vec::new();
    model.visit_linears(&mut |name, layer| {
        if include(name) && layer.dense().is_some() {
            layer
                .quantize(precision)
                .map_err(|e| SlideSparseError::Backend(format!("{name}: {e}")))?;
            quantized.push(name.to_string());
        }
        Ok(())
    })?;
    Ok(quantized)
}

/// Prunes every dense linear layer of `model` for which `method_for(name)` gives a method
/// to `pattern`, keeping it trainable under the mask ([`MaskedLinear`]); returns the names
/// masked. Pack the fine-tuned model afterwards with [`sparsify`].
pub fn mask_with<B: Backend, M: VisitLinears<B>>(
    model: &mut M,
    pattern: SparsityPattern,
    method_for: impl Fn(&str) -> Option<PruneMethod>,
) -> Result<Vec<String>> {
    let mut masked = Vec::new();
    model.visit_linears(&mut |name, layer| {
        if let Some(method) = method_for(name).filter(|_| layer.dense().is_some()) {
            layer
                .mask(pattern, &method)
                .map_err(|e| SlideSparseError::Backend(format!("{name}: {e}")))?;
            masked.push(name.to_string());
        }
        Ok(())
    })?;
    Ok(masked)
}
