//! The dense baseline GEMM through cuBLASLt (cudarc's runtime-loaded bindings), with the same
//! layout as the sparse GEMM: `D [m_pad, n] (row-major) = X [m_pad, k] . W [n, k]^T`, i.e.
//! column-major `D [n, m_pad] = W^T-op . X`, "TN" as Hopper's 8-bit kernels require.

use std::{collections::HashMap, ffi::c_void};

use cudarc::cublaslt::{result, sys};

use super::accumulator::{AccType, Accumulator};
use crate::{
    error::{Result, SlideSparseError},
    weight_quant::Precision,
};

fn err(call: &'static str) -> impl Fn(result::CublasError) -> SlideSparseError {
    move |e| SlideSparseError::CublasLt {
        call,
        code: format!("{:?}", e.0),
    }
}

/// Shape of one dense GEMM.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct DenseShape {
    pub m_pad: usize,
    pub n: usize,
    pub k: usize,
    pub precision: Precision,
    /// INT32 for INT8 inputs; FP32 or the layer's 16-bit type for FP8, see [`Accumulator`].
    pub accumulator: Accumulator,
}

/// (input, output, compute, scale) types of a precision with a full-precision output; FP8
/// may write the layer's 16-bit type instead (see [`Accumulator::dense`]).
fn types(
    p: Precision,
) -> (
    sys::cudaDataType,
    sys::cudaDataType,
    sys::cublasComputeType_t,
    sys::cudaDataType,
) {
    use sys::{cublasComputeType_t as C, cudaDataType as T};
    match p {
        Precision::Int8 => (
            T::CUDA_R_8I,
            T::CUDA_R_32I,
            C::CUBLAS_COMPUTE_32I,
            T::CUDA_R_32I,
        ),
        Precision::Fp8 => (
            T::CUDA_R_8F_E4M3,
            T::CUDA_R_32F,
            C::CUBLAS_COMPUTE_32F,
            T::CUDA_R_32F,
        ),
        Precision::Bf16 => (
            T::CUDA_R_16BF,
            T::CUDA_R_16BF,
            C::CUBLAS_COMPUTE_32F,
            T::CUDA_R_32F,
        ),
        Precision::F16 => (
            T::CUDA_R_16F,
            T::CUDA_R_16F,
            C::CUBLAS_COMPUTE_32F,
            T::CUDA_R_32F,
        ),
        Precision::F32 => (
            T::CUDA_R_32F,
            T::CUDA_R_32F,
            C::CUBLAS_COMPUTE_32F,
            T::CUDA_R_32F,
        ),
    }
}

/// Workspace cuBLASLt may use (bytes).
pub const WORKSPACE: usize = 32 << 20;

/// A cached dense plan: descriptors and the heuristic's algorithm.
pub struct DensePlan {
    desc: sys::cublasLtMatmulDesc_t,
    layouts: [sys::cublasLtMatrixLayout_t; 3],
    algo: sys::cublasLtMatmulAlgo_t,
    int_scale: bool,
}

/// The cuBLASLt handle plus its plans, one per device (lives in the device state).
pub struct CublasLt {
    handle: sys::cublasLtHandle_t,
    plans: HashMap<DenseShape, DensePlan>,
}

// SAFETY: used only under the device state's mutex.
unsafe impl Send for CublasLt {}

impl CublasLt {
    /// Creates the handle (cuBLASLt is loaded by cudarc on first use).
    pub fn new() -> Result<Self> {
        Ok(Self {
            handle: result::create_handle().map_err(err("create"))?,
            plans: HashMap::new(),
        })
    }

    fn plan(&mut self, shape: DenseShape) -> Result<&DensePlan> {
        if !self.plans.contains_key(&shape) {
            let plan = self.build(shape)?;
            self.plans.insert(shape, plan);
        }
        Ok(&self.plans[&shape])
    }

    fn build(&self, s: DenseShape) -> Result<DensePlan> {
        let (input, mut output, compute, scale) = types(s.precision);
        if s.precision == Precision::Fp8 {
            output = match s.accumulator.ty {
                AccType::Bf16 => sys::cudaDataType::CUDA_R_16BF,
                AccType::F16 => sys::cudaDataType::CUDA_R_16F,
                _ => output,
            };
        }
        let desc = result::create_matmul_desc(compute, scale).map_err(err("MatmulDescCreate"))?;
        let transpose: i32 = 1; // CUBLAS_OP_T
        // SAFETY: the attribute is a cublasOperation_t, passed by pointer with its size.
        unsafe {
            result::set_matmul_desc_attribute(
                desc,
                sys::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_TRANSA,
                &transpose as *const _ as *const c_void,
                std::mem::size_of_val(&transpose),
            )
            .map_err(err("set TRANSA"))?;
        }
        let (m, n, k) = (s.m_pad as u64, s.n as u64, s.k as u64);
        let a = result::create_matrix_layout(input, k, n, k as i64).map_err(err("layout A"))?;
        let b = result::create_matrix_layout(input, k, m, k as i64).map_err(err("layout B"))?;
        let d = result::create_matrix_layout(output, n, m, n as i64).map_err(err("layout D"))?;
        let pref = result::create_matmul_pref().map_err(err("PreferenceCreate"))?;
        let workspace = WORKSPACE as u64;
        // SAFETY: valid objects; attribute value is a u64.
        let heuristic = unsafe {
            result::set_matmul_pref_attribute(
                pref,
                sys::cublasLtMatmulPreferenceAttributes_t::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                &workspace as *const u64 as *const c_void,
                8,
            )
            .map_err(err("set workspace"))?;
            let h = result::get_matmul_algo_heuristic(self.handle, desc, a, b, d, d, pref);
            let _ = result::destroy_matmul_pref(pref);
            h.map_err(err("no algorithm for this shape (AlgoGetHeuristic)"))?
        };
        Ok(DensePlan {
            desc,
            layouts: [a, b, d],
            algo: heuristic.algo,
            int_scale: s.precision == Precision::Int8,
        })
    }

    /// Enqueues `D = X . W^T` on `stream`.
    ///
    /// # Safety
    /// Pointers must be live device buffers of `shape`; `workspace` at least [`WORKSPACE`].
    pub unsafe fn run(
        &mut self,
        shape: DenseShape,
        d_weight: u64,
        d_act: u64,
        d_out: u64,
        d_workspace: u64,
        stream: *mut c_void,
    ) -> Result<()> {
        let handle = self.handle;
        let plan = self.plan(shape)?;
        let (one_i, zero_i, one_f, zero_f) = (1i32, 0i32, 1.0f32, 0.0f32);
        let (alpha, beta): (*const c_void, *const c_void) = if plan.int_scale {
            (&one_i as *const i32 as _, &zero_i as *const i32 as _)
        } else {
            (&one_f as *const f32 as _, &zero_f as *const f32 as _)
        };
        let [a, b, d] = plan.layouts;
        // SAFETY: the plan's descriptors match `shape`; the caller guarantees the pointers
        // and the workspace; alpha and beta outlive the call.
        unsafe {
            result::matmul(
                handle,
                plan.desc,
                alpha,
                beta,
                d_weight as *const c_void,
                a,
                d_act as *const c_void,
                b,
                d_out as *const c_void,
                d,
                d_out as *mut c_void,
                d,
                &plan.algo,
                d_workspace as *mut c_void,
                WORKSPACE,
                stream as sys::cudaStream_t,
            )
        }
        .map_err(err("Matmul"))
    }
}

impl Drop for CublasLt {
    fn drop(&mut self) {
        // SAFETY: every object was created here and is destroyed once.
        unsafe {
            for plan in self.plans.values() {
                let _ = result::destroy_matmul_desc(plan.desc);
                for l in plan.layouts {
                    let _ = result::destroy_matrix_layout(l);
                }
            }
            let _ = result::destroy_handle(self.handle);
        }
    }
}
