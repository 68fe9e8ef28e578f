//! The sizes of a causal attention call, checked once ([`AttentionShape`]), and the head
//! dim of a fused `[q | k | v]` projection ([`qkv_head_dim`]): what both the attention API
//! and the CUDA kernels' host side check shapes with.

use crate::error::{Result, SlideSparseError};

/// The sizes of one attention call, checked.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AttentionShape {
    /// Sequences.
    pub batch: usize,
    /// Queries per sequence (at positions `kv_len - tq .. kv_len`).
    pub tq: usize,
    /// Query heads.
    pub hq: usize,
    /// Key/value heads (`hq` is a multiple).
    pub hkv: usize,
    /// Head dim.
    pub d: usize,
    /// Cache positions in use (`tq <= kv_len <=` the key length).
    pub kv_len: usize,
}

impl AttentionShape {
    /// Checks `q [batch, tq, hq, d]` against `k`, `v` `[batch, capacity, hkv, d]` and
    /// `kv_len` (`None`: the whole capacity).
    pub fn new(q: [usize; 4], k: [usize; 4], v: [usize; 4], kv_len: Option<usize>) -> Result<Self> {
        let [batch, tq, hq, d] = q;
        if k != v {
            return Err(SlideSparseError::shape(
                "attention value shape",
                format!("{k:?}"),
                format!("{v:?}"),
            ));
        }
        let [kb, cap, hkv, kd] = k;
        if kb != batch || kd != d {
            return Err(SlideSparseError::shape(
                "attention key shape (batch, _, _, head dim)",
                format!("[{batch}, _, _, {d}]"),
                format!("{k:?}"),
            ));
        }
        if hkv == 0 || hq % hkv != 0 {
            return Err(SlideSparseError::shape(
                "attention key/value heads (a divisor of the query heads)",
                format!("a divisor of {hq}"),
                hkv,
            ));
        }
        let kv_len = kv_len.unwrap_or(cap);
        if kv_len > cap || tq > kv_len || tq == 0 || batch == 0 || d == 0 {
            return Err(SlideSparseError::shape(
                "attention lengths (0 < queries <= kv_len <= key length)",
                format!("0 < {tq} <= kv_len <= {cap}"),
                kv_len,
            ));
        }
        Ok(Self {
            batch,
            tq,
            hq,
            hkv,
            d,
            kv_len,
        })
    }

    /// Query heads per key/value head.
    pub fn group(&self) -> usize {
        self.hq / self.hkv
    }

    /// The multiply-adds of the visible (causal) scores, times 4: the FLOPs of `QK^T` and
    /// `PV` that a causal kernel does (benchmarks report TFLOP/s from it).
    pub fn causal_flops(&self) -> f64 {
        let start = (self.kv_len - self.tq) as f64;
        let t = self.tq as f64;
        let visible = t * start + t * (t + 1.0) / 2.0;
        4.0 * visible * (self.d * self.hq * self.batch) as f64
    }

    /// Bytes of K and V in use (what decode must read at least).
    pub fn kv_bytes(&self, element_bytes: usize) -> f64 {
        (2 * self.batch * self.kv_len * self.hkv * self.d * element_bytes) as f64
    }
}

/// The head dim of a fused `[q | k | v]` projection output `width` values wide, with `hq`
/// query and `hkv` key/value heads: `width / (hq + 2 hkv)`, which must be whole and even
/// (RoPE rotates pairs), with `hkv` dividing `hq`.
pub(crate) fn qkv_head_dim(width: usize, (hq, hkv): (usize, usize)) -> Result<usize> {
    let heads = hq + 2 * hkv;
    if hkv == 0
        || !hq.is_multiple_of(hkv)
        || !width.is_multiple_of(heads)
        || !(width / heads).is_multiple_of(2)
    {
        return Err(SlideSparseError::shape(
            "qkv width ((hq + 2 hkv) x an even head dim, hkv dividing hq)",
            format!("({hq} + 2 x {hkv}) x d"),
            width,
        ));
    }
    Ok(width / heads)
}
