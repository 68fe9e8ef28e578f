//! Input-channel permutations, applied exactly: a layer packed in a permuted input order
//! computes the pruned weight's function in the original order (bit for bit for INT8: the
//! same codes and the same integer accumulations), through the packer, the reference lift,
//! the packed file format (version 2, version 1 still read), records, fused projections,
//! tensor-parallel shards, checkpoint packing and masked training.

use burn::{
    backend::NdArray,
    module::{Module, Param},
    nn::Linear,
    record::{BinBytesRecorder, FullPrecisionSettings, Recorder},
    tensor::{Tensor, TensorData},
};
use burn_slidesparse::{
    ChannelPermutation, InputPermutation, MaskedLinear, MaybeSparseLinear, PackOptions, PackedFile,
    PackedLinear, Parallelism, PermutationSearch, Precision, PruneMethod, SlideSparseError,
    SlideSparseLinear, SparseGptCalibration, SparsityPattern, concat_outputs,
    internals::{
        format::{self, OwnedTensor},
        pack::prune_and_quantize,
    },
    pack_linear, prune, save_layers, shard_packed,
};
use rand::{Rng, rngs::StdRng, seq::SliceRandom};
use slidesparse_tests::{host_w8a8, random_f32, rng};

type B = NdArray;

fn random_order(r: &mut StdRng, k: usize) -> InputPermutation {
    let mut order: Vec<u32> = (0..k as u32).collect();
    order.shuffle(r);
    InputPermutation::new(order).unwrap()
}

fn forward(layer: &SlideSparseLinear<B>, x: &[f32], m: usize) -> Vec<f32> {
    let k = layer.spec.in_features;
    let y = layer.forward(Tensor::<B, 2>::from_data(
        TensorData::new(x.to_vec(), [m, k]),
        &Default::default(),
    ));
    y.into_data().into_vec::<f32>().unwrap()
}

/// What packing in `order` must keep: the weight pruned in the permuted order, back in the
/// original order (computed here with the pruner alone, not the packer).
fn pruned_in_order(
    w: &[f32],
    (rows, k): (usize, usize),
    pattern: SparsityPattern,
    method: &PruneMethod,
    order: &InputPermutation,
) -> Vec<f32> {
    let permuted = order.permute_columns(w);
    let method = order.permute_method(method);
    order.unpermute_columns(&prune("w", &permuted, rows, k, pattern, &method).unwrap())
}

/// Random INT8 layers (every pattern 2:4..14:16, widths with a partial last block, random
/// and searched orders, magnitude and Wanda): the packed layer's reference forward equals
/// the host W8A8 of the weight pruned in the permuted order and put back in the original
/// order, bit for bit (K <= 1000 keeps every INT32 accumulation exact in the reference's
/// f32 matmul), and `verify_against` that weight passes.
#[test]
fn permuted_int8_layers_compute_the_pruned_weight_in_original_order_bit_for_bit() {
    let mut r = rng(4410);
    for case in 0..150 {
        let pattern = SparsityPattern::from_n(r.random_range(2..=8)).unwrap();
        let (k, rows, m) = (
            r.random_range(1..1000),
            r.random_range(1..40),
            r.random_range(1..6),
        );
        let w = random_f32(&mut r, rows * k);
        let b = random_f32(&mut r, rows);
        let method = if r.random_bool(0.5) {
            PruneMethod::Magnitude
        } else {
            PruneMethod::ActivationAware {
                input_norms: (0..k).map(|_| r.random_range(0.0..4.0)).collect(),
            }
        };
        let order = if r.random_bool(0.5) {
            ChannelPermutation::Given(random_order(&mut r, k))
        } else {
            ChannelPermutation::Search(PermutationSearch {
                rounds: 5,
                ..Default::default()
            })
        };
        let options = PackOptions {
            prune: method.clone(),
            permutation: order,
            ..PackOptions::new(pattern, Precision::Int8)
        };
        let (packed, reference, _) = pack_linear("w", &w, rows, k, Some(&b), &options).unwrap();
        let used = packed
            .input_permutation
            .clone()
            .unwrap_or_else(|| InputPermutation::identity(k));
        let expected = burn_slidesparse::internals::weight_quant::quantize_weight(
            &pruned_in_order(&w, (rows, k), pattern, &method, &used),
            rows,
            k,
            Precision::Int8,
        );
        assert_eq!(reference, expected, "case {case}");
        packed.verify_against(&expected).unwrap();
        assert_eq!(
            prune_and_quantize("w", &w, rows, k, &options).unwrap(),
            expected,
            "case {case}: the staged reference"
        );
        let x = random_f32(&mut r, m * k);
        let layer = SlideSparseLinear::<B>::from_packed(&packed, &Default::default());
        let got = forward(&layer, &x, m);
        let want = host_w8a8(&x, &expected, &b, (m, k, rows), Precision::Int8);
        let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
        assert_eq!(
            bits(&got),
            bits(&want),
            "case {case}: {pattern} k={k} rows={rows}"
        );
    }
}

/// Every order of a 6:8 block of 8 and of a 4:6 block of 6 (all 40320 and 720): the packed
/// layer un-slides to the weight pruned in that order, and the lifted integer dot product
/// through the composed map `order[src(o)]` equals the dense one exactly.
#[test]
fn every_order_of_a_small_layer_lifts_exactly() {
    let mut r = rng(4411);
    for (pattern, k) in [(SparsityPattern::P6_8, 8usize), (SparsityPattern::P4_6, 6)] {
        let w: Vec<f32> = (0..k).map(|_| r.random_range(-50..50) as f32).collect();
        let x: Vec<f32> = (0..k).map(|_| r.random_range(-50..50) as f32).collect();
        let mut order: Vec<u32> = (0..k as u32).collect();
        let mut count = 0;
        permutations(&mut order, 0, &mut |o| {
            let order = InputPermutation::new(o.to_vec()).unwrap();
            let options = PackOptions {
                permutation: ChannelPermutation::Given(order.clone()),
                ..PackOptions::new(pattern, Precision::F32)
            };
            let (packed, reference, _) = pack_linear("w", &w, 1, k, None, &options).unwrap();
            let pruned = pruned_in_order(&w, (1, k), pattern, &PruneMethod::Magnitude, &order);
            assert_eq!(reference.codes.to_f32(), pruned, "{order:?}");
            let map = packed.lift_map_with_zero_column();
            let slid = packed.weight.codes.to_f32();
            let lifted: f32 = map
                .iter()
                .zip(&slid)
                .map(|(&src, &v)| if src < k { v * x[src] } else { 0.0 })
                .sum();
            let dense: f32 = pruned.iter().zip(&x).map(|(a, b)| a * b).sum();
            assert_eq!(lifted, dense, "{order:?}");
            count += 1;
        });
        assert_eq!(count, (1..=k).product::<usize>());
    }
}

/// Heap's algorithm: calls `f` with every order of `items` (`items[..start]` fixed).
fn permutations(items: &mut [u32], start: usize, f: &mut dyn FnMut(&[u32])) {
    if start == items.len() {
        return f(items);
    }
    for i in start..items.len() {
        items.swap(start, i);
        permutations(items, start + 1, f);
        items.swap(start, i);
    }
}

/// FP8, 16-bit and f32 layers packed in a random order compute the pruned weight's function
/// in the original order up to rounding (FP8 products summed in another order).
#[test]
fn permuted_layers_of_every_precision_keep_the_function() {
    let mut r = rng(4412);
    for precision in [
        Precision::Fp8,
        Precision::Bf16,
        Precision::F16,
        Precision::F32,
    ] {
        for pattern in [
            SparsityPattern::P2_4,
            SparsityPattern::P6_8,
            SparsityPattern::P8_10,
        ] {
            let (k, rows, m) = (r.random_range(100..700), 24, 3);
            let w = random_f32(&mut r, rows * k);
            let options = PackOptions {
                permutation: ChannelPermutation::Given(random_order(&mut r, k)),
                ..PackOptions::new(pattern, precision)
            };
            let (packed, reference, _) = pack_linear("w", &w, rows, k, None, &options).unwrap();
            let dense = reference.dequantize();
            let x = random_f32(&mut r, m * k);
            let got = forward(
                &SlideSparseLinear::from_packed(&packed, &Default::default()),
                &x,
                m,
            );
            let x = match precision.qmax() {
                // The reference quantizes activations per token: compare with the same.
                Some(qmax) => x
                    .chunks(k)
                    .flat_map(|row| {
                        let absmax = row.iter().fold(0f32, |a, v| a.max(v.abs()));
                        let s = absmax.max(1e-12) / qmax;
                        row.iter()
                            .map(move |&v| precision.quantize(v, s) * s)
                            .collect::<Vec<_>>()
                    })
                    .collect(),
                None => x,
            };
            let want = slidesparse_tests::dense_linear(&x, &dense, None, m, k, rows);
            let err = slidesparse_tests::relative_error(&got, &want);
            assert!(err < 1e-2, "{precision} {pattern}: {err}");
        }
    }
}

/// SparseGPT in a permuted order: the Gram matrix is permuted with the weight, the result
/// satisfies the pattern in the permuted order and the packed layer un-slides to it.
#[test]
fn sparsegpt_prunes_in_the_permuted_order() {
    let mut r = rng(4413);
    let (k, rows, tokens) = (64, 16, 128);
    let x = random_f32(&mut r, tokens * k);
    let w = random_f32(&mut r, rows * k);
    let method = PruneMethod::SparseGpt(SparseGptCalibration::from_inputs(&x, tokens, k).unwrap());
    let options = PackOptions {
        prune: method.clone(),
        permutation: ChannelPermutation::Search(PermutationSearch::default()),
        ..PackOptions::new(SparsityPattern::P6_8, Precision::Int8)
    };
    let (packed, reference, _) = pack_linear("w", &w, rows, k, None, &options).unwrap();
    let order = packed
        .input_permutation
        .clone()
        .expect("an order better than the identity");
    packed.verify_against(&reference).unwrap();
    let kept = order.permute_columns(&reference.codes.to_f32());
    burn_slidesparse::check_pattern("w", &kept, rows, k, SparsityPattern::P6_8).unwrap();
    let again = pruned_in_order(&w, (rows, k), SparsityPattern::P6_8, &method, &order);
    let requantized = burn_slidesparse::internals::weight_quant::quantize_weight(
        &again,
        rows,
        k,
        Precision::Int8,
    );
    assert_eq!(requantized, reference);
}

fn packed_layers(r: &mut StdRng) -> Vec<PackedLinear> {
    let k = 96;
    let order = random_order(r, k);
    (0..3)
        .map(|i| {
            let rows = 8 + 4 * i;
            let w = random_f32(r, rows * k);
            let b = random_f32(r, rows);
            let permutation = match i {
                0 => ChannelPermutation::Identity,
                _ => ChannelPermutation::Given(order.clone()),
            };
            let options = PackOptions {
                permutation,
                ..PackOptions::new(SparsityPattern::P6_8, Precision::Int8)
            };
            pack_linear(
                &format!("l{i}.weight"),
                &w,
                rows,
                k,
                (i != 1).then_some(&b[..]),
                &options,
            )
            .unwrap()
            .0
        })
        .collect()
}

/// Version 2 files hold the permutation and round-trip every layer exactly; a version 1
/// file (no permutation) still loads; a stored list that is not a permutation, or of the
/// wrong length or dtype, is an error naming the tensor; `I32` orders are read too.
#[test]
fn packed_files_round_trip_permutations_and_read_version_1() {
    let mut r = rng(4414);
    let layers = packed_layers(&mut r);
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("v2.safetensors");
    save_layers(&path, &layers).unwrap();
    assert_eq!(PackedFile::load(&path).unwrap().layers, layers);

    // Version 1: the layer without a permutation, written with the old version number.
    let (meta, tensors) = format::layer_tensors_in(&layers[0], format::WeightLayout::Slid).unwrap();
    let mut metadata = format::file_metadata(&[meta]);
    metadata.insert(format::VERSION_KEY.into(), "1".into());
    let bytes = format::serialize(&tensors, metadata).unwrap();
    let v1 = PackedFile::from_bytes("v1", &bytes).unwrap();
    assert_eq!(v1.layers, vec![layers[0].clone()]);

    let with_order = |dtype, values: Vec<u8>, shape: Vec<usize>| {
        let (meta, mut tensors) = format::layer_tensors(&layers[1]).unwrap();
        let entry = tensors
            .iter_mut()
            .find(|(n, _)| n.ends_with(format::PERMUTATION_SUFFIX))
            .unwrap();
        entry.1 = OwnedTensor {
            dtype,
            shape,
            data: values,
        };
        let bytes = format::serialize(&tensors, format::file_metadata(&[meta])).unwrap();
        PackedFile::from_bytes("file", &bytes)
    };
    let order = layers[1]
        .input_permutation
        .as_ref()
        .unwrap()
        .as_slice()
        .to_vec();
    let le = |v: &[u32]| v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>();
    let as_i32 = with_order(safetensors::Dtype::I32, le(&order), vec![order.len()]).unwrap();
    assert_eq!(as_i32.layers[0], layers[1]);
    let mut twice = order.clone();
    twice[1] = twice[0];
    let err = with_order(safetensors::Dtype::U32, le(&twice), vec![order.len()]).unwrap_err();
    assert!(err.to_string().contains("input_permutation"), "{err}");
    let err = with_order(
        safetensors::Dtype::U32,
        le(&order[1..]),
        vec![order.len() - 1],
    )
    .unwrap_err();
    assert!(
        matches!(err, SlideSparseError::ShapeMismatch { .. }),
        "{err}"
    );
    let err = with_order(safetensors::Dtype::F32, le(&order), vec![order.len()]).unwrap_err();
    assert!(err.to_string().contains("unsupported dtype F32"), "{err}");
}

/// A permuted layer survives a burn record round trip (the permutation is in the record).
#[test]
fn records_keep_the_permutation() {
    let mut r = rng(4415);
    let layer = SlideSparseLinear::<B>::from_packed(&packed_layers(&mut r)[1], &Default::default());
    let x = random_f32(&mut r, 4 * 96);
    let recorder = BinBytesRecorder::<FullPrecisionSettings>::default();
    let bytes = recorder.record(layer.clone().into_record(), ()).unwrap();
    // A layer of the same structure in another order: loading replaces the order too.
    let other =
        SlideSparseLinear::<B>::from_packed(&packed_layers(&mut rng(1))[1], &Default::default());
    let record = recorder.load(bytes, &Default::default()).unwrap();
    let loaded = other.load_record(record);
    assert_eq!(
        loaded.weight.input_permutation(),
        layer.weight.input_permutation()
    );
    assert_eq!(forward(&loaded, &x, 4), forward(&layer, &x, 4));
}

/// Layers sharing one permutation fuse (the fused output is the parts side by side, bit
/// for bit); layers in different orders, or one permuted and one not, are refused.
#[test]
fn only_layers_in_one_order_fuse() {
    let mut r = rng(4416);
    let layers: Vec<MaybeSparseLinear<B>> = packed_layers(&mut r)
        .iter()
        .map(|p| SlideSparseLinear::<B>::from_packed(p, &Default::default()).into())
        .collect();
    let fused = concat_outputs(&[&layers[1], &layers[2]]).unwrap();
    let x = Tensor::<B, 2>::from_data(
        TensorData::new(random_f32(&mut r, 5 * 96), [5, 96]),
        &Default::default(),
    );
    let parts = Tensor::cat(
        vec![layers[1].forward(x.clone()), layers[2].forward(x.clone())],
        1,
    );
    assert_eq!(
        fused.forward(x).into_data().into_vec::<f32>().unwrap(),
        parts.into_data().into_vec::<f32>().unwrap()
    );
    let mixed = concat_outputs(&[&layers[0], &layers[1]]).unwrap_err();
    assert!(
        matches!(mixed, SlideSparseError::FuseMismatch { .. }),
        "{mixed}"
    );
    let other =
        SlideSparseLinear::<B>::from_packed(&packed_layers(&mut rng(7))[1], &Default::default())
            .into();
    let differ = concat_outputs(&[&layers[1], &other]).unwrap_err();
    assert!(differ.to_string().contains("different orders"), "{differ}");
}

/// Tensor-parallel shards of a permuted layer: column-parallel always (every rank reads the
/// whole input); row-parallel when the order keeps every rank's slice of K (each rank then
/// gets its part, local to its slice) and otherwise a typed error.
#[test]
fn shards_of_permuted_layers() {
    let mut r = rng(4417);
    let (k, rows, ranks) = (128, 16, 2);
    let w = random_f32(&mut r, rows * k);
    let pack = |order: Vec<u32>| {
        let options = PackOptions {
            permutation: ChannelPermutation::Given(InputPermutation::new(order).unwrap()),
            ..PackOptions::new(SparsityPattern::P6_8, Precision::Int8)
        };
        pack_linear("w", &w, rows, k, None, &options).unwrap().0
    };
    let mut within: Vec<u32> = Vec::new();
    for rank in 0..ranks {
        let mut slice: Vec<u32> = ((rank * 64) as u32..((rank + 1) * 64) as u32).collect();
        slice.shuffle(&mut r);
        within.extend(slice);
    }
    let layer = pack(within);
    let x = random_f32(&mut r, 3 * k);
    let whole = forward(
        &SlideSparseLinear::from_packed(&layer, &Default::default()),
        &x,
        3,
    );
    for parallelism in [Parallelism::Column, Parallelism::Row] {
        let shards = shard_packed(&layer, parallelism, ranks).unwrap();
        assert!(shards.iter().all(|s| s.validate().is_ok()));
    }
    let columns = shard_packed(&layer, Parallelism::Column, ranks).unwrap();
    let parts: Vec<Vec<f32>> = columns
        .iter()
        .map(|s| {
            forward(
                &SlideSparseLinear::from_packed(s, &Default::default()),
                &x,
                3,
            )
        })
        .collect();
    for row in 0..3 {
        let joined: Vec<f32> = parts
            .iter()
            .flat_map(|p| p[row * 8..(row + 1) * 8].to_vec())
            .collect();
        assert_eq!(joined, whole[row * rows..(row + 1) * rows]);
    }
    let across = pack(random_order(&mut r, k).as_slice().to_vec());
    let err = shard_packed(&across, Parallelism::Row, ranks).unwrap_err();
    assert!(
        matches!(err, SlideSparseError::InvalidSplit { .. }),
        "{err}"
    );
}

/// The fine-tuning flow: a layer masked in a permuted order keeps the order, passes its
/// pattern check, and packs (pattern checked, not re-pruned) into a layer computing the
/// masked function; a checkpoint that stores the order next to the weight packs the same.
#[test]
fn masked_layers_pack_in_their_order() {
    let mut r = rng(4418);
    let (k, rows) = (48, 12);
    let device = Default::default();
    let linear = Linear::<B> {
        weight: Param::from_tensor(Tensor::from_data(
            TensorData::new(random_f32(&mut r, k * rows), [k, rows]),
            &device,
        )),
        bias: None,
    };
    let order = random_order(&mut r, k);
    let pattern = SparsityPattern::P6_8;
    let masked = MaskedLinear::from_linear_permuted(
        linear,
        pattern,
        &PruneMethod::Magnitude,
        Some(order.clone()),
    )
    .unwrap();
    masked.check(pattern).unwrap();
    assert!(
        MaskedLinear {
            input_permutation: None,
            ..masked.clone()
        }
        .check(pattern)
        .is_err()
    );
    let options = PackOptions::new(pattern, Precision::F32);
    let sparse = masked.to_sparse(&options).unwrap();
    assert_eq!(sparse.weight.input_permutation(), Some(&order));
    let x = Tensor::<B, 2>::from_data(TensorData::new(random_f32(&mut r, 3 * k), [3, k]), &device);
    let a = masked
        .forward(x.clone())
        .into_data()
        .into_vec::<f32>()
        .unwrap();
    let b = sparse.forward(x).into_data().into_vec::<f32>().unwrap();
    let err =
        slidesparse_tests::relative_error(&b, &a.iter().map(|&v| v as f64).collect::<Vec<_>>());
    assert!(err < 1e-6, "{err}");

    // The same weight in a checkpoint with its order: `pack_checkpoint` with prune none.
    let dir = tempfile::tempdir().unwrap();
    let (input, output) = (
        dir.path().join("ft.safetensors"),
        dir.path().join("ft.packed.safetensors"),
    );
    let w = masked
        .effective_weight()
        .transpose()
        .into_data()
        .into_vec::<f32>()
        .unwrap();
    let tensors = vec![
        (
            "layers.0.mlp.up_proj.weight".to_string(),
            OwnedTensor {
                dtype: safetensors::Dtype::F32,
                shape: vec![rows, k],
                data: format::f32_bytes(&w),
            },
        ),
        (
            format!("layers.0.mlp.up_proj{}", format::PERMUTATION_SUFFIX),
            OwnedTensor {
                dtype: safetensors::Dtype::U32,
                shape: vec![k],
                data: order
                    .as_slice()
                    .iter()
                    .flat_map(|v| v.to_le_bytes())
                    .collect(),
            },
        ),
    ];
    std::fs::write(
        &input,
        format::serialize(&tensors, Default::default()).unwrap(),
    )
    .unwrap();
    let options = PackOptions {
        prune: PruneMethod::None,
        ..options
    };
    let report = burn_slidesparse::pack_checkpoint(
        &input,
        &output,
        &burn_slidesparse::LayerSelection::new(None).unwrap(),
        &options,
    )
    .unwrap();
    assert_eq!(
        report.copied_tensors, 0,
        "the order is part of the packed layer"
    );
    let file = PackedFile::load(&output).unwrap();
    assert_eq!(file.layers[0].input_permutation.as_ref(), Some(&order));
}

/// `pack_checkpoint` with a search: q/k/v of a block share one order, gate/up another, the
/// others have their own; every layer verifies against the original checkpoint.
#[test]
fn checkpoint_packing_searches_one_order_per_shared_input() {
    let mut r = rng(4419);
    let dir = tempfile::tempdir().unwrap();
    let (input, output) = (
        dir.path().join("m.safetensors"),
        dir.path().join("m.packed.safetensors"),
    );
    let (d, ff) = (64, 96);
    let mut tensors = Vec::new();
    for (name, rows, cols) in [
        ("q_proj", d, d),
        ("k_proj", d / 2, d),
        ("v_proj", d / 2, d),
        ("o_proj", d, d),
        ("gate_proj", ff, d),
        ("up_proj", ff, d),
        ("down_proj", d, ff),
    ] {
        let w = random_f32(&mut r, rows * cols);
        let group = match name {
            "gate_proj" | "up_proj" | "down_proj" => "mlp",
            _ => "self_attn",
        };
        tensors.push((
            format!("model.layers.0.{group}.{name}.weight"),
            OwnedTensor {
                dtype: safetensors::Dtype::F32,
                shape: vec![rows, cols],
                data: format::f32_bytes(&w),
            },
        ));
    }
    std::fs::write(
        &input,
        format::serialize(&tensors, Default::default()).unwrap(),
    )
    .unwrap();
    let options = PackOptions {
        permutation: ChannelPermutation::Search(PermutationSearch::default()),
        ..PackOptions::new(SparsityPattern::P6_8, Precision::Int8)
    };
    burn_slidesparse::pack_checkpoint(
        &input,
        &output,
        &burn_slidesparse::LayerSelection::new(None).unwrap(),
        &options,
    )
    .unwrap();
    let file = PackedFile::load(&output).unwrap();
    let order = |name: &str| {
        file.layers
            .iter()
            .find(|l| l.name.contains(name))
            .unwrap()
            .input_permutation
            .clone()
            .expect("searched")
    };
    assert_eq!(order("q_proj"), order("k_proj"));
    assert_eq!(order("q_proj"), order("v_proj"));
    assert_eq!(order("gate_proj"), order("up_proj"));
    assert_ne!(order("q_proj"), order("o_proj"));
    let report = burn_slidesparse::verify_checkpoint(&output, Some(&input)).unwrap();
    assert_eq!(report.checked_against_original, 7);
}
