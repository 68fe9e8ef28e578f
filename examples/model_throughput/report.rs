//! The printed tables: GPU memory per variant, tokens/s and speedups.

use std::collections::BTreeMap;

use burn_slidesparse::cuda::memory::MemoryReport;

use crate::args::{Args, list};

pub(crate) fn mib(bytes: u64) -> f64 {
    bytes as f64 / (1 << 20) as f64
}

/// GPU memory after preparation per variant, with ratios to dense INT8 and bf16.
pub(crate) fn print_memory(args: &Args, memory: &[(String, MemoryReport)]) {
    let in_use = |name: &str| {
        memory
            .iter()
            .find(|(v, _)| v == name)
            .map(|(_, r)| r.allocator_in_use as f64)
    };
    println!(
        "\n{} with {} blocks, LM head {}, GPU memory after preparation (allocator: live cubecl allocations; driver: the process's device memory in use)",
        args.model,
        args.layers,
        crate::variants::head_kind(args).unwrap_or("?")
    );
    println!(
        "| variant | allocator in use (MiB) | x dense-int8 | x bf16 | allocator reserved (MiB) | driver used (MiB) |"
    );
    println!("|---|---|---|---|---|---|");
    for (variant, r) in memory {
        let ratio = |base: Option<f64>| {
            base.map_or("-".to_string(), |b| {
                format!("{:.3}", r.allocator_in_use as f64 / b)
            })
        };
        println!(
            "| {variant} | {:.0} | {} | {} | {:.0} | {:.0} |",
            mib(r.allocator_in_use),
            ratio(in_use("dense-int8")),
            ratio(in_use("bf16")),
            mib(r.allocator_reserved),
            mib(r.driver_used)
        );
    }
}

/// Tokens/s per variant and workload, the speedup over the dense INT8 baseline, and the
/// per-block speedup (zero-block model subtracted).
pub(crate) fn print_table(
    args: &Args,
    results: &BTreeMap<(String, String), f64>,
    variants: &[String],
) {
    let workloads: Vec<String> = list(&args.prefill)
        .iter()
        .map(|t| format!("prefill {t}"))
        .chain(
            list(&args.decode_batch)
                .iter()
                .map(|b| format!("decode {b}")),
        )
        .collect();
    println!(
        "\n{} with {} blocks, {} backend, bf16 activations: ms (whole model), x = dense-int8 ms / variant ms (graph rows: dense-int8/graph), per-block x = the same with the zero-block model's time subtracted",
        args.model, args.layers, args.backend
    );
    println!("| variant | workload | ms | tok/s | x vs dense-int8 | per-block x | host ms/step |");
    println!("|---|---|---|---|---|---|---|");
    for variant in variants {
        for w in &workloads {
            // Graph rows against the dense INT8 graph, the others against its operations.
            let baseline = match variant.strip_suffix("/graph") {
                Some(_) => "dense-int8/graph",
                None => "dense-int8",
            };
            let (Some(ms), Some(dense)) = (
                results.get(&(variant.clone(), w.clone())),
                results.get(&(baseline.to_string(), w.clone())),
            ) else {
                continue;
            };
            let per_block = results
                .get(&("head-only".to_string(), w.clone()))
                .filter(|_| baseline == "dense-int8")
                .map_or("-".to_string(), |head| {
                    format!("{:.3}", (dense - head) / (ms - head))
                });
            let tokens: usize = w
                .split(' ')
                .nth(1)
                .and_then(|n| n.parse().ok())
                .unwrap_or(1);
            let host = results
                .get(&(variant.clone(), w.replace("decode", "host")))
                .map_or("-".to_string(), |h| format!("{h:.3}"));
            println!(
                "| {variant} | {w} | {ms:.3} | {:.0} | {:.3} | {per_block} | {host} |",
                tokens as f64 / ms * 1e3,
                dense / ms,
            );
        }
    }
}
