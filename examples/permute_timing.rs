//! How long the input-channel permutation search takes on one layer, and what it gains.
//!
//! `cargo run --release -p slidesparse-examples --example permute_timing -- [ROWS] [COLS]
//!   [PATTERN] [ROUNDS]`
//!
//! Defaults: a Llama-3-8B down projection (`4096 x 14336`), 6:8, the default rounds. Random
//! weights (uniform) with Wanda norms of a heavy-tailed spread (a few outlier channels, as
//! in LLM activations); prints the search's time, rounds and pruned score energy for the
//! magnitude and Wanda scores, and the packer's time with and without the order.

use std::time::Instant;

use burn_slidesparse::{
    ChannelPermutation, PackOptions, PermutationSearch, Precision, PruneMethod, SparsityPattern,
    pack_linear, search_permutation,
};
use indicatif::{ProgressBar, ProgressStyle};
use rand::{Rng, SeedableRng, rngs::StdRng};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let number = |i: usize, default: usize| -> Result<usize, Box<dyn std::error::Error>> {
        Ok(args
            .get(i)
            .map(|a| a.parse())
            .transpose()?
            .unwrap_or(default))
    };
    let (rows, cols) = (number(0, 4096)?, number(1, 14336)?);
    let pattern: SparsityPattern = args.get(2).map_or("6:8", String::as_str).parse()?;
    let search = PermutationSearch {
        rounds: number(3, PermutationSearch::DEFAULT_ROUNDS)?,
        ..Default::default()
    };
    println!(
        "{rows} x {cols}, {pattern}, at most {} rounds, {} cores",
        search.rounds,
        std::thread::available_parallelism().map_or(1, |n| n.get())
    );
    let mut rng = StdRng::seed_from_u64(0);
    let w: Vec<f32> = (0..rows * cols)
        .map(|_| rng.random_range(-1.0f32..1.0))
        .collect();
    // Activation norms spread over two decades, a few channels far above the rest.
    let norms: Vec<f32> = (0..cols)
        .map(|_| 10f32.powf(rng.random_range(0.0f32..1.0).powi(4) * 2.0))
        .collect();
    let methods = [
        ("magnitude", PruneMethod::Magnitude),
        (
            "wanda",
            PruneMethod::ActivationAware {
                input_norms: norms.clone(),
            },
        ),
    ];
    let bar = ProgressBar::new(methods.len() as u64);
    bar.set_style(ProgressStyle::with_template(
        "{bar:30} {pos}/{len} {msg} [{elapsed}]",
    )?);
    for (name, method) in &methods {
        bar.set_message(format!("searching ({name})"));
        let start = Instant::now();
        let found = search_permutation("w", &[(&w, rows, method)], cols, pattern, &search)?;
        let seconds = start.elapsed().as_secs_f64();
        bar.suspend(|| println!(
            "{name:<10} search {seconds:>7.2} s, {:>3} rounds, pruned score energy {:.3}% -> {:.3}%",
            found.rounds,
            100.0 * found.pruned_before,
            100.0 * found.pruned_after
        ));
        let options = |permutation| PackOptions {
            prune: method.clone(),
            permutation,
            ..PackOptions::new(pattern, Precision::Int8)
        };
        for (label, permutation) in [
            ("original order", ChannelPermutation::Identity),
            (
                "found order",
                ChannelPermutation::Given(found.permutation.clone()),
            ),
        ] {
            let start = Instant::now();
            let (_, _, stats) = pack_linear("w", &w, rows, cols, None, &options(permutation))?;
            bar.suspend(|| {
                println!(
                    "{name:<10} pack_linear in the {label:<14} {:>7.2} s, pruning error {:.4}",
                    start.elapsed().as_secs_f64(),
                    stats.pruning_error
                )
            });
        }
        bar.inc(1);
    }
    bar.finish_and_clear();
    Ok(())
}
