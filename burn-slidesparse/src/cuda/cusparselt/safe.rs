//! Safe owners of cuSPARSELt objects: the per-device handle, compressed weights and cached
//! matmul plans. Every object is boxed (cuSPARSELt keeps pointers into them) and destroyed
//! exactly once, in `Drop`.

use std::ffi::c_void;

use super::{
    result::{MIN_VERSION, version_string},
    sys::{self, CusparseLt, Opaque, Stream},
};
use crate::{
    cuda::{
        accumulator::{AccType, Accumulator},
        config::Config,
    },
    error::{Result, SlideSparseError},
    weight_quant::Precision,
};

/// One cuSPARSELt handle (bound to the device current when it was made).
pub struct LtHandle {
    pub lib: CusparseLt,
    handle: Box<Opaque>,
    pub version: i32,
}

// SAFETY: the handle is only used under the device state's mutex (see `state.rs`).
unsafe impl Send for LtHandle {}

impl LtHandle {
    /// Loads the library and creates a handle on the current device.
    pub fn new(config: &Config) -> Result<Self> {
        let lib = CusparseLt::load(config)?;
        let mut handle = Opaque::boxed();
        // SAFETY: `handle` is a writable, aligned, 1 KiB opaque struct.
        lib.check(unsafe { (lib.cusparseLtInit)(&mut *handle) }, "Init")?;
        let mut version = 0;
        lib.check(
            // SAFETY: the handle was initialized above.
            unsafe { (lib.cusparseLtGetVersion)(&*handle, &mut version) },
            "GetVersion",
        )?;
        let this = Self {
            lib,
            handle,
            version,
        };
        if version < MIN_VERSION {
            return Err(SlideSparseError::LibraryUnavailable {
                library: "cuSPARSELt",
                detail: format!(
                    "{} at {} is too old: {} or newer is needed",
                    version_string(version),
                    this.lib.path.display(),
                    version_string(MIN_VERSION)
                ),
            });
        }
        Ok(this)
    }

    pub(crate) fn raw(&self) -> *const Opaque {
        &*self.handle
    }
}

impl Drop for LtHandle {
    fn drop(&mut self) {
        // SAFETY: initialized in `new`, destroyed once here.
        unsafe { (self.lib.cusparseLtDestroy)(&*self.handle) };
    }
}

/// cuSPARSELt types of one GEMM: (input, output/C/D, compute).
pub fn types_of(precision: Precision, accumulator: Accumulator) -> (i32, i32, i32) {
    use sys::{compute, data_type as t};
    let output = match accumulator.ty {
        AccType::I32 => t::R_32I,
        AccType::F32 => t::R_32F,
        AccType::Bf16 => t::R_16BF,
        AccType::F16 => t::R_16F,
    };
    match precision {
        Precision::Int8 => (t::R_8I, output, compute::C32I),
        Precision::Fp8 => (t::R_8F_E4M3, output, compute::C32F),
        Precision::Bf16 => (t::R_16BF, output, compute::C32F),
        Precision::F16 => (t::R_16F, output, compute::C32F),
        Precision::F32 => (t::R_32F, output, compute::C32F),
    }
}

/// The input type of a precision.
fn input_type(precision: Precision) -> i32 {
    types_of(
        precision,
        Accumulator::dense(precision, burn::tensor::DType::F32),
    )
    .0
}

/// A matrix descriptor.
pub struct MatDescriptor {
    desc: Box<Opaque>,
}

impl MatDescriptor {
    /// The structured (2:4) weight `W'` row-major `[n_pad, k']` seen column-major `[k', n_pad]`.
    pub fn structured(
        lt: &LtHandle,
        k_prime: usize,
        n_pad: usize,
        precision: Precision,
    ) -> Result<Self> {
        let mut desc = Opaque::boxed();
        let input = input_type(precision);
        // SAFETY: valid handle and writable descriptor.
        let status = unsafe {
            (lt.lib.cusparseLtStructuredDescriptorInit)(
                lt.raw(),
                &mut *desc,
                k_prime as i64,
                n_pad as i64,
                k_prime as i64,
                16,
                input,
                sys::ORDER_COL,
                sys::SPARSITY_50_PERCENT,
            )
        };
        lt.lib.check(status, "StructuredDescriptorInit")?;
        Ok(Self { desc })
    }

    /// A dense column-major `[rows, cols]` matrix with `ld = rows`.
    pub fn dense(lt: &LtHandle, rows: usize, cols: usize, data_type: i32) -> Result<Self> {
        let mut desc = Opaque::boxed();
        // SAFETY: valid handle and writable descriptor.
        let status = unsafe {
            (lt.lib.cusparseLtDenseDescriptorInit)(
                lt.raw(),
                &mut *desc,
                rows as i64,
                cols as i64,
                rows as i64,
                16,
                data_type,
                sys::ORDER_COL,
            )
        };
        lt.lib.check(status, "DenseDescriptorInit")?;
        Ok(Self { desc })
    }

    fn raw(&self) -> *const Opaque {
        &*self.desc
    }

    /// Destroys a descriptor that no plan owns.
    pub fn destroy(self, lt: &LtHandle) -> Result<()> {
        // SAFETY: initialized at construction, destroyed once (consumes self).
        lt.lib.check(
            unsafe { (lt.lib.cusparseLtMatDescriptorDestroy)(self.raw()) },
            "MatDescriptorDestroy",
        )
    }
}

/// Descriptors are destroyed by their owner, which also holds the library (`Drop` needs it).
struct OwnedDescriptor {
    desc: MatDescriptor,
    destroy: unsafe extern "C" fn(*const Opaque) -> sys::Status,
}

impl Drop for OwnedDescriptor {
    fn drop(&mut self) {
        // SAFETY: initialized, destroyed once.
        unsafe { (self.destroy)(self.desc.raw()) };
    }
}

/// A weight compressed for cuSPARSELt: the device buffer lives in a cubecl handle owned by
/// the caller; this records its size.
pub struct CompressedSizes {
    pub compressed: usize,
    pub buffer: usize,
}

/// Size of the compressed form of `W'` and of the scratch buffer compression needs.
pub fn compressed_sizes(lt: &LtHandle, desc: &MatDescriptor) -> Result<CompressedSizes> {
    let (mut compressed, mut buffer) = (0usize, 0usize);
    // SAFETY: valid handle and descriptor; outputs are plain integers.
    let status = unsafe {
        (lt.lib.cusparseLtSpMMACompressedSize2)(lt.raw(), desc.raw(), &mut compressed, &mut buffer)
    };
    lt.lib.check(status, "SpMMACompressedSize2")?;
    Ok(CompressedSizes { compressed, buffer })
}

/// Enqueues the 2:4 validity check of `W'` into the device int `d_valid` (0 = valid).
///
/// # Safety
/// `d_weight` and `d_valid` must be live device pointers of the sizes `desc` implies.
pub unsafe fn prune_check(
    lt: &LtHandle,
    desc: &MatDescriptor,
    d_weight: u64,
    d_valid: u64,
    stream: Stream,
) -> Result<()> {
    // SAFETY: the caller's contract; `desc` describes the weight.
    let status = unsafe {
        (lt.lib.cusparseLtSpMMAPruneCheck2)(
            lt.raw(),
            desc.raw(),
            1,
            sys::OP_TRANSPOSE,
            d_weight as *const c_void,
            d_valid as *mut i32,
            stream,
        )
    };
    lt.lib.check(status, "SpMMAPruneCheck2")
}

/// Enqueues the compression of `W'`.
///
/// # Safety
/// All pointers must be live device allocations of the sizes `compressed_sizes` gave.
pub unsafe fn compress(
    lt: &LtHandle,
    desc: &MatDescriptor,
    d_weight: u64,
    d_compressed: u64,
    d_buffer: u64,
    stream: Stream,
) -> Result<()> {
    // SAFETY: the caller's contract; `desc` describes the weight.
    let status = unsafe {
        (lt.lib.cusparseLtSpMMACompress2)(
            lt.raw(),
            desc.raw(),
            1,
            sys::OP_TRANSPOSE,
            d_weight as *const c_void,
            d_compressed as *mut c_void,
            d_buffer as *mut c_void,
            stream,
        )
    };
    lt.lib.check(status, "SpMMACompress2")
}

/// Shape of one sparse GEMM: `D [m_pad, n_pad] = X' [m_pad, k'] . W'^T`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct GemmShape {
    pub m_pad: usize,
    pub n_pad: usize,
    pub k_prime: usize,
    pub precision: Precision,
    pub accumulator: Accumulator,
}

/// Device pointers of one sparse GEMM: the compressed `W'`, `X'`, the output `D` and the
/// alpha vector (`n_pad` weight scales, read only for a channel-scaled accumulator).
#[derive(Clone, Copy, Debug)]
pub struct GemmPointers {
    pub weight: u64,
    pub act: u64,
    pub out: u64,
    pub alpha: u64,
}

/// A ready matmul plan with its descriptors; built once per shape and reused.
pub struct SparsePlan {
    plan: Box<Opaque>,
    alg: Box<Opaque>,
    /// The plan keeps a pointer into it: owned here so it outlives the plan.
    _matmul: Box<Opaque>,
    _descs: [OwnedDescriptor; 3],
    pub workspace: usize,
    pub config_id: i32,
    /// Whether the algorithm is still to be settled (searched, or the default kept): true
    /// for a plan built without a remembered configuration, until its first run decides.
    pub needs_search: bool,
    /// Alpha is a device vector (per output channel): the accumulator is channel-scaled.
    alpha_vector: bool,
    destroy_plan: unsafe extern "C" fn(*const Opaque) -> sys::Status,
    destroy_alg: unsafe extern "C" fn(*const Opaque) -> sys::Status,
}

// SAFETY: plans are only used under the device state's mutex.
unsafe impl Send for SparsePlan {}

impl SparsePlan {
    /// Descriptors, matmul descriptor, algorithm selection (with `config_id` if given) and plan.
    pub fn new(lt: &LtHandle, shape: GemmShape, config_id: Option<i32>) -> Result<Self> {
        let (input, output, compute) = types_of(shape.precision, shape.accumulator);
        let own = |desc| OwnedDescriptor {
            desc,
            destroy: lt.lib.cusparseLtMatDescriptorDestroy,
        };
        let weight = own(MatDescriptor::structured(
            lt,
            shape.k_prime,
            shape.n_pad,
            shape.precision,
        )?);
        let act = own(MatDescriptor::dense(lt, shape.k_prime, shape.m_pad, input)?);
        let out = own(MatDescriptor::dense(lt, shape.n_pad, shape.m_pad, output)?);
        let mut matmul = Opaque::boxed();
        let lib = &lt.lib;
        // SAFETY: all descriptors are initialized and outlive the matmul descriptor (they
        // are stored in the plan).
        unsafe {
            lib.check(
                (lib.cusparseLtMatmulDescriptorInit)(
                    lt.raw(),
                    &mut *matmul,
                    sys::OP_TRANSPOSE,
                    sys::OP_NON_TRANSPOSE,
                    weight.desc.raw(),
                    act.desc.raw(),
                    out.desc.raw(),
                    out.desc.raw(),
                    compute,
                ),
                "MatmulDescriptorInit",
            )?;
        }
        if shape.accumulator.channel_scaled {
            let on: i32 = 1;
            // SAFETY: the attribute takes an `int`.
            let status = unsafe {
                (lib.cusparseLtMatmulDescSetAttribute)(
                    lt.raw(),
                    &mut *matmul,
                    sys::MATMUL_ALPHA_VECTOR_SCALING,
                    &on as *const i32 as *const c_void,
                    4,
                )
            };
            lib.check(status, "MatmulDescSetAttribute(ALPHA_VECTOR_SCALING)")?;
        }
        let mut alg = Opaque::boxed();
        // SAFETY: as above.
        unsafe {
            lib.check(
                (lib.cusparseLtMatmulAlgSelectionInit)(
                    lt.raw(),
                    &mut *alg,
                    &*matmul,
                    sys::ALG_DEFAULT,
                ),
                "MatmulAlgSelectionInit",
            )?;
        }
        if let Some(id) = config_id {
            // SAFETY: `id` is an i32 as the attribute requires.
            let status = unsafe {
                (lib.cusparseLtMatmulAlgSetAttribute)(
                    lt.raw(),
                    &mut *alg,
                    sys::ALG_CONFIG_ID,
                    &id as *const i32 as *const c_void,
                    4,
                )
            };
            lib.check(status, "MatmulAlgSetAttribute(CONFIG_ID)")?;
        }
        let mut plan = Opaque::boxed();
        let mut workspace = 0usize;
        // SAFETY: as above.
        unsafe {
            lib.check(
                (lib.cusparseLtMatmulPlanInit)(lt.raw(), &mut *plan, &*matmul, &*alg),
                "MatmulPlanInit",
            )?;
            lib.check(
                (lib.cusparseLtMatmulGetWorkspace)(lt.raw(), &*plan, &mut workspace),
                "MatmulGetWorkspace",
            )?;
        }
        let mut this = Self {
            plan,
            alg,
            _matmul: matmul,
            _descs: [weight, act, out],
            workspace,
            config_id: config_id.unwrap_or(0),
            needs_search: config_id.is_none(),
            alpha_vector: shape.accumulator.channel_scaled,
            destroy_plan: lib.cusparseLtMatmulPlanDestroy,
            destroy_alg: lib.cusparseLtMatmulAlgSelectionDestroy,
        };
        this.config_id = this.read_config_id(lt)?;
        Ok(this)
    }

    /// The `alpha` argument: the device vector with alpha-vector scaling, else host 1.0.
    fn alpha_pointer(&self, one: &f32, d_alpha: u64) -> *const c_void {
        if self.alpha_vector {
            d_alpha as *const c_void
        } else {
            one as *const f32 as *const c_void
        }
    }

    fn read_config_id(&self, lt: &LtHandle) -> Result<i32> {
        let mut id = 0i32;
        // SAFETY: valid selection; output is an i32.
        let status = unsafe {
            (lt.lib.cusparseLtMatmulAlgGetAttribute)(
                lt.raw(),
                &*self.alg,
                sys::ALG_CONFIG_ID,
                &mut id as *mut i32 as *mut c_void,
                4,
            )
        };
        lt.lib.check(status, "MatmulAlgGetAttribute(CONFIG_ID)")?;
        Ok(id)
    }

    /// Enqueues `D = alpha * (W' . X'^T)` on `stream`.
    ///
    /// # Safety
    /// Pointers must be live device buffers of this plan's shapes; `workspace` at least
    /// `self.workspace` bytes (or 0 when that is 0).
    pub unsafe fn run(
        &self,
        lt: &LtHandle,
        p: GemmPointers,
        d_workspace: u64,
        stream: Stream,
    ) -> Result<()> {
        let (one, beta) = (1.0f32, 0.0f32);
        let alpha = self.alpha_pointer(&one, p.alpha);
        let mut streams = [stream];
        // SAFETY: the caller's contract; the plan is initialized; alpha, beta and the stream
        // array outlive the call.
        let status = unsafe {
            (lt.lib.cusparseLtMatmul)(
                lt.raw(),
                &*self.plan,
                alpha,
                p.weight as *const c_void,
                p.act as *const c_void,
                &beta as *const f32 as *const c_void,
                p.out as *const c_void,
                p.out as *mut c_void,
                d_workspace as *mut c_void,
                streams.as_mut_ptr(),
                1,
            )
        };
        lt.lib.check(status, "Matmul")
    }

    /// Times every algorithm on the given buffers (blocking), keeps the fastest in the plan
    /// and returns its configuration id.
    ///
    /// # Safety
    /// As for [`run`](Self::run).
    pub unsafe fn search(
        &mut self,
        lt: &LtHandle,
        p: GemmPointers,
        d_workspace: u64,
        stream: Stream,
    ) -> Result<i32> {
        let (one, beta) = (1.0f32, 0.0f32);
        let alpha = self.alpha_pointer(&one, p.alpha);
        let mut streams = [stream];
        // SAFETY: as in `run`; the search is blocking and may rewrite the plan.
        let status = unsafe {
            (lt.lib.cusparseLtMatmulSearch)(
                lt.raw(),
                &mut *self.plan,
                alpha,
                p.weight as *const c_void,
                p.act as *const c_void,
                &beta as *const f32 as *const c_void,
                p.out as *const c_void,
                p.out as *mut c_void,
                d_workspace as *mut c_void,
                streams.as_mut_ptr(),
                1,
            )
        };
        lt.lib.check(status, "MatmulSearch")?;
        self.config_id = self.read_config_id(lt)?;
        // The winner may need a different workspace; the caller re-reads it.
        // SAFETY: a valid plan; the output is a plain integer.
        unsafe {
            lt.lib.check(
                (lt.lib.cusparseLtMatmulGetWorkspace)(lt.raw(), &*self.plan, &mut self.workspace),
                "MatmulGetWorkspace",
            )?;
        }
        Ok(self.config_id)
    }
}

impl Drop for SparsePlan {
    fn drop(&mut self) {
        // SAFETY: initialized in `new`; destroyed once, plan before its selection, and the
        // descriptors (fields) after both. The matmul descriptor has no destroy call in
        // cuSPARSELt; its box is freed with the plan.
        unsafe {
            (self.destroy_plan)(&*self.plan);
            (self.destroy_alg)(&*self.alg);
        }
    }
}
