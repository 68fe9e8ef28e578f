//! The portable packed format: a safetensors file.
//!
//! Per packed layer with source weight `P.weight` (prefix `P`):
//! - its codes in the compact layout (version 3, [`WeightLayout::Compact`]):
//!   `P.slidesparse.kept`, the `2N-2` kept codes of every block of `2N` (`[out, blocks *
//!   (2N-2)]` as `I8`, `U8` (E4M3 bits), `BF16`, `F16` or `F32`), and
//!   `P.slidesparse.zero_pairs`, each block's pair of zero positions as its rank packed to
//!   `ceil(log2 C(2N, 2))` bits (`U8 [out, bytes per row]`); or, as versions 1 and 2 store
//!   them ([`WeightLayout::Slid`]), `P.slidesparse.weight`, the slid `W' [out, K']`;
//! - `P.slidesparse.weight_scale`: `F32 [out]`;
//! - `P.bias` (optional, any float dtype): the layer's bias under its usual name;
//! - `P.slidesparse.input_permutation` (optional, version 2): `U32 [K]` (`I32` accepted on
//!   read), the order of the input channels the layer was pruned in.
//!
//! File metadata: `slidesparse.format_version` (written `3`; `2`, slid weights, and `1`, the
//! same without permutations, are read too) and `slidesparse.layers`, a JSON list of
//! [`LayerMeta`]. Every other tensor of a packed checkpoint is copied unchanged.
//! Loading checks every field, the compact layout's ranks and the 2:4 validity of each `W'`
//! it gives, and fails with an error naming the file and tensor, never with a panic; a layer
//! read from either layout is the same [`PackedLinear`] (its slid codes).

mod layout;

pub use layout::{KEPT_SUFFIX, WeightLayout, ZERO_PAIRS_SUFFIX};

use std::{collections::HashMap, path::Path};

use half::{bf16, f16};
use safetensors::{Dtype, SafeTensors, tensor::TensorView};
use serde::{Deserialize, Serialize};

// The GPU algorithm cache (`cuda/algo_cache.rs`) imports it from here.
pub(crate) use crate::files::write_atomically;
use crate::{
    error::{Result, SlideSparseError},
    pack::{PackedLinear, check_alignment},
    pattern::SparsityPattern,
    permute::InputPermutation,
    weight_quant::{Precision, QuantizedWeight, WeightCodes},
};

/// Version written by this crate (3: the compact weight layout). Readers accept it, version
/// 2 (slid weights, optional input permutations) and version 1 (the same without
/// permutations), and reject any other.
pub const FORMAT_VERSION: u32 = 3;
/// Versions this crate reads.
pub const READ_VERSIONS: [u32; 3] = [1, 2, 3];
/// The first version that may store a layer in the compact layout.
pub const COMPACT_SINCE: u32 = 3;
/// Metadata key of the format version.
pub const VERSION_KEY: &str = "slidesparse.format_version";
/// Metadata key of the layer list.
pub const LAYERS_KEY: &str = "slidesparse.layers";
/// Largest layer dimension a packed file may declare (2^31).
pub const MAX_DIMENSION: usize = 1 << 31;
/// Suffix of a packed weight tensor in the slid layout (versions 1 and 2).
pub const WEIGHT_SUFFIX: &str = ".slidesparse.weight";
/// Suffix of a packed layer's scales.
pub const SCALE_SUFFIX: &str = ".slidesparse.weight_scale";
/// Suffix of a packed layer's input permutation (version 2).
pub const PERMUTATION_SUFFIX: &str = ".slidesparse.input_permutation";

/// Description of one packed layer in the file metadata.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct LayerMeta {
    /// Prefix of the layer's tensors (the source weight name without `.weight`).
    pub prefix: String,
    /// Name of the dense weight this layer was packed from.
    pub source_tensor: String,
    /// The `(2N-2):2N` pattern.
    pub pattern: SparsityPattern,
    /// Element type of the stored `W'`.
    pub precision: Precision,
    /// Output width.
    pub out_features: usize,
    /// Original K.
    pub in_features: usize,
    /// K'.
    pub k_prime: usize,
    /// Alignment of `K'`.
    pub alignment: usize,
    /// Whether a bias tensor is stored.
    pub bias: bool,
    /// How the weight was pruned (`magnitude`, `activation-aware`, `sparsegpt` or `none`), so
    /// that `verify --against` can redo it (`sparsegpt` rewrote the kept weights: not
    /// checked against the original).
    #[serde(default)]
    pub prune: Option<String>,
    /// Whether an input permutation tensor is stored (version 2; absent in version 1: no).
    #[serde(default)]
    pub input_permutation: bool,
    /// How the weight codes are stored (version 3; absent in versions 1 and 2: slid).
    #[serde(default)]
    pub layout: WeightLayout,
}

impl LayerMeta {
    /// Metadata of a packed layer.
    pub fn of(layer: &PackedLinear) -> Self {
        Self {
            prefix: prefix_of(&layer.name),
            source_tensor: layer.name.clone(),
            pattern: layer.pattern,
            precision: layer.precision(),
            out_features: layer.out_features(),
            in_features: layer.in_features,
            k_prime: layer.k_prime(),
            alignment: layer.alignment,
            bias: layer.bias.is_some(),
            prune: None,
            input_permutation: layer.input_permutation.is_some(),
            layout: WeightLayout::Compact,
        }
    }
}

/// The prefix of a weight name: `a.b.weight` -> `a.b`; other names are kept whole.
pub fn prefix_of(weight_name: &str) -> String {
    weight_name
        .strip_suffix(".weight")
        .unwrap_or(weight_name)
        .to_string()
}

/// A tensor owned in memory, to be written to safetensors.
#[derive(Clone, Debug)]
pub struct OwnedTensor {
    /// Element type of `data`.
    pub dtype: Dtype,
    /// Shape, row-major.
    pub shape: Vec<usize>,
    /// Little-endian element bytes.
    pub data: Vec<u8>,
}

impl safetensors::View for &OwnedTensor {
    fn dtype(&self) -> Dtype {
        self.dtype
    }
    fn shape(&self) -> &[usize] {
        &self.shape
    }
    fn data(&self) -> std::borrow::Cow<'_, [u8]> {
        std::borrow::Cow::Borrowed(&self.data)
    }
    fn data_len(&self) -> usize {
        self.data.len()
    }
}

fn dtype_of(precision: Precision) -> Dtype {
    match precision {
        Precision::Int8 => Dtype::I8,
        Precision::Fp8 => Dtype::U8,
        Precision::Bf16 => Dtype::BF16,
        Precision::F16 => Dtype::F16,
        Precision::F32 => Dtype::F32,
    }
}

/// Little-endian bytes of f32 values.
pub fn f32_bytes(values: &[f32]) -> Vec<u8> {
    values.iter().flat_map(|v| v.to_le_bytes()).collect()
}

/// The tensors and metadata entry that store one packed layer, its weight in the compact
/// layout (what [`save_layers`] writes).
pub fn layer_tensors(layer: &PackedLinear) -> Result<(LayerMeta, Vec<(String, OwnedTensor)>)> {
    layer_tensors_in(layer, WeightLayout::Compact)
}

/// [`layer_tensors`] with the weight in the given layout (`Slid`: as versions 1 and 2 store
/// it, for files an older reader must open).
pub fn layer_tensors_in(
    layer: &PackedLinear,
    layout: WeightLayout,
) -> Result<(LayerMeta, Vec<(String, OwnedTensor)>)> {
    let meta = LayerMeta {
        layout,
        ..LayerMeta::of(layer)
    };
    let rows = layer.out_features();
    let mut tensors = match layout {
        WeightLayout::Compact => layout::compact_tensors(layer, &meta.prefix)?.to_vec(),
        WeightLayout::Slid => vec![(
            format!("{}{WEIGHT_SUFFIX}", meta.prefix),
            OwnedTensor {
                dtype: dtype_of(layer.precision()),
                shape: vec![rows, layer.k_prime()],
                data: layer.weight.codes.to_le_bytes(),
            },
        )],
    };
    tensors.push((
        format!("{}{SCALE_SUFFIX}", meta.prefix),
        OwnedTensor {
            dtype: Dtype::F32,
            shape: vec![rows],
            data: f32_bytes(&layer.weight.scales),
        },
    ));
    if let Some(bias) = &layer.bias {
        tensors.push((
            format!("{}.bias", meta.prefix),
            OwnedTensor {
                dtype: Dtype::F32,
                shape: vec![rows],
                data: f32_bytes(bias),
            },
        ));
    }
    if let Some(p) = &layer.input_permutation {
        tensors.push((
            format!("{}{PERMUTATION_SUFFIX}", meta.prefix),
            OwnedTensor {
                dtype: Dtype::U32,
                shape: vec![p.len()],
                data: p.as_slice().iter().flat_map(|v| v.to_le_bytes()).collect(),
            },
        ));
    }
    Ok((meta, tensors))
}

/// The file metadata for a list of layers (the version written: [`FORMAT_VERSION`]).
pub fn file_metadata(layers: &[LayerMeta]) -> HashMap<String, String> {
    HashMap::from([
        (VERSION_KEY.to_string(), FORMAT_VERSION.to_string()),
        (
            LAYERS_KEY.to_string(),
            serde_json::to_string(layers).expect("layer metadata serializes"),
        ),
    ])
}

/// Serializes tensors plus metadata to bytes.
pub fn serialize(
    tensors: &[(String, OwnedTensor)],
    metadata: HashMap<String, String>,
) -> Result<Vec<u8>> {
    safetensors::serialize(tensors.iter().map(|(n, t)| (n.as_str(), t)), Some(metadata)).map_err(
        |source| SlideSparseError::SafeTensors {
            path: "<memory>".into(),
            source,
        },
    )
}

/// Writes packed layers (and nothing else) to `path`, atomically (a temporary file in the
/// same folder, synced, then renamed); [`PackedFile::load`] reads them back.
pub fn save_layers(path: &Path, layers: &[PackedLinear]) -> Result<()> {
    write_atomically(path, &file_bytes(layers)?)
}

/// The bytes of a packed file holding `layers`.
fn file_bytes(layers: &[PackedLinear]) -> Result<Vec<u8>> {
    let mut metas = Vec::new();
    let mut tensors = Vec::new();
    for layer in layers {
        let (meta, t) = layer_tensors(layer)?;
        metas.push(meta);
        tensors.extend(t);
    }
    serialize(&tensors, file_metadata(&metas))
}

/// A packed file read into memory and checked.
#[derive(Debug)]
pub struct PackedFile {
    /// The packed layers, in the file's order.
    pub layers: Vec<PackedLinear>,
}

impl PackedFile {
    /// Reads and fully checks a packed file (memory-mapped: the host holds the parsed
    /// layers, not a second copy of the file).
    pub fn load(path: &Path) -> Result<Self> {
        let bytes = crate::files::map_file(path)?;
        Self::from_bytes(&path.display().to_string(), &bytes)
    }

    /// Parses and fully checks a packed file held in memory; `path` is only for messages.
    pub fn from_bytes(path: &str, bytes: &[u8]) -> Result<Self> {
        reject_duplicate_names(path, bytes)?;
        let (_, header) =
            SafeTensors::read_metadata(bytes).map_err(|source| SlideSparseError::SafeTensors {
                path: path.to_string(),
                source,
            })?;
        let st =
            SafeTensors::deserialize(bytes).map_err(|source| SlideSparseError::SafeTensors {
                path: path.to_string(),
                source,
            })?;
        let metas = read_layer_metas(path, header.metadata())?;
        let layers = metas
            .iter()
            .map(|meta| read_layer(path, &st, meta))
            .collect::<Result<Vec<_>>>()?;
        Ok(Self { layers })
    }

    /// The file's bytes (what [`save`](Self::save) writes), e.g. to store elsewhere than in
    /// a local file; [`from_bytes`](Self::from_bytes) parses them back.
    pub fn to_bytes(&self) -> Result<Vec<u8>> {
        file_bytes(&self.layers)
    }

    /// Writes the layers to `path` as [`save_layers`] does.
    pub fn save(&self, path: &Path) -> Result<()> {
        save_layers(path, &self.layers)
    }

    /// The layer packed from `source_tensor` (or with that prefix).
    pub fn layer(&self, name: &str) -> Option<&PackedLinear> {
        self.layers
            .iter()
            .find(|l| l.name == name || prefix_of(&l.name) == name)
    }
}

/// Rejects a safetensors header that names a tensor twice. JSON parsers (and so the
/// safetensors crate) silently keep the last of duplicated keys; a file like that is
/// ambiguous, so it is an error here. Other header problems are left to the safetensors
/// parser, which reports them.
pub fn reject_duplicate_names(path: &str, bytes: &[u8]) -> Result<()> {
    struct UniqueKeys;
    impl<'de> serde::de::Visitor<'de> for UniqueKeys {
        type Value = Option<String>;
        fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
            f.write_str("a JSON object")
        }
        fn visit_map<A: serde::de::MapAccess<'de>>(
            self,
            mut map: A,
        ) -> std::result::Result<Self::Value, A::Error> {
            // Consume the whole map (serde_json checks that it ends) and report the first
            // duplicate.
            let (mut seen, mut duplicate) = (std::collections::HashSet::new(), None);
            while let Some(key) = map.next_key::<String>()? {
                map.next_value::<serde::de::IgnoredAny>()?;
                if !seen.insert(key.clone()) && duplicate.is_none() {
                    duplicate = Some(key);
                }
            }
            Ok(duplicate)
        }
    }
    let Some(len) = bytes
        .get(..8)
        .map(|b| u64::from_le_bytes(b.try_into().expect("8 bytes")))
    else {
        return Ok(()); // too short: the safetensors parser reports it
    };
    let Some(header) = usize::try_from(len)
        .ok()
        .and_then(|n| bytes.get(8..8usize.checked_add(n)?))
    else {
        return Ok(());
    };
    let mut de = serde_json::Deserializer::from_slice(header);
    if let Ok(Some(name)) = serde::Deserializer::deserialize_map(&mut de, UniqueKeys) {
        return Err(SlideSparseError::packed(
            path,
            format!("tensor {name:?} is listed twice in the header"),
        ));
    }
    Ok(())
}

/// Reads and checks the version and layer list of a packed file's metadata.
pub fn read_layer_metas(
    path: &str,
    metadata: &Option<HashMap<String, String>>,
) -> Result<Vec<LayerMeta>> {
    let bad = |detail: String| SlideSparseError::packed(path, detail);
    let metadata = metadata
        .as_ref()
        .ok_or_else(|| bad("no metadata: not a SlideSparse packed file".into()))?;
    let version = metadata
        .get(VERSION_KEY)
        .ok_or_else(|| bad(format!("no {VERSION_KEY}: not a SlideSparse packed file")))?;
    let Some(version) = version
        .trim()
        .parse::<u32>()
        .ok()
        .filter(|v| READ_VERSIONS.contains(v))
    else {
        return Err(bad(format!(
            "format version {version:?} is not supported (this build reads versions \
             {READ_VERSIONS:?})"
        )));
    };
    let layers = metadata
        .get(LAYERS_KEY)
        .ok_or_else(|| bad(format!("no {LAYERS_KEY} entry")))?;
    let metas: Vec<LayerMeta> =
        serde_json::from_str(layers).map_err(|e| bad(format!("invalid {LAYERS_KEY}: {e}")))?;
    let mut seen = std::collections::HashSet::new();
    for m in &metas {
        if !seen.insert(m.prefix.as_str()) {
            return Err(bad(format!("layer {:?} is listed twice", m.prefix)));
        }
        if m.layout == WeightLayout::Compact && version < COMPACT_SINCE {
            return Err(bad(format!(
                "layer {:?} is stored compact, which format version {version} does not have \
                 (version {COMPACT_SINCE} and later)",
                m.prefix
            )));
        }
    }
    Ok(metas)
}

fn tensor<'a>(path: &str, st: &SafeTensors<'a>, name: &str) -> Result<TensorView<'a>> {
    st.tensor(name)
        .map_err(|_| SlideSparseError::MissingTensor {
            name: name.to_string(),
            path: path.to_string(),
        })
}

fn check_tensor_shape(name: &str, view: &TensorView<'_>, expected: &[usize]) -> Result<()> {
    if view.shape() != expected {
        return Err(SlideSparseError::shape(name, expected, view.shape()));
    }
    Ok(())
}

/// Reads a safetensors tensor of a float dtype (F32, F16, BF16) as f32 values, as the packer
/// reads a checkpoint's weights (for [`pack_linear`](crate::pack_linear) of a tensor of
/// one's own); another dtype is [`SlideSparseError::UnsupportedDtype`] naming `name`.
pub fn read_f32(name: &str, view: &TensorView<'_>) -> Result<Vec<f32>> {
    let data = view.data();
    Ok(match view.dtype() {
        Dtype::F32 => data
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect(),
        Dtype::F16 => data
            .chunks_exact(2)
            .map(|c| f16::from_le_bytes([c[0], c[1]]).to_f32())
            .collect(),
        Dtype::BF16 => data
            .chunks_exact(2)
            .map(|c| bf16::from_le_bytes([c[0], c[1]]).to_f32())
            .collect(),
        other => {
            return Err(SlideSparseError::UnsupportedDtype {
                name: name.to_string(),
                dtype: format!("{other:?}"),
                context: "expected F32, F16 or BF16".into(),
            });
        }
    })
}

fn read_codes(name: &str, view: &TensorView<'_>, precision: Precision) -> Result<WeightCodes> {
    let data = view.data();
    let ok = matches!(
        (precision, view.dtype()),
        (Precision::Int8, Dtype::I8)
            | (Precision::Fp8, Dtype::U8 | Dtype::F8_E4M3)
            | (Precision::Bf16, Dtype::BF16)
            | (Precision::F16, Dtype::F16)
            | (Precision::F32, Dtype::F32)
    );
    if !ok {
        return Err(SlideSparseError::UnsupportedDtype {
            name: name.to_string(),
            dtype: format!("{:?}", view.dtype()),
            context: format!("layer metadata says precision {precision}"),
        });
    }
    Ok(match precision {
        Precision::Int8 => WeightCodes::I8(data.iter().map(|&b| b as i8).collect()),
        Precision::Fp8 => WeightCodes::Fp8(data.to_vec()),
        Precision::Bf16 => WeightCodes::Bf16(
            data.chunks_exact(2)
                .map(|c| bf16::from_le_bytes([c[0], c[1]]))
                .collect(),
        ),
        Precision::F16 => WeightCodes::F16(
            data.chunks_exact(2)
                .map(|c| f16::from_le_bytes([c[0], c[1]]))
                .collect(),
        ),
        Precision::F32 => WeightCodes::F32(read_f32(name, view)?),
    })
}

fn read_layer(path: &str, st: &SafeTensors<'_>, meta: &LayerMeta) -> Result<PackedLinear> {
    let bad = |detail: String| {
        SlideSparseError::packed(path, format!("layer {:?}: {detail}", meta.prefix))
    };
    check_alignment(meta.alignment, meta.precision).map_err(|e| bad(e.to_string()))?;
    // Bound the sizes before any arithmetic on them (no overflow, no absurd allocation).
    for (what, value) in [
        ("in_features", meta.in_features),
        ("out_features", meta.out_features),
        ("k_prime", meta.k_prime),
        ("alignment", meta.alignment),
    ] {
        if value > MAX_DIMENSION {
            return Err(bad(format!(
                "{what} = {value} exceeds the supported maximum {MAX_DIMENSION}"
            )));
        }
    }
    let geometry = meta.pattern.geometry(meta.in_features, meta.alignment);
    if meta.k_prime != geometry.k_prime() {
        return Err(bad(format!(
            "K' = {} but pattern {} with K = {} and alignment {} gives {}",
            meta.k_prime,
            meta.pattern,
            meta.in_features,
            meta.alignment,
            geometry.k_prime()
        )));
    }
    let codes = match meta.layout {
        WeightLayout::Compact => layout::read_compact(path, st, meta)?,
        WeightLayout::Slid => {
            let weight_name = format!("{}{WEIGHT_SUFFIX}", meta.prefix);
            let weight = tensor(path, st, &weight_name)?;
            check_tensor_shape(&weight_name, &weight, &[meta.out_features, meta.k_prime])?;
            read_codes(&weight_name, &weight, meta.precision)?
        }
    };

    let scale_name = format!("{}{SCALE_SUFFIX}", meta.prefix);
    let scales_view = tensor(path, st, &scale_name)?;
    check_tensor_shape(&scale_name, &scales_view, &[meta.out_features])?;
    if scales_view.dtype() != Dtype::F32 {
        return Err(SlideSparseError::UnsupportedDtype {
            name: scale_name,
            dtype: format!("{:?}", scales_view.dtype()),
            context: "scales are F32".into(),
        });
    }
    let scales = read_f32(&scale_name, &scales_view)?;

    let bias = if meta.bias {
        let bias_name = format!("{}.bias", meta.prefix);
        let view = tensor(path, st, &bias_name)?;
        check_tensor_shape(&bias_name, &view, &[meta.out_features])?;
        Some(read_f32(&bias_name, &view)?)
    } else {
        None
    };
    let layer = PackedLinear {
        name: meta.source_tensor.clone(),
        pattern: meta.pattern,
        in_features: meta.in_features,
        alignment: meta.alignment,
        weight: QuantizedWeight {
            rows: meta.out_features,
            cols: meta.k_prime,
            codes,
            scales,
        },
        bias,
        input_permutation: read_permutation(path, st, meta)?,
    };
    layer.validate().map_err(|e| bad(e.to_string()))?;
    Ok(layer)
}

/// The layer's input permutation, if its metadata says one is stored: `U32` or `I32 [K]`,
/// a permutation of `0..K`.
fn read_permutation(
    path: &str,
    st: &SafeTensors<'_>,
    meta: &LayerMeta,
) -> Result<Option<InputPermutation>> {
    if !meta.input_permutation {
        return Ok(None);
    }
    let name = format!("{}{PERMUTATION_SUFFIX}", meta.prefix);
    let view = tensor(path, st, &name)?;
    check_tensor_shape(&name, &view, &[meta.in_features])?;
    read_order(&name, &view)
        .map(Some)
        .map_err(|e| SlideSparseError::packed(path, e.to_string()))
}

/// An input permutation tensor (`U32` or `I32 [K]`) named `name`: a permutation of `0..K`.
pub fn read_order(name: &str, view: &TensorView<'_>) -> Result<InputPermutation> {
    if view.shape().len() != 1 {
        return Err(SlideSparseError::shape(name, "[K]", view.shape()));
    }
    let words = view
        .data()
        .chunks_exact(4)
        .map(|c| [c[0], c[1], c[2], c[3]]);
    let order: Vec<u32> = match view.dtype() {
        Dtype::U32 => words.map(u32::from_le_bytes).collect(),
        // A negative index is no channel: mapped past every valid one.
        Dtype::I32 => words
            .map(|w| u32::try_from(i32::from_le_bytes(w)).unwrap_or(u32::MAX))
            .collect(),
        other => {
            return Err(SlideSparseError::UnsupportedDtype {
                name: name.to_string(),
                dtype: format!("{other:?}"),
                context: "an input permutation is U32 (or I32)".into(),
            });
        }
    };
    InputPermutation::new(order).map_err(|e| match e {
        SlideSparseError::InvalidPermutation { detail } => SlideSparseError::InvalidPermutation {
            detail: format!("{name}: {detail}"),
        },
        other => other,
    })
}

#[cfg(test)]
mod tests {
    #[test]
    fn duplicate_tensor_names_are_found_anywhere_in_the_header() {
        for header in [
            &br#"{"a":{"x":1},"a":{"x":1}}  "#[..],
            &br#"{"__metadata__":{"k":"[{\"p\":1}]"},"a":{"x":[1,2]},"a":{"x":[1,2]},"b":{}}"#[..],
        ] {
            let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
            bytes.extend(header);
            let err = super::reject_duplicate_names("t", &bytes)
                .unwrap_err()
                .to_string();
            assert!(err.contains("\"a\" is listed twice"), "{err}");
        }
    }
}
