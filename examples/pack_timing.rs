//! Where the packer's time goes, stage by stage, on one random layer.
//!
//! `cargo run --release -p slidesparse-examples --example pack_timing -- [ROWS] [COLS] [REPS]`
//!
//! With `REPS`, only the whole `pack_linear` runs, `REPS` times (for profiling it alone).

use std::time::Instant;

use burn_slidesparse::{
    PackOptions, PackedFile, Precision, PruneMethod, QuantizedWeight, SparsityPattern, pack_linear,
    prune,
};
use rand::{Rng, SeedableRng, rngs::StdRng};

fn main() {
    let args: Vec<usize> = std::env::args()
        .skip(1)
        .map(|a| a.parse().expect("ROWS COLS"))
        .collect();
    let (rows, cols) = (
        *args.first().unwrap_or(&5632),
        *args.get(1).unwrap_or(&2048),
    );
    let mut rng = StdRng::seed_from_u64(0);
    let w: Vec<f32> = (0..rows * cols)
        .map(|_| rng.random_range(-1.0f32..1.0))
        .collect();
    let options = PackOptions::new(SparsityPattern::P6_8, Precision::Int8);
    if let Some(&reps) = args.get(2) {
        for _ in 0..reps {
            let t = Instant::now();
            pack_linear("w", &w, rows, cols, None, &options).unwrap();
            let s = t.elapsed().as_secs_f64();
            let mb = (rows * cols * 4) as f64 / 1e6;
            println!("pack_linear {:>8.1} ms  {:>8.0} MB/s", s * 1e3, mb / s);
        }
        return;
    }
    let mb = (rows * cols * 4) as f64 / 1e6;
    let time = |name: &str, f: &mut dyn FnMut()| {
        let t = Instant::now();
        f();
        let s = t.elapsed().as_secs_f64();
        println!(
            "{name:<28} {:>8.1} ms  {:>8.0} MB/s (of f32 input)",
            s * 1e3,
            mb / s
        );
    };
    let mut pruned = Vec::new();
    time("prune (magnitude)", &mut || {
        pruned = prune(
            "w",
            &w,
            rows,
            cols,
            options.pattern,
            &PruneMethod::Magnitude,
        )
        .unwrap()
    });
    let mut q = None;
    time("quantize (int8)", &mut || {
        q = Some(QuantizedWeight::quantize(&pruned, rows, cols, Precision::Int8).unwrap())
    });
    let mut packed = None;
    time("pack_linear (all stages)", &mut || {
        packed = Some(pack_linear("w", &w, rows, cols, None, &options).unwrap().0)
    });
    let file = PackedFile {
        layers: vec![packed.unwrap()],
    };
    time("validate (2:4 + unslide)", &mut || {
        file.layers[0].validate().unwrap();
    });
    time("to_bytes (the packed file)", &mut || {
        file.to_bytes().unwrap();
    });
}
