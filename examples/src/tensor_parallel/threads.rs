//! One driving thread per rank: [`TensorParallelLlama::with_rank_threads`].
//!
//! A decode step of the example model is bound by the host's queuing, not by the GPU: the
//! thread that runs a rank's operations spends about as long queuing a step as the GPU
//! spends on it (`docs/decisions/tensor-parallel.md`). One thread driving every rank would
//! queue `R` ranks' steps one after the other; here each rank's thread runs its rank's
//! whole step, and the ranks meet only at the all-reduces.
//!
//! The threads live as long as [`TensorParallelLlama::with_rank_threads`]'s body, not one
//! step: cubecl keeps a stream per calling thread, and the library keeps its GEMM graphs,
//! buffers and stream lookups per device and thread, so a thread per step would capture
//! every graph again. When the body ends, the library retires the threads' GEMM graphs and
//! buffers with them.
//!
//! At an all-reduce each rank's thread calls a [`RankCollective`] for its own part:
//! - [`NcclRanks`](burn_slidesparse::cuda::NcclRanks) queues that rank's `ncclAllReduce`
//!   on its GPU from the rank's own thread (NCCL's one-thread-per-GPU use): the ranks
//!   never wait for each other on the host, and each call sits in the stream of the thread
//!   that made the part.
//! - [`MeetingRanks`] serves a single-controller [`Collective`] that combines with tensor
//!   operations ([`SimulatedRanks`](burn_slidesparse::SimulatedRanks)): every rank leaves
//!   its part, the last to arrive runs the collective for all, the others spin until their
//!   sums are there (a sleeping thread takes tens of µs to wake, against a few µs per
//!   all-reduce).
//!
//! The process thread hands each step to the ranks' threads and takes their outcomes
//! through channels polled for a few ms before sleeping ([`recv_hot`]): waking a sleeping
//! thread costs tens of µs at each of a step's two hand-offs.
//!
//! A rank whose step fails aborts the collective, so that no peer waits for it forever;
//! every later call then fails too.

use std::{
    panic::{AssertUnwindSafe, catch_unwind},
    sync::{
        Mutex,
        atomic::{AtomicBool, AtomicUsize, Ordering},
        mpsc::{Receiver, RecvError, Sender, TryRecvError, channel},
    },
    thread::{Scope, yield_now},
    time::{Duration, Instant},
};

use burn::tensor::{Int, Tensor, backend::Backend};
use burn_slidesparse::{Collective, SlideSparseBackend, SlideSparseError};

use super::{RankModel, Residual, Result, TensorParallelCache, TensorParallelLlama};

/// A rank's keys and values, per block.
type Slots<B> = Vec<(Tensor<B, 4>, Tensor<B, 4>)>;

/// What a rank's thread is asked to run: its token ids, its cache slots (handed back with
/// the outcome) and the first new position.
struct Job<B: SlideSparseBackend> {
    tokens: Tensor<B, 2, Int>,
    slots: Slots<B>,
    start: usize,
}

/// A rank's answer: its rank, its cache slots, and its residual stream after the last
/// block (`x + delta`).
type Outcome<B> = (usize, Slots<B>, Result<Tensor<B, 3>>);

/// A collective that each rank's thread calls for its own part, every rank the same calls
/// in the same order.
pub trait RankCollective<B: Backend>: Sync {
    /// Number of ranks.
    fn ranks(&self) -> usize;

    /// Rank `rank`'s `[M, n]` part summed over every rank, on the rank's device.
    fn all_reduce_sum_rank(&self, rank: usize, part: Tensor<B, 2>) -> Result<Tensor<B, 2>>;

    /// A rank's step failed before its next call: no peer may wait for it.
    fn abort(&self, why: &str);
}

#[cfg(feature = "cuda")]
mod nccl {
    use burn_slidesparse::cuda::{CudaBackend, NcclRanks};

    use super::{RankCollective, Result, Tensor};

    macro_rules! rank_collective {
        ($($f:ty),*) => {$(
            impl RankCollective<CudaBackend<$f>> for NcclRanks {
                fn ranks(&self) -> usize {
                    self.devices().len()
                }

                fn all_reduce_sum_rank(
                    &self,
                    rank: usize,
                    part: Tensor<CudaBackend<$f>, 2>,
                ) -> Result<Tensor<CudaBackend<$f>, 2>> {
                    NcclRanks::all_reduce_sum_rank(self, rank, part)
                }

                fn abort(&self, why: &str) {
                    NcclRanks::abort(self, why)
                }
            }
        )*};
    }
    rank_collective!(f32, half::bf16, half::f16);
}

/// The ranks' threads of [`TensorParallelLlama::with_rank_threads`].
pub struct RankThreads<'m, B: SlideSparseBackend> {
    model: &'m TensorParallelLlama<B>,
    collective_ranks: usize,
    jobs: Vec<Sender<Job<B>>>,
    outcomes: Receiver<Outcome<B>>,
}

impl<B: SlideSparseBackend> TensorParallelLlama<B>
where
    B::Device: Sync,
{
    /// Runs `body` with one thread per rank driving that rank's part of every forward
    /// ([`RankThreads::forward_last`]); the threads end with `body`. The same operations
    /// and results as [`forward_last`](Self::forward_last) on one thread, each rank's
    /// all-reduces called by its own thread through `collective`.
    pub fn with_rank_threads<C, R>(
        &self,
        collective: &C,
        body: impl FnOnce(&mut RankThreads<'_, B>) -> R,
    ) -> R
    where
        C: RankCollective<B> + ?Sized,
    {
        std::thread::scope(|scope| {
            let (done, outcomes) = channel();
            let jobs = (0..self.ranks())
                .map(|rank| self.spawn_rank(scope, rank, collective, done.clone()))
                .collect();
            let mut threads = RankThreads {
                model: self,
                collective_ranks: collective.ranks(),
                jobs,
                outcomes,
            };
            // The threads end when `threads` (their job senders) is dropped.
            body(&mut threads)
        })
    }

    /// Rank `rank`'s thread: runs every job it is sent, until the senders are gone.
    fn spawn_rank<'s, 'env, C: RankCollective<B> + ?Sized>(
        &'env self,
        scope: &'s Scope<'s, 'env>,
        rank: usize,
        collective: &'env C,
        done: Sender<Outcome<B>>,
    ) -> Sender<Job<B>> {
        let (send, jobs) = channel::<Job<B>>();
        let part = &self.ranks[rank];
        let heads = self.heads;
        scope.spawn(move || {
            while let Ok(mut job) = recv_hot(&jobs) {
                let sum = |p: Tensor<B, 3>| {
                    let [batch, t, width] = p.dims();
                    let flat = p.reshape([batch * t, width]);
                    let sum = collective.all_reduce_sum_rank(rank, flat)?;
                    Ok(sum.reshape([batch, t, width]))
                };
                // A panic in a rank's step must not leave its peers waiting at the next
                // all-reduce: it is this rank's error, and the collective is aborted.
                let out = catch_unwind(AssertUnwindSafe(|| part.run(&mut job, heads, sum)))
                    .unwrap_or_else(|panic| {
                        let why = panic
                            .downcast_ref::<String>()
                            .map(String::as_str)
                            .or_else(|| panic.downcast_ref::<&str>().copied())
                            .unwrap_or("a panic");
                        Err(SlideSparseError::Backend(format!("panicked: {why}")))
                    });
                if let Err(e) = &out {
                    collective.abort(&format!("rank {rank}: {e}"));
                }
                if done.send((rank, job.slots, out)).is_err() {
                    return;
                }
            }
        });
        send
    }
}

impl<B: SlideSparseBackend> RankModel<B> {
    /// Every block on this rank for `job`, the all-reduces through `sum`; returns the
    /// residual stream after the last block.
    fn run(
        &self,
        job: &mut Job<B>,
        heads: (usize, usize),
        mut sum: impl FnMut(Tensor<B, 3>) -> Result<Tensor<B, 3>>,
    ) -> Result<Tensor<B, 3>> {
        if job.slots.len() != self.blocks.len() {
            return Err(SlideSparseError::shape(
                "TensorParallelLlama: a rank's cache blocks (a forward that failed lost them)",
                self.blocks.len(),
                job.slots.len(),
            ));
        }
        let mut stream: Residual<B> = (self.embed.forward(job.tokens.clone()), None);
        for (b, slots) in (0..self.blocks.len()).zip(&mut job.slots) {
            let (x, partial) = self.attention_half(b, stream, slots, job.start, heads)?;
            let (h, partial) = self.mlp_half(b, x, sum(partial)?)?;
            stream = (h, Some(sum(partial)?));
        }
        Ok(match stream {
            (x, Some(delta)) => x + delta,
            (x, None) => x,
        })
    }
}

impl<B: SlideSparseBackend> RankThreads<'_, B> {
    /// Logits `[batch, vocab]` of the last position (on rank 0) for `tokens` (each rank's
    /// copy of the `[batch, t]` ids: [`TensorParallelLlama::upload`]) following the cached
    /// ones, each rank's part run by its own thread.
    pub fn forward_last(
        &mut self,
        tokens: Vec<Tensor<B, 2, Int>>,
        cache: &mut TensorParallelCache<B>,
    ) -> Result<Tensor<B, 2>> {
        let t = self
            .model
            .check_call(&tokens, self.collective_ranks, cache)?;
        let start = cache.len;
        for ((send, tokens), slots) in self.jobs.iter().zip(tokens).zip(&mut cache.ranks) {
            let job = Job {
                tokens,
                slots: std::mem::take(slots),
                start,
            };
            send.send(job).map_err(|_| gone())?;
        }
        let mut hidden = None;
        // Every rank's error: after one rank fails, its peers fail at their next
        // all-reduce too, and the first to answer need not be the cause.
        let mut failed = Vec::new();
        for _ in 0..self.jobs.len() {
            let (rank, slots, out) = recv_hot(&self.outcomes).map_err(|_| gone())?;
            cache.ranks[rank] = slots;
            match out {
                Ok(h) if rank == 0 => hidden = Some(h),
                Ok(_) => {}
                Err(e) => failed.push((rank, e.to_string())),
            }
        }
        if !failed.is_empty() {
            failed.sort();
            let each: Vec<String> = failed
                .iter()
                .map(|(r, e)| format!("rank {r}: {e}"))
                .collect();
            return Err(SlideSparseError::Backend(each.join("; ")));
        }
        cache.len = start + t;
        self.model.last_logits(hidden.ok_or_else(gone)?)
    }
}

/// How long a hand-off between the process thread and the ranks' threads polls before it
/// sleeps: a sleeping thread took 24-56 µs (medians) to wake for each of the two hand-offs
/// of a decode step on the H200's host, a polling one 1-2 µs
/// (`docs/decisions/tensor-parallel.md`). A decode step is a few ms, so both sides of its
/// hand-offs stay awake; between prefills or generations the threads sleep.
const HOT_WAIT: Duration = Duration::from_millis(10);

/// The next message of `from`: polled for up to [`HOT_WAIT`], then waited for asleep.
fn recv_hot<T>(from: &Receiver<T>) -> std::result::Result<T, RecvError> {
    let started = Instant::now();
    let mut backoff = Backoff::default();
    loop {
        match from.try_recv() {
            Ok(message) => return Ok(message),
            Err(TryRecvError::Disconnected) => return Err(RecvError),
            Err(TryRecvError::Empty) if started.elapsed() > HOT_WAIT => return from.recv(),
            Err(TryRecvError::Empty) => backoff.pause(),
        }
    }
}

/// The pause between two polls of a thread waiting for a peer.
#[derive(Default)]
struct Backoff {
    polls: u32,
}

impl Backoff {
    /// Spins while the peer is a few µs behind; yields the core past that.
    fn pause(&mut self) {
        self.polls += 1;
        if self.polls < 4096 {
            std::hint::spin_loop();
        } else {
            yield_now();
        }
    }
}

/// A rank's thread ended without answering (it panicked).
fn gone() -> SlideSparseError {
    SlideSparseError::Backend("TensorParallelLlama: a rank's thread ended".into())
}

/// A single-controller [`Collective`] for ranks driven by their own threads (module docs):
/// for [`SimulatedRanks`](burn_slidesparse::SimulatedRanks), whose tensor operations burn
/// orders across threads. Not for the NCCL collectives: those must be called from each
/// rank's own thread ([`RankCollective`] for `NcclRanks`).
pub struct MeetingRanks<'c, B: Backend, C> {
    collective: &'c C,
    state: Mutex<MeetingState<B>>,
    /// Counts the all-reduces completed; a waiting rank's sum is ready when it moves on.
    round: AtomicUsize,
    failed: AtomicBool,
}

struct MeetingState<B: Backend> {
    parts: Vec<Option<Tensor<B, 2>>>,
    sums: Vec<Option<Tensor<B, 2>>>,
    arrived: usize,
    /// Why the collective failed, once it has.
    error: Option<String>,
}

impl<'c, B: Backend, C: Collective<B>> MeetingRanks<'c, B, C> {
    pub fn new(collective: &'c C) -> Self {
        let ranks = collective.ranks();
        Self {
            collective,
            state: Mutex::new(MeetingState {
                parts: (0..ranks).map(|_| None).collect(),
                sums: (0..ranks).map(|_| None).collect(),
                arrived: 0,
                error: None,
            }),
            round: AtomicUsize::new(0),
            failed: AtomicBool::new(false),
        }
    }

    /// The last rank to arrive: every part summed, each rank's sum left for it.
    fn run_collective(&self, state: &mut MeetingState<B>) {
        state.arrived = 0;
        let parts: Vec<_> = state.parts.iter_mut().filter_map(Option::take).collect();
        if state.error.is_some() {
            return;
        }
        match self.collective.all_reduce_sum(parts) {
            Ok(sums) => {
                for (slot, sum) in state.sums.iter_mut().zip(sums) {
                    *slot = Some(sum);
                }
            }
            Err(e) => state.error = Some(e.to_string()),
        }
    }

    /// Spins until round `round` is complete, or fails once a rank has aborted.
    fn wait_past(&self, round: usize) -> Result<()> {
        let mut backoff = Backoff::default();
        while self.round.load(Ordering::Acquire) == round {
            self.check_failed()?;
            backoff.pause();
        }
        Ok(())
    }

    fn check_failed(&self) -> Result<()> {
        if self.failed.load(Ordering::Acquire) {
            return Err(SlideSparseError::Backend(
                "all-reduce: a rank's step failed; the ranks' threads cannot meet again".into(),
            ));
        }
        Ok(())
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, MeetingState<B>> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl<B: Backend, C: Collective<B> + Sync> RankCollective<B> for MeetingRanks<'_, B, C> {
    fn ranks(&self) -> usize {
        self.collective.ranks()
    }

    fn all_reduce_sum_rank(&self, rank: usize, part: Tensor<B, 2>) -> Result<Tensor<B, 2>> {
        self.check_failed()?;
        let round = self.round.load(Ordering::Acquire);
        {
            let mut state = self.lock();
            state.parts[rank] = Some(part);
            state.arrived += 1;
            if state.arrived == state.parts.len() {
                self.run_collective(&mut state);
                self.round.fetch_add(1, Ordering::AcqRel);
            }
        }
        self.wait_past(round)?;
        let mut state = self.lock();
        if let Some(why) = &state.error {
            return Err(SlideSparseError::Backend(format!("all-reduce: {why}")));
        }
        state.sums[rank].take().ok_or_else(|| {
            SlideSparseError::Backend("all-reduce: a rank's sum was taken twice".into())
        })
    }

    fn abort(&self, _why: &str) {
        self.failed.store(true, Ordering::Release);
    }
}
