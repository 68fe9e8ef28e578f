//! A strict GGUF (v2/v3) reader: metadata, tensor directory, and F32 / F16 / BF16 / Q8_0 /
//! Q4_0 / Q4_1 / Q5_0 / Q5_1 and the k-quants Q2_K / Q3_K / Q4_K / Q5_K / Q6_K / Q8_K tensors
//! dequantized to f32 (each tensor may have its own type, as in a `Q4_K_M` file). Every count, length and offset is checked against
//! the bytes actually present before it is used, so a malformed file is an error, never a
//! panic or an allocation sized by a header value.

use std::collections::HashMap;

use half::{bf16, f16};

use crate::error::{Result, SlideSparseError};

const MAGIC: &[u8; 4] = b"GGUF";
const DEFAULT_ALIGNMENT: u64 = 32;
/// Most dimensions a GGUF tensor may have (ggml's limit).
const MAX_DIMS: u32 = 4;
/// Values per k-quant super-block.
const QK_K: usize = 256;

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
    /// 5-bit blocks of 32 with one f16 scale.
    Q5_0,
    /// 5-bit blocks of 32 with an f16 scale and minimum.
    Q5_1,
    /// 8-bit blocks of 32 with one f16 scale.
    Q8_0,
    /// 2-bit super-blocks of 256: 16 sub-blocks with 4-bit scales and minimums.
    Q2K,
    /// 3-bit super-blocks of 256: 16 sub-blocks with 6-bit signed scales.
    Q3K,
    /// 4-bit super-blocks of 256: 8 sub-blocks with 6-bit scales and minimums.
    Q4K,
    /// 5-bit super-blocks of 256: 8 sub-blocks with 6-bit scales and minimums.
    Q5K,
    /// 6-bit super-blocks of 256: 16 sub-blocks with 8-bit signed scales.
    Q6K,
    /// 8-bit super-blocks of 256 with one f32 scale.
    Q8K,
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
            6 => GgmlType::Q5_0,
            7 => GgmlType::Q5_1,
            8 => GgmlType::Q8_0,
            10 => GgmlType::Q2K,
            11 => GgmlType::Q3K,
            12 => GgmlType::Q4K,
            13 => GgmlType::Q5K,
            14 => GgmlType::Q6K,
            15 => GgmlType::Q8K,
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
            GgmlType::Q5_0 => Some((32, 22)),
            GgmlType::Q5_1 => Some((32, 24)),
            GgmlType::Q8_0 => Some((32, 34)),
            GgmlType::Q2K => Some((QK_K, 84)),
            GgmlType::Q3K => Some((QK_K, 110)),
            GgmlType::Q4K => Some((QK_K, 144)),
            GgmlType::Q5K => Some((QK_K, 176)),
            GgmlType::Q6K => Some((QK_K, 210)),
            GgmlType::Q8K => Some((QK_K, 292)),
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
            GgmlType::F16 => data.chunks_exact(2).map(|c| f16_at(c, 0)).collect(),
            GgmlType::Bf16 => data
                .chunks_exact(2)
                .map(|c| bf16::from_le_bytes([c[0], c[1]]).to_f32())
                .collect(),
            GgmlType::Q8_0 => dequantize_blocks(data, 34, 32, |b, out| {
                let d = f16_at(b, 0);
                for (o, &q) in out.iter_mut().zip(&b[2..34]) {
                    *o = d * q as i8 as f32;
                }
            }),
            GgmlType::Q4_0 => dequantize_blocks(data, 18, 32, |b, out| {
                let d = f16_at(b, 0);
                for (j, &q) in b[2..18].iter().enumerate() {
                    out[j] = d * ((q & 0x0F) as f32 - 8.0);
                    out[j + 16] = d * ((q >> 4) as f32 - 8.0);
                }
            }),
            GgmlType::Q4_1 => dequantize_blocks(data, 20, 32, |b, out| {
                let (d, m) = (f16_at(b, 0), f16_at(b, 2));
                for (j, &q) in b[4..20].iter().enumerate() {
                    out[j] = d * (q & 0x0F) as f32 + m;
                    out[j + 16] = d * (q >> 4) as f32 + m;
                }
            }),
            GgmlType::Q5_0 => dequantize_blocks(data, 22, 32, |b, out| {
                let d = f16_at(b, 0);
                let high = u32::from_le_bytes([b[2], b[3], b[4], b[5]]);
                for (j, &q) in b[6..22].iter().enumerate() {
                    let (lo, hi) = q5_codes(q, high, j);
                    out[j] = d * (lo as f32 - 16.0);
                    out[j + 16] = d * (hi as f32 - 16.0);
                }
            }),
            GgmlType::Q5_1 => dequantize_blocks(data, 24, 32, |b, out| {
                let (d, m) = (f16_at(b, 0), f16_at(b, 2));
                let high = u32::from_le_bytes([b[4], b[5], b[6], b[7]]);
                for (j, &q) in b[8..24].iter().enumerate() {
                    let (lo, hi) = q5_codes(q, high, j);
                    out[j] = d * lo as f32 + m;
                    out[j + 16] = d * hi as f32 + m;
                }
            }),
            GgmlType::Q2K => dequantize_blocks(data, 84, QK_K, dequantize_q2_k),
            GgmlType::Q3K => dequantize_blocks(data, 110, QK_K, dequantize_q3_k),
            GgmlType::Q4K => dequantize_blocks(data, 144, QK_K, dequantize_q4_k),
            GgmlType::Q5K => dequantize_blocks(data, 176, QK_K, dequantize_q5_k),
            GgmlType::Q6K => dequantize_blocks(data, 210, QK_K, dequantize_q6_k),
            GgmlType::Q8K => dequantize_blocks(data, 292, QK_K, |b, out| {
                // An f32 scale (not f16, unlike the other types), 256 codes, then 16 sums
                // of the codes that only matter to ggml's dot products.
                let d = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
                for (o, &q) in out.iter_mut().zip(&b[4..4 + QK_K]) {
                    *o = d * q as i8 as f32;
                }
            }),
            GgmlType::Other(id) => {
                return Err(SlideSparseError::UnsupportedDtype {
                    name: name.to_string(),
                    dtype: format!("ggml type {id}"),
                    context: SUPPORTED_TYPES.into(),
                });
            }
        };
        Ok((values, info.shape()))
    }
}

/// The tensor types [`GgufFile::tensor_f32`] reads, for error messages.
pub const SUPPORTED_TYPES: &str =
    "supported: F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, Q8_K";

fn f16_at(b: &[u8], at: usize) -> f32 {
    f16::from_le_bytes([b[at], b[at + 1]]).to_f32()
}

/// The two 5-bit codes of byte `j` of a Q5_0 / Q5_1 block: its low nibble (element `j`) and
/// high nibble (element `j + 16`), each with its fifth bit from the 32-bit `high` mask (bit
/// `j` for element `j`, bit `j + 16` for element `j + 16`).
fn q5_codes(q: u8, high: u32, j: usize) -> (u8, u8) {
    let lo = (q & 0x0F) | ((((high >> j) & 1) as u8) << 4);
    let hi = (q >> 4) | ((((high >> (j + 16)) & 1) as u8) << 4);
    (lo, hi)
}

/// Q2_K: 16 bytes of sub-block scales (low nibble: scale, high nibble: minimum, each times the
/// f16 super-scales `d` / `dmin` at bytes 80 / 82), then 64 bytes of 2-bit codes. The 256
/// values are two halves of 128; in half `n`, the four 32-value runs `j` take bits `2j..2j+2`
/// of code bytes `32n..32n+32`, and each 16 values have their own sub-block (`8n + 2j` and
/// `8n + 2j + 1`). Value = `d * scale * code - dmin * min`.
fn dequantize_q2_k(b: &[u8], out: &mut [f32]) {
    let (scales, codes) = (&b[0..16], &b[16..80]);
    let (d, dmin) = (f16_at(b, 80), f16_at(b, 82));
    for (i, o) in out.iter_mut().enumerate() {
        let (n, j, l) = (i / 128, (i % 128) / 32, i % 32);
        let sub = scales[8 * n + 2 * j + l / 16];
        let code = (codes[32 * n + l] >> (2 * j)) & 3;
        *o = d * (sub & 0x0F) as f32 * code as f32 - dmin * (sub >> 4) as f32;
    }
}

/// Q3_K: a 32-byte high-bit mask, 64 bytes of 2-bit low codes (laid out as in Q2_K), 12
/// bytes holding sixteen 6-bit scales, and the f16 super-scale at byte 108. Scale `s`: low 4
/// bits are the low nibble of byte `s` (s < 8) or the high nibble of byte `s - 8`; its top 2
/// bits are bits `2 * (s / 4)..` of byte `8 + s % 4`; it is stored offset by 32. The high
/// bit of value `i` (run `r = i / 32` of 8, position `l`) is bit `r` of mask byte `l`; when
/// it is clear, 4 is subtracted from the 2-bit code. Value = `d * (scale - 32) * code`.
fn dequantize_q3_k(b: &[u8], out: &mut [f32]) {
    let (mask, codes, packed) = (&b[0..32], &b[32..96], &b[96..108]);
    let d = f16_at(b, 108);
    let scales: [f32; 16] = std::array::from_fn(|s| {
        let low = if s < 8 {
            packed[s] & 0x0F
        } else {
            packed[s - 8] >> 4
        };
        let high = (packed[8 + s % 4] >> (2 * (s / 4))) & 3;
        ((low | (high << 4)) as i32 - 32) as f32
    });
    for (i, o) in out.iter_mut().enumerate() {
        let (n, j, l) = (i / 128, (i % 128) / 32, i % 32);
        let low = ((codes[32 * n + l] >> (2 * j)) & 3) as i32;
        let high_set = mask[l] & (1 << (i / 32)) != 0;
        let code = low - if high_set { 0 } else { 4 };
        *o = d * scales[8 * n + 2 * j + l / 16] * code as f32;
    }
}

/// The 6-bit scale and minimum of sub-block `s` (0..8) from the 12 packed bytes of Q4_K /
/// Q5_K: for s < 4 the low 6 bits of byte `s` (scale) and of byte `s + 4` (minimum); for
/// s >= 4 a nibble of byte `s + 4` (low: scale, high: minimum) below the top 2 bits of byte
/// `s - 4` (scale) or of byte `s` (minimum).
fn scale_min_k4(packed: &[u8], s: usize) -> (f32, f32) {
    let (scale, min) = if s < 4 {
        (packed[s] & 63, packed[s + 4] & 63)
    } else {
        (
            (packed[s + 4] & 0x0F) | ((packed[s - 4] >> 6) << 4),
            (packed[s + 4] >> 4) | ((packed[s] >> 6) << 4),
        )
    };
    (scale as f32, min as f32)
}

/// Q4_K: f16 `d` and `dmin`, 12 bytes of packed 6-bit scales / minimums (eight sub-blocks
/// of 32), then 128 bytes of 4-bit codes: each 64 values `c` take code bytes `32c..32c+32`,
/// low nibbles for the first 32 (sub-block `2c`), high nibbles for the next 32 (`2c + 1`).
/// Value = `d * scale * code - dmin * min`.
fn dequantize_q4_k(b: &[u8], out: &mut [f32]) {
    let (d, dmin) = (f16_at(b, 0), f16_at(b, 2));
    let (packed, codes) = (&b[4..16], &b[16..144]);
    let scale_min: [(f32, f32); 8] = std::array::from_fn(|s| scale_min_k4(packed, s));
    for (i, o) in out.iter_mut().enumerate() {
        let (sub, l) = (i / 32, i % 32);
        let byte = codes[32 * (sub / 2) + l];
        let code = if sub % 2 == 0 { byte & 0x0F } else { byte >> 4 };
        let (scale, min) = scale_min[sub];
        *o = d * scale * code as f32 - dmin * min;
    }
}

/// Q5_K: as Q4_K, with 32 bytes of fifth bits (`qh`) between the scales and the 4-bit codes:
/// value `i` of sub-block `sub` (position `l`) takes bit `sub` of byte `l`.
fn dequantize_q5_k(b: &[u8], out: &mut [f32]) {
    let (d, dmin) = (f16_at(b, 0), f16_at(b, 2));
    let (packed, high, codes) = (&b[4..16], &b[16..48], &b[48..176]);
    let scale_min: [(f32, f32); 8] = std::array::from_fn(|s| scale_min_k4(packed, s));
    for (i, o) in out.iter_mut().enumerate() {
        let (sub, l) = (i / 32, i % 32);
        let byte = codes[32 * (sub / 2) + l];
        let low = if sub % 2 == 0 { byte & 0x0F } else { byte >> 4 };
        let code = low | (((high[l] >> sub) & 1) << 4);
        let (scale, min) = scale_min[sub];
        *o = d * scale * code as f32 - dmin * min;
    }
}

/// Q6_K: 128 bytes of low nibbles (`ql`), 64 bytes of 2-bit high parts (`qh`), sixteen
/// signed 8-bit scales (one per 16 values), the f16 super-scale at byte 208. In half `n` of
/// 128 values, quarter `q` (32 values, position `l`) takes the low (q = 0, 1) or high
/// (q = 2, 3) nibble of `ql[64n + 32 * (q % 2) + l]` and bits `2q..2q+2` of `qh[32n + l]`;
/// the 6-bit code is stored offset by 32. Value = `d * scale * (code - 32)`.
fn dequantize_q6_k(b: &[u8], out: &mut [f32]) {
    let (low, high, scales) = (&b[0..128], &b[128..192], &b[192..208]);
    let d = f16_at(b, 208);
    for (i, o) in out.iter_mut().enumerate() {
        let (n, q, l) = (i / 128, (i % 128) / 32, i % 32);
        let byte = low[64 * n + 32 * (q % 2) + l];
        let nibble = if q < 2 { byte & 0x0F } else { byte >> 4 };
        let code = (nibble | (((high[32 * n + l] >> (2 * q)) & 3) << 4)) as i32 - 32;
        let scale = scales[i / 16] as i8;
        *o = d * scale as f32 * code as f32;
    }
}

/// Dequantizes blocks of `per_block` values stored in `block_bytes` each, in parallel.
fn dequantize_blocks(
    data: &[u8],
    block_bytes: usize,
    per_block: usize,
    block: impl Fn(&[u8], &mut [f32]) + Sync,
) -> Vec<f32> {
    use rayon::prelude::*;
    let mut out = vec![0f32; data.len() / block_bytes * per_block];
    out.par_chunks_mut(per_block)
        .zip(data.par_chunks_exact(block_bytes))
        .for_each(|(o, b)| block(b, o));
    out
}
