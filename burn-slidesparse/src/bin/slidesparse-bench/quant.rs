//! `slidesparse-bench quant`: the quant+lift kernel alone at M x K for every layout given
//! (`--units`, `--rows`), next to the row-staged kernel and the launcher's default, with the
//! achieved bandwidth against a device copy measured in the same process. Every variant's
//! codes and scales are first compared byte for byte with the row-staged kernel's, so that a
//! fast layout that writes wrong codes fails loudly instead of landing in a table.
//!
//! For a sparse pattern, the launcher's choice and the row-staged kernel are also timed with
//! a random input permutation folded into the lift map (`permuted` rows, their time against
//! the same kernel with the identity map in `vs identity`); their codes are checked against
//! the row-staged kernel's on the input permuted beforehand.

use burn::tensor::{DType, Distribution, Int, Tensor, TensorData, TensorPrimitive};
use burn_slidesparse::{
    Precision, SparsityPattern,
    cuda::{
        launch::{QuantKernel, launch_quant_lift_permuted},
        pipeline::m_pad,
    },
};
use cubecl::{Runtime, cuda::CudaRuntime, server::Handle};
use rand::{SeedableRng, rngs::StdRng, seq::SliceRandom};

use super::{
    Args,
    layer::{ACT_BYTES, Gpu, copy_bandwidth, device_median_ms},
    parse_all, parse_list, rotation,
};

/// Rows of each variant's output compared with the row-staged kernel's.
const CHECK_ROWS: usize = 1000;

/// The variants to time: the launcher's choice, the row-staged kernel, and the grouped
/// kernel at each requested cube size and rows per cube, with and without loading the next
/// row ahead (for several rows per cube) and with direct or shared-memory-staged stores.
fn variants(args: &Args) -> Vec<QuantKernel> {
    let units: Vec<Option<u32>> = parse_list(&args.units)
        .iter()
        .map(|u| (u != "default").then(|| u.parse().expect("--units: default or integers")))
        .collect();
    let rows: Vec<usize> = parse_all(&args.rows).expect("--rows: comma-separated integers");
    let mut out = vec![QuantKernel::Auto, QuantKernel::RowStaged];
    for &u in &units {
        for &r in &rows {
            for prefetch in [false, true] {
                for staged_stores in [false, true] {
                    if prefetch && r == 1 {
                        continue;
                    }
                    out.push(QuantKernel::Grouped {
                        units: u,
                        rows_per_cube: r,
                        prefetch,
                        staged_stores,
                    });
                }
            }
        }
    }
    out
}

fn label(kernel: QuantKernel) -> String {
    match kernel {
        QuantKernel::Auto => "auto".into(),
        QuantKernel::RowStaged => "row-staged".into(),
        QuantKernel::Grouped {
            units,
            rows_per_cube,
            prefetch,
            staged_stores,
        } => format!(
            "grouped u={} r={rows_per_cube}{}{}",
            units.map_or("default".into(), |u| u.to_string()),
            if prefetch { " prefetch" } else { "" },
            if staged_stores { " staged" } else { "" },
        ),
    }
}

pub fn quant_bench(args: &Args) {
    let device = Default::default();
    let client = CudaRuntime::client(&device);
    let copy_bw = copy_bandwidth(&client, &device);
    println!(
        "measured copy bandwidth (x + 1.0 over 1 GiB, read + write): {:.0} GB/s\n",
        copy_bw / 1e9
    );
    let ms: Vec<usize> = parse_all(&args.m).expect("--m: comma-separated integers");
    let ks: Vec<usize> = parse_all(&args.k).expect("--k: comma-separated integers");
    let precisions: Vec<Precision> = parse_all(&args.precisions).expect("--precisions");
    let patterns: Vec<Option<SparsityPattern>> = parse_list(&args.patterns)
        .iter()
        .map(|p| (p != "dense").then(|| p.parse().expect("--patterns: dense, 2:4, 6:8, ...")))
        .collect();
    println!("| precision | pattern | K | M | kernel | ms | GB/s | % of copy | vs identity |");
    println!("|---|---|---|---|---|---|---|---|---|");
    let mut rows = Vec::new();
    for &precision in &precisions {
        for &pattern in &patterns {
            for &k in &ks {
                for &m in &ms {
                    rows.extend(time_shape(
                        &client, &device, args, precision, pattern, k, m, copy_bw,
                    ));
                }
            }
        }
    }
    if let Some(path) = &args.json {
        let json = serde_json::json!({"copy_bandwidth_gbs": copy_bw / 1e9, "quant": rows});
        std::fs::write(path, serde_json::to_vec_pretty(&json).unwrap()).unwrap();
    }
}

/// A random order of `k` input channels (seeded: every run times the same map).
fn random_order(k: usize) -> Vec<u32> {
    let mut order: Vec<u32> = (0..k as u32).collect();
    order.shuffle(&mut StdRng::seed_from_u64(0x5EED_0044));
    order
}

/// `x [m, k]` with its columns in `order`: `out[:, j] = x[:, order[j]]`.
fn permuted_columns(
    x: &burn_cubecl::tensor::CubeTensor<CudaRuntime>,
    order: &[u32],
    device: &burn::tensor::Device<Gpu>,
) -> burn_cubecl::tensor::CubeTensor<CudaRuntime> {
    let index: Vec<i64> = order.iter().map(|&c| c as i64).collect();
    let index = Tensor::<Gpu, 1, Int>::from_data(TensorData::new(index, [order.len()]), device);
    Tensor::<Gpu, 2>::from_primitive(TensorPrimitive::Float(x.clone()))
        .select(1, index)
        .into_primitive()
        .tensor()
}

/// Checks and times every variant at one shape; prints and returns one row per variant.
#[allow(clippy::too_many_arguments)]
fn time_shape(
    client: &cubecl::client::ComputeClient<CudaRuntime>,
    device: &burn::tensor::Device<Gpu>,
    args: &Args,
    precision: Precision,
    pattern: Option<SparsityPattern>,
    k: usize,
    m: usize,
    copy_bw: f64,
) -> Vec<serde_json::Value> {
    let (n, k_slide, k_out) = match pattern {
        Some(p) => {
            let g = p.geometry(k, 64);
            (g.n, g.k_slide(), g.k_prime())
        }
        None => (0, k, k.next_multiple_of(16)),
    };
    let mp = m_pad(m, precision);
    let rot = rotation(m * k * ACT_BYTES, 2);
    let xs: Vec<_> = (0..rot)
        .map(|_| {
            Tensor::<Gpu, 2>::random([m, k], Distribution::Uniform(-1.0, 1.0), device)
                .into_primitive()
                .tensor()
        })
        .collect();
    let order = random_order(k);
    let perm = client.create_from_slice(
        &order
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect::<Vec<u8>>(),
    );
    // `rows` = (M, M_pad) of the launch: the timed calls take all rows, the check fewer.
    let run = |kernel: QuantKernel,
               permuted: bool,
               x: &burn_cubecl::tensor::CubeTensor<CudaRuntime>,
               codes: &Handle,
               scales: &Handle,
               (rows, rows_pad): (usize, usize)| {
        launch_quant_lift_permuted(
            kernel,
            client,
            &x.handle,
            permuted.then_some(&perm),
            codes,
            scales,
            (rows, rows_pad, k, k_slide, k_out),
            n,
            precision,
            DType::BF16,
        )
    };
    // The check runs on the first rows only (at most CHECK_ROWS, a smaller grid of the same
    // kernel): downloading every variant's full output would dominate the run.
    let (mc, mcp) = (m.min(CHECK_ROWS), m_pad(m.min(CHECK_ROWS), precision));
    let output = |kernel, permuted, x: &burn_cubecl::tensor::CubeTensor<CudaRuntime>| {
        let codes = client.empty(mcp * k_out);
        let scales = client.empty(mcp * 4);
        run(kernel, permuted, x, &codes, &scales, (mc, mcp)).map(|_| {
            let c = client.read_one(codes).unwrap().to_vec();
            let s = client.read_one(scales).unwrap().to_vec();
            (c, s)
        })
    };
    let expected = output(QuantKernel::RowStaged, false, &xs[0]).expect("row-staged kernel");
    // What a permuted map must give: the identity map on the input permuted beforehand.
    let expected_permuted = pattern.map(|_| {
        let xp = permuted_columns(&xs[0], &order, device);
        output(QuantKernel::RowStaged, false, &xp).expect("row-staged kernel")
    });
    let bytes = (m * k * ACT_BYTES + mp * k_out + mp * 4) as f64;
    let pattern_name = pattern.map_or("dense".into(), |p| p.to_string());
    let mut variants: Vec<(QuantKernel, bool)> =
        variants(args).into_iter().map(|v| (v, false)).collect();
    if pattern.is_some() {
        variants.extend([(QuantKernel::Auto, true), (QuantKernel::RowStaged, true)]);
    }
    let mut identity_ms = std::collections::HashMap::new();
    let mut rows = Vec::new();
    for (kernel, permuted) in variants {
        let name = format!(
            "{}{}",
            label(kernel),
            if permuted { " permuted" } else { "" }
        );
        let want = if permuted {
            expected_permuted.as_ref().expect("a sparse pattern")
        } else {
            &expected
        };
        match output(kernel, permuted, &xs[0]) {
            Err(e) => {
                eprintln!("{precision} {pattern_name} K={k} M={m} {name}: skipped ({e})");
                continue;
            }
            Ok(got) => assert!(
                &got == want,
                "{precision} {pattern_name} K={k} M={m} {name}: codes differ from the row-staged kernel's"
            ),
        }
        let codes = client.empty(mp * k_out);
        let scales = client.empty(mp * 4);
        let ms = device_median_ms(client, 3, args.reps, |i| {
            run(kernel, permuted, &xs[i % rot], &codes, &scales, (m, mp)).unwrap();
        });
        let vs_identity = if permuted {
            identity_ms.get(&label(kernel)).map(|&base: &f64| ms / base)
        } else {
            identity_ms.insert(label(kernel), ms);
            None
        };
        let gbs = bytes / (ms / 1e3) / 1e9;
        println!(
            "| {precision} | {pattern_name} | {k} | {m} | {name} | {ms:.4} | {gbs:.0} | {:.0}% | {} |",
            100.0 * gbs * 1e9 / copy_bw,
            vs_identity.map_or(String::new(), |r| format!("{r:.3}x"))
        );
        rows.push(serde_json::json!({
            "precision": precision.to_string(), "pattern": pattern_name, "k": k, "m": m,
            "kernel": name, "ms": ms, "gbs": gbs, "copy_gbs": copy_bw / 1e9,
            "vs_identity": vs_identity,
        }));
    }
    rows
}
