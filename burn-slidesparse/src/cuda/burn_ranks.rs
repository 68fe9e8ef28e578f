//! burn's own all-reduce as a [`Collective`]: [`BurnRanks`], for any backend that
//! implements burn's `DistributedBackend` on CUDA devices, burn's fusion backend
//! (`burn::backend::Cuda`) included, which [`NcclRanks`](super::NcclRanks) does not serve.
//!
//! burn's CUDA backends all-reduce through cubecl: each rank's `ncclAllReduce` runs on
//! cubecl's communication stream of that GPU, fenced after burn's stream (an event), and
//! `resolve` makes burn's stream wait for it (another event, and a flush of the device's
//! queue). The GPU is never waited for; under fusion, `resolve` also drains the rank's fusion
//! stream (a blocking round trip to its fusion thread, once per rank and all-reduce, which
//! ends fusion's look-ahead there). [`NcclRanks`](super::NcclRanks) instead enqueues the call
//! in burn's stream itself, with no events, flush or drain; which one the example model uses,
//! and why, is in `docs/decisions/tensor-parallel.md`.
//!
//! cubecl runs its NCCL calls inside tasks on the device threads, where a failure is a
//! panic that the device thread logs and swallows: the rank's tensor comes back unreduced
//! and no error reaches the caller. So [`BurnRanks::new`] settles what it can first:
//! - cubecl loads NCCL through cudarc, which panics when none of its library names loads
//!   (it never tries `libnccl.so.2`, the one file NVIDIA's pip wheel ships): the same names
//!   are tried first, and a typed error says how to fix it;
//! - one all-reduce of ones runs on every rank and is read back: the communicators are
//!   created (cubecl creates them once, at the first call) and must give `R` everywhere.
//!
//! A failure after that (a lost peer, an NCCL error) is not detected: the ranks' tensors
//! come back unreduced. [`NcclRanks`](super::NcclRanks) reports it and aborts the
//! communicators.

use std::sync::Mutex;

use burn::tensor::{
    DType, Tensor, TensorPrimitive,
    backend::{
        Backend, DeviceId, DeviceOps,
        distributed::{DistributedBackend, ReduceOperation},
    },
};
use cubecl::cuda::CudaDevice;
use libloading::Library;

use super::{nccl_ranks::check_devices, runtime::CudaBackend};
use crate::{
    error::{Result, SlideSparseError},
    collective::Collective,
};

/// The GPUs of this process as tensor-parallel ranks, all-reduced through burn's own
/// `DistributedBackend` (cubecl's NCCL): [`Collective`] for every such backend on CUDA
/// devices, [`CudaBackend`] and [`CudaFusionBackend`](super::runtime::CudaFusionBackend) included.
///
/// Each call costs 2-6x what [`NcclRanks`](super::NcclRanks) costs (one H200: 6-9 µs on the
/// plain backend, 18-20 µs on fusion, against 3 µs; `docs/decisions/tensor-parallel.md`):
/// on the plain backend use `NcclRanks`; this is for burn's fusion backend, which that does
/// not serve.
///
/// `all_gather` has no counterpart in burn's API: it is an all-reduce of each rank's part
/// placed in zeros (exact but for a `-0.0`, which becomes `+0.0`): inputs `R` times a part,
/// twice the traffic of an all-gather.
#[derive(Debug)]
pub struct BurnRanks {
    devices: Vec<CudaDevice>,
    ids: Vec<DeviceId>,
    /// Collectives from several threads are queued one at a time: every rank must see them
    /// in the same order.
    queueing: Mutex<()>,
}

impl BurnRanks {
    /// Ranks on the CUDA devices `devices` (rank 0 first), their communicators created by
    /// one all-reduce that is checked before this returns (module docs).
    ///
    /// Errors: no devices, a device named twice or past the last one; cudarc (cubecl's
    /// loader) finding no NCCL ([`SlideSparseError::LibraryUnavailable`]); the first
    /// all-reduce not giving the sum ([`SlideSparseError::Unsupported`]).
    pub fn new(devices: &[usize]) -> Result<Self> {
        check_devices("BurnRanks", devices)?;
        cubecl_loads_nccl()?;
        let devices: Vec<CudaDevice> = devices.iter().map(|&index| CudaDevice { index }).collect();
        let ranks = Self {
            ids: devices.iter().map(DeviceOps::id).collect(),
            devices,
            queueing: Mutex::default(),
        };
        // The dtype is explicit: a tensor created with the device's default dtype would fix
        // that default (burn keeps one per device, whatever the backend's float type) to
        // f32 for the whole process, and the caller's bf16 model would then create f32
        // activations.
        let ones: Vec<Tensor<CudaBackend<f32>, 2>> = ranks
            .devices
            .iter()
            .map(|device| Tensor::ones([1, 1], (device, DType::F32)))
            .collect();
        let sums = Collective::<CudaBackend<f32>>::all_reduce_sum(&ranks, ones)?;
        let want = ranks.devices.len() as f32;
        for (sum, device) in sums.into_iter().zip(&ranks.devices) {
            let got = sum.into_data().convert::<f32>().into_vec::<f32>();
            if !matches!(&got, Ok(v) if v[..] == [want]) {
                return Err(SlideSparseError::Unsupported {
                    what: "burn's all-reduce".into(),
                    why: format!(
                        "the first all-reduce of ones over {} rank(s) gave {got:?} on CUDA \
                         device {}, not [{want}]; cubecl's NCCL call failed on its device \
                         thread (its log says why)",
                        ranks.devices.len(),
                        device.index
                    ),
                });
            }
        }
        Ok(ranks)
    }

    /// The CUDA device of every rank, rank 0 first.
    pub fn devices(&self) -> Vec<usize> {
        self.devices.iter().map(|d| d.index).collect()
    }

    /// One tensor per rank, on its rank's device, all of one shape and a float dtype NCCL
    /// reduces: checked for every rank before any call is queued.
    fn check<B: Backend<Device = CudaDevice>>(
        &self,
        what: &str,
        parts: &[Tensor<B, 2>],
    ) -> Result<()> {
        if parts.len() != self.devices.len() {
            return Err(SlideSparseError::shape(
                format!("{what}: tensors (one per rank)"),
                self.devices.len(),
                parts.len(),
            ));
        }
        let dims = parts[0].dims();
        for (part, device) in parts.iter().zip(&self.devices) {
            if part.dims() != dims {
                return Err(SlideSparseError::shape(
                    format!("{what}: a rank's tensor"),
                    dims,
                    part.dims(),
                ));
            }
            if part.device() != *device {
                return Err(SlideSparseError::Unsupported {
                    what: format!("burn's {what}"),
                    why: format!(
                        "a tensor of the rank on CUDA device {} is on device {}",
                        device.index,
                        part.device().index
                    ),
                });
            }
            if !matches!(part.dtype(), DType::F32 | DType::BF16 | DType::F16) {
                return Err(SlideSparseError::UnsupportedDtype {
                    name: format!("burn's {what} input"),
                    dtype: format!("{:?}", part.dtype()),
                    context: "tensor-parallel collectives reduce f32, bf16 or f16".into(),
                });
            }
        }
        Ok(())
    }
}

impl<B: DistributedBackend<Device = CudaDevice>> Collective<B> for BurnRanks {
    fn ranks(&self) -> usize {
        self.devices.len()
    }

    fn all_reduce_sum(&self, parts: Vec<Tensor<B, 2>>) -> Result<Vec<Tensor<B, 2>>> {
        self.check("all_reduce_sum", &parts)?;
        let _one_at_a_time = self.queueing.lock().unwrap_or_else(|e| e.into_inner());
        // Every rank's call is queued before any is resolved: resolving drains the rank's
        // fusion stream, and a rank whose call is not queued yet would leave its peers'
        // kernels waiting.
        let pending: Vec<_> = parts
            .into_iter()
            .map(|part| {
                B::all_reduce(
                    part.into_primitive().tensor(),
                    ReduceOperation::Sum,
                    self.ids.clone(),
                )
            })
            .collect();
        Ok(pending
            .into_iter()
            .map(|sum| Tensor::from_primitive(TensorPrimitive::Float(sum.resolve())))
            .collect())
    }

    fn all_gather(&self, parts: Vec<Tensor<B, 2>>) -> Result<Vec<Tensor<B, 2>>> {
        self.check("all_gather", &parts)?;
        let ranks = parts.len();
        let placed = parts
            .into_iter()
            .enumerate()
            .map(|(rank, part)| {
                let blocks = (0..ranks)
                    .map(|r| {
                        if r == rank {
                            part.clone()
                        } else {
                            part.zeros_like()
                        }
                    })
                    .collect();
                Tensor::cat(blocks, 1)
            })
            .collect();
        self.all_reduce_sum(placed)
    }
}

/// `Ok` when cubecl can load NCCL: one of the names cudarc (its loader) tries loads. cudarc
/// panics on a device thread otherwise, at the first collective or copy between GPUs of
/// burn's CUDA backends.
///
/// Errors: [`SlideSparseError::LibraryUnavailable`], naming the names tried and the fix.
pub fn cubecl_loads_nccl() -> Result<()> {
    let names = cudarc::get_lib_name_candidates("nccl");
    let loads = |name: &String| {
        // SAFETY: loading NCCL runs only its library initializers, which have no
        // preconditions; the handle is dropped at once (cudarc opens it again by name).
        unsafe { Library::new(name) }.is_ok()
    };
    if names.iter().any(loads) {
        return Ok(());
    }
    Err(SlideSparseError::LibraryUnavailable {
        library: "NCCL",
        detail: format!(
            "burn's all-reduce loads NCCL through cudarc, which found none of {names:?} on the \
             loader path; NVIDIA's pip wheel ships libnccl.so.2 only: link libnccl.so to it \
             in a folder on LD_LIBRARY_PATH (NcclRanks finds libnccl.so.2 itself)"
        ),
    })
}
