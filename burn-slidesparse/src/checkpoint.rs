//! Packing whole checkpoints: every selected 2-D linear weight of a safetensors file is
//! packed, every other tensor is copied unchanged.

use std::{path::Path, time::Instant};

use regex::Regex;
use safetensors::SafeTensors;
use serde::Serialize;

use crate::{
    error::{Result, SlideSparseError},
    files::map_file,
    format::{self, LayerMeta, OwnedTensor, PERMUTATION_SUFFIX, PackedFile},
    pack::{PackOptions, PackStats, pack_linear, prune_and_quantize},
    permute::{ChannelPermutation, InputPermutation, PermutationSearch, search_permutation},
    prune::PruneMethod,
    weight_quant::quantize_weight,
};

/// Default selection: every `*.weight` matrix except embeddings, norms and the LM head.
pub const DEFAULT_LAYER_FILTER: &str = r"\.weight$";
/// Names never packed by default (embeddings, norms, output head).
pub const DEFAULT_EXCLUDE: &str = r"(embed|norm|lm_head|wte|wpe)";

/// Which tensors of a checkpoint to pack.
#[derive(Clone, Debug)]
pub struct LayerSelection {
    include: Regex,
    exclude: Option<Regex>,
}

impl LayerSelection {
    /// `include` selects tensor names; with `None`, the default selection applies.
    pub fn new(include: Option<&str>) -> Result<Self> {
        let compile = |pattern: &str| {
            Regex::new(pattern).map_err(|source| SlideSparseError::Regex {
                pattern: pattern.to_string(),
                source,
            })
        };
        Ok(match include {
            Some(p) => Self {
                include: compile(p)?,
                exclude: None,
            },
            None => Self {
                include: compile(DEFAULT_LAYER_FILTER)?,
                exclude: Some(compile(DEFAULT_EXCLUDE)?),
            },
        })
    }

    /// Whether a 2-D tensor of this name is packed.
    pub fn selects(&self, name: &str) -> bool {
        self.include.is_match(name) && !self.exclude.as_ref().is_some_and(|e| e.is_match(name))
    }
}

/// The JSON report of a `pack` run.
#[derive(Clone, Debug, Serialize)]
pub struct PackReport {
    /// The checkpoint packed.
    pub input: String,
    /// The packed file written.
    pub output: String,
    /// How every selected layer was packed.
    pub options: PackOptions,
    /// One entry per packed layer, in name order.
    pub layers: Vec<PackStats>,
    /// Tensors copied unchanged (embeddings, norms, biases of unpacked layers, ...).
    pub copied_tensors: usize,
    /// Size of the input checkpoint.
    pub input_bytes: u64,
    /// Size of the packed file.
    pub output_bytes: u64,
    /// Wall time of the whole run.
    pub seconds: f64,
    /// Input bytes over wall time.
    pub megabytes_per_second: f64,
}

fn parse<'a>(path: &Path, bytes: &'a [u8]) -> Result<SafeTensors<'a>> {
    format::reject_duplicate_names(&path.display().to_string(), bytes)?;
    SafeTensors::deserialize(bytes).map_err(|source| SlideSparseError::SafeTensors {
        path: path.display().to_string(),
        source,
    })
}

/// Where a [`pack_checkpoint_with_progress`] run stands: about to pack `layer`, with
/// `done_bytes` of the selected weights' `total_bytes` packed so far.
#[derive(Clone, Copy, Debug)]
pub struct PackProgress<'a> {
    /// The tensor about to be packed.
    pub layer: &'a str,
    /// Bytes of the selected weights packed so far.
    pub done_bytes: u64,
    /// Bytes of all selected weights.
    pub total_bytes: u64,
}

/// Packs a checkpoint `input` into `output` (written atomically; never over the input).
pub fn pack_checkpoint(
    input: &Path,
    output: &Path,
    selection: &LayerSelection,
    options: &PackOptions,
) -> Result<PackReport> {
    pack_checkpoint_with_progress(input, output, selection, options, |_| {})
}

/// [`pack_checkpoint`], calling `progress` before each selected layer (e.g. to drive a
/// progress bar, as the `slidesparse` CLI does).
pub fn pack_checkpoint_with_progress(
    input: &Path,
    output: &Path,
    selection: &LayerSelection,
    options: &PackOptions,
    mut progress: impl FnMut(PackProgress<'_>),
) -> Result<PackReport> {
    options.validate()?;
    refuse_overwriting_input(input, output)?;
    let start = Instant::now();
    let mmap = map_file(input)?;
    let st = parse(input, &mmap)?;
    let mut names: Vec<String> = st.names().into_iter().map(String::from).collect();
    names.sort();
    let selected: Vec<&String> = names
        .iter()
        .filter(|n| selection.selects(n) && st.tensor(n).is_ok_and(|t| t.shape().len() == 2))
        .collect();
    let total_bytes: u64 = selected
        .iter()
        .map(|n| st.tensor(n).map_or(0, |t| t.data().len() as u64))
        .sum();
    let mut done_bytes = 0;

    let mut layer_metas = Vec::new();
    let mut stats = Vec::new();
    let mut tensors: Vec<(String, OwnedTensor)> = Vec::new();
    let mut packed_prefixes = std::collections::HashSet::new();
    let orders = layer_orders(&st, &selected, options, &mut |layer| {
        progress(PackProgress {
            layer,
            done_bytes: 0,
            total_bytes,
        })
    })?;
    for name in &selected {
        let view = st.tensor(name).expect("listed above");
        progress(PackProgress {
            layer: name,
            done_bytes,
            total_bytes,
        });
        let [rows, cols] = [view.shape()[0], view.shape()[1]];
        let weight = format::read_f32(name, &view)?;
        let bias_name = format!("{}.bias", format::prefix_of(name));
        let bias = match st.tensor(&bias_name) {
            Ok(b) if b.shape() == [rows] => Some(format::read_f32(&bias_name, &b)?),
            _ => None,
        };
        let layer_options = match orders.get(name.as_str()) {
            Some(order) => PackOptions {
                permutation: ChannelPermutation::Given(order.clone()),
                ..options.clone()
            },
            None => options.clone(),
        };
        let (packed, _, layer_stats) =
            pack_linear(name, &weight, rows, cols, bias.as_deref(), &layer_options)?;
        let (mut meta, layer_tensors) = format::layer_tensors(&packed)?;
        meta.prune = Some(options.prune.to_string());
        packed_prefixes.insert(meta.prefix.clone());
        layer_metas.push(meta);
        tensors.extend(layer_tensors);
        stats.push(layer_stats);
        done_bytes += view.data().len() as u64;
    }

    let mut copied = 0;
    for name in &names {
        let is_packed_weight = selected.contains(&name);
        let is_packed_part = [".bias", PERMUTATION_SUFFIX].iter().any(|s| {
            name.strip_suffix(s)
                .is_some_and(|p| packed_prefixes.contains(p))
        });
        if is_packed_weight || is_packed_part {
            continue;
        }
        let view = st.tensor(name).expect("listed above");
        tensors.push((
            name.clone(),
            OwnedTensor {
                dtype: view.dtype(),
                shape: view.shape().to_vec(),
                data: view.data().to_vec(),
            },
        ));
        copied += 1;
    }
    let bytes = format::serialize(&tensors, format::file_metadata(&layer_metas))?;
    format::write_atomically(output, &bytes)?;
    let seconds = start.elapsed().as_secs_f64();
    Ok(PackReport {
        input: input.display().to_string(),
        output: output.display().to_string(),
        options: options.clone(),
        layers: stats,
        copied_tensors: copied,
        input_bytes: mmap.len() as u64,
        output_bytes: bytes.len() as u64,
        seconds,
        megabytes_per_second: mmap.len() as f64 / 1e6 / seconds.max(1e-9),
    })
}

/// The key of the input a linear reads, for sharing one permutation: the projections of a
/// transformer block that read the same hidden state (`q_proj`/`k_proj`/`v_proj` and
/// `gate_proj`/`up_proj` of one block, or Meta's `wq`/`wk`/`wv` and `w1`/`w3`) map to one
/// key, so that they can still be fused after packing; every other weight is its own group.
pub fn input_group(name: &str) -> String {
    const GROUPS: [(&[&str], &str); 2] = [
        (
            &["q_proj", "k_proj", "v_proj", "wq", "wk", "wv"],
            "qkv_proj",
        ),
        (&["gate_proj", "up_proj", "w1", "w3"], "gate_up_proj"),
    ];
    let prefix = format::prefix_of(name);
    let (parent, last) = prefix.rsplit_once('.').unwrap_or(("", &prefix));
    match GROUPS.iter().find(|(members, _)| members.contains(&last)) {
        Some((_, key)) => format!("{parent}.{key}"),
        None => prefix.clone(),
    }
}

/// The input order of every selected layer that has one: the order stored next to the
/// weight in the checkpoint (`P.slidesparse.input_permutation`, written by a tool that
/// pruned the weight in it, e.g. before fine-tuning), else, with
/// [`ChannelPermutation::Search`], one order per [`input_group`] searched over all its
/// layers with `options.prune`'s scores. `searching` is called with each group's name.
fn layer_orders(
    st: &SafeTensors<'_>,
    selected: &[&String],
    options: &PackOptions,
    searching: &mut dyn FnMut(&str),
) -> Result<std::collections::HashMap<String, InputPermutation>> {
    let mut orders = std::collections::HashMap::new();
    for name in selected {
        let stored = format!("{}{PERMUTATION_SUFFIX}", format::prefix_of(name));
        if let Ok(view) = st.tensor(&stored) {
            orders.insert(name.to_string(), format::read_order(&stored, &view)?);
        }
    }
    let ChannelPermutation::Search(search) = &options.permutation else {
        return Ok(orders);
    };
    let mut groups: Vec<(String, Vec<&String>)> = Vec::new();
    for name in selected.iter().filter(|n| !orders.contains_key(n.as_str())) {
        let key = input_group(name);
        match groups.iter_mut().find(|(k, _)| *k == key) {
            Some((_, members)) => members.push(name),
            None => groups.push((key, vec![name])),
        }
    }
    for (key, members) in groups {
        searching(&key);
        let order = search_group(st, &key, &members, options, search)?;
        for name in members {
            orders.insert(name.to_string(), order.clone());
        }
    }
    Ok(orders)
}

/// One order for the layers `members` (reading one input), scored with `options.prune`.
fn search_group(
    st: &SafeTensors<'_>,
    key: &str,
    members: &[&String],
    options: &PackOptions,
    search: &PermutationSearch,
) -> Result<InputPermutation> {
    let mut weights = Vec::new();
    for name in members {
        let view = st.tensor(name).expect("selected from the file");
        weights.push((
            format::read_f32(name, &view)?,
            view.shape()[0],
            view.shape()[1],
        ));
    }
    let cols = weights[0].2;
    if let Some((_, _, c)) = weights.iter().find(|w| w.2 != cols) {
        return Err(SlideSparseError::shape(
            format!("{key}: input width of the layers sharing an input"),
            cols,
            *c,
        ));
    }
    let layers: Vec<(&[f32], usize, &crate::prune::PruneMethod)> = weights
        .iter()
        .map(|(w, rows, _)| (w.as_slice(), *rows, &options.prune))
        .collect();
    Ok(search_permutation(key, &layers, cols, options.pattern, search)?.permutation)
}

fn refuse_overwriting_input(input: &Path, output: &Path) -> Result<()> {
    let same = match (input.canonicalize(), output.canonicalize()) {
        (Ok(a), Ok(b)) => a == b,
        _ => input == output,
    };
    if same {
        return Err(SlideSparseError::OutputIsInput(output.to_path_buf()));
    }
    Ok(())
}

/// Outcome of verifying one packed file.
#[derive(Clone, Debug, Serialize)]
pub struct VerifyReport {
    /// Packed layers found valid (2:4 windows, exact un-slide).
    pub layers: usize,
    /// Layers also checked against the original checkpoint (0 without one).
    pub checked_against_original: usize,
}

/// Checks every packed layer (2:4 validity, exact un-slide) and, with `original`, that each
/// un-slides to the pruned, quantized original weight.
pub fn verify_checkpoint(packed: &Path, original: Option<&Path>) -> Result<VerifyReport> {
    let bytes = std::fs::read(packed).map_err(|e| SlideSparseError::io(packed, e))?;
    let path = packed.display().to_string();
    let file = PackedFile::from_bytes(&path, &bytes)?;
    let mut checked = 0;
    if let Some(original) = original {
        let (_, header) =
            SafeTensors::read_metadata(&bytes).map_err(|source| SlideSparseError::SafeTensors {
                path: path.clone(),
                source,
            })?;
        let metas = format::read_layer_metas(&path, header.metadata())?;
        let mmap = map_file(original)?;
        let st = parse(original, &mmap)?;
        for (meta, layer) in metas.iter().zip(&file.layers) {
            if verify_layer_against(original, &st, meta, layer)? {
                checked += 1;
            }
        }
    }
    Ok(VerifyReport {
        layers: file.layers.len(),
        checked_against_original: checked,
    })
}

/// Whether the layer could be checked against the original: a SparseGPT layer's kept weights
/// were rewritten from calibration data that the files do not hold, so only its structure
/// (checked by the packed file's reader) is verified.
fn verify_layer_against(
    original: &Path,
    st: &SafeTensors<'_>,
    meta: &LayerMeta,
    layer: &crate::pack::PackedLinear,
) -> Result<bool> {
    if meta.prune.as_deref() == Some("sparsegpt") {
        return Ok(false);
    }
    let view = st
        .tensor(&meta.source_tensor)
        .map_err(|_| SlideSparseError::MissingTensor {
            name: meta.source_tensor.clone(),
            path: original.display().to_string(),
        })?;
    let expected_shape = [meta.out_features, meta.in_features];
    if view.shape() != expected_shape {
        return Err(SlideSparseError::shape(
            &meta.source_tensor,
            expected_shape,
            view.shape(),
        ));
    }
    let weight = format::read_f32(&meta.source_tensor, &view)?;
    let expected = match meta.prune.as_deref() {
        Some("magnitude") | Some("none") => {
            let options = PackOptions {
                pattern: meta.pattern,
                precision: meta.precision,
                prune: meta
                    .prune
                    .as_deref()
                    .unwrap_or("none")
                    .parse::<PruneMethod>()?,
                alignment: meta.alignment,
                // Pruned in the file's order, redone in it.
                permutation: layer
                    .input_permutation
                    .clone()
                    .map_or(ChannelPermutation::Identity, ChannelPermutation::Given),
            };
            prune_and_quantize(
                &meta.source_tensor,
                &weight,
                meta.out_features,
                meta.in_features,
                &options,
            )?
        }
        // Pruned with information not in the file (calibration norms): check against the
        // original restricted to the kept positions.
        _ => {
            let kept = layer.unslide()?.codes.to_f32();
            let masked: Vec<f32> = weight
                .iter()
                .zip(&kept)
                .map(|(&w, &k)| if k != 0.0 { w } else { 0.0 })
                .collect();
            quantize_weight(&masked, meta.out_features, meta.in_features, meta.precision)
        }
    };
    layer.verify_against(&expected).map(|()| true)
}
