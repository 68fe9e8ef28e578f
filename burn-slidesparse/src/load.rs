//! Loading into a model: burn records with a check of the layer kinds ([`load_record`],
//! [`load_file`]: an error where burn's own `load_record` panics), and packed files into a
//! model's [`MaybeSparseLinear`](crate::MaybeSparseLinear) layers ([`load_packed`], [`load_packed_file`]: every layer
//! checked before any is replaced).

use std::{
    any::Any,
    collections::HashMap,
    panic::AssertUnwindSafe,
    path::{Path, PathBuf},
};

use burn::{
    module::{Module, ModuleVisitor},
    record::FileRecorder,
    tensor::backend::Backend,
};

use crate::{
    error::{Result, SlideSparseError},
    format::{PackedFile, prefix_of},
    maybe_sparse::VisitLinears,
    pack::PackedLinear,
    sparse_linear::SlideSparseLinear,
};

/// Loads `record` into `model`, like burn's `Module::load_record`, but returns an error where
/// burn would panic: when a [`MaybeSparseLinear`](crate::MaybeSparseLinear) of the record is another kind than the
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

/// `path=Kind` for every `MaybeSparseLinear` in `model`, for error messages.
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
        .map(|l| (prefix_of(&l.name), l))
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
