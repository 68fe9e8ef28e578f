//! The configuration of the CUDA path, read from the environment in one place.
//!
//! Every `SLIDESPARSE_*` variable is read here, once per process (when a device is first
//! used). A value that is not one of the accepted ones is an error naming the
//! variable and the accepted values, never a silent default: `SLIDESPARSE_GRAPHS=of` must
//! not mean "graphs on". `docs/configuration.md` has the table.

use std::path::PathBuf;

use crate::error::{Result, SlideSparseError};

/// How a library GEMM (cuSPARSELt, cuBLASLt) is ordered with burn's kernels.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SyncMode {
    /// On burn's own stream, found through CUPTI, with no host synchronization (default).
    /// Falls back to [`Host`](Self::Host) with the reason where CUPTI is missing.
    Stream,
    /// Host synchronizations before and after the GEMM (correct anywhere; slower).
    Host,
}

/// Whether GEMM calls on kept buffers are replayed as CUDA graphs, and how (`graphs.rs`,
/// `queued`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GraphMode {
    /// Replayed, and the launch of a captured graph queued on cubecl's device thread
    /// without waiting (default).
    Queued,
    /// Replayed, the caller waiting for the launch on cubecl's device thread.
    Blocking,
    /// Never replayed: the library is called directly.
    Off,
}

impl GraphMode {
    /// Whether graphs are replayed at all.
    pub fn replays(self) -> bool {
        self != GraphMode::Off
    }

    /// Whether launches of captured graphs are queued without waiting.
    pub fn queued(self) -> bool {
        self == GraphMode::Queued
    }
}

/// Which GEMM a SlideSparse layer's forwards above the GEMV's sizes run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SparseGemmChoice {
    /// cuSPARSELt on its own compressed copy of the weight, on every GPU (default).
    CuSparseLt,
    /// Our Hopper kernel on the compact rows, the layer's one copy (INT8 2:4 .. 14:16 on
    /// sm_90; cuSPARSELt elsewhere).
    Compact,
}

/// The settings a device's forwards run under; tests and benchmarks change them
/// through `DeviceState::set_settings` (`state.rs`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Settings {
    /// How the GEMM joins burn's stream.
    pub sync: SyncMode,
    /// Graph replay of decode-sized GEMM calls.
    pub graphs: GraphMode,
}

/// Everything the environment configures.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Config {
    /// `SLIDESPARSE_SYNC` and `SLIDESPARSE_GRAPHS`.
    pub settings: Settings,
    /// `SLIDESPARSE_ALGO_SEARCH`: run `cusparseLtMatmulSearch` for new GEMM shapes.
    pub algo_search: bool,
    /// `SLIDESPARSE_DECODE_GEMV`: forwards of up to 16 tokens run our weight-streaming GEMV
    /// (`gemv.rs`) where the layer has one (INT8 dense, INT8 6:8), not the library GEMM.
    pub decode_gemv: bool,
    /// `SLIDESPARSE_SPARSE_GEMM`: the SlideSparse layers' GEMM.
    pub sparse_gemm: SparseGemmChoice,
    /// Where the search results are kept (`SLIDESPARSE_CACHE_DIR`, `XDG_CACHE_HOME`,
    /// `HOME`), or `None` where none of them is set.
    pub cache_dir: Option<PathBuf>,
    /// `SLIDESPARSE_CUSPARSELT`: the cuSPARSELt library file to load first.
    pub cusparselt: Option<PathBuf>,
    /// `SLIDESPARSE_NCCL`: the NCCL library file to load first (tensor parallelism).
    pub nccl: Option<PathBuf>,
    /// `SLIDESPARSE_CUPTI`: the CUPTI library file to load first.
    pub cupti: Option<PathBuf>,
    /// `SLIDESPARSE_KERNEL_DIR`: a folder whose CUDA C files replace the ones compiled into
    /// the binary (`nvrtc_module.rs`).
    pub kernel_dir: Option<PathBuf>,
    /// `CUDA_PATH` (default `/usr/local/cuda`): where CUPTI is looked for.
    pub cuda_path: PathBuf,
    /// Roots of Python environments whose pip folders may hold cuSPARSELt and NCCL
    /// (`VIRTUAL_ENV`, `CONDA_PREFIX`, `~/.local`).
    pub python_roots: Vec<PathBuf>,
}

/// A variable's accepted values and what each means.
struct Choice<T: 'static> {
    variable: &'static str,
    accepted: &'static str,
    values: &'static [(&'static str, T)],
    default: T,
}

impl<T: Copy> Choice<T> {
    fn read(&self, value: Option<String>) -> Result<T> {
        let Some(value) = value else {
            return Ok(self.default);
        };
        self.values
            .iter()
            .find(|(name, _)| *name == value.trim())
            .map(|(_, v)| *v)
            .ok_or(SlideSparseError::Config {
                variable: self.variable,
                value,
                accepted: self.accepted,
            })
    }
}

const SYNC: Choice<SyncMode> = Choice {
    variable: "SLIDESPARSE_SYNC",
    accepted: "stream, host",
    values: &[("stream", SyncMode::Stream), ("host", SyncMode::Host)],
    default: SyncMode::Stream,
};

const GRAPHS: Choice<GraphMode> = Choice {
    variable: "SLIDESPARSE_GRAPHS",
    accepted: "queued, blocking, off",
    values: &[
        ("queued", GraphMode::Queued),
        ("blocking", GraphMode::Blocking),
        ("off", GraphMode::Off),
    ],
    default: GraphMode::Queued,
};

const ALGO_SEARCH: Choice<bool> = Choice {
    variable: "SLIDESPARSE_ALGO_SEARCH",
    accepted: "on, off, 1, 0",
    values: &[("on", true), ("1", true), ("off", false), ("0", false)],
    default: true,
};

const DECODE_GEMV: Choice<bool> = Choice {
    variable: "SLIDESPARSE_DECODE_GEMV",
    accepted: "on, off, 1, 0",
    values: &[("on", true), ("1", true), ("off", false), ("0", false)],
    default: true,
};

const SPARSE_GEMM: Choice<SparseGemmChoice> = Choice {
    variable: "SLIDESPARSE_SPARSE_GEMM",
    accepted: "cusparselt, compact",
    values: &[
        ("cusparselt", SparseGemmChoice::CuSparseLt),
        ("compact", SparseGemmChoice::Compact),
    ],
    default: SparseGemmChoice::CuSparseLt,
};

impl Config {
    /// The configuration of this process's environment.
    pub fn from_env() -> Result<Self> {
        Self::from_lookup(|name| std::env::var_os(name).map(|v| v.to_string_lossy().into_owned()))
    }

    /// The configuration that `lookup` (variable name -> value) describes.
    pub fn from_lookup(lookup: impl Fn(&str) -> Option<String>) -> Result<Self> {
        let path = |name: &str| lookup(name).filter(|v| !v.is_empty()).map(PathBuf::from);
        let home = path("HOME");
        let cache_dir = path("SLIDESPARSE_CACHE_DIR")
            .or_else(|| path("XDG_CACHE_HOME").map(|d| d.join("burn-slidesparse")))
            .or_else(|| home.as_ref().map(|h| h.join(".cache/burn-slidesparse")));
        let python_roots = [path("VIRTUAL_ENV"), path("CONDA_PREFIX")]
            .into_iter()
            .chain([home.map(|h| h.join(".local"))])
            .flatten()
            .collect();
        Ok(Self {
            settings: Settings {
                sync: SYNC.read(lookup(SYNC.variable))?,
                graphs: GRAPHS.read(lookup(GRAPHS.variable))?,
            },
            algo_search: ALGO_SEARCH.read(lookup(ALGO_SEARCH.variable))?,
            decode_gemv: DECODE_GEMV.read(lookup(DECODE_GEMV.variable))?,
            sparse_gemm: SPARSE_GEMM.read(lookup(SPARSE_GEMM.variable))?,
            cache_dir,
            cusparselt: path("SLIDESPARSE_CUSPARSELT"),
            nccl: path("SLIDESPARSE_NCCL"),
            cupti: path("SLIDESPARSE_CUPTI"),
            kernel_dir: path("SLIDESPARSE_KERNEL_DIR"),
            cuda_path: path("CUDA_PATH").unwrap_or_else(|| PathBuf::from("/usr/local/cuda")),
            python_roots,
        })
    }

    /// Python environments searched for NVIDIA's pip wheels: the configured ones, then the
    /// usual system-wide and container ones.
    pub fn python_environments(&self) -> Vec<PathBuf> {
        self.python_roots
            .iter()
            .cloned()
            .chain(["/opt/torch/.venv", "/usr/local", "/usr"].map(PathBuf::from))
            .collect()
    }

    /// `file` in each of `subdirs` of the `nvidia` folder of every pip package folder
    /// (`lib/python3.*/{site,dist}-packages/nvidia`) of every environment of
    /// [`python_environments`](Self::python_environments), in that order.
    pub fn pip_library_paths(&self, subdirs: &[&str], file: &str) -> Vec<PathBuf> {
        let mut paths = Vec::new();
        for root in self.python_environments() {
            for py in PYTHON_VERSIONS {
                for pkgs in ["site-packages", "dist-packages"] {
                    let base = root.join("lib").join(py).join(pkgs).join("nvidia");
                    paths.extend(subdirs.iter().map(|d| base.join(d).join(file)));
                }
            }
        }
        paths
    }
}

/// The Python versions whose pip folders are searched.
const PYTHON_VERSIONS: [&str; 5] = [
    "python3.10",
    "python3.11",
    "python3.12",
    "python3.13",
    "python3.14",
];

/// The process's configuration, read from the environment on first use.
pub fn config() -> Result<&'static Config> {
    static CONFIG: std::sync::OnceLock<std::result::Result<Config, SlideSparseError>> =
        std::sync::OnceLock::new();
    // `from_lookup` fails only with `Config` errors, rebuilt here for each caller (the
    // error type is not `Clone`: it carries I/O errors elsewhere).
    CONFIG
        .get_or_init(Config::from_env)
        .as_ref()
        .map_err(|e| match e {
            SlideSparseError::Config {
                variable,
                value,
                accepted,
            } => SlideSparseError::Config {
                variable,
                value: value.clone(),
                accepted,
            },
            other => SlideSparseError::Backend(other.to_string()),
        })
}
