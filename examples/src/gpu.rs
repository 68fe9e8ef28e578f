//! The examples on a GPU: burn-cuda's plain backend with bf16 floats (what the library's bf16
//! kernels and its decode graph run on), and where cubecl keeps what a first run spends its
//! time on (compiled kernels, autotune results) so that later runs find it.

use std::{
    fmt,
    path::{Path, PathBuf},
    time::SystemTime,
};

use burn::tensor::{DType, set_default_dtypes};
use burn_slidesparse::cuda::{CudaBackend, CudaDevice};
use cubecl::config::{CubeClRuntimeConfig, RuntimeConfig, cache::CacheConfig};

/// burn-cuda without fusion, bf16 floats: the backend the decode graph runs on.
pub type Gpu = CudaBackend<half::bf16>;

/// GPU `index`, its default dtypes set to bf16 floats and i32 ints. Call it before any tensor
/// exists on the device: burn fixes a device's default dtypes at the first tensor created
/// there, and every float tensor the loaders create takes that default.
pub fn bf16_device(index: usize) -> Result<CudaDevice, String> {
    let device = CudaDevice { index };
    set_default_dtypes::<Gpu>(&device, DType::BF16, DType::I32)
        .map_err(|e| format!("GPU {index}'s default dtypes (bf16, i32): {e:?}"))?;
    Ok(device)
}

/// Where cubecl keeps its caches in this process ([`use_user_cache_for_cubecl`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum KernelCaches {
    /// Set here: autotune results under `autotune`, this build's compiled kernels under
    /// `kernels`.
    User { autotune: PathBuf, kernels: PathBuf },
    /// cubecl's configuration had been read before (a device was used first): cubecl's own
    /// defaults, or the `cubecl.toml` it found, hold.
    AlreadyRead,
    /// No cache directory is known (`SLIDESPARSE_CACHE_DIR`, `XDG_CACHE_HOME` and `HOME` are
    /// all unset): cubecl's defaults hold.
    NoCacheDir,
}

impl fmt::Display for KernelCaches {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::User { autotune, kernels } => write!(
                f,
                "cubecl caches: autotune results in {}, compiled kernels in {}",
                autotune.display(),
                kernels.display()
            ),
            Self::AlreadyRead => write!(
                f,
                "cubecl caches: cubecl's configuration was read before it could be set \
                 (its own locations hold)"
            ),
            Self::NoCacheDir => write!(
                f,
                "cubecl caches: no cache directory (set SLIDESPARSE_CACHE_DIR or HOME); \
                 cubecl's own locations hold"
            ),
        }
    }
}

/// Points cubecl's persistent caches at the user's cache directory, the one the library keeps
/// its cuSPARSELt algorithm choices in (`SLIDESPARSE_CACHE_DIR`, else
/// `$XDG_CACHE_HOME/burn-slidesparse`, else `~/.cache/burn-slidesparse`), under `cubecl/`.
/// Call it before any CUDA device is used: cubecl reads its configuration once, when its first
/// device starts, and refuses to change it afterwards.
///
/// Why: cubecl 0.10 keeps autotune results in the `target/` folder of the Cargo project
/// above the working directory (`CacheConfig::Target`, cubecl-runtime `config/cache.rs`), so
/// a run from elsewhere tunes again, and keeps no compiled kernels at all unless configured
/// (`compilation.cache` is `None` by default, cubecl-cuda `compute/context.rs`). Both are
/// fields of `CubeClRuntimeConfig`, which `RuntimeConfig::set` installs.
///
/// A location the user chose in a `cubecl.toml` (or a `burn.toml`'s `[cubecl]` section) other
/// than cubecl's defaults is kept; cubecl's `CUBECL_*` variables still apply. Autotune results
/// are safe to share between builds (cubecl checks each entry's checksum of the tuned
/// candidates); compiled kernels are not (cubecl keys them by the kernel's type name and
/// settings, not its code, so an edited `#[cube]` kernel would load the old build's PTX),
/// hence one folder per build of the running program, the other builds' folders removed.
pub fn use_user_cache_for_cubecl() -> burn_slidesparse::Result<KernelCaches> {
    if CubeClRuntimeConfig::storage().lock().is_some() {
        return Ok(KernelCaches::AlreadyRead);
    }
    let Some(root) = burn_slidesparse::cuda::config::config()?.cache_dir.clone() else {
        return Ok(KernelCaches::NoCacheDir);
    };
    let root = root.join("cubecl");
    let autotune = root.clone();
    let builds = root.join("kernels");
    let kernels = builds.join(build_id());
    remove_other_builds(&builds, &kernels);
    // What cubecl would read by itself (a config file above the working directory, then its
    // environment variables), with only its default cache locations replaced.
    let mut config = CubeClRuntimeConfig::from_current_dir().override_from_env();
    if matches!(config.autotune.cache, CacheConfig::Target) {
        config.autotune.cache = CacheConfig::File(autotune.clone());
    }
    if config.compilation.cache.is_none() {
        config.compilation.cache = Some(CacheConfig::File(kernels.clone()));
    }
    CubeClRuntimeConfig::set(config);
    // cubecl appends its own subfolders: `autotune/<version>/<device>/` and
    // `cuda/<version>/ptx.json.log` (cubecl-common `cache.rs`).
    Ok(KernelCaches::User { autotune, kernels })
}

/// Names this build of the running program (its executable's size and modification time) and
/// the host (a home folder shared between hosts with different GPUs must not share PTX).
fn build_id() -> String {
    use std::hash::{DefaultHasher, Hash, Hasher};
    let mut hasher = DefaultHasher::new();
    if let Some(meta) = std::env::current_exe()
        .ok()
        .and_then(|exe| std::fs::metadata(exe).ok())
    {
        meta.len().hash(&mut hasher);
        meta.modified()
            .ok()
            .and_then(|t| t.duration_since(SystemTime::UNIX_EPOCH).ok())
            .hash(&mut hasher);
    }
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .unwrap_or_default()
        .trim()
        .hash(&mut hasher);
    format!("{:016x}", hasher.finish())
}

/// Removes the compiled kernels of other builds, so the cache holds one build's. Best effort:
/// a folder that cannot be removed only costs disk space.
fn remove_other_builds(builds: &Path, keep: &Path) {
    let Ok(entries) = std::fs::read_dir(builds) else {
        return;
    };
    for entry in entries.flatten() {
        let path = entry.path();
        if path != keep && path.is_dir() {
            let _ = std::fs::remove_dir_all(&path);
        }
    }
}
