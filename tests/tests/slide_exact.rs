//! Slide and lift are lossless: exhaustive over all block masks, randomized over matrices.

use burn_slidesparse::{
    PackOptions, Precision, PruneMethod, SparsityPattern,
    internals::pack::prune_and_quantize,
    internals::slide::{first_2_4_violation, slide_matrix},
    pack_linear,
};
use cubecl_kernels::SlideGeometry;
use rand::Rng;
use slidesparse_tests::{random_f32, random_small_ints, rng};

/// `sum_o W'[o] X'[o]` with the lift map, in i64.
fn lifted_dot(slid: &[f32], x: &[f32], g: &SlideGeometry) -> i64 {
    (0..g.k_prime())
        .map(|o| g.source(o).map_or(0, |s| slid[o] as i64 * x[s] as i64))
        .sum()
}

#[test]
fn every_block_mask_slides_iff_it_fits_and_the_dot_product_is_exact() {
    let mut rng = rng(1);
    for n in 2..=8u32 {
        let l = 2 * n as usize;
        let g = SlideGeometry::new(n, l, 32);
        let mut fits = 0;
        for mask in 0u32..(1 << l) {
            let nnz = mask.count_ones() as usize;
            let values = random_small_ints(&mut rng, l, 100);
            let w: Vec<f32> = (0..l)
                .map(|p| if mask >> p & 1 == 1 { values[p] } else { 0.0 })
                .collect();
            let x = random_small_ints(&mut rng, l, 100);
            match slide_matrix(&w, 1, &g) {
                Ok(slid) => {
                    assert!(
                        nnz <= l - 2,
                        "n={n} mask={mask:b}: slid with {nnz} nonzeros"
                    );
                    assert_eq!(first_2_4_violation(&slid, 1, g.k_prime()), None);
                    let dense: i64 = (0..l).map(|p| w[p] as i64 * x[p] as i64).sum();
                    assert_eq!(lifted_dot(&slid, &x, &g), dense, "n={n} mask={mask:b}");
                    // Every nonzero lands exactly once.
                    let landed = slid.iter().filter(|v| **v != 0.0).count();
                    assert_eq!(landed, nnz);
                    fits += 1;
                }
                Err(f) => {
                    assert!(
                        nnz > l - 2,
                        "n={n} mask={mask:b}: refused with {nnz} nonzeros"
                    );
                    assert_eq!((f.row, f.block, f.nonzeros), (0, 0, nnz));
                }
            }
        }
        // Masks with at most L-2 ones: 2^L - 1 - L.
        assert_eq!(fits, (1usize << l) - 1 - l, "n={n}");
    }
}

#[test]
fn random_matrices_with_padding_pack_verify_and_unslide_exactly() {
    let mut rng = rng(2);
    for pattern in SparsityPattern::all().take(8) {
        for precision in Precision::ALL {
            let n_out = rng.random_range(1..40);
            // K deliberately not a multiple of 2N most of the time.
            let k = rng.random_range(1..200);
            let w = random_f32(&mut rng, n_out * k);
            let bias = random_f32(&mut rng, n_out);
            let options = PackOptions::new(pattern, precision);
            let (packed, expected, stats) =
                pack_linear("w", &w, n_out, k, Some(&bias), &options).unwrap();
            assert_eq!(packed.k_prime(), pattern.geometry(k, 64).k_prime());
            assert_eq!(packed.unslide().unwrap(), expected);
            assert_eq!(
                expected,
                prune_and_quantize("w", &w, n_out, k, &options).unwrap()
            );
            assert!(stats.nonzeros_kept <= n_out * k);
            packed.validate().unwrap();
        }
    }
}

#[test]
fn lifted_integer_gemm_equals_the_dense_gemm_exactly() {
    let mut rng = rng(3);
    for pattern in SparsityPattern::all().take(8) {
        let (n_out, k, m) = (7, rng.random_range(20..90), 5);
        let w = random_small_ints(&mut rng, n_out * k, 9);
        let x = random_small_ints(&mut rng, m * k, 9);
        let mut options = PackOptions::new(pattern, Precision::F32);
        options.prune = PruneMethod::Magnitude;
        let (packed, pruned, _) = pack_linear("w", &w, n_out, k, None, &options).unwrap();
        let g = packed.geometry();
        let slid = packed.weight.codes.to_f32();
        let pruned = pruned.codes.to_f32();
        for i in 0..m {
            let xr = &x[i * k..(i + 1) * k];
            for j in 0..n_out {
                let dense: i64 = (0..k)
                    .map(|t| pruned[j * k + t] as i64 * xr[t] as i64)
                    .sum();
                let row = &slid[j * g.k_prime()..(j + 1) * g.k_prime()];
                assert_eq!(lifted_dot(row, xr, &g), dense);
            }
        }
    }
}
