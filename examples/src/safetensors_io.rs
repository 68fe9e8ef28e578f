//! Writing plain safetensors files (Hugging Face checkpoints: f32 weights, and the u32 input
//! orders a fine-tuned mask holds in) for the examples, atomically:
//! a temporary file in the same folder, synced, then renamed. Reading one is the library's
//! `read_f32`; packed SlideSparse files have their own API (`PackedFile::load`,
//! `PackedFile::save`, `save_layers`).

use std::{collections::HashMap, io::Write, path::Path};

use burn_slidesparse::SlideSparseError;
use safetensors::{Dtype, View};

/// A tensor to write: its name, shape (row-major), type and little-endian bytes.
pub struct F32Tensor {
    /// The tensor's name in the file.
    pub name: String,
    /// Its shape.
    pub shape: Vec<usize>,
    dtype: Dtype,
    bytes: Vec<u8>,
}

impl F32Tensor {
    /// An f32 tensor of `values` with `shape`.
    pub fn new(name: impl Into<String>, shape: Vec<usize>, values: Vec<f32>) -> Self {
        Self {
            name: name.into(),
            shape,
            dtype: Dtype::F32,
            bytes: values.iter().flat_map(|v| v.to_le_bytes()).collect(),
        }
    }

    /// A u32 tensor (an input order a layer's mask holds in) of `values` with `shape`.
    pub fn u32(name: impl Into<String>, shape: Vec<usize>, values: &[u32]) -> Self {
        Self {
            name: name.into(),
            shape,
            dtype: Dtype::U32,
            bytes: values.iter().flat_map(|v| v.to_le_bytes()).collect(),
        }
    }
}

/// One tensor as safetensors sees it.
struct F32View<'a> {
    shape: &'a [usize],
    dtype: Dtype,
    bytes: &'a [u8],
}

impl View for &F32View<'_> {
    fn dtype(&self) -> Dtype {
        self.dtype
    }
    fn shape(&self) -> &[usize] {
        self.shape
    }
    fn data(&self) -> std::borrow::Cow<'_, [u8]> {
        std::borrow::Cow::Borrowed(self.bytes)
    }
    fn data_len(&self) -> usize {
        self.bytes.len()
    }
}

/// Writes `tensors` as a safetensors file at `path`, atomically.
pub fn write_f32_safetensors(path: &Path, tensors: &[F32Tensor]) -> Result<(), SlideSparseError> {
    let views: Vec<(&str, F32View<'_>)> = tensors
        .iter()
        .map(|t| {
            (
                t.name.as_str(),
                F32View {
                    shape: &t.shape,
                    dtype: t.dtype,
                    bytes: &t.bytes,
                },
            )
        })
        .collect();
    let bytes = safetensors::serialize(
        views.iter().map(|(name, view)| (*name, view)),
        None::<HashMap<String, String>>,
    )
    .map_err(|source| SlideSparseError::SafeTensors {
        path: path.display().to_string(),
        source,
    })?;
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy())
        .unwrap_or_default();
    let tmp = path.with_file_name(format!(".{name}.tmp-{}", std::process::id()));
    let written = (|| {
        let mut file = std::fs::File::create(&tmp)?;
        file.write_all(&bytes)?;
        file.sync_all()?;
        std::fs::rename(&tmp, path)
    })();
    written.map_err(|e| {
        // The write already failed; that error is the one to report.
        let _ = std::fs::remove_file(&tmp);
        SlideSparseError::io(path, e)
    })
}
