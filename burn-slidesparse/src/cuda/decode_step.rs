//! The kernels of a decode step that only its graph launches (`decode_graph.rs`): the
//! per-token quantization of the attention's output and of the SiLU-gated product
//! (`kernels/act_quant.cu`), the embedding gather and the greedy argmax that advances the
//! position on the device (`kernels/decode_step.cu`). Their parameter blocks, and the
//! functions of one device.

use std::{collections::HashMap, sync::Arc};

use cudarc::driver::sys;

use super::{
    nvrtc_module::{LoadedProgram, Program},
    runtime::PerDevice,
};
use crate::error::Result;

/// The program: the activations' quantization, the embedding and the argmax.
pub(super) const PROGRAM: Program = Program {
    name: "decode step",
    files: &["act_quant.cu", "decode_step.cu"],
    min_capability: (8, 0),
    arch_specific: false,
};

/// Threads of an `act_quant` CTA (`QUANT_THREADS`).
pub const QUANT_THREADS: u32 = 512;
/// The widest row `act_quant` holds: `8 * QUANT_CHUNKS * QUANT_THREADS`.
pub const QUANT_MAX_WIDTH: usize = 8 * 8 * 512;
/// Threads of an argmax CTA (`ARGMAX_THREADS`).
pub const ARGMAX_THREADS: u32 = 1024;
/// Threads of an embedding CTA.
pub const EMBED_THREADS: u32 = 256;

/// Must match `ActQuantParams` in `kernels/act_quant.cu`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct ActQuantParams {
    pub x: u64,
    pub out: u64,
    pub codes: u64,
    pub scales: u64,
    pub rows: i32,
    pub width: i32,
    pub codes_stride: i32,
}

/// Must match `EmbedParams` in `kernels/decode_step.cu`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct EmbedParams {
    pub tokens: u64,
    pub table: u64,
    pub out: u64,
    pub rows: i32,
    pub width: i32,
    pub vocab: i32,
}

/// Must match `ArgmaxParams` in `kernels/decode_step.cu`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct ArgmaxParams {
    pub logits: u64,
    pub tokens: u64,
    pub advance: u64,
    pub rows: i32,
    pub vocab: i32,
    pub by: i32,
}

/// The kernels of one 16-bit type.
#[derive(Clone, Copy)]
pub struct Functions {
    /// `quant_rows_*`: a row quantized as it is.
    pub quant_rows: sys::CUfunction,
    /// `silu_mul_quant_*`: `silu(gate) * up` of `[gate | up]`, quantized.
    pub silu_mul_quant: sys::CUfunction,
    /// `argmax_*`.
    pub argmax: sys::CUfunction,
    /// `embed_rows` (16-bit rows of either type).
    pub embed: sys::CUfunction,
}

/// The kernels of one device, by bf16.
struct Kernels(HashMap<bool, Functions>);

// SAFETY: function handles of a program loaded for the process, immutable after loading;
// launches use them with the device's context current.
unsafe impl Send for Kernels {}
// SAFETY: as above.
unsafe impl Sync for Kernels {}

/// The functions of device `index` for bf16 (or f16), compiled on first use.
pub fn functions(index: usize, bf16: bool) -> Result<Functions> {
    static KERNELS: PerDevice<Kernels> = PerDevice::new();
    let kernels: Arc<Kernels> = KERNELS.get_or_try_init(index, || {
        let program = LoadedProgram::load(index, &PROGRAM)?;
        let embed = program.function("embed_rows", 0)?;
        let mut by_type = HashMap::new();
        for (bf16, name) in [(true, "bf16"), (false, "f16")] {
            let of_type = Functions {
                quant_rows: program.function(&format!("quant_rows_{name}"), 0)?,
                silu_mul_quant: program.function(&format!("silu_mul_quant_{name}"), 0)?,
                argmax: program.function(&format!("argmax_{name}"), 0)?,
                embed,
            };
            by_type.insert(bf16, of_type);
        }
        Ok(Kernels(by_type))
    })?;
    Ok(kernels.0[&bf16])
}
