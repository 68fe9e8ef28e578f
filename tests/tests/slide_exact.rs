//! Slide and lift are lossless: exhaustive over all block masks, randomized over matrices.

use burn_slidesparse::{
    PackOptions, Precision, PruneMethod, SlideSparseError, SparseGptCalibration, SparsityPattern,
    internals::pack::prune_and_quantize,
    internals::slide::{first_2_4_violation, slide_matrix},
    internals::weight_quant::{WeightCodes, quantize_weight},
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

/// `||a - b||^2` and `||a||^2` in f64.
fn squared_error(a: &[f32], b: &[f32]) -> (f64, f64) {
    a.iter().zip(b).fold((0.0, 0.0), |(e, n), (&x, &y)| {
        (e + (x as f64 - y as f64).powi(2), n + (x as f64).powi(2))
    })
}

/// `pack_linear` runs its stages fused row by row; the result must be exactly the stages run
/// one after the other over the whole matrix (prune, quantize, slide), for every pattern,
/// precision and row-local prune method, and its statistics must be those of the stages.
#[test]
fn fused_packing_equals_the_staged_stages_exactly() {
    let mut rng = rng(4);
    for pattern in SparsityPattern::all().take(8) {
        for precision in Precision::ALL {
            let (n_out, k) = (rng.random_range(1..24), rng.random_range(1..160));
            // Small integers: exact zeros and ties, which the tie rules must agree on.
            let w = if rng.random_bool(0.5) {
                random_small_ints(&mut rng, n_out * k, 3)
            } else {
                random_f32(&mut rng, n_out * k)
            };
            let norms: Vec<f32> = (0..k).map(|_| rng.random_range(0.0..2.0)).collect();
            let pre_pruned =
                burn_slidesparse::prune("w", &w, n_out, k, pattern, &PruneMethod::Magnitude)
                    .unwrap();
            let tokens = 6;
            let x = random_f32(&mut rng, tokens * k);
            let calibration = SparseGptCalibration::from_inputs(&x, tokens, k).unwrap();
            let methods = [
                (PruneMethod::Magnitude, &w),
                (
                    PruneMethod::ActivationAware {
                        input_norms: norms.clone(),
                    },
                    &w,
                ),
                (PruneMethod::None, &pre_pruned),
                (PruneMethod::SparseGpt(calibration), &w),
            ];
            for (method, input) in methods {
                let mut options = PackOptions::new(pattern, precision);
                options.prune = method.clone();
                let ctx = format!("{pattern} {precision} {method} [{n_out}, {k}]");
                let (packed, quantized, stats) =
                    pack_linear("w", input, n_out, k, None, &options).unwrap();
                let pruned =
                    burn_slidesparse::prune("w", input, n_out, k, pattern, &method).unwrap();
                let staged = quantize_weight(&pruned, n_out, k, precision);
                // Bit for bit: the sign of zero and FP8's 0x80 included.
                let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                assert_eq!(
                    quantized.codes.to_le_bytes(),
                    staged.codes.to_le_bytes(),
                    "{ctx}"
                );
                assert_eq!(
                    bits(&quantized.scales),
                    bits(&staged.scales),
                    "{ctx}: scales"
                );
                let g = packed.geometry();
                let staged_slid = match &staged.codes {
                    WeightCodes::I8(v) => WeightCodes::I8(slide_matrix(v, n_out, &g).unwrap()),
                    WeightCodes::Fp8(v) => WeightCodes::Fp8(slide_matrix(v, n_out, &g).unwrap()),
                    WeightCodes::Bf16(v) => WeightCodes::Bf16(slide_matrix(v, n_out, &g).unwrap()),
                    WeightCodes::F16(v) => WeightCodes::F16(slide_matrix(v, n_out, &g).unwrap()),
                    WeightCodes::F32(v) => WeightCodes::F32(slide_matrix(v, n_out, &g).unwrap()),
                };
                assert_eq!(
                    packed.weight.codes.to_le_bytes(),
                    staged_slid.to_le_bytes(),
                    "{ctx}: slid codes"
                );
                assert_eq!(bits(&packed.weight.scales), bits(&staged.scales), "{ctx}");
                let nnz = |v: &[f32]| v.iter().filter(|x| **x != 0.0).count();
                assert_eq!(stats.nonzeros_before, nnz(input), "{ctx}");
                assert_eq!(stats.nonzeros_kept, nnz(&staged.codes.to_f32()), "{ctx}");
                let rel = |(e, n): (f64, f64)| if n == 0.0 { 0.0 } else { (e / n).sqrt() };
                let pruning = rel(squared_error(input, &pruned));
                let total = rel(squared_error(input, &staged.dequantize()));
                assert!(
                    (stats.pruning_error - pruning).abs() <= 1e-9 * (1.0 + pruning),
                    "{ctx}"
                );
                assert!(
                    (stats.total_error - total).abs() <= 1e-6 * (1.0 + total),
                    "{ctx}"
                );
            }
        }
    }
}

/// What the packer refuses, whatever runs its stages: a row whose largest weight is so small
/// that its 8-bit scale underflows to zero, and a layer without input columns.
#[test]
fn packing_refuses_an_underflowing_scale_and_an_empty_input_width() {
    let tiny = f32::from_bits(1); // the smallest subnormal: max / 127 rounds to 0
    for precision in [Precision::Int8, Precision::Fp8] {
        let options = PackOptions::new(SparsityPattern::P6_8, precision);
        let w = [1.0, 0.5, 0.0, 0.0, tiny, 0.0, 0.0, 0.0];
        match pack_linear("w", &w, 2, 4, None, &options) {
            Err(SlideSparseError::VerifyMismatch {
                row: 1,
                column: 0,
                detail,
                ..
            }) => assert!(detail.contains("not finite and positive"), "{detail}"),
            other => panic!("{precision}: expected the row-1 scale error, got {other:?}"),
        }
        assert!(matches!(
            pack_linear("w", &[], 3, 0, None, &options),
            Err(SlideSparseError::ShapeMismatch { .. })
        ));
    }
}
