//! One error type for the crate: every way a user input can be wrong, with the numbers.

use std::path::PathBuf;

/// Result alias used across the crate.
pub type Result<T, E = SlideSparseError> = std::result::Result<T, E>;

/// Everything that can go wrong in packing, loading and running SlideSparse layers.
#[derive(Debug, thiserror::Error)]
pub enum SlideSparseError {
    #[error(
        "invalid sparsity pattern {input:?}: expected nonzeros:block of the form (2N-2):2N with N in 2..=16 \
         (2:4, 4:6, 6:8, 8:10, 10:12, 12:14, 14:16, ..., 30:32){hint}"
    )]
    /// A pattern string that is not `(2N-2):2N`.
    InvalidPattern {
        /// What was given.
        input: String,
        /// A hint for a likely mix-up (e.g. zeros:block instead of nonzeros:block).
        hint: String,
    },

    /// A precision name that is not one of the supported ones.
    #[error("invalid precision {0:?}: expected one of int8, fp8, bf16, f16, f32")]
    InvalidPrecision(String),

    /// A `K'` alignment that is not a power of two at least the precision's minimum
    /// (given, minimum).
    #[error("invalid K' alignment {0}: must be a power of two >= {1} for this precision")]
    InvalidAlignment(usize, usize),

    /// A tensor or input of the wrong shape.
    #[error("{what}: shape mismatch, expected {expected} but got {actual}")]
    ShapeMismatch {
        /// What was checked.
        what: String,
        /// The expected shape.
        expected: String,
        /// The shape found.
        actual: String,
    },

    #[error(
        "{tensor}: row {row}, block {block} (columns {start}..{end}) holds {nonzeros} nonzeros, \
         more than the {allowed} that pattern {pattern} allows"
    )]
    /// A block of a weight holds more nonzeros than its pattern allows.
    PatternViolation {
        /// The tensor.
        tensor: String,
        /// The pattern.
        pattern: String,
        /// The row.
        row: usize,
        /// The block's index in the row.
        block: usize,
        /// The block's first column.
        start: usize,
        /// One past the block's last column.
        end: usize,
        /// Nonzeros found.
        nonzeros: usize,
        /// Nonzeros allowed.
        allowed: usize,
    },

    #[error(
        "{tensor}: row {row}, 2:4 window at column {column} holds {nonzeros} nonzeros (at most 2 allowed)"
    )]
    /// A 2:4 window of a slid weight holds more than two nonzeros.
    WindowViolation {
        /// The tensor.
        tensor: String,
        /// The row.
        row: usize,
        /// The window's first column.
        column: usize,
        /// Nonzeros found.
        nonzeros: usize,
    },

    /// A packed weight does not reproduce its source.
    #[error("{tensor}: verification failed at row {row}, column {column}: {detail}")]
    VerifyMismatch {
        /// The tensor.
        tensor: String,
        /// The row.
        row: usize,
        /// The column.
        column: usize,
        /// What differs.
        detail: String,
    },

    #[error(
        "{tensor}: non-finite weight ({value}) at row {row}, column {column}; the packer refuses NaN/Inf weights"
    )]
    /// A NaN or infinite weight given to the packer.
    NonFiniteWeight {
        /// The tensor.
        tensor: String,
        /// The row.
        row: usize,
        /// The column.
        column: usize,
        /// The value.
        value: f32,
    },

    #[error(
        "{tensor}: activation norms have length {actual}, expected {expected} (one per input channel)"
    )]
    /// Activation norms for activation-aware pruning of the wrong length.
    CalibrationMismatch {
        /// The tensor.
        tensor: String,
        /// One per input channel.
        expected: usize,
        /// What was given.
        actual: usize,
    },

    /// Per-layer pattern allocation: a kept density outside (0, 1], a group without valid
    /// candidates, or a budget below what the sparsest candidates keep.
    #[error("pattern allocation: {0}")]
    InvalidAllocation(String),

    #[error(
        "{tensor}: the damped calibration Hessian is not positive definite (pivot {pivot} at \
         input column {column}, damping {damping} of the mean diagonal); calibrate on more \
         tokens or raise the damping"
    )]
    /// SparseGPT pruning: the Cholesky factorization of the damped Hessian failed.
    NotPositiveDefinite {
        /// The tensor.
        tensor: String,
        /// The input column whose pivot failed.
        column: usize,
        /// The pivot found (not a finite positive number).
        pivot: f64,
        /// The relative damping used.
        damping: f64,
    },

    /// A list that is not a permutation of a layer's input channels.
    #[error("invalid input permutation: {detail}")]
    InvalidPermutation {
        /// What is wrong.
        detail: String,
    },

    /// A packed file that fails a check of the format.
    #[error("packed file {path}: {detail}")]
    InvalidPackedFile {
        /// The file.
        path: String,
        /// What is wrong.
        detail: String,
    },

    /// A GGUF file that fails a check.
    #[error("GGUF file {path}: {detail}")]
    InvalidGguf {
        /// The file.
        path: String,
        /// What is wrong.
        detail: String,
    },

    /// A tensor a file should hold is missing.
    #[error("tensor {name:?} not found in {path}")]
    MissingTensor {
        /// The tensor.
        name: String,
        /// The file.
        path: String,
    },

    /// A tensor of a dtype that cannot be read where it is.
    #[error("tensor {name:?}: unsupported dtype {dtype} ({context})")]
    UnsupportedDtype {
        /// The tensor.
        name: String,
        /// Its dtype.
        dtype: String,
        /// Where it was read.
        context: String,
    },

    /// The output path of a command is its input.
    #[error("refusing to write {0}: it is the input file")]
    OutputIsInput(PathBuf),

    /// A layer-selecting regular expression that does not compile.
    #[error("invalid regular expression {pattern:?}: {source}")]
    Regex {
        /// The expression.
        pattern: String,
        /// The parser's error.
        source: regex::Error,
    },

    /// An I/O error, with the path it happened on.
    #[error("I/O error on {path}: {source}")]
    Io {
        /// The path.
        path: String,
        /// The error.
        source: std::io::Error,
    },

    /// A safetensors file that does not parse.
    #[error("safetensors error in {path}: {source}")]
    SafeTensors {
        /// The file.
        path: String,
        /// The parser's error.
        source: safetensors::SafeTensorError,
    },

    /// The error of work queued earlier on the same stream (the calling thread's cubecl
    /// stream) that failed after the call that queued it had returned: an operation burn's
    /// fusion backend executed later, or a kernel, GEMM graph or NCCL launch that cubecl's
    /// device thread issued later. That work's outputs were set to NaN. Reported once, by the
    /// next call of this crate on that stream; calls on other streams never see it.
    #[error("work queued earlier on this stream failed (its outputs were set to NaN): {0}")]
    Deferred(Box<SlideSparseError>),

    /// A packed file that does not fit the model it is loaded into: a layer the model does
    /// not list, or one of other sizes or bias than the model's layer of that name.
    #[error("loading packed layers from {path}: {detail}")]
    PackedMismatch {
        /// The packed file.
        path: String,
        /// Which layer, and what differs.
        detail: String,
    },

    /// Layers that cannot be fused into one ([`concat_outputs`](crate::concat_outputs)):
    /// of different kinds, input widths, patterns or precisions.
    #[error("fusing layers: {detail}")]
    FuseMismatch {
        /// What differs.
        detail: String,
    },

    /// A layer that cannot be split over the requested number of tensor-parallel ranks.
    #[error("{layer}: cannot split over {ranks} tensor-parallel ranks: {detail}")]
    InvalidSplit {
        /// The layer.
        layer: String,
        /// The number of ranks asked for.
        ranks: usize,
        /// Which dimension does not divide, and what would.
        detail: String,
    },

    /// A saved record that cannot be loaded into the model: unreadable, or of other layer
    /// kinds than the model's (a sparse record into a dense-built model).
    #[error("loading a record: {detail}")]
    Record {
        /// What went wrong, with the model's layer kinds where they differ.
        detail: String,
    },

    /// A failure of a backend operation that has no more specific variant (the reference
    /// path reading tensors, a layer's name added as context).
    #[error("{0}")]
    Backend(String),

    /// A CUDA driver call failed; `code` is the driver's error name.
    #[error("CUDA driver: {call} failed: {code}")]
    Cuda {
        /// The driver entry point, e.g. `cuStreamCreate`.
        call: &'static str,
        /// The `CUresult`, e.g. `CUDA_ERROR_ILLEGAL_ADDRESS`.
        code: String,
    },

    /// A cuSPARSELt call failed.
    #[error("cuSPARSELt {call} failed with status {status}: {message}")]
    CusparseLt {
        /// The entry point without its `cusparseLt` prefix, e.g. `Matmul`.
        call: &'static str,
        /// The `cusparseStatus_t`.
        status: i32,
        /// `cusparseLtGetErrorString` of the status.
        message: String,
    },

    /// A cuBLASLt call of the dense baseline failed.
    #[error("cuBLASLt {call} failed: {code}")]
    CublasLt {
        /// What was called.
        call: &'static str,
        /// The `cublasStatus_t` name.
        code: String,
    },

    /// A CUPTI call failed (finding burn's stream; the caller falls back to host
    /// synchronization).
    #[error("CUPTI {call} failed with status {status}: {message}")]
    Cupti {
        /// The entry point.
        call: &'static str,
        /// The `CUptiResult`.
        status: u32,
        /// `cuptiGetResultString` of the status.
        message: String,
    },

    /// An NCCL call of a tensor-parallel collective failed.
    #[error("NCCL {call} failed with status {status}: {message}")]
    Nccl {
        /// The entry point, e.g. `ncclAllReduce`.
        call: &'static str,
        /// The `ncclResult_t`.
        status: i32,
        /// `ncclGetErrorString` of the status.
        message: String,
    },

    /// A request to cubecl (its device thread, its memory pool) failed.
    #[error("cubecl {what}: {detail}")]
    Cubecl {
        /// What was asked of cubecl.
        what: &'static str,
        /// cubecl's error.
        detail: String,
    },

    /// A library loaded at run time is missing or unusable.
    #[error("{library} not found or unusable: {detail}")]
    LibraryUnavailable {
        /// The library, e.g. `cuSPARSELt`.
        library: &'static str,
        /// What was tried and how to fix it.
        detail: String,
    },

    /// cuSPARSELt's own 2:4 check rejected a weight: some 2:4 window holds more than two
    /// nonzeros. (The packer's checks make this unreachable for a valid packed layer; the
    /// library does not say where.)
    #[error(
        "{tensor}: cuSPARSELt's prune check rejected the weight (a 2:4 window holds more than 2 \
         nonzeros; the library does not report where: run `slidesparse verify` on the packed file)"
    )]
    PruneCheckRejected {
        /// The layer.
        tensor: String,
    },

    /// The launch of a GEMM captured as a CUDA graph, queued without waiting, failed; its
    /// forward's output was set to NaN. Reported inside [`Deferred`](Self::Deferred).
    #[error("a queued GEMM graph launch failed ({code})")]
    QueuedReplayFailed {
        /// The `CUresult` of `cuGraphLaunch`.
        code: String,
    },

    /// An environment variable holds a value that is not one of the accepted ones.
    #[error("environment variable {variable}={value:?} is not valid: expected one of {accepted}")]
    Config {
        /// The variable.
        variable: &'static str,
        /// Its value.
        value: String,
        /// The accepted values.
        accepted: &'static str,
    },

    /// A layer that the CUDA path cannot run.
    #[error("{what}: not supported on the CUDA path: {why}")]
    Unsupported {
        /// The layer or operation.
        what: String,
        /// Why, and what to do instead.
        why: String,
    },

    /// No usable NVIDIA GPU: no driver, no device, or an index past the last one.
    #[error(
        "no usable NVIDIA GPU: {0}; run on a reference backend (e.g. NdArray) or check the driver"
    )]
    NoGpu(String),

    #[error(
        "GPU out of memory: {what} needs {needed} bytes but only {available} are free \
         (driver free memory plus cubecl's unused pool); use fewer tokens per call (smaller M), \
         fewer layers on this GPU, or free other tensors first"
    )]
    /// A request that cannot fit in the GPU's free memory, refused before cubecl is asked.
    OutOfMemory {
        /// What the memory was for.
        what: String,
        /// Bytes needed.
        needed: u64,
        /// Bytes free.
        available: u64,
    },
}

impl SlideSparseError {
    /// Wraps an I/O error with the path it happened on.
    pub fn io(path: impl AsRef<std::path::Path>, source: std::io::Error) -> Self {
        Self::Io {
            path: path.as_ref().display().to_string(),
            source,
        }
    }

    /// A packed-file error with a human-readable detail.
    pub fn packed(path: impl Into<String>, detail: impl Into<String>) -> Self {
        Self::InvalidPackedFile {
            path: path.into(),
            detail: detail.into(),
        }
    }

    /// [`SlideSparseError::ShapeMismatch`]: `what` expected `expected`, got `actual`
    /// (both written with `{:?}`).
    pub fn shape(
        what: impl Into<String>,
        expected: impl std::fmt::Debug,
        actual: impl std::fmt::Debug,
    ) -> Self {
        Self::ShapeMismatch {
            what: what.into(),
            expected: format!("{expected:?}"),
            actual: format!("{actual:?}"),
        }
    }
}
