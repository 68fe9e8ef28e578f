//! This crate's own CUDA C (the files of `cuda/kernels/`), compiled with NVRTC for a device's
//! architecture and loaded into its primary context, once per program and device.
//!
//! A [`Program`] is one or more `.cu` files compiled as one translation unit. A line
//! `#include "name"` naming another file of the folder is replaced by that file (once per
//! program), so each file also compiles on its own (`nvcc -I cuda/kernels`). The files are
//! compiled into the binary; with `SLIDESPARSE_KERNEL_DIR` set, every file of a program is
//! read from that folder instead when the program is first loaded on a device, so a changed
//! kernel runs without rebuilding the Rust code (the names of the `extern "C"` functions and
//! their parameter blocks must still be the ones the host code launches).
//!
//! Adding a kernel: write its file in `cuda/kernels/` (`#include "common.cuh"` for the
//! 16-bit types and helpers), list it in [`FILES`], give it a [`Program`] (or add it to an
//! existing one) in the host module that launches it, and look its functions up there with
//! [`LoadedProgram::function`] once per device (`runtime::PerDevice`);
//! launches go through `queued::submit`. `attention.rs` and `block_steps.rs` do exactly this.

use std::{
    borrow::Cow,
    collections::HashSet,
    ffi::{CString, c_void},
    path::Path,
};

use cudarc::driver::{result as cu, sys};

use super::{
    config::config,
    driver::{Context, cuda_device, driver_err},
};
use crate::error::{Result, SlideSparseError};

/// A CUDA C file of `cuda/kernels/`: its name there and the text compiled into the binary.
pub struct KernelFile {
    /// The file name (what `#include` and `SLIDESPARSE_KERNEL_DIR` look for).
    pub name: &'static str,
    builtin: &'static str,
}

macro_rules! kernel_files {
    ($($name:literal),* $(,)?) => {
        &[$(KernelFile { name: $name, builtin: include_str!(concat!("kernels/", $name)) }),*]
    };
}

/// Every file of `cuda/kernels/`.
pub const FILES: &[KernelFile] = kernel_files![
    "common.cuh",
    "attention.cu",
    "rms_norm.cu",
    "silu_mul.cu",
    "rope_cache.cu",
    "stream_gate.cu",
    "quantize.cuh",
    "act_quant.cu",
    "decode_step.cu",
    "decode_gemv.cu",
    "sparse_gemm_sm90.cu",
];

/// Files of [`FILES`] compiled together into one module.
pub struct Program {
    /// What the program holds, for errors.
    pub name: &'static str,
    /// Its files, in order (the files they include are pulled in where they are included).
    pub files: &'static [&'static str],
    /// The oldest compute capability its kernels run on (`(major, minor)`).
    pub min_capability: (i32, i32),
    /// Compiled for the architecture-specific target of exactly `min_capability` (`sm_90a`:
    /// Hopper's `wgmma`, `setmaxnreg`), and refused on every other GPU.
    pub arch_specific: bool,
}

/// The device facts a launch configuration needs.
#[derive(Clone, Copy, Debug)]
pub struct DeviceInfo {
    /// Compute capability `(major, minor)`.
    pub capability: (i32, i32),
    /// Streaming multiprocessors.
    pub sm_count: usize,
}

impl DeviceInfo {
    /// The facts of device `index`.
    pub fn of(index: usize) -> Result<Self> {
        let dev = cuda_device(index)?;
        let attr = |a| {
            // SAFETY: `dev` comes from `cuda_device`.
            unsafe { cu::device::get_attribute(dev, a) }.map_err(driver_err("cuDeviceGetAttribute"))
        };
        use sys::CUdevice_attribute::*;
        Ok(Self {
            capability: (
                attr(CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)?,
                attr(CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)?,
            ),
            sm_count: attr(CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)?.max(1) as usize,
        })
    }
}

/// NVRTC's name for a compute capability (PTX of the closest older known target otherwise).
pub(super) fn arch((major, minor): (i32, i32)) -> &'static str {
    match (major, minor) {
        (8, 0) => "sm_80",
        (8, 6) => "sm_86",
        (8, 7) => "sm_87",
        (8, 9) => "sm_89",
        (9, 0) => "sm_90",
        (10, 0) => "sm_100",
        (12, 0) => "sm_120",
        (9.., _) => "compute_90",
        _ => "compute_80",
    }
}

/// NVRTC's name for the architecture-specific target of a compute capability (`sm_90a`), if
/// this crate builds one.
pub(super) fn arch_specific((major, minor): (i32, i32)) -> Option<&'static str> {
    match (major, minor) {
        (9, 0) => Some("sm_90a"),
        _ => None,
    }
}

/// A program compiled for one device and loaded in its primary context, for the life of the
/// process (the module is never unloaded: its functions are cached by their users).
pub struct LoadedProgram {
    module: sys::CUmodule,
    /// The device it was compiled for.
    pub info: DeviceInfo,
}

// SAFETY: a module and the functions looked up in it are immutable after loading; the
// driver API is thread-safe, and launches use them with the device's context current.
unsafe impl Send for LoadedProgram {}
// SAFETY: as above, nothing is mutated after loading.
unsafe impl Sync for LoadedProgram {}

impl LoadedProgram {
    /// Compiles `program` for device `index` and loads it (its context made current on this
    /// thread). Errors: a GPU older than the program's `min_capability`
    /// ([`SlideSparseError::Unsupported`]), a file missing from `SLIDESPARSE_KERNEL_DIR`
    /// ([`SlideSparseError::Io`]), NVRTC's log of a failed compile.
    pub fn load(index: usize, program: &Program) -> Result<Self> {
        let info = DeviceInfo::of(index)?;
        // The module lives in the device's primary context (cubecl's), made current here.
        Context::retain(cuda_device(index)?)?;
        let (major, minor) = info.capability;
        if info.capability < program.min_capability {
            let (need_major, need_minor) = program.min_capability;
            return Err(SlideSparseError::Unsupported {
                what: format!("the {} kernels", program.name),
                why: format!(
                    "they need compute capability {need_major}.{need_minor}+ (bf16/f16 tensor \
                     cores), the GPU has {major}.{minor}; the reference path runs anywhere"
                ),
            });
        }
        let target = if program.arch_specific {
            arch_specific(info.capability)
                .filter(|_| info.capability == program.min_capability)
                .ok_or_else(|| {
                    let (need_major, need_minor) = program.min_capability;
                    SlideSparseError::Unsupported {
                        what: format!("the {} kernels", program.name),
                        why: format!(
                            "they are built for compute capability {need_major}.{need_minor} \
                             exactly (architecture-specific instructions), the GPU has \
                             {major}.{minor}"
                        ),
                    }
                })?
        } else {
            arch(info.capability)
        };
        let source = source_of(program, config()?.kernel_dir.as_deref())?;
        let ptx = compile(program, source, target)?;
        let image = CString::new(ptx.to_src()).map_err(|e| SlideSparseError::Cuda {
            call: "PTX",
            code: format!("the {} kernels: {e:?}", program.name),
        })?;
        // SAFETY: `image` is a NUL-terminated PTX string; the context is current (`retain`).
        let module = unsafe { cu::module::load_data(image.as_ptr() as *const c_void) }
            .map_err(driver_err("cuModuleLoadData"))?;
        Ok(Self { module, info })
    }

    /// The value of the program's `extern "C" __constant__ int name`: a fact of a kernel
    /// (its shared memory, say) that its file computes, read back instead of computed twice.
    pub fn global_i32(&self, name: &str) -> Result<i32> {
        let c_name = CString::new(name).map_err(|_| SlideSparseError::Unsupported {
            what: "kernel constant name".into(),
            why: format!("{name:?} holds a NUL"),
        })?;
        let (mut ptr, mut bytes) = (0 as sys::CUdeviceptr, 0usize);
        // SAFETY: the module was loaded in this device's context (current, as for
        // `function`); the driver writes the global's address and size.
        unsafe { sys::cuModuleGetGlobal_v2(&mut ptr, &mut bytes, self.module, c_name.as_ptr()) }
            .result()
            .map_err(driver_err("cuModuleGetGlobal"))?;
        if bytes != 4 {
            return Err(SlideSparseError::Cuda {
                call: "cuModuleGetGlobal",
                code: format!("{name} holds {bytes} bytes, not an int"),
            });
        }
        let mut value = 0i32;
        // SAFETY: `ptr` is the module's 4-byte global, copied into a live i32.
        unsafe { cu::memcpy_dtoh_sync(std::slice::from_mut(&mut value), ptr) }
            .map_err(driver_err("cuMemcpyDtoH"))?;
        Ok(value)
    }

    /// The `extern "C"` function `name` of the program, allowed `dynamic_smem` bytes of
    /// dynamic shared memory (past 48 KiB it has to be opted into).
    pub fn function(&self, name: &str, dynamic_smem: usize) -> Result<sys::CUfunction> {
        let c_name = CString::new(name).map_err(|_| SlideSparseError::Unsupported {
            what: "kernel name".into(),
            why: format!("{name:?} holds a NUL"),
        })?;
        // SAFETY: the module was loaded in this device's context, which is current on this
        // thread (the loader's) or made current by the caller.
        let f = unsafe { cu::module::get_function(self.module, c_name) }
            .map_err(driver_err("cuModuleGetFunction"))?;
        if dynamic_smem > 48 * 1024 {
            // SAFETY: `f` is a function of the loaded module; the size is what it launches
            // with.
            unsafe {
                cu::function::set_function_attribute(
                    f,
                    sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                    dynamic_smem as i32,
                )
            }
            .map_err(driver_err("cuFuncSetAttribute"))?;
        }
        Ok(f)
    }
}

/// `source` (the text of `program`) compiled to PTX for `arch` (an NVRTC target name); the
/// error holds NVRTC's log. Needs NVRTC, not a GPU.
fn compile(program: &Program, source: String, arch: &'static str) -> Result<cudarc::nvrtc::Ptx> {
    let options = cudarc::nvrtc::CompileOptions {
        arch: Some(arch),
        options: vec!["-std=c++17".into()],
        ..Default::default()
    };
    cudarc::nvrtc::compile_ptx_with_opts(source, options).map_err(|e| SlideSparseError::Cuda {
        call: "NVRTC",
        code: format!("the {} kernels: {e:?}", program.name),
    })
}

/// `program`'s built-in files compiled for `arch`, for the tests that check every kernel
/// compiles without a GPU.
#[cfg(test)]
pub(super) fn compile_builtin(program: &Program, arch: &'static str) -> Result<()> {
    compile(program, source_of(program, None)?, arch).map(|_| ())
}

/// The text of file `name`: from `dir` when given (`SLIDESPARSE_KERNEL_DIR`), else the one
/// compiled into the binary.
fn file_text(name: &str, dir: Option<&Path>) -> Result<Cow<'static, str>> {
    match dir {
        Some(dir) => {
            let path = dir.join(name);
            std::fs::read_to_string(&path)
                .map(Cow::Owned)
                .map_err(|source| SlideSparseError::Io {
                    path: format!("{} (SLIDESPARSE_KERNEL_DIR)", path.display()),
                    source,
                })
        }
        None => FILES
            .iter()
            .find(|f| f.name == name)
            .map(|f| Cow::Borrowed(f.builtin))
            .ok_or_else(|| SlideSparseError::Unsupported {
                what: "CUDA C source".into(),
                why: format!("no file {name:?} in cuda/kernels/ (`nvrtc_module::FILES`)"),
            }),
    }
}

/// The file an `#include "name"` line includes.
fn included(line: &str) -> Option<&str> {
    line.trim()
        .strip_prefix("#include")?
        .trim()
        .strip_prefix('"')?
        .strip_suffix('"')
}

/// The program's source: its files in order, each included file in place of its first
/// `#include` line (later ones are dropped: a file is compiled once).
fn source_of(program: &Program, dir: Option<&Path>) -> Result<String> {
    fn append(
        name: &str,
        dir: Option<&Path>,
        seen: &mut HashSet<String>,
        out: &mut String,
    ) -> Result<()> {
        if !seen.insert(name.to_string()) {
            return Ok(());
        }
        for line in file_text(name, dir)?.lines() {
            match included(line) {
                Some(file) => append(file, dir, seen, out)?,
                None => {
                    out.push_str(line);
                    out.push('\n');
                }
            }
        }
        Ok(())
    }
    let (mut seen, mut out) = (HashSet::new(), String::new());
    for file in program.files {
        append(file, dir, &mut seen, &mut out)?;
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    const TEST_PROGRAM: Program = Program {
        name: "test",
        files: &["a.cu", "b.cu"],
        min_capability: (8, 0),
        arch_specific: false,
    };

    #[test]
    fn every_include_of_a_builtin_file_is_a_builtin_file() {
        for file in FILES {
            for name in file.builtin.lines().filter_map(included) {
                assert!(
                    FILES.iter().any(|f| f.name == name),
                    "{} includes {name}, which is not in FILES",
                    file.name
                );
            }
        }
    }

    #[test]
    fn includes_expand_once_in_place_and_the_kernel_dir_replaces_the_builtin_files() {
        let dir = std::env::temp_dir().join(format!("slidesparse-kernels-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("common.cuh"), "// common\n").unwrap();
        std::fs::write(dir.join("a.cu"), "#include \"common.cuh\"\nA\n").unwrap();
        std::fs::write(dir.join("b.cu"), "  #include \"common.cuh\"\nB\n").unwrap();
        let source = source_of(&TEST_PROGRAM, Some(&dir)).unwrap();
        assert_eq!(source, "// common\nA\nB\n");
        std::fs::remove_file(dir.join("b.cu")).unwrap();
        let err = source_of(&TEST_PROGRAM, Some(&dir)).unwrap_err().to_string();
        assert!(err.contains("b.cu (SLIDESPARSE_KERNEL_DIR)"), "{err}");
        std::fs::remove_dir_all(&dir).unwrap();
        let err = source_of(&TEST_PROGRAM, None).unwrap_err().to_string();
        assert!(err.contains("no file \"a.cu\""), "{err}");
    }
}
