//! GPU tests of the NCCL collectives (`NcclRanks`; `BurnRanks`, burn's own all-reduce, on the
//! plain and fusion backends) and of tensor-parallel layers combined by them, against the
//! CPU-tested simulated ranks on fresh data.
//!
//! On one GPU a communicator has one rank: the collectives are the identity (bit for bit),
//! queued on burn's stream, and a layer "split" over one rank is the layer. With two or more
//! GPUs, the layers split over every GPU must give what `SimulatedRanks` (the reference
//! collective, tested in CI) gives for the same shards; those tests say so and return early
//! where only one GPU is present. Needs an NVIDIA GPU and NCCL (`#[ignore]`d; run with
//! `--ignored` on the GPU host).
#![cfg(feature = "cuda")]

use burn::tensor::{DType, Tensor, TensorData};
use burn_slidesparse::{
    Collective, PackOptions, PackedLinear, Parallelism, Precision, SimulatedRanks,
    SlideSparseError, SlideSparseLinear, SparsityPattern, TensorParallelLinear,
    cuda::{BurnRanks, CudaBackend, CudaFusionBackend, NcclRanks},
    pack_linear,
};
use cubecl::cuda::CudaDevice;
use slidesparse_tests::{random_f32, rng};

type Gpu = CudaBackend<f32>;
type Gpu16 = CudaBackend<half::bf16>;
type Fused16 = CudaFusionBackend<half::bf16>;

fn devices() -> Vec<usize> {
    (0..burn_slidesparse::cuda::device_count().unwrap()).collect()
}

fn host<B: burn::tensor::backend::Backend>(t: Tensor<B, 2>) -> Vec<f32> {
    t.into_data().convert::<f32>().into_vec::<f32>().unwrap()
}

fn on<B: burn::tensor::backend::Backend<Device = CudaDevice>>(
    values: &[f32],
    shape: [usize; 2],
    device: usize,
    dtype: DType,
) -> Tensor<B, 2> {
    Tensor::from_data(
        TensorData::new(values.to_vec(), shape),
        (&CudaDevice { index: device }, dtype),
    )
}

/// `ranks` parts of `len` integers in -8..=8: every partial sum of them is exact in bf16
/// and f32, in any order.
fn small_integer_parts(rng: &mut impl rand::Rng, ranks: usize, len: usize) -> Vec<Vec<f32>> {
    (0..ranks)
        .map(|_| {
            (0..len)
                .map(|_| rng.random_range(-8i32..=8) as f32)
                .collect()
        })
        .collect()
}

fn bits(values: &[f32]) -> Vec<u32> {
    values.iter().map(|v| v.to_bits()).collect()
}

#[test]
#[ignore = "needs an NVIDIA GPU and NCCL"]
fn one_rank_collectives_are_the_identity_in_stream_order() {
    let ranks = NcclRanks::new(&[0]).unwrap();
    assert_eq!(Collective::<Gpu>::ranks(&ranks), 1);
    let mut rng = rng(2401);
    // Many rounds on fresh data, each result used by the next kernel without a host sync and
    // its input dropped at once: a call out of stream order would read or write reused memory.
    for round in 0..40 {
        let (m, n) = (1 + round % 7, 64 * (1 + round % 5));
        let x = random_f32(&mut rng, m * n);
        let (reduced, gathered) = if round % 2 == 0 {
            // An input the caller still holds goes to a new buffer (fresh ones are reduced
            // in place, as in the bf16 rounds).
            let held = on::<Gpu>(&x, [m, n], 0, DType::F32);
            let a = ranks.all_reduce_sum(vec![held.clone()]).unwrap();
            drop(held);
            let g = ranks
                .all_gather(vec![on::<Gpu>(&x, [m, n], 0, DType::F32)])
                .unwrap();
            (host(a[0].clone() * 2.0), host(g[0].clone() * 2.0))
        } else {
            let a = ranks
                .all_reduce_sum(vec![on::<Gpu16>(&x, [m, n], 0, DType::BF16)])
                .unwrap();
            let g = ranks
                .all_gather(vec![on::<Gpu16>(&x, [m, n], 0, DType::BF16)])
                .unwrap();
            (host(a[0].clone() * 2.0), host(g[0].clone() * 2.0))
        };
        let expected: Vec<f32> = if round % 2 == 0 {
            x.iter().map(|v| v * 2.0).collect()
        } else {
            x.iter()
                .map(|&v| half::bf16::from_f32(v).to_f32() * 2.0)
                .collect()
        };
        assert_eq!(
            bits(&reduced),
            bits(&expected),
            "all_reduce_sum, round {round}"
        );
        assert_eq!(
            bits(&gathered),
            bits(&expected),
            "all_gather, round {round}"
        );
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU and NCCL"]
fn bad_ranks_are_typed_errors() {
    let twice = NcclRanks::new(&[0, 0]).unwrap_err();
    assert!(
        matches!(&twice, SlideSparseError::InvalidSplit { detail, .. } if detail.contains("named twice")),
        "{twice}"
    );
    let past = NcclRanks::new(&[0, 999]).unwrap_err();
    assert!(matches!(past, SlideSparseError::NoGpu(_)), "{past}");
    assert!(NcclRanks::new(&[]).is_err());

    let ranks = NcclRanks::new(&[0]).unwrap();
    let x = on::<Gpu>(&[1.0; 8], [2, 4], 0, DType::F32);
    let two = ranks
        .all_reduce_sum(vec![x.clone(), x.clone()])
        .unwrap_err();
    assert!(
        matches!(two, SlideSparseError::ShapeMismatch { .. }),
        "{two}"
    );
}

/// A 6:8 INT8 layer with a bias, `K` and `out` splittable over `ranks`.
fn layer(seed: u64, ranks: usize, k: usize, out: usize) -> PackedLinear {
    let mut rng = rng(seed);
    let w = random_f32(&mut rng, out * k);
    let b = random_f32(&mut rng, out);
    let options = PackOptions::new(SparsityPattern::P6_8, Precision::Int8);
    assert_eq!(k % (ranks * 8), 0);
    pack_linear("layer.weight", &w, out, k, Some(&b), &options)
        .unwrap()
        .0
}

/// Every rank's output of a tensor-parallel layer over `devices`: NCCL's against the
/// simulated ranks' (same shards, same partial outputs; a sum of two is the same in either
/// order).
fn check_split_over(devices: &[usize], parallelism: Parallelism) {
    let ranks = devices.len();
    let (m, k, out) = (5, 1024, 768);
    let packed = layer(2402 + ranks as u64, ranks, k, out);
    let cuda: Vec<CudaDevice> = devices.iter().map(|&index| CudaDevice { index }).collect();
    let tp = TensorParallelLinear::<Gpu>::from_packed(&packed, parallelism, &cuda).unwrap();
    let nccl = NcclRanks::new(devices).unwrap();
    let simulated = SimulatedRanks::new(ranks).unwrap();
    let x = random_f32(&mut rng(2403), m * k);
    let input = || on::<Gpu>(&x, [m, k], devices[0], DType::F32);
    let over_nccl = tp.forward_ranks(input(), &nccl).unwrap();
    let reference = tp.forward_ranks(input(), &simulated).unwrap();
    let whole = SlideSparseLinear::<Gpu>::from_packed(&packed, &cuda[0]).forward(input());
    let whole = host(whole);
    for (rank, (a, b)) in over_nccl.into_iter().zip(reference).enumerate() {
        assert_eq!(a.device(), cuda[rank], "{parallelism} rank {rank}");
        let (a, b) = (host(a), host(b));
        let max_diff = a
            .iter()
            .zip(&b)
            .map(|(p, q)| (p - q).abs())
            .fold(0.0, f32::max);
        if ranks <= 2 {
            assert_eq!(bits(&a), bits(&b), "{parallelism} rank {rank} of {ranks}");
        } else {
            assert!(max_diff <= 1e-4, "{parallelism} rank {rank}: {max_diff}");
        }
        // Column-parallel and one rank are the layer itself (same codes); row-parallel
        // INT8 quantizes each slice on its own (`docs/decisions/tensor-parallel.md`).
        if parallelism == Parallelism::Column || ranks == 1 {
            assert_eq!(
                bits(&a),
                bits(&whole),
                "{parallelism} rank {rank} vs the layer"
            );
        }
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU and NCCL"]
fn a_layer_over_one_rank_is_the_layer() {
    for parallelism in [Parallelism::Column, Parallelism::Row] {
        check_split_over(&[0], parallelism);
    }
}

#[test]
#[ignore = "needs two NVIDIA GPUs and NCCL"]
fn layers_split_over_every_gpu_match_the_simulated_ranks() {
    let devices = devices();
    if devices.len() < 2 {
        eprintln!("one GPU: nothing split over GPUs (the one-rank tests ran)");
        return;
    }
    // Every GPU where the test layer splits over them (K = 1024 in blocks of 8, out = 768).
    let all = devices.len();
    let splits = 1024 % (8 * all) == 0 && 768 % all == 0;
    for parallelism in [Parallelism::Column, Parallelism::Row] {
        if splits {
            check_split_over(&devices, parallelism);
        }
        check_split_over(&devices[..2], parallelism);
    }
}

#[test]
#[ignore = "needs two NVIDIA GPUs and NCCL"]
fn all_reduce_over_every_gpu_sums_in_bf16_and_f32() {
    let devices = devices();
    if devices.len() < 2 {
        eprintln!("one GPU: no sum over GPUs (the one-rank tests ran)");
        return;
    }
    let nccl = NcclRanks::new(&devices).unwrap();
    let mut rng = rng(2404);
    let (m, n) = (3, 4096);
    let parts = small_integer_parts(&mut rng, devices.len(), m * n);
    let sum: Vec<f32> = (0..m * n)
        .map(|i| parts.iter().map(|p| p[i]).sum())
        .collect();
    // Tensors the caller still holds are not reduced in place.
    let f32s: Vec<Tensor<Gpu, 2>> = parts
        .iter()
        .zip(&devices)
        .map(|(p, &d)| on::<Gpu>(p, [m, n], d, DType::F32))
        .collect();
    for (rank, t) in nccl
        .all_reduce_sum(f32s.clone())
        .unwrap()
        .into_iter()
        .enumerate()
    {
        assert_eq!(host(t), sum, "f32 rank {rank}");
    }
    for (rank, (held, part)) in f32s.into_iter().zip(&parts).enumerate() {
        assert_eq!(&host(held), part, "rank {rank}'s held input");
    }
    let bf16s = parts
        .iter()
        .zip(&devices)
        .map(|(p, &d)| on::<Gpu16>(p, [m, n], d, DType::BF16))
        .collect();
    for (rank, t) in nccl.all_reduce_sum(bf16s).unwrap().into_iter().enumerate() {
        assert_eq!(host(t), sum, "bf16 rank {rank}");
    }
    let gathered: Vec<f32> = (0..m)
        .flat_map(|row| {
            parts
                .iter()
                .flat_map(move |p| p[row * n..(row + 1) * n].to_vec())
        })
        .collect();
    let f32s = parts
        .iter()
        .zip(&devices)
        .map(|(p, &d)| on::<Gpu>(p, [m, n], d, DType::F32))
        .collect();
    for (rank, t) in nccl.all_gather(f32s).unwrap().into_iter().enumerate() {
        assert_eq!(host(t), gathered, "all_gather rank {rank}");
    }
}

/// One round of `BurnRanks` on one rank of backend `B`: the sum and the gather of `x` are
/// `x`, bit for bit, read through a kernel queued after them with no host sync; an input the
/// caller still holds is left as it was.
fn burn_ranks_identity<
    B: burn::tensor::backend::distributed::DistributedBackend<Device = CudaDevice>,
>(
    ranks: &BurnRanks,
    x: &[f32],
    [m, n]: [usize; 2],
    dtype: DType,
    round: usize,
) {
    let rounded: Vec<f32> = match dtype {
        DType::BF16 => x
            .iter()
            .map(|&v| half::bf16::from_f32(v).to_f32())
            .collect(),
        _ => x.to_vec(),
    };
    let expected: Vec<f32> = rounded.iter().map(|v| v * 2.0).collect();
    let held = on::<B>(x, [m, n], 0, dtype);
    let reduced = ranks.all_reduce_sum(vec![held.clone()]).unwrap();
    let gathered = ranks
        .all_gather(vec![on::<B>(x, [m, n], 0, dtype)])
        .unwrap();
    let (reduced, gathered) = (
        host(reduced[0].clone() * 2.0),
        host(gathered[0].clone() * 2.0),
    );
    assert_eq!(
        bits(&reduced),
        bits(&expected),
        "all_reduce_sum, round {round}"
    );
    assert_eq!(
        bits(&gathered),
        bits(&expected),
        "all_gather, round {round}"
    );
    assert_eq!(
        bits(&host(held)),
        bits(&rounded),
        "held input, round {round}"
    );
}

#[test]
#[ignore = "needs an NVIDIA GPU and NCCL (as libnccl.so on the loader path)"]
fn burn_ranks_over_one_rank_are_the_identity_on_plain_and_fusion() {
    let ranks = BurnRanks::new(&[0]).unwrap();
    assert_eq!(ranks.devices(), vec![0]);
    assert_eq!(Collective::<Fused16>::ranks(&ranks), 1);
    let mut rng = rng(2405);
    for round in 0..30 {
        let shape = [1 + round % 7, 64 * (1 + round % 5)];
        let x = random_f32(&mut rng, shape[0] * shape[1]);
        match round % 3 {
            0 => burn_ranks_identity::<Gpu>(&ranks, &x, shape, DType::F32, round),
            1 => burn_ranks_identity::<Gpu16>(&ranks, &x, shape, DType::BF16, round),
            _ => burn_ranks_identity::<Fused16>(&ranks, &x, shape, DType::BF16, round),
        }
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU and NCCL (as libnccl.so on the loader path)"]
fn bad_burn_ranks_are_typed_errors() {
    let twice = BurnRanks::new(&[0, 0]).unwrap_err();
    assert!(
        matches!(&twice, SlideSparseError::InvalidSplit { detail, .. } if detail.contains("named twice")),
        "{twice}"
    );
    let past = BurnRanks::new(&[0, 999]).unwrap_err();
    assert!(matches!(past, SlideSparseError::NoGpu(_)), "{past}");
    assert!(BurnRanks::new(&[]).is_err());

    let ranks = BurnRanks::new(&[0]).unwrap();
    let x = on::<Fused16>(&[1.0; 8], [2, 4], 0, DType::BF16);
    let two = ranks
        .all_reduce_sum(vec![x.clone(), x.clone()])
        .unwrap_err();
    assert!(
        matches!(two, SlideSparseError::ShapeMismatch { .. }),
        "{two}"
    );
}

/// Set for the child process of the test below.
const FRESH_PROCESS: &str = "SLIDESPARSE_TEST_FRESH_PROCESS";

/// burn keeps one default float dtype per device, for every backend on that device type, and
/// fixes it at the first tensor created with it: `BurnRanks::new` (whose check runs in f32)
/// must leave it to the caller, or a bf16 model created after it computes in f32. Checked
/// in a fresh process (this test binary again, running only the test after this one), where
/// nothing else has touched the devices.
#[test]
#[ignore = "needs an NVIDIA GPU and NCCL (as libnccl.so on the loader path)"]
fn burn_ranks_leave_the_default_dtype_to_the_caller() {
    let child = "fresh_process_burn_ranks_then_a_bf16_default";
    let run = std::process::Command::new(std::env::current_exe().unwrap())
        .args([
            child,
            "--exact",
            "--ignored",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(FRESH_PROCESS, "1")
        .output()
        .unwrap();
    let said = format!(
        "{}{}",
        String::from_utf8_lossy(&run.stdout),
        String::from_utf8_lossy(&run.stderr)
    );
    assert!(run.status.success(), "{said}");
    assert!(said.contains("1 passed"), "{said}");
}

#[test]
#[ignore = "run in a fresh process by burn_ranks_leave_the_default_dtype_to_the_caller"]
fn fresh_process_burn_ranks_then_a_bf16_default() {
    if std::env::var_os(FRESH_PROCESS).is_none() {
        return;
    }
    let ranks = BurnRanks::new(&devices()).unwrap();
    for index in ranks.devices() {
        let device = CudaDevice { index };
        burn::tensor::set_default_dtypes::<Gpu16>(&device, DType::BF16, DType::I32)
            .expect("BurnRanks::new fixed the device's default dtypes");
        assert_eq!(
            Tensor::<Gpu16, 2>::ones([1, 1], &device).dtype(),
            DType::BF16
        );
    }
}

#[test]
#[ignore = "needs two NVIDIA GPUs and NCCL (as libnccl.so on the loader path)"]
fn burn_ranks_over_every_gpu_sum_and_gather_on_plain_and_fusion() {
    let devices = devices();
    if devices.len() < 2 {
        eprintln!("one GPU: no sum over GPUs (the one-rank tests ran)");
        return;
    }
    let ranks = BurnRanks::new(&devices).unwrap();
    let mut rng = rng(2406);
    let (m, n) = (3, 4096);
    for round in 0..6 {
        let parts = small_integer_parts(&mut rng, devices.len(), m * n);
        let sum: Vec<f32> = (0..m * n)
            .map(|i| parts.iter().map(|p| p[i]).sum())
            .collect();
        let gathered: Vec<f32> = (0..m)
            .flat_map(|row| {
                parts
                    .iter()
                    .flat_map(move |p| p[row * n..(row + 1) * n].to_vec())
            })
            .collect();
        let (reduced, gather) = if round % 2 == 0 {
            run_burn_ranks::<Gpu>(&ranks, &parts, [m, n], DType::F32)
        } else {
            run_burn_ranks::<Fused16>(&ranks, &parts, [m, n], DType::BF16)
        };
        for (rank, (r, g)) in reduced.into_iter().zip(gather).enumerate() {
            assert_eq!(r, sum, "round {round}: rank {rank}'s sum");
            assert_eq!(g, gathered, "round {round}: rank {rank}'s gather");
        }
    }
}

/// Every rank's sum and gather of `parts` (rank `r`'s on GPU `r`) through `BurnRanks` on `B`.
fn run_burn_ranks<
    B: burn::tensor::backend::distributed::DistributedBackend<Device = CudaDevice>,
>(
    ranks: &BurnRanks,
    parts: &[Vec<f32>],
    shape: [usize; 2],
    dtype: DType,
) -> (Vec<Vec<f32>>, Vec<Vec<f32>>) {
    let upload = || -> Vec<Tensor<B, 2>> {
        parts
            .iter()
            .zip(ranks.devices())
            .map(|(p, d)| on::<B>(p, shape, d, dtype))
            .collect()
    };
    let reduced = ranks.all_reduce_sum(upload()).unwrap();
    let gathered = ranks.all_gather(upload()).unwrap();
    (
        reduced.into_iter().map(host).collect(),
        gathered.into_iter().map(host).collect(),
    )
}

/// `NcclRanks::all_reduce_sum_rank` from each rank's own thread (what
/// `TensorParallelLlama::with_rank_threads` does): three chained sums per rank, each thread
/// on its own burn stream, read back on that thread. On one GPU the sums are the parts, bit
/// for bit; over every GPU, exact sums of small integers. A rank past the last and a
/// tensor on another rank's device are typed errors.
#[test]
#[ignore = "needs an NVIDIA GPU and NCCL (as libnccl.so on the loader path)"]
fn per_rank_all_reduces_from_each_ranks_thread_sum_over_every_gpu() {
    let devices = devices();
    let nccl = NcclRanks::new(&devices).unwrap();
    let mut rng = rng(2407);
    let (m, n) = (2, 4096);
    let parts = small_integer_parts(&mut rng, devices.len(), m * n);
    // Three rounds: the sum, then the sum of R copies of it, twice.
    let r = devices.len() as f32;
    let want: Vec<f32> = (0..m * n)
        .map(|i| parts.iter().map(|p| p[i]).sum::<f32>() * r * r)
        .collect();
    std::thread::scope(|s| {
        let threads: Vec<_> = devices
            .iter()
            .zip(&parts)
            .enumerate()
            .map(|(rank, (&d, part))| {
                let nccl = &nccl;
                s.spawn(move || {
                    let mut x = on::<Gpu16>(part, [m, n], d, DType::BF16);
                    for _ in 0..3 {
                        x = nccl.all_reduce_sum_rank(rank, x).unwrap();
                    }
                    host(x)
                })
            })
            .collect();
        for (rank, t) in threads.into_iter().enumerate() {
            let got = t.join().unwrap();
            if devices.len() == 1 {
                assert_eq!(bits(&got), bits(&parts[0]), "one rank: the part itself");
            } else {
                assert_eq!(got, want, "rank {rank}");
            }
        }
    });
    let x = on::<Gpu16>(&parts[0], [m, n], devices[0], DType::BF16);
    let past = nccl.all_reduce_sum_rank(devices.len(), x.clone());
    assert!(
        matches!(past, Err(SlideSparseError::ShapeMismatch { .. })),
        "{past:?}"
    );
    if devices.len() > 1 {
        let wrong = nccl.all_reduce_sum_rank(1, x);
        assert!(
            matches!(wrong, Err(SlideSparseError::Unsupported { .. })),
            "{wrong:?}"
        );
    }
}
