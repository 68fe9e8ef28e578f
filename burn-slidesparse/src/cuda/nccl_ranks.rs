//! NCCL collectives on burn-cuda: the [`Collective`] that tensor-parallel layers combine
//! their shards' outputs with when every rank is a GPU of this process.
//!
//! One process drives every rank (single controller). Each rank's call is queued on
//! **cubecl's device thread of that rank's GPU**, behind the launches queued before it, and
//! enqueued there on burn's stream of the calling cubecl stream (found once per device and
//! stream by the device's lanes, as for the GEMMs: `queued`). So every NCCL kernel sits in
//! its stream exactly where
//! the collective stands in the program, and nothing waits on the host: the caller returns
//! once every rank's call is queued.
//!
//! Two device threads issuing one call each on their own communicator is NCCL's "one
//! thread per GPU" model, which needs no group calls: each `ncclAllReduce` only launches
//! its kernel, and the kernels meet on the GPUs. Every rank's queue is flushed after the
//! calls are queued, so no rank's kernel waits on a peer whose call is still in a queue.
//!
//! Everything that can be checked before queueing (ranks, devices, shapes, dtypes, burn's
//! streams) is checked for **all** ranks before the first call is queued: a collective
//! queued on some ranks and not others would leave those ranks' kernels waiting forever.
//! A call that still fails on a device thread cannot reach the caller: its output is
//! NaN-filled where it could be resolved, its error goes to the cubecl stream that queued it
//! (`crate::deferred`: that stream's next call returns it), and with more than one rank
//! every communicator is aborted at once (`ncclCommAbort`), so that the peers' kernels,
//! which would wait forever for the missing call, end. Every later collective, on any
//! thread, says the ranks were aborted and why.
//!
//! Collectives from several threads are queued one at a time (a lock): each rank must see
//! the collectives in the same order, or NCCL pairs one thread's call on rank 0 with
//! another's on rank 1.

use std::{
    ffi::c_int,
    sync::{Arc, Mutex, RwLock},
};

use burn::tensor::{DType, Shape, Tensor, TensorPrimitive};
use burn_cubecl::{FloatElement, kernel::into_contiguous, tensor::CubeTensor};
use cubecl::{
    Runtime as _,
    cuda::CudaDevice,
    device::Device,
    device_handle::DeviceHandle,
    server::{Binding, ComputeServer},
    stream_id::StreamId,
};
use cudarc::driver::sys;

use super::{
    config::config,
    driver::{cuda_device, device_count},
    nccl::{Comm, Nccl, data_type, op},
    queued::{Lanes, lanes, queue_task},
    runtime::{Client, CudaBackend, Runtime, Server},
};
use crate::{
    collective::Collective,
    deferred,
    error::{Result, SlideSparseError},
};

/// The oldest NCCL accepted: every entry point bound here is older, but older versions
/// are untested here (the GPU hosts' pip wheels ship newer ones).
const MIN_VERSION: i32 = 21800;

/// The GPUs of this process as tensor-parallel ranks, with one NCCL communicator each:
/// [`Collective`] for burn-cuda's plain backend ([`CudaBackend`]).
pub struct NcclRanks {
    ranks: Vec<Rank>,
    health: Arc<Health>,
    /// Held while a collective is queued on every rank (same order on every rank).
    queueing: Mutex<()>,
}

/// One rank: its device, its communicator, the queue of the device's cubecl thread and
/// the device's lanes (burn's stream of each cubecl stream).
struct Rank {
    device: usize,
    comm: Comm,
    client: Client,
    queue: DeviceHandle<Server>,
    lanes: Arc<Mutex<Lanes>>,
}

/// What the device threads share: the library and every communicator (to abort them all).
struct Health {
    nccl: Arc<Nccl>,
    /// Every rank's communicator, as integers.
    comms: Vec<usize>,
    /// Why the communicators were aborted, once they were. Calls hold the read side while
    /// they call NCCL; the abort takes the write side.
    aborted: RwLock<Option<String>>,
}

impl Health {
    /// After a failed call: with peers, aborts every communicator (once) so that no kernel
    /// waits for the call that did not happen.
    fn abort_peers(&self, error: &SlideSparseError) {
        if self.comms.len() > 1 {
            let mut aborted = self.aborted.write().unwrap_or_else(|e| e.into_inner());
            if aborted.is_none() {
                for &comm in &self.comms {
                    // SAFETY: a live communicator (aborted once, under the write lock, so no
                    // call is being enqueued on it); its kernels in flight end.
                    let _ = unsafe { (self.nccl.ncclCommAbort)(comm as Comm) };
                }
                *aborted = Some(error.to_string());
            }
        }
    }
}

// SAFETY: a communicator is only used by tasks on its own device's cubecl thread, which
// runs them one at a time (and by `Drop`, through the same queue), or aborted through
// `Health::abort_peers`, which NCCL allows from any thread; the other fields are
// thread-safe.
unsafe impl Send for NcclRanks {}
// SAFETY: as above; `&self` methods queue tasks under the `queueing` lock (one collective
// at a time, the same order on every rank) and lock the other mutexes.
unsafe impl Sync for NcclRanks {}
// SAFETY: `Health` holds the communicators as integers, used only as described above.
unsafe impl Send for Health {}
// SAFETY: as above.
unsafe impl Sync for Health {}

impl std::fmt::Debug for NcclRanks {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let devices: Vec<usize> = self.ranks.iter().map(|r| r.device).collect();
        f.debug_struct("NcclRanks")
            .field("devices", &devices)
            .field("library", &self.health.nccl.path())
            .finish()
    }
}

/// Which collective a queued call runs.
#[derive(Clone, Copy)]
enum Call {
    /// Sum of `count` elements over the ranks, into the output.
    AllReduceSum,
    /// Every rank's `count` elements, rank-major, into an output `ranks` times as long.
    AllGather,
}

/// One rank's queued call: its buffers, size and stream.
struct Queued {
    call: Call,
    input: Binding,
    output: Binding,
    /// Elements of the input.
    count: usize,
    /// Elements of the output (NaN-filled if the call fails).
    out_len: usize,
    dtype: DType,
    stream_id: StreamId,
    burn_stream: usize,
    comm: Comm,
}
// SAFETY: cubecl bindings (which keep their memory alive), sizes, and the communicator and
// stream handles of the rank whose device thread runs the task (see `NcclRanks`).
unsafe impl Send for Queued {}

impl NcclRanks {
    /// One rank per CUDA device of `devices` (device indices, rank 0 first), with NCCL
    /// found as `docs/configuration.md` says.
    ///
    /// Errors: no NCCL or one older than 2.18 ([`SlideSparseError::LibraryUnavailable`]);
    /// no devices, a device named twice (NCCL runs one rank per GPU) or past the last one;
    /// `ncclCommInitAll` failing ([`SlideSparseError::Nccl`]).
    pub fn new(devices: &[usize]) -> Result<Self> {
        check_devices("NcclRanks", devices)?;
        let nccl = Nccl::load(config()?)?;
        let version = nccl.version()?;
        if version < MIN_VERSION {
            return Err(SlideSparseError::LibraryUnavailable {
                library: "NCCL",
                detail: format!(
                    "{} is version {version}; tensor parallelism needs >= {MIN_VERSION} (2.18)",
                    nccl.path().display()
                ),
            });
        }
        let mut comms: Vec<Comm> = vec![std::ptr::null_mut(); devices.len()];
        let list: Vec<c_int> = devices.iter().map(|&d| d as c_int).collect();
        // SAFETY: `comms` has room for one communicator per device of `list`; the devices
        // exist and are distinct (checked above).
        let status = unsafe {
            (nccl.ncclCommInitAll)(comms.as_mut_ptr(), list.len() as c_int, list.as_ptr())
        };
        nccl.check("ncclCommInitAll", status)?;
        let health = Arc::new(Health {
            nccl: Arc::new(nccl),
            comms: comms.iter().map(|&c| c as usize).collect(),
            aborted: RwLock::default(),
        });
        let ranks = devices
            .iter()
            .zip(comms)
            .map(|(&index, comm)| {
                let device = CudaDevice { index };
                Ok(Rank {
                    device: index,
                    comm,
                    // The client first: it makes sure the device's runner is cubecl-cuda's
                    // own before the queue attaches to it.
                    client: Runtime::client(&device),
                    queue: DeviceHandle::new(device.to_id()),
                    lanes: lanes(index)?,
                })
            })
            .collect::<Result<_>>()?;
        Ok(Self {
            ranks,
            health,
            queueing: Mutex::default(),
        })
    }

    /// The CUDA device of every rank, rank 0 first.
    pub fn devices(&self) -> Vec<usize> {
        self.ranks.iter().map(|r| r.device).collect()
    }

    /// burn's stream on `rank`'s device for the current cubecl stream (its lane's, probed
    /// once).
    fn burn_stream(&self, rank: usize) -> Result<usize> {
        let rank = &self.ranks[rank];
        let mut lanes = rank.lanes.lock().unwrap_or_else(|e| e.into_inner());
        match lanes.current().burn_stream(&rank.client) {
            Ok(stream) => Ok(stream as usize),
            Err(e) => Err(SlideSparseError::Unsupported {
                what: "NCCL collective".into(),
                why: format!(
                    "burn's stream on CUDA device {} could not be found ({e}); the \
                     collectives are ordered on it and need CUPTI",
                    rank.device
                ),
            }),
        }
    }

    /// The failure of work queued earlier on the current cubecl stream (reported once,
    /// `crate::deferred`), or that the communicators were aborted.
    fn take_failures(&self) -> Result<()> {
        deferred::take_current()?;
        match &*self
            .health
            .aborted
            .read()
            .unwrap_or_else(|e| e.into_inner())
        {
            Some(why) => Err(SlideSparseError::Unsupported {
                what: "NCCL collective".into(),
                why: format!(
                    "the communicators were aborted after a call failed ({why}); create new \
                     NcclRanks"
                ),
            }),
            None => Ok(()),
        }
    }

    /// Checks every rank's tensor (its device, `dims`, a dtype NCCL reduces) and returns
    /// them contiguous, before anything is queued.
    fn prepare<F: FloatElement>(
        &self,
        what: &str,
        parts: Vec<Tensor<CudaBackend<F>, 2>>,
    ) -> Result<Vec<CubeTensor<Runtime>>> {
        if parts.len() != self.ranks.len() {
            return Err(SlideSparseError::shape(
                format!("{what}: tensors (one per rank)"),
                self.ranks.len(),
                parts.len(),
            ));
        }
        let dims = parts[0].dims();
        parts
            .into_iter()
            .zip(&self.ranks)
            .map(|(part, rank)| {
                if part.dims() != dims {
                    return Err(SlideSparseError::shape(
                        format!("{what}: a rank's tensor"),
                        dims,
                        part.dims(),
                    ));
                }
                contiguous_on(what, rank, part)
            })
            .collect()
    }

    /// Queues `call` on rank `rank`'s device thread, on `burn_stream` (the calling
    /// thread's), into a buffer of `out_scale` times `x`'s length (`x` itself where that is
    /// 1 and nothing else holds it); returns the output's handle.
    fn queue_one(
        &self,
        call: Call,
        rank: usize,
        x: &CubeTensor<Runtime>,
        burn_stream: usize,
        out_scale: usize,
    ) -> cubecl::server::Handle {
        let count = x.meta.shape.num_elements();
        let out_len = count * out_scale;
        // An all-reduce of a buffer nothing else holds runs in place (NCCL allows it): no
        // allocation per call.
        let output = if out_scale == 1 && x.handle.can_mut() {
            x.handle.clone()
        } else {
            x.client.empty(out_len * x.dtype.size())
        };
        let queued = Queued {
            call,
            input: x.handle.clone().binding(),
            output: output.clone().binding(),
            count,
            out_len,
            dtype: x.dtype,
            stream_id: StreamId::current(),
            burn_stream,
            comm: self.ranks[rank].comm,
        };
        let health = self.health.clone();
        queue_task(&self.ranks[rank].queue, move |server| {
            queued
                .run(&health, server)
                .inspect_err(|error| health.abort_peers(error))
        });
        output
    }

    /// Queues `call` on every rank (inputs checked by `prepare`), each into a buffer of
    /// `out_scale` times its input's length (the input itself where that is 1 and nothing
    /// else holds it), and returns the outputs' handles.
    fn queue_all(
        &self,
        call: Call,
        inputs: &[CubeTensor<Runtime>],
        out_scale: usize,
    ) -> Result<Vec<cubecl::server::Handle>> {
        let _one_at_a_time = self.queueing.lock().unwrap_or_else(|e| e.into_inner());
        self.take_failures()?;
        let streams = (0..self.ranks.len())
            .map(|rank| self.burn_stream(rank))
            .collect::<Result<Vec<_>>>()?;
        let outputs = inputs
            .iter()
            .zip(streams)
            .enumerate()
            .map(|(rank, (x, burn_stream))| self.queue_one(call, rank, x, burn_stream, out_scale))
            .collect();
        // Every rank's call must be issued for any rank's kernel to finish (one rank waits
        // on no peer: its queue is issued in its own time).
        if self.ranks.len() > 1 {
            for rank in &self.ranks {
                rank.queue.flush_queue();
            }
        }
        Ok(outputs)
    }

    /// Rank `rank`'s part of an all-reduce (sum), called by the thread that drives that
    /// rank: NCCL's one-thread-per-GPU use, for a program that runs each rank on its own
    /// thread. The call is queued on the rank's device thread, on burn's stream of the
    /// calling thread, and returns at once; the sum lands where the peers' calls meet it on
    /// the GPUs.
    ///
    /// Every rank's thread must make the same calls in the same order, and a program uses
    /// either these or the all-rank [`Collective`] calls, not both: nothing pairs one
    /// thread's call with another's here. A rank that stops before making its call must
    /// [`abort`](Self::abort), or its peers' kernels wait forever.
    ///
    /// Errors: as [`Collective::all_reduce_sum`], for this rank's tensor alone; the error of
    /// an earlier call that failed on a device thread.
    pub fn all_reduce_sum_rank<F: FloatElement>(
        &self,
        rank: usize,
        part: Tensor<CudaBackend<F>, 2>,
    ) -> Result<Tensor<CudaBackend<F>, 2>> {
        let Some(this) = self.ranks.get(rank) else {
            return Err(SlideSparseError::shape(
                "all_reduce_sum_rank: rank",
                self.ranks.len(),
                rank + 1,
            ));
        };
        let x = contiguous_on("all_reduce_sum_rank", this, part)?;
        self.take_failures()?;
        let burn_stream = self.burn_stream(rank)?;
        let output = self.queue_one(Call::AllReduceSum, rank, &x, burn_stream, 1);
        if self.ranks.len() > 1 {
            // The peers' kernels wait for this one: issue it now.
            this.queue.flush_queue();
        }
        Ok(float(CubeTensor::new_contiguous(
            x.client.clone(),
            x.device.clone(),
            x.meta.shape.clone(),
            output,
            x.dtype,
        )))
    }

    /// Aborts every rank's communicator (once), so that no peer's kernel waits for a call
    /// a rank will not make; later calls are refused (with one rank, nothing waits: the
    /// calling stream's next call reports `why`). For programs driving each rank from its
    /// own thread ([`all_reduce_sum_rank`](Self::all_reduce_sum_rank)) when a rank's step
    /// fails before its call.
    pub fn abort(&self, why: &str) {
        let error = SlideSparseError::Unsupported {
            what: "NCCL collective".into(),
            why: format!("a rank stopped before its call: {why}"),
        };
        self.health.abort_peers(&error);
        deferred::record_current(error);
    }
}

impl Queued {
    /// Runs on the rank's cubecl device thread (context current): resolves the buffers and
    /// enqueues the NCCL call on burn's stream; fills the output with NaN if that fails.
    fn run(self, health: &Health, server: &mut Server) -> Result<()> {
        let nccl = &health.nccl;
        let resolve = |server: &mut Server, binding: Binding| {
            server
                .get_resource(binding, self.stream_id)
                .map(|r| r.resource().ptr)
                .map_err(|e| SlideSparseError::Cubecl {
                    what: "get_resource (NCCL collective)",
                    detail: format!("{e:?}"),
                })
        };
        let out = resolve(server, self.output.clone())?;
        let result = resolve(server, self.input.clone()).and_then(|input| {
            let dtype = nccl_type(self.dtype)?;
            // Held through the call: an abort (the write side) waits for calls in flight,
            // and no call starts on an aborted (freed) communicator.
            let aborted = health.aborted.read().unwrap_or_else(|e| e.into_inner());
            if let Some(why) = &*aborted {
                return Err(SlideSparseError::Unsupported {
                    what: "NCCL collective".into(),
                    why: format!("the communicators were aborted after a call failed ({why})"),
                });
            }
            let stream = self.burn_stream as *mut std::ffi::c_void;
            let (input, output) = (
                input as *const std::ffi::c_void,
                out as *mut std::ffi::c_void,
            );
            // SAFETY: live cubecl allocations of `count` (input) and `out_len` (output)
            // elements of `dtype`, kept alive by their bindings until this task ends, then
            // reused only by later work on burn's stream (cubecl's pools are per stream,
            // and other streams wait on events); the communicator is this device's, used
            // only on this thread.
            let (call, status) = unsafe {
                match self.call {
                    Call::AllReduceSum => (
                        "ncclAllReduce",
                        (nccl.ncclAllReduce)(
                            input,
                            output,
                            self.count,
                            dtype,
                            op::SUM,
                            self.comm,
                            stream,
                        ),
                    ),
                    Call::AllGather => (
                        "ncclAllGather",
                        (nccl.ncclAllGather)(input, output, self.count, dtype, self.comm, stream),
                    ),
                }
            };
            nccl.check(call, status)
        });
        if result.is_err() {
            // SAFETY: `out` holds `out_len` elements of a 2- or 4-byte dtype; burn's stream
            // is live.
            unsafe {
                poison(
                    out,
                    self.out_len,
                    self.dtype,
                    self.burn_stream as sys::CUstream,
                )
            };
        }
        result
    }
}

impl<F: FloatElement> Collective<CudaBackend<F>> for NcclRanks {
    fn ranks(&self) -> usize {
        self.ranks.len()
    }

    fn all_reduce_sum(
        &self,
        parts: Vec<Tensor<CudaBackend<F>, 2>>,
    ) -> Result<Vec<Tensor<CudaBackend<F>, 2>>> {
        let inputs = self.prepare("all_reduce_sum", parts)?;
        let outputs = self.queue_all(Call::AllReduceSum, &inputs, 1)?;
        Ok(inputs
            .iter()
            .zip(outputs)
            .map(|(x, out)| {
                float(CubeTensor::new_contiguous(
                    x.client.clone(),
                    x.device.clone(),
                    x.meta.shape.clone(),
                    out,
                    x.dtype,
                ))
            })
            .collect())
    }

    fn all_gather(
        &self,
        parts: Vec<Tensor<CudaBackend<F>, 2>>,
    ) -> Result<Vec<Tensor<CudaBackend<F>, 2>>> {
        let inputs = self.prepare("all_gather", parts)?;
        let outputs = self.queue_all(Call::AllGather, &inputs, self.ranks.len())?;
        let ranks = self.ranks.len();
        Ok(inputs
            .iter()
            .zip(outputs)
            .map(|(x, out)| {
                let [m, n] = [x.meta.shape[0], x.meta.shape[1]];
                // NCCL writes rank-major `[R, M, n]`; the layer's output is `[M, R·n]`.
                let gathered: Tensor<CudaBackend<F>, 3> =
                    Tensor::from_primitive(TensorPrimitive::Float(CubeTensor::new_contiguous(
                        x.client.clone(),
                        x.device.clone(),
                        Shape::new([ranks, m, n]),
                        out,
                        x.dtype,
                    )));
                gathered.swap_dims(0, 1).reshape([m, ranks * n])
            })
            .collect())
    }
}

impl Drop for NcclRanks {
    fn drop(&mut self) {
        // Communicators aborted after a failure are freed already.
        if self
            .health
            .aborted
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .is_some()
        {
            return;
        }
        // Destroyed on each device's thread, behind every call queued there, all ranks at
        // once (finalizing a communicator waits for its peers' calls).
        for rank in &self.ranks {
            let (nccl, comm) = (self.health.nccl.clone(), rank.comm as usize);
            rank.queue.submit(move |_server: &mut Server| {
                // SAFETY: the communicator is destroyed once, after every call queued on it.
                let _ = unsafe { (nccl.ncclCommDestroy)(comm as Comm) };
            });
            rank.queue.flush_queue();
        }
        for rank in &self.ranks {
            let _ = rank.queue.exclusive(|| ());
        }
    }
}

fn float<F: FloatElement>(t: CubeTensor<Runtime>) -> Tensor<CudaBackend<F>, 2> {
    Tensor::from_primitive(TensorPrimitive::Float(t))
}

/// The devices as ranks: at least one, each present, none twice.
pub(super) fn check_devices(what: &str, devices: &[usize]) -> Result<()> {
    let invalid = |detail: String| SlideSparseError::InvalidSplit {
        layer: what.into(),
        ranks: devices.len(),
        detail,
    };
    if devices.is_empty() {
        return Err(invalid("at least one device is needed".into()));
    }
    for (i, d) in devices.iter().enumerate() {
        if devices[..i].contains(d) {
            return Err(invalid(format!(
                "CUDA device {d} is named twice; NCCL runs one rank per GPU ({} present)",
                device_count()?
            )));
        }
        cuda_device(*d)?;
    }
    Ok(())
}

/// `part` contiguous, checked to be on `rank`'s device in a dtype NCCL reduces.
fn contiguous_on<F: FloatElement>(
    what: &str,
    rank: &Rank,
    part: Tensor<CudaBackend<F>, 2>,
) -> Result<CubeTensor<Runtime>> {
    let t = into_contiguous(part.into_primitive().tensor());
    if t.device.index != rank.device {
        return Err(SlideSparseError::Unsupported {
            what: format!("NCCL {what}"),
            why: format!(
                "a tensor of the rank on CUDA device {} is on device {}",
                rank.device, t.device.index
            ),
        });
    }
    nccl_type(t.dtype)?;
    Ok(t)
}

/// NCCL's data type for a float dtype of burn-cuda.
fn nccl_type(dtype: DType) -> Result<i32> {
    match dtype {
        DType::F32 => Ok(data_type::FLOAT32),
        DType::BF16 => Ok(data_type::BFLOAT16),
        DType::F16 => Ok(data_type::FLOAT16),
        other => Err(SlideSparseError::UnsupportedDtype {
            name: "NCCL collective input".into(),
            dtype: format!("{other:?}"),
            context: "tensor-parallel collectives reduce f32, bf16 or f16".into(),
        }),
    }
}

/// Fills `len` elements of `dtype` at `ptr` with NaN on `stream`.
///
/// # Safety
/// `ptr` is a device allocation of at least `len` elements of `dtype` (2 or 4 bytes) and
/// `stream` a live stream of its device, with the device's context current.
unsafe fn poison(ptr: u64, len: usize, dtype: DType, stream: sys::CUstream) {
    // SAFETY: the caller's contract.
    let _ = unsafe {
        match dtype {
            DType::BF16 => sys::cuMemsetD16Async(ptr, 0x7FC0, len, stream),
            DType::F16 => sys::cuMemsetD16Async(ptr, 0x7E00, len, stream),
            _ => sys::cuMemsetD32Async(ptr, 0x7FC0_0000, len, stream),
        }
    };
}
