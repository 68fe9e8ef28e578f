//! All-reduce time of the collectives a tensor-parallel model can use, over the GPUs of this
//! process (feature `cuda`), at the sizes of tensor-parallel decode and prefill: bf16 partial
//! outputs `[rows, 4096]` of 8 KB (decode, batch 1) to 64 MB (prefill, 8192 tokens).
//!
//! - `nccl`: this crate's `cuda::NcclRanks` (NCCL in place, in burn's stream, plain backend);
//! - `burn`: burn's own `DistributedBackend::all_reduce` on the plain backend (cubecl's NCCL
//!   call on its communication stream, fenced against burn's stream) and `resolve`;
//! - `burn-fusion`: the same through burn's fusion backend (`burn::backend::Cuda`);
//! - `burn-collective-ring`, `-tree`, `-centralized`: the burn-collective crate's local
//!   all-reduce, one thread per rank (sums by tensor operations, copies between devices).
//!
//! Each is first checked (rank `r` sends `r + 1` everywhere; every rank must get
//! `R (R + 1) / 2` everywhere), then timed: `--calls` all-reduces back to back and one sync
//! of every GPU, median over `--reps`, per call.
//!
//! ```text
//! cargo run --release -p slidesparse-examples --features cuda --example collective_timing -- \
//!     --ranks 2
//! ```
//!
//! cubecl loads NCCL through cudarc, which looks for `libnccl.so` (and `.so.13`, ...) but not
//! `libnccl.so.2`, the one file NVIDIA's pip wheel ships: the burn methods are skipped, with
//! a message, unless one of cudarc's names loads (a `libnccl.so` link on the loader path).

use std::{
    sync::{Barrier, Mutex},
    time::Instant,
};

use burn::tensor::{DType, Tensor, TensorPrimitive, backend::Backend};
use burn_collective::{AllReduceStrategy, CollectiveConfig, PeerId};
use burn_slidesparse::{
    Collective,
    cuda::{
        BurnRanks, CudaBackend, CudaDevice, CudaFusionBackend, NcclRanks,
        burn_ranks::cubecl_loads_nccl, device_count,
    },
};
use clap::Parser;
use half::bf16;

type Plain = CudaBackend<bf16>;
type Fused = CudaFusionBackend<bf16>;
type Error = Box<dyn std::error::Error>;

const METHODS: [&str; 6] = [
    "nccl",
    "burn",
    "burn-fusion",
    "burn-collective-ring",
    "burn-collective-tree",
    "burn-collective-centralized",
];

/// The hidden size of Llama-3-8B: a partial output is `[tokens, 4096]` bf16.
const WIDTH: usize = 4096;

#[derive(Parser)]
struct Args {
    /// Ranks, one GPU each (GPUs 0..R); all present GPUs when left out.
    #[arg(long)]
    ranks: Option<usize>,
    /// Bytes of one rank's bf16 tensor, comma-separated (K and M suffixes; multiples of 8K).
    #[arg(long, default_value = "8K,64K,512K,4M,32M,64M")]
    sizes: String,
    /// Methods, comma-separated: nccl, burn, burn-fusion, burn-collective-ring,
    /// burn-collective-tree, burn-collective-centralized.
    #[arg(
        long,
        default_value = "nccl,burn,burn-fusion,burn-collective-ring,burn-collective-tree,burn-collective-centralized"
    )]
    methods: String,
    /// Timed repetitions per method and size (the median is reported).
    #[arg(long, default_value_t = 15)]
    reps: usize,
    /// All-reduces back to back per repetition.
    #[arg(long, default_value_t = 20)]
    calls: usize,
}

fn main() -> Result<(), Error> {
    let args = Args::parse();
    let present = device_count()?;
    let ranks = args.ranks.unwrap_or(present);
    if ranks == 0 || ranks > present {
        return Err(format!("--ranks {ranks}: {present} GPU(s) present").into());
    }
    if args.reps == 0 || args.calls == 0 {
        return Err("--reps and --calls: at least 1".into());
    }
    let sizes = parse_sizes(&args.sizes)?;
    let indices: Vec<usize> = (0..ranks).collect();
    let devices: Vec<CudaDevice> = indices.iter().map(|&index| CudaDevice { index }).collect();
    let methods: Vec<&str> = args.methods.split(',').map(str::trim).collect();
    if let Some(other) = methods.iter().find(|m| !METHODS.contains(m)) {
        return Err(format!("--methods: unknown method {other} (one of {METHODS:?})").into());
    }
    let cubecl_nccl = cubecl_loads_nccl();
    let mut columns = Vec::new();
    for method in methods {
        if let (true, Err(e)) = (method.starts_with("burn"), &cubecl_nccl) {
            eprintln!("{method}: skipped: {e}");
            continue;
        }
        let started = Instant::now();
        let times = match method {
            "nccl" => time_collective::<Plain>(
                method,
                &args,
                &sizes,
                &devices,
                &NcclRanks::new(&indices)?,
            )?,
            "burn" => time_collective::<Plain>(
                method,
                &args,
                &sizes,
                &devices,
                &BurnRanks::new(&indices)?,
            )?,
            "burn-fusion" => time_collective::<Fused>(
                method,
                &args,
                &sizes,
                &devices,
                &BurnRanks::new(&indices)?,
            )?,
            "burn-collective-ring" => {
                time_burn_collective(&args, &sizes, &devices, AllReduceStrategy::Ring)?
            }
            "burn-collective-tree" => {
                time_burn_collective(&args, &sizes, &devices, AllReduceStrategy::Tree(2))?
            }
            "burn-collective-centralized" => {
                time_burn_collective(&args, &sizes, &devices, AllReduceStrategy::Centralized)?
            }
            _ => unreachable!("methods are checked above"),
        };
        eprintln!(
            "{method}: checked and timed in {:.1} s",
            started.elapsed().as_secs_f64()
        );
        columns.push((method.to_string(), times));
    }
    print_table(ranks, &args, &sizes, &columns);
    Ok(())
}

/// `8K`, `4M`, ... as bytes; each a positive multiple of one bf16 row (8 KB).
fn parse_sizes(list: &str) -> Result<Vec<usize>, Error> {
    list.split(',')
        .map(|s| {
            let s = s.trim();
            let (digits, unit) = match s.strip_suffix(['K', 'k']) {
                Some(d) => (d, 1 << 10),
                None => match s.strip_suffix(['M', 'm']) {
                    Some(d) => (d, 1 << 20),
                    None => (s, 1),
                },
            };
            let bytes = digits
                .parse::<usize>()
                .map_err(|_| format!("--sizes: {s} is not a size"))?
                * unit;
            let row = WIDTH * size_of::<bf16>();
            if bytes == 0 || !bytes.is_multiple_of(row) {
                return Err(
                    format!("--sizes: {s} is not a positive multiple of {row} bytes").into(),
                );
            }
            Ok(bytes)
        })
        .collect()
}

/// Rows of a `[rows, WIDTH]` bf16 tensor of `bytes`.
fn rows(bytes: usize) -> usize {
    bytes / (WIDTH * size_of::<bf16>())
}

/// Every rank's tensor: `[rows, WIDTH]` of `value(rank)`.
fn parts<B: Backend>(
    devices: &[B::Device],
    rows: usize,
    value: impl Fn(usize) -> f32,
) -> Vec<Tensor<B, 2>> {
    devices
        .iter()
        .enumerate()
        .map(|(rank, device)| Tensor::full([rows, WIDTH], value(rank), (device, DType::BF16)))
        .collect()
}

fn sync_all<B: Backend>(devices: &[B::Device]) -> Result<(), Error> {
    for device in devices {
        B::sync(device)?;
    }
    Ok(())
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Median µs per call: `--calls` calls of `call` back to back, then `sync` (which waits
/// until the state is computed), `--reps` times (after one untimed repetition).
fn time_calls<T>(
    args: &Args,
    mut state: T,
    mut call: impl FnMut(T) -> Result<T, Error>,
    sync: impl Fn(&T) -> Result<(), Error>,
) -> Result<f64, Error> {
    let mut times = Vec::with_capacity(args.reps);
    for rep in 0..=args.reps {
        sync(&state)?;
        let start = Instant::now();
        for _ in 0..args.calls {
            state = call(state)?;
        }
        sync(&state)?;
        if rep > 0 {
            times.push(start.elapsed().as_secs_f64() * 1e6 / args.calls as f64);
        }
    }
    Ok(median(times))
}

/// `collective`'s all-reduce on `B` (`NcclRanks`, `BurnRanks`), checked and then timed at
/// every size.
fn time_collective<B: Backend<Device = CudaDevice>>(
    method: &str,
    args: &Args,
    sizes: &[usize],
    devices: &[CudaDevice],
    collective: &impl Collective<B>,
) -> Result<Vec<f64>, Error> {
    let ones = parts::<B>(devices, 1, |r| (r + 1) as f32);
    for (rank, sum) in collective.all_reduce_sum(ones)?.into_iter().enumerate() {
        check_sum(method, rank, devices.len(), sum)?;
    }
    sizes
        .iter()
        .map(|&bytes| {
            time_calls(
                args,
                parts::<B>(devices, rows(bytes), |_| 0.0),
                |x| Ok(collective.all_reduce_sum(x)?),
                |_| sync_all::<B>(devices),
            )
        })
        .collect()
}

/// burn-collective's local all-reduce with `strategy`, one thread per rank (its API blocks
/// each caller until every rank has called). Rank 0's thread keeps the time; the others keep
/// in step through the collective and a barrier around each repetition.
fn time_burn_collective(
    args: &Args,
    sizes: &[usize],
    devices: &[CudaDevice],
    strategy: AllReduceStrategy,
) -> Result<Vec<f64>, Error> {
    let ranks = devices.len();
    burn_collective::reset_collective::<Plain>();
    let config = CollectiveConfig::default()
        .with_num_devices(ranks)
        .with_local_all_reduce_strategy(strategy);
    let barrier = Barrier::new(ranks);
    let times = Mutex::new(Vec::new());
    std::thread::scope(|scope| {
        for (rank, device) in devices.iter().enumerate() {
            let (config, barrier, times) = (config.clone(), &barrier, &times);
            scope.spawn(move || {
                let id = PeerId::from(rank as u32);
                let run = || -> Result<Vec<f64>, Error> {
                    burn_collective::register::<Plain>(id, device.clone(), config)
                        .map_err(|e| format!("register: {e:?}"))?;
                    let sum = |x: Tensor<Plain, 2>| -> Result<Tensor<Plain, 2>, Error> {
                        let out = burn_collective::all_reduce::<Plain>(
                            id,
                            x.into_primitive().tensor(),
                            burn_collective::ReduceOperation::Sum,
                        )
                        .map_err(|e| format!("all_reduce: {e:?}"))?;
                        Ok(Tensor::from_primitive(TensorPrimitive::Float(out)))
                    };
                    let ones = Tensor::full([1, WIDTH], (rank + 1) as f32, (device, DType::BF16));
                    check_sum("burn-collective", rank, ranks, sum(ones)?)?;
                    let mut mine = Vec::new();
                    for &bytes in sizes {
                        let one = time_calls(
                            args,
                            Tensor::<Plain, 2>::zeros([rows(bytes), WIDTH], (device, DType::BF16)),
                            sum,
                            |x| {
                                // burn-collective sums on its own threads, in streams of
                                // their own: reading the result waits for them (a sync of
                                // this thread's stream would not).
                                x.clone().slice([0..1, 0..1]).into_data();
                                barrier.wait();
                                Ok(())
                            },
                        )?;
                        mine.push(one);
                    }
                    burn_collective::finish_collective::<Plain>(id)
                        .map_err(|e| format!("finish: {e:?}"))?;
                    Ok(mine)
                };
                match run() {
                    Ok(mine) if rank == 0 => *times.lock().unwrap() = mine,
                    Ok(_) => {}
                    Err(e) => {
                        // The other ranks wait for this one in the collective or at the
                        // barrier, forever: end the process.
                        eprintln!("burn-collective: rank {rank}: {e}");
                        std::process::exit(1);
                    }
                }
            });
        }
    });
    Ok(times.into_inner().unwrap())
}

/// Checks that `rank`'s result of one all-reduce of `r + 1` over `ranks` ranks holds
/// `R (R + 1) / 2` everywhere.
fn check_sum<B: Backend>(
    method: &str,
    rank: usize,
    ranks: usize,
    got: Tensor<B, 2>,
) -> Result<(), Error> {
    let want = (ranks * (ranks + 1) / 2) as f32;
    let got = got.into_data().convert::<f32>().into_vec::<f32>()?;
    match got.iter().find(|&&v| v != want) {
        Some(bad) => Err(format!("{method}: rank {rank} holds {bad}, not the sum {want}").into()),
        None => Ok(()),
    }
}

fn print_table(ranks: usize, args: &Args, sizes: &[usize], columns: &[(String, Vec<f64>)]) {
    println!(
        "\nall-reduce (sum) of one bf16 [rows, {WIDTH}] tensor per rank over {ranks} GPU(s): \
         median µs per call ({} calls back to back, then a sync; {} reps); x = nccl µs / method µs",
        args.calls, args.reps
    );
    let header: Vec<&str> = columns.iter().map(|(m, _)| m.as_str()).collect();
    println!("| bytes per rank | rows | {} |", header.join(" | "));
    println!("|---|---|{}", "---|".repeat(columns.len()));
    let nccl = columns.iter().find(|(m, _)| m == "nccl").map(|(_, t)| t);
    for (i, &bytes) in sizes.iter().enumerate() {
        let cells: Vec<String> = columns
            .iter()
            .map(|(method, times)| match nccl {
                Some(nccl) if method != "nccl" => {
                    format!("{:.1} ({:.2}x)", times[i], nccl[i] / times[i])
                }
                _ => format!("{:.1}", times[i]),
            })
            .collect();
        println!(
            "| {} | {} | {} |",
            human(bytes),
            rows(bytes),
            cells.join(" | ")
        );
    }
}

fn human(bytes: usize) -> String {
    if bytes.is_multiple_of(1 << 20) {
        format!("{} MB", bytes >> 20)
    } else {
        format!("{} KB", bytes >> 10)
    }
}
