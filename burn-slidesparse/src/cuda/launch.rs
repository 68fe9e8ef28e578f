//! Launchers of the CubeCL kernels (`cubecl-kernels`) on burn's stream: the choice of kernel
//! variant, vector widths, cube layout and addressing for a given shape.

use burn::tensor::DType;
use cubecl::{
    CubeCount, CubeDim, calculate_cube_count_elemwise, e4m3, ir::AddressType, prelude::*,
    server::Handle,
};
use cubecl_kernels::{
    epilogue::{EPILOGUE_CUBE_DIM, dequant_bias_kernel},
    grouping::grouped_layout,
    quant_lift::{
        GroupedLayout, LiftMode, QUANT_CUBE_DIM, STAGE_BYTES, quant_lift_grouped_kernel,
        quant_lift_kernel,
    },
};
#[cfg(feature = "internals")]
use cubecl_kernels::grouping::{group_output_len, grouped_layout_with_units};
use half::{bf16, f16};

use super::{
    accumulator::{AccType, Accumulator},
    runtime::{Client, Runtime},
};
#[cfg(feature = "internals")]
use crate::error::SlideSparseError;
use crate::{error::Result, weight_quant::Precision};


fn lift_mode(precision: Precision) -> LiftMode {
    match precision {
        Precision::Int8 => LiftMode::Int8,
        Precision::Fp8 => LiftMode::Fp8,
        _ => LiftMode::Float,
    }
}

fn address_type(bytes: usize) -> AddressType {
    if bytes > (i32::MAX as usize) {
        AddressType::U64
    } else {
        AddressType::U32
    }
}

/// Input vector width (elements) of the quant kernel for elements of `elem_bytes`: 16 bytes
/// where `K` allows.
fn input_vector(k: usize, elem_bytes: usize) -> usize {
    let full = 16 / elem_bytes;
    [full, 4, 2, 1]
        .into_iter()
        .find(|v| k.is_multiple_of(*v))
        .unwrap_or(1)
}

/// Launches the quant+lift kernel: `X [m, k]` -> codes `[m_pad, k_out]` + scales `[m_pad]`.
/// `n == 0` is the dense baseline (no lift, `k_slide == k`). `k_out` must be a multiple of 4.
///
/// Rows of whole 16-byte vectors (every LLM shape) take [`fn@quant_lift_grouped_kernel`]; other
/// rows take [`fn@quant_lift_kernel`], which stages the row in shared memory when it fits in
/// [`STAGE_BYTES`] and reads it twice otherwise. Both write the same codes.
#[allow(clippy::too_many_arguments)]
pub fn launch_quant_lift(
    client: &Client,
    x: &Handle,
    codes: &Handle,
    scales: &Handle,
    dims: (usize, usize, usize, usize, usize),
    n: u32,
    precision: Precision,
    input: DType,
) -> Result<()> {
    launch_quant_lift_with(
        QuantKernel::Auto,
        client,
        x,
        codes,
        scales,
        dims,
        n,
        precision,
        input,
    )
}

/// Which quant+lift kernel [`launch_quant_lift_with`] runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum QuantKernel {
    /// The grouped kernel where the shape allows, else the row-staged one (the forward's choice).
    Auto,
    /// Always the row-staged kernel: for tests and benchmarks that compare the two.
    #[cfg(feature = "internals")]
    RowStaged,
    /// The grouped kernel with an explicit layout: `units` per cube (`None`: the default for
    /// the row), `rows_per_cube` rows per cube, whether a cube loads its next row ahead, and
    /// whether stores go through shared memory ([`GroupedLayout`]). Fails where the row does
    /// not allow it. For tests and benchmarks.
    #[cfg(feature = "internals")]
    Grouped {
        units: Option<u32>,
        rows_per_cube: usize,
        prefetch: bool,
        staged_stores: bool,
    },
}

/// Rows each cube of the grouped kernel handles by default: one. Loading the next row ahead
/// (several rows per cube) measured no faster on the H200 and needs twice the registers.
pub const ROWS_PER_CUBE: usize = 1;
/// Shared memory the grouped kernel may stage one round of stores in (bytes).
#[cfg(feature = "internals")]
const STAGED_STORE_BYTES: usize = 24 * 1024;

/// The forward's choice: the grouped kernel in its default layout where the row allows it
/// (with its rows per cube), or `None` for the row-staged kernel.
fn auto_layout(k: usize, n: u32, input_bytes: usize) -> Option<(GroupedLayout, usize)> {
    grouped_layout(k, n, input_bytes).map(|(units, per_unit)| {
        let layout = GroupedLayout {
            units: units as usize,
            groups_per_unit: per_unit,
            prefetch: false,
            // Direct stores: since the 8-bit codes travel as packed words, staging the
            // stores in shared memory measured 5% slower on the long rows and no faster
            // on the short ones (H200, docs/decisions/quant-lift-kernel-layout.md).
            staged_stores: false,
        };
        (layout, ROWS_PER_CUBE)
    })
}

/// The grouped kernel's layout that [`QuantKernel::Grouped`] asks for (`units`, rows per
/// cube, prefetch, staged stores), or why the row does not allow it.
#[cfg(feature = "internals")]
fn explicit_layout(
    k: usize,
    n: u32,
    (input_bytes, output_bytes): (usize, usize),
    (units, rows_per_cube, prefetch, staged_stores): (Option<u32>, usize, bool, bool),
) -> Result<(GroupedLayout, usize)> {
    let stage_bytes = |units: u32| units as usize * group_output_len(n) * output_bytes;
    let layout = match units {
        None => grouped_layout(k, n, input_bytes),
        Some(u) => grouped_layout_with_units(k, n, input_bytes, u).map(|p| (u, p)),
    };
    let Some((units, per_unit)) = layout.filter(|&(u, _)| {
        rows_per_cube >= 1 && (!staged_stores || stage_bytes(u) <= STAGED_STORE_BYTES)
    }) else {
        return Err(SlideSparseError::Unsupported {
            what: "the grouped quant kernel".into(),
            why: format!(
                "it cannot take K = {k} (n = {n}) with {units:?} units, {rows_per_cube} rows per cube, staged stores {staged_stores}"
            ),
        });
    };
    let layout = GroupedLayout {
        units: units as usize,
        groups_per_unit: per_unit,
        prefetch,
        staged_stores,
    };
    Ok((layout, rows_per_cube))
}

/// [`launch_quant_lift`] with the kernel choice made explicit.
#[allow(clippy::too_many_arguments)]
pub fn launch_quant_lift_with(
    kernel: QuantKernel,
    client: &Client,
    x: &Handle,
    codes: &Handle,
    scales: &Handle,
    dims: (usize, usize, usize, usize, usize),
    n: u32,
    precision: Precision,
    input: DType,
) -> Result<()> {
    launch_quant_lift_permuted(
        kernel, client, x, None, codes, scales, dims, n, precision, input,
    )
}

/// Shared-memory elements a permuted grouped launch stages each row in (`K` rounded up to
/// 1024, so that layers of similar width share one kernel), or `None` where the row does
/// not fit next to the block reduction's buffer.
fn permuted_stage(k: usize, input_bytes: usize) -> Option<usize> {
    let len = k.next_multiple_of(1024);
    (len * input_bytes + 1024 <= STAGE_BYTES).then_some(len)
}

/// The grouped choice for a layer read through an input permutation: the same layout, its
/// row staged for the gather, where the row fits shared memory and the layout neither loads
/// ahead nor stages its stores (those use the registers and shared memory the gather
/// needs); otherwise the row-staged kernel (`Auto`) or an error (an explicit layout).
fn permuted_choice(
    kernel: QuantKernel,
    grouped: Option<(GroupedLayout, usize)>,
    k: usize,
    input_bytes: usize,
) -> Result<Option<(GroupedLayout, usize, usize)>> {
    let Some((layout, rows_per_cube)) = grouped else {
        return Ok(None);
    };
    let stage = permuted_stage(k, input_bytes).filter(|_| !layout.prefetch && !layout.staged_stores);
    match (stage, kernel) {
        (Some(stage), _) => Ok(Some((layout, rows_per_cube, stage))),
        (None, QuantKernel::Auto) => Ok(None),
        // Only the benchmarks' explicit layouts reach here.
        #[cfg(feature = "internals")]
        (None, _) => Err(SlideSparseError::Unsupported {
            what: "the grouped quant kernel with an input permutation".into(),
            why: format!(
                "it stages the row (K = {k}, {input_bytes}-byte inputs) in shared memory and \
                 takes no prefetch and no staged stores (asked: {layout:?})"
            ),
        }),
    }
}

/// [`launch_quant_lift_with`] for a layer read through an input permutation: `perm` (`u32
/// [k]` on the device, `perm[j]` the input channel of position `j`) folded into the lift
/// map, `X'[m, o] = X[m, perm[src(o)]]`; `None` is the original order (then the launch is
/// exactly [`launch_quant_lift_with`]'s). The grouped kernel gathers from the row staged in
/// shared memory; rows that do not fit there take the row-staged kernel.
#[allow(clippy::too_many_arguments)]
pub fn launch_quant_lift_permuted(
    kernel: QuantKernel,
    client: &Client,
    x: &Handle,
    perm: Option<&Handle>,
    codes: &Handle,
    scales: &Handle,
    (m, m_pad, k, k_slide, k_out): (usize, usize, usize, usize, usize),
    n: u32,
    precision: Precision,
    input: DType,
) -> Result<()> {
    let input_bytes = input.size();
    let mode = lift_mode(precision);
    let elem = precision.element_bytes();
    let addr = address_type((m_pad * k_out * elem.max(4)).max(m * k * input_bytes));
    debug_assert!(k_out.is_multiple_of(4), "k_out = {k_out}");
    // 16-byte stores where the row allows, else one 2:4 window per store.
    let vo = if k_out.is_multiple_of(16 / elem) {
        16 / elem
    } else {
        4
    };
    // The grouped kernel writes whole 16-byte vectors: rows of other widths take the
    // row-staged kernel (an explicit grouped layout is refused instead).
    let whole_vectors = vo == 16 / elem;
    let grouped = match kernel {
        QuantKernel::Auto => auto_layout(k, n, input_bytes).filter(|_| whole_vectors),
        #[cfg(feature = "internals")]
        QuantKernel::RowStaged => None,
        #[cfg(feature = "internals")]
        QuantKernel::Grouped {
            units,
            rows_per_cube,
            prefetch,
            staged_stores,
        } => {
            if !whole_vectors {
                return Err(SlideSparseError::Unsupported {
                    what: "the grouped quant kernel".into(),
                    why: format!("it needs K' = {k_out} to be whole 16-byte vectors"),
                });
            }
            let asked = (units, rows_per_cube, prefetch, staged_stores);
            Some(explicit_layout(k, n, (input_bytes, elem), asked)?)
        }
    };
    let grouped = match perm {
        Some(_) => permuted_choice(kernel, grouped, k, input_bytes)?,
        None => grouped.map(|(layout, rows_per_cube)| (layout, rows_per_cube, 0)),
    };
    let (vi, dim, staged) = match grouped {
        Some((layout, ..)) => (16 / input_bytes, CubeDim::new_1d(layout.units as u32), 0),
        None => {
            // Round the staged length so that layers of similar width share one kernel.
            let staged_len = k.next_multiple_of(1024);
            let staged = if staged_len * input_bytes <= STAGE_BYTES {
                staged_len
            } else {
                0
            };
            let vi = if staged > 0 {
                input_vector(k, input_bytes)
            } else {
                1
            };
            (vi, CubeDim::new_1d(QUANT_CUBE_DIM), staged)
        }
    };
    let count = match grouped {
        Some((_, rows_per_cube, _)) => {
            CubeCount::Static(m_pad.div_ceil(rows_per_cube) as u32, 1, 1)
        }
        None => CubeCount::Static(m_pad as u32, 1, 1),
    };
    let scalars = (m as u32, k as u32, k_slide as u32, k_out as u32);
    // The grouped kernel writes 8-bit codes as u32 words of four, 16-byte vectors of 4 words.
    let packed = grouped.is_some() && mode != LiftMode::Float;
    let (out_vector, out_len) = if packed {
        (4, m_pad * k_out / 16)
    } else {
        (vo, m_pad * k_out / vo)
    };
    // SAFETY: buffer sizes match the lengths given; the kernels bound every access by them.
    // Without a permutation the kernels never read `perm`: the input stands in for it (both
    // are read-only, so the alias is harmless), which costs no allocation per launch.
    unsafe {
        let x_arg = ArrayArg::from_raw_parts(x.clone(), m * k / vi);
        let perm_arg = match perm {
            Some(p) => ArrayArg::from_raw_parts(p.clone(), k),
            None => ArrayArg::from_raw_parts(x.clone(), 1),
        };
        let out = ArrayArg::from_raw_parts(codes.clone(), out_len);
        let s = ArrayArg::from_raw_parts(scales.clone(), m_pad);
        macro_rules! go {
            ($q:ty, $grouped_q:ty) => {
                match grouped {
                    Some((layout, _, permuted)) => {
                        quant_lift_grouped_kernel::launch_unchecked::<$grouped_q, Runtime>(
                            client,
                            count,
                            dim,
                            addr,
                            vi,
                            out_vector,
                            x_arg,
                            perm_arg,
                            out,
                            s,
                            scalars.0,
                            m_pad as u32,
                            scalars.1,
                            scalars.3,
                            f32::NAN,
                            n,
                            mode,
                            layout,
                            permuted,
                            input.into(),
                        )
                    }
                    None => quant_lift_kernel::launch_unchecked::<$q, Runtime>(
                        client,
                        count,
                        dim,
                        addr,
                        vi,
                        vo,
                        x_arg,
                        perm_arg,
                        out,
                        s,
                        scalars.0,
                        scalars.1,
                        scalars.2,
                        scalars.3,
                        f32::NAN,
                        n,
                        mode,
                        staged,
                        perm.is_some(),
                        input.into(),
                    ),
                }
            };
        }
        match precision {
            Precision::Int8 => go!(i8, u32),
            Precision::Fp8 => go!(e4m3, u32),
            Precision::Bf16 => go!(bf16, bf16),
            Precision::F16 => go!(f16, f16),
            Precision::F32 => go!(f32, f32),
        }
    }
    Ok(())
}

/// Launches the epilogue: `acc [m_pad, n_pad]` -> `Y [m, n]`.
#[allow(clippy::too_many_arguments)]
pub fn launch_epilogue(
    client: &Client,
    acc: &Handle,
    token_scales: &Handle,
    channel_scales: &Handle,
    bias: Option<&Handle>,
    out: &Handle,
    (m, m_pad, n, n_pad): (usize, usize, usize, usize),
    accumulator: Accumulator,
    output: DType,
) -> Result<()> {
    debug_assert!(
        !accumulator.finished,
        "a finished accumulator is the output itself: no epilogue runs"
    );
    // The widest vector of at most 16 bytes (the widest CUDA load/store; wider vectors
    // compute wrong results in cubecl 0.10) that divides both row lengths, so that no
    // vector straddles two rows.
    let widest = accumulator.bytes().max(output.size());
    let v = [8usize, 4, 2, 1]
        .into_iter()
        .find(|v| v * widest <= 16 && n.is_multiple_of(*v) && n_pad.is_multiple_of(*v))
        .unwrap_or(1);
    let dim = CubeDim::new_1d(EPILOGUE_CUBE_DIM);
    let count = calculate_cube_count_elemwise(client, m * n / v, dim);
    let addr = address_type(m_pad * n_pad * 4);
    let channel_scaled = accumulator.channel_scaled;
    // SAFETY: sizes as allocated by the caller; the kernel reads only rows < m, cols < n.
    unsafe {
        let acc_arg = ArrayArg::from_raw_parts(acc.clone(), m_pad * n_pad / v);
        let sx = ArrayArg::from_raw_parts(token_scales.clone(), m_pad);
        let sw = ArrayArg::from_raw_parts(channel_scales.clone(), n / v);
        let b = ArrayArg::from_raw_parts(bias.unwrap_or(channel_scales).clone(), n / v);
        let y = ArrayArg::from_raw_parts(out.clone(), m * n / v);
        let dims = (m as u32, n as u32, n_pad as u32);
        macro_rules! go {
            ($a:ty) => {
                dequant_bias_kernel::launch_unchecked::<$a, Runtime>(
                    client,
                    count,
                    dim,
                    addr,
                    v,
                    acc_arg,
                    sx,
                    sw,
                    b,
                    y,
                    dims.0,
                    dims.1,
                    dims.2,
                    bias.is_some(),
                    channel_scaled,
                    output.into(),
                )
            };
        }
        match accumulator.ty {
            AccType::I32 => go!(i32),
            AccType::F32 => go!(f32),
            AccType::Bf16 => go!(bf16),
            AccType::F16 => go!(f16),
        }
    }
    Ok(())
}
