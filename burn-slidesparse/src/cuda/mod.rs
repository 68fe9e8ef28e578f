//! The CUDA path (feature `cuda`): the pipeline that `SlideSparseBackend` runs for burn-cuda's
//! `CubeBackend` (chosen in `cube.rs` from the runtime's type), with cuSPARSELt (and
//! cuBLASLt for the dense baseline) ordered on burn's own stream.
//!
//! Layers, bottom to top; a module imports only from its own layer or those below it, and
//! no import cycle (`scripts/check-layers.py` checks this list against
//! `docs/architecture.md`):
//!
//! 1. helpers: [`config`] (the environment, read once), `runtime` (cubecl types, device
//!    pointers, per-device values), `driver` (typed driver errors, device, context),
//!    `accumulator` (what a GEMM writes), `thread_exit` (per-stream state released when its
//!    thread ends);
//! 2. libraries: `cusparselt` (its symbols, statuses and owning types),
//!    `cublaslt`, `cupti`, `nccl` (the library, found at run time, for tensor parallelism),
//!    `nvrtc_module` (our CUDA C of `kernels/`, compiled per device), `algo_cache` (search
//!    results on disk), `side_kernels` (the stream gate's kernels, for benchmarks);
//! 3. buffers and order: `buffers` (held and kept device buffers), `graphs` (GEMM calls
//!    replayed as CUDA graphs), `queued` (per-stream lanes; all our work queued behind
//!    burn's kernels: library calls, our kernels, failures), `launch` (CubeCL kernel
//!    launches);
//! 4. device: `state` (per-device state), `memory` (allocations checked against free
//!    memory);
//! 5. operations: `compact_gemm` (our Hopper sparse GEMM on the compact rows), `gemm` (the
//!    GEMMs behind one trait: cuSPARSELt or the compact GEMM, cuBLASLt), `gemv` (our
//!    weight-streaming GEMV of forwards of up to 16 tokens), `pipeline` (the one forward:
//!    quant(+lift) -> GEMM -> epilogue, or quant -> GEMV), `prepare` (building a layer once),
//!    `decode_step` (the kernels only a decode step's graph launches), `decode_graph` (a
//!    whole decode step as one CUDA graph),
//!    `attention` (flash attention), `block_steps` (RMSNorm, SiLU-gated product, RoPE and
//!    the cache write), `nccl_ranks` and `burn_ranks` (tensor-parallel collectives);
//! 6. benchmark tools: `gate` (a stream gate), `profiler` (profiler ranges).
//!
//! The benchmark tools and `side_kernels` are compiled only with the `internals` feature.

/// Declares modules that are crate-private, or public (doc-hidden) with the `internals`
/// feature that the project's own GPU tests and benchmarks use.
macro_rules! internal_modules {
    ($($name:ident),* $(,)?) => {$(
        #[cfg(feature = "internals")]
        #[doc(hidden)]
        pub mod $name;
        #[cfg(not(feature = "internals"))]
        pub(crate) mod $name;
    )*};
}

/// Declares the benchmark tools: compiled only with the `internals` feature (public,
/// doc-hidden).
macro_rules! benchmark_modules {
    ($($name:ident),* $(,)?) => {$(
        #[cfg(feature = "internals")]
        #[doc(hidden)]
        pub mod $name;
    )*};
}

/// A struct `$library` holding a library loaded at run time and its entry points, each
/// looked up by its exact C name and given the signature written here (that of the
/// library's C header), with `from_library(lib, path)` to build it (`nccl`, `cusparselt`).
macro_rules! library_bindings {
    ($library:ident { $($name:ident: fn($($arg:ty),*) $(-> $ret:ty)?;)* }) => {
        /// The loaded library and its entry points.
        pub struct $library {
            $(pub $name: unsafe extern "C" fn($($arg),*) $(-> $ret)?,)*
            /// Where the library was found.
            pub path: PathBuf,
            _lib: Library,
        }

        impl $library {
            fn from_library(lib: Library, path: PathBuf) -> std::result::Result<Self, String> {
                // SAFETY: each symbol is looked up by its exact C name and given the
                // signature its C header declares (written at the macro's call); the
                // library outlives the pointers (`_lib`).
                unsafe {
                    Ok(Self {
                        $($name: *lib
                            .get(concat!(stringify!($name), "\0").as_bytes())
                            .map_err(|e| format!("{}: {e}", stringify!($name)))?,)*
                        path,
                        _lib: lib,
                    })
                }
            }

            /// The first of `paths` that opens and exports every entry point, or a line per
            /// path tried. A path that does not exist is skipped silently unless it is
            /// `named` (the file an environment variable named: `(path, variable)`).
            fn open_first(
                paths: impl IntoIterator<Item = PathBuf>,
                named: Option<(&std::path::Path, &str)>,
            ) -> std::result::Result<Self, Vec<String>> {
                let mut tried = Vec::new();
                for path in paths {
                    if path.components().count() > 1 && !path.exists() {
                        if let Some((file, variable)) = named.filter(|(f, _)| *f == path) {
                            tried.push(format!("{} ({variable}: no such file)", file.display()));
                        }
                        continue;
                    }
                    // SAFETY: loading a shared library runs its initializers; the vendor
                    // libraries loaded here have no preconditions.
                    match unsafe { Library::new(&path) } {
                        Ok(lib) => match Self::from_library(lib, path.clone()) {
                            Ok(loaded) => return Ok(loaded),
                            Err(missing) => tried
                                .push(format!("{} (missing symbol {missing})", path.display())),
                        },
                        Err(e) => tried.push(format!("{} ({e})", path.display())),
                    }
                }
                Err(tried)
            }
        }
    };
}

pub mod config;

internal_modules!(
    accumulator,
    attention,
    block_steps,
    algo_cache,
    buffers,
    burn_ranks,
    compact_gemm,
    cublaslt,
    cupti,
    cusparselt,
    driver,
    decode_graph,
    decode_step,
    gemm,
    gemv,
    graphs,
    launch,
    memory,
    nccl,
    nccl_ranks,
    nvrtc_module,
    pipeline,
    prepare,
    queued,
    runtime,
    state,
    thread_exit,
);

benchmark_modules!(gate, profiler, side_kernels);

/// A SlideSparse layer prepared on the GPU (cuSPARSELt's compressed weight, or the compact
/// rows of our Hopper GEMM).
pub type CudaPrepared = pipeline::GpuLayer<gemm::SparseGemm>;

/// A dense quantized baseline layer prepared on the GPU (cuBLASLt).
pub type DenseLayerGpu = pipeline::GpuLayer<gemm::DenseGemm>;

pub use burn_ranks::BurnRanks;
pub use config::{Config, GraphMode, Settings, SyncMode};
/// The device of [`CudaBackend`]: `CudaDevice { index }` is GPU `index`.
pub use cubecl::cuda::CudaDevice;
pub use driver::{cuda_driver_present, device_count};
pub use nccl_ranks::NcclRanks;

pub use runtime::{CudaBackend, CudaFusionBackend};

/// Every CUDA C file of `kernels/` compiles with NVRTC for every target this crate builds
/// kernels for. NVRTC needs no GPU, so this runs in CI (which installs NVRTC and sets
/// `SLIDESPARSE_TEST_REQUIRE_NVRTC`); without NVRTC and that variable it says so and passes.
/// With `internals`, so that the benchmark tools' kernels are compiled too.
#[cfg(all(test, feature = "internals"))]
mod kernel_compile_tests {
    use super::nvrtc_module::{FILES, Program, compile_builtin};

    /// Every program of the crate.
    fn programs() -> Vec<&'static Program> {
        vec![
            &super::attention::PROGRAM,
            &super::block_steps::PROGRAM,
            &super::decode_step::PROGRAM,
            &super::gemv::PROGRAM,
            &super::side_kernels::PROGRAM,
            &super::compact_gemm::PROGRAM,
        ]
    }

    /// NVRTC's target names for the compute capabilities a program may run on, as
    /// `nvrtc_module` picks them, plus `sm_90a` (Hopper's wgmma and setmaxnreg).
    fn targets(program: &Program) -> Vec<&'static str> {
        let mut targets: Vec<&'static str> = [(8, 0), (8, 6), (8, 9), (9, 0), (10, 0), (12, 0)]
            .into_iter()
            .filter(|&c| c >= program.min_capability)
            .map(super::nvrtc_module::arch)
            .collect();
        targets.push("sm_90a");
        targets
    }

    fn nvrtc_present() -> bool {
        // SAFETY: only loads the library and drops it (no symbol is called).
        let present = unsafe { cudarc::nvrtc::sys::is_culib_present() };
        if !present && std::env::var_os("SLIDESPARSE_TEST_REQUIRE_NVRTC").is_some() {
            panic!(
                "SLIDESPARSE_TEST_REQUIRE_NVRTC is set but NVRTC (libnvrtc.so.13) was not found"
            );
        }
        if !present {
            eprintln!("NVRTC not found: the kernels were not compiled");
        }
        present
    }

    #[test]
    fn every_kernel_file_is_in_a_program() {
        let listed: Vec<&str> = FILES.iter().map(|f| f.name).collect();
        let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/src/cuda/kernels");
        for entry in std::fs::read_dir(dir).unwrap() {
            let name = entry.unwrap().file_name().into_string().unwrap();
            assert!(
                listed.contains(&name.as_str()),
                "kernels/{name} is not in FILES"
            );
        }
        let programs = programs();
        for file in FILES.iter().filter(|f| f.name.ends_with(".cu")) {
            assert!(
                programs.iter().any(|p| p.files.contains(&file.name)),
                "no program compiles {}",
                file.name
            );
        }
    }

    #[test]
    fn every_program_compiles_for_every_target() {
        if !nvrtc_present() {
            return;
        }
        let mut failures = Vec::new();
        for program in programs() {
            for arch in targets(program) {
                if let Err(e) = compile_builtin(program, arch) {
                    failures.push(format!("{} for {arch}: {e}", program.name));
                }
            }
        }
        assert!(failures.is_empty(), "{}", failures.join("\n\n"));
    }
}
