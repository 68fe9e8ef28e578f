//! A strict GGUF (v2/v3) reader: metadata, tensor directory, and F32 / F16 / BF16 / Q8_0 /
//! Q4_0 / Q4_1 tensors dequantized to f32. Every count, length and offset is checked against
//! the bytes actually present before it is used, so a malformed file is an error, never a
//! panic or an allocation sized by a header value.

use std::collections::HashMap;

use half::{bf16, f16};

use crate::error::{Result, SlideSparseError};

const MAGIC: &[u8; 4] = b"GGUF";
const DEFAULT_ALIGNMENT: u64 = 32;
/// Most dimensions a GGUF tensor may have (ggml's limit).
const MAX_DIMS: u32 = 4;

/// A metadata value.
#[derive(Clone, Debug, PartialEq)]
pub enum GgufValue {
    /// `uint8`.
    U8(u8),
    /// `int8`.
    I8(i8),
    /// `uint16`.
    U16(u16),
    /// `int16`.
    I16(i16),
    /// `uint32`.
    U32(u32),
    /// `int32`.
    I32(i32),
    /// `uint64`.
    U64(u64),
    /// `int64`.
    I64(i64),
    /// `float32`.
    F32(f32),
    /// `float64`.
    F64(f64),
    /// `bool`.
    Bool(bool),
    /// A UTF-8 string.
    String(String),
    /// An array (of one value type).
    Array(Vec<GgufValue>),
}

impl GgufValue {
    /// The value as an unsigned integer, if it is one.
    pub fn as_u64(&self) -> Option<u64> {
        match *self {
            GgufValue::U8(v) => Some(v as u64),
            GgufValue::U16(v) => Some(v as u64),
            GgufValue::U32(v) => Some(v as u64),
            GgufValue::U64(v) => Some(v),
            GgufValue::I8(v) => u64::try_from(v).ok(),
            GgufValue::I16(v) => u64::try_from(v).ok(),
            GgufValue::I32(v) => u64::try_from(v).ok(),
            GgufValue::I64(v) => u64::try_from(v).ok(),
            _ => None,
        }
    }

    /// The value as a float, if it is a number.
    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            GgufValue::F32(v) => Some(v as f64),
            GgufValue::F64(v) => Some(v),
            _ => self.as_u64().map(|v| v as f64),
        }
    }

    /// The value as a string, if it is one.
    pub fn as_str(&self) -> Option<&str> {
        match self {
            GgufValue::String(s) => Some(s),
            _ => None,
        }
    }
}

/// Tensor element types this reader dequantizes (ggml type ids).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GgmlType {
    /// 32-bit float.
    F32,
    /// IEEE half.
    F16,
    /// 4-bit blocks of 32 with one f16 scale.
    Q4_0,
    /// 4-bit blocks of 32 with an f16 scale and minimum.
    Q4_1,
    /// 8-bit blocks of 32 with one f16 scale.
    Q8_0,
    /// bfloat16.
    Bf16,
    /// Any other ggml type: listed, but reading it is an error.
    Other(u32),
}

impl GgmlType {
    fn from_id(id: u32) -> Self {
        match id {
            0 => GgmlType::F32,
            1 => GgmlType::F16,
            2 => GgmlType::Q4_0,
            3 => GgmlType::Q4_1,
            8 => GgmlType::Q8_0,
            30 => GgmlType::Bf16,
            other => GgmlType::Other(other),
        }
    }

    /// (elements per block, bytes per block).
    fn block(&self) -> Option<(usize, usize)> {
        match self {
            GgmlType::F32 => Some((1, 4)),
            GgmlType::F16 | GgmlType::Bf16 => Some((1, 2)),
            GgmlType::Q4_0 => Some((32, 18)),
            GgmlType::Q4_1 => Some((32, 20)),
            GgmlType::Q8_0 => Some((32, 34)),
            GgmlType::Other(_) => None,
        }
    }
}

/// One entry of the tensor directory.
#[derive(Clone, Debug, PartialEq)]
pub struct GgufTensorInfo {
    /// Tensor name.
    pub name: String,
    /// ggml order: `dims[0]` is the innermost (contiguous) dimension.
    pub dims: Vec<u64>,
    /// Element (or block) type.
    pub ggml_type: GgmlType,
    /// Absolute byte range in the file (checked to lie inside it, for known types).
    pub start: usize,
    /// Byte length of the tensor data.
    pub len: usize,
}

impl GgufTensorInfo {
    /// The shape in row-major (PyTorch) order: `dims` reversed.
    pub fn shape(&self) -> Vec<usize> {
        self.dims.iter().rev().map(|&d| d as usize).collect()
    }

    /// Number of elements.
    pub fn elements(&self) -> usize {
        self.dims.iter().map(|&d| d as usize).product()
    }
}

/// A parsed GGUF file (borrowing its bytes).
#[derive(Debug)]
pub struct GgufFile<'a> {
    /// GGUF format version (2 or 3).
    pub version: u32,
    /// Key-value metadata.
    pub metadata: HashMap<String, GgufValue>,
    /// The tensor directory, in file order.
    pub tensors: Vec<GgufTensorInfo>,
    bytes: &'a [u8],
    path: String,
}

/// Bounds-checked little-endian cursor.
struct Cursor<'a> {
    bytes: &'a [u8],
    pos: usize,
    path: &'a str,
}

impl<'a> Cursor<'a> {
    fn err(&self, detail: impl Into<String>) -> SlideSparseError {
        SlideSparseError::InvalidGguf {
            path: self.path.to_string(),
            detail: format!("at byte {}: {}", self.pos, detail.into()),
        }
    }

    fn take(&mut self, n: usize) -> Result<&'a [u8]> {
        let end = self.pos.checked_add(n).filter(|&e| e <= self.bytes.len());
        match end {
            Some(end) => {
                let out = &self.bytes[self.pos..end];
                self.pos = end;
                Ok(out)
            }
            None => Err(self.err(format!(
                "truncated: needs {n} more bytes, {} left",
                self.remaining()
            ))),
        }
    }

    fn remaining(&self) -> usize {
        self.bytes.len() - self.pos
    }

    fn array<const N: usize>(&mut self) -> Result<[u8; N]> {
        Ok(self.take(N)?.try_into().expect("length checked"))
    }

    fn u32(&mut self) -> Result<u32> {
        Ok(u32::from_le_bytes(self.array()?))
    }

    fn u64(&mut self) -> Result<u64> {
        Ok(u64::from_le_bytes(self.array()?))
    }

    /// A count of items each at least `min_size` bytes: bounded by the bytes left.
    fn count(&mut self, min_size: usize, what: &str) -> Result<usize> {
        let n = self.u64()?;
        if n > (self.remaining() / min_size.max(1)) as u64 {
            return Err(self.err(format!("{what} count {n} exceeds what the file can hold")));
        }
        Ok(n as usize)
    }

    fn string(&mut self) -> Result<String> {
        let len = self.count(1, "string length")?;
        let raw = self.take(len)?;
        String::from_utf8(raw.to_vec()).map_err(|_| self.err("string is not UTF-8"))
    }

    fn value(&mut self, type_id: u32, depth: u32) -> Result<GgufValue> {
        Ok(match type_id {
            0 => GgufValue::U8(self.array::<1>()?[0]),
            1 => GgufValue::I8(self.array::<1>()?[0] as i8),
            2 => GgufValue::U16(u16::from_le_bytes(self.array()?)),
            3 => GgufValue::I16(i16::from_le_bytes(self.array()?)),
            4 => GgufValue::U32(self.u32()?),
            5 => GgufValue::I32(i32::from_le_bytes(self.array()?)),
            6 => GgufValue::F32(f32::from_le_bytes(self.array()?)),
            7 => match self.array::<1>()?[0] {
                0 => GgufValue::Bool(false),
                1 => GgufValue::Bool(true),
                b => return Err(self.err(format!("bool byte {b}"))),
            },
            8 => GgufValue::String(self.string()?),
            9 => {
                if depth > 2 {
                    return Err(self.err("arrays nested too deeply"));
                }
                let item_type = self.u32()?;
                let count = self.count(1, "array")?;
                let mut items = Vec::with_capacity(count.min(1 << 20));
                for _ in 0..count {
                    items.push(self.value(item_type, depth + 1)?);
                }
                GgufValue::Array(items)
            }
            10 => GgufValue::U64(self.u64()?),
            11 => GgufValue::I64(i64::from_le_bytes(self.array()?)),
            12 => GgufValue::F64(f64::from_le_bytes(self.array()?)),
            other => return Err(self.err(format!("unknown metadata value type {other}"))),
        })
    }
}

impl<'a> GgufFile<'a> {
    /// Parses the header and tensor directory; `path` is only for messages.
    pub fn parse(path: &str, bytes: &'a [u8]) -> Result<Self> {
        let mut c = Cursor {
            bytes,
            pos: 0,
            path,
        };
        if c.take(4)
            .map_err(|_| c.err("not a GGUF file (too short)"))?
            != MAGIC
        {
            return Err(c.err("not a GGUF file (bad magic)"));
        }
        let version = c.u32()?;
        if !(2..=3).contains(&version) {
            return Err(c.err(format!("GGUF version {version} is not supported (2 or 3)")));
        }
        // A tensor entry takes at least 8 + 4 + 8 + 4 + 8 bytes, a metadata entry 8 + 4 + 1.
        let tensor_count = c.count(32, "tensor")?;
        let kv_count = c.count(13, "metadata")?;
        let mut metadata = HashMap::with_capacity(kv_count);
        for _ in 0..kv_count {
            let key = c.string()?;
            let type_id = c.u32()?;
            let value = c.value(type_id, 0)?;
            if metadata.insert(key.clone(), value).is_some() {
                return Err(c.err(format!("metadata key {key:?} appears twice")));
            }
        }
        let mut infos = Vec::with_capacity(tensor_count);
        let mut names = std::collections::HashSet::new();
        for _ in 0..tensor_count {
            let name = c.string()?;
            let n_dims = c.u32()?;
            if n_dims == 0 || n_dims > MAX_DIMS {
                return Err(c.err(format!(
                    "tensor {name:?} has {n_dims} dimensions (1..=4 allowed)"
                )));
            }
            let dims = (0..n_dims).map(|_| c.u64()).collect::<Result<Vec<_>>>()?;
            let ggml_type = GgmlType::from_id(c.u32()?);
            let offset = c.u64()?;
            if !names.insert(name.clone()) {
                return Err(c.err(format!("tensor {name:?} is listed twice")));
            }
            infos.push((name, dims, ggml_type, offset));
        }
        let alignment = match metadata.get("general.alignment") {
            None => DEFAULT_ALIGNMENT,
            Some(v) => v
                .as_u64()
                .filter(|a| a.is_power_of_two())
                .ok_or_else(|| c.err("general.alignment is not a power of two"))?,
        };
        let data_start = (c.pos as u64).next_multiple_of(alignment);
        let mut tensors = Vec::with_capacity(infos.len());
        for (name, dims, ggml_type, offset) in infos {
            let bad = |detail: String| SlideSparseError::InvalidGguf {
                path: path.to_string(),
                detail: format!("tensor {name:?}: {detail}"),
            };
            let elements = dims
                .iter()
                .try_fold(1u64, |a, &d| a.checked_mul(d))
                .ok_or_else(|| bad(format!("dimensions {dims:?} overflow")))?;
            let (start, len) = match ggml_type.block() {
                Some((per_block, block_bytes)) => {
                    if dims[0] % per_block as u64 != 0 {
                        return Err(bad(format!(
                            "row length {} is not a multiple of the block size {per_block}",
                            dims[0]
                        )));
                    }
                    let len = (elements / per_block as u64)
                        .checked_mul(block_bytes as u64)
                        .ok_or_else(|| bad("size overflows".into()))?;
                    let start = data_start
                        .checked_add(offset)
                        .ok_or_else(|| bad("offset overflows".into()))?;
                    let end = start
                        .checked_add(len)
                        .ok_or_else(|| bad("offset overflows".into()))?;
                    if end > bytes.len() as u64 {
                        return Err(bad(format!(
                            "data [{start}, {end}) lies past the end of the file ({} bytes)",
                            bytes.len()
                        )));
                    }
                    (start as usize, len as usize)
                }
                None => (0, 0),
            };
            tensors.push(GgufTensorInfo {
                name,
                dims,
                ggml_type,
                start,
                len,
            });
        }
        Ok(Self {
            version,
            metadata,
            tensors,
            bytes,
            path: path.to_string(),
        })
    }

    /// The directory entry of a tensor.
    pub fn tensor(&self, name: &str) -> Result<&GgufTensorInfo> {
        self.tensors.iter().find(|t| t.name == name).ok_or_else(|| {
            SlideSparseError::MissingTensor {
                name: name.to_string(),
                path: self.path.clone(),
            }
        })
    }

    /// A tensor dequantized to f32, row-major in [`GgufTensorInfo::shape`] order.
    pub fn tensor_f32(&self, name: &str) -> Result<(Vec<f32>, Vec<usize>)> {
        let info = self.tensor(name)?;
        let data = &self.bytes[info.start..info.start + info.len];
        let values = match info.ggml_type {
            GgmlType::F32 => data
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes(c.try_into().expect("4")))
                .collect(),
            GgmlType::F16 => data
                .chunks_exact(2)
                .map(|c| f16::from_le_bytes([c[0], c[1]]).to_f32())
                .collect(),
            GgmlType::Bf16 => data
                .chunks_exact(2)
                .map(|c| bf16::from_le_bytes([c[0], c[1]]).to_f32())
                .collect(),
            GgmlType::Q8_0 => dequantize_blocks(data, 34, |b, out| {
                let d = f16::from_le_bytes([b[0], b[1]]).to_f32();
                for (o, &q) in out.iter_mut().zip(&b[2..34]) {
                    *o = d * q as i8 as f32;
                }
            }),
            GgmlType::Q4_0 => dequantize_blocks(data, 18, |b, out| {
                let d = f16::from_le_bytes([b[0], b[1]]).to_f32();
                for (j, &q) in b[2..18].iter().enumerate() {
                    out[j] = d * ((q & 0x0F) as f32 - 8.0);
                    out[j + 16] = d * ((q >> 4) as f32 - 8.0);
                }
            }),
            GgmlType::Q4_1 => dequantize_blocks(data, 20, |b, out| {
                let d = f16::from_le_bytes([b[0], b[1]]).to_f32();
                let m = f16::from_le_bytes([b[2], b[3]]).to_f32();
                for (j, &q) in b[4..20].iter().enumerate() {
                    out[j] = d * (q & 0x0F) as f32 + m;
                    out[j + 16] = d * (q >> 4) as f32 + m;
                }
            }),
            GgmlType::Other(id) => {
                return Err(SlideSparseError::UnsupportedDtype {
                    name: name.to_string(),
                    dtype: format!("ggml type {id}"),
                    context: "supported: F32, F16, BF16, Q8_0, Q4_0, Q4_1".into(),
                });
            }
        };
        Ok((values, info.shape()))
    }
}

/// Dequantizes 32-element blocks of `block_bytes` each.
fn dequantize_blocks(
    data: &[u8],
    block_bytes: usize,
    block: impl Fn(&[u8], &mut [f32]) + Sync,
) -> Vec<f32> {
    use rayon::prelude::*;
    let mut out = vec![0f32; data.len() / block_bytes * 32];
    out.par_chunks_mut(32)
        .zip(data.par_chunks_exact(block_bytes))
        .for_each(|(o, b)| block(b, o));
    out
}
