//! The reference SlideSparse forward, for any burn backend.
//!
//! It performs exactly the GPU pipeline with plain tensor ops: lift by index gather,
//! per-token quantization with the same scale and rounding as the GPU kernel (INT8 round
//! half to even, FP8 E4M3 round to nearest even with saturation), a matmul with the slid
//! weight codes, and the epilogue `Y = acc * s_x[m] * s_w[n] + b[n]`.
//!
//! Non-finite activations: for 8-bit precisions a token (row) holding any NaN or ±Inf gets
//! the scale NaN, so its whole output row is NaN (never a silently finite garbage row). For
//! float precisions IEEE arithmetic applies.

use burn::tensor::{Int, Tensor, TensorData, backend::Backend};

use crate::{
    backend::{DenseTensors, PackedTensors},
    fp8,
    weight_quant::{Precision, QuantizedWeight},
};

/// Floor of the per-token absmax before dividing by `QMAX`, the kernels' own value.
pub use cubecl_kernels::rounding::ACTIVATION_EPS;

/// Prepared weights of the reference path (SlideSparse, or the dense baseline without a lift).
#[derive(Clone, Debug)]
pub struct ReferencePrepared<B: Backend> {
    /// How activations are quantized before the matmul.
    pub precision: Precision,
    /// Input width `K`.
    pub in_features: usize,
    /// `W'^T [K', out]` as float code values (INT8 integers, decoded E4M3, or floats).
    pub weight_t: Tensor<B, 2>,
    /// `s_w [1, out]`.
    pub scale: Tensor<B, 2>,
    /// `b [1, out]`.
    pub bias: Option<Tensor<B, 2>>,
    /// Lift map `[K']` into `X` extended with one zero column (index `K` means zero);
    /// `None` for the dense baseline.
    pub lift: Option<Tensor<B, 1, Int>>,
}

/// Uploads the transposed weight values for the matmul and builds the lift map (the input
/// permutation folded in). Panics if the permutation's length is not the layer's `K`.
pub fn prepare<B: Backend>(weights: PackedTensors<B>) -> ReferencePrepared<B> {
    let spec = weights.spec;
    let device = weights.device;
    let slid = weights.weight.full();
    let mut map = spec.geometry().lift_map_with_zero_column();
    if let Some(p) = &weights.input_permutation {
        // A permuted layer reads its input through the permutation: one gather, the same.
        assert_eq!(
            p.len(),
            spec.in_features,
            "SlideSparse layer: the input permutation orders {} channels, the layer has {}",
            p.len(),
            spec.in_features
        );
        map = p.compose_lift_map(&map);
    }
    let lift: Vec<i64> = map.into_iter().map(|i| i as i64).collect();
    let k_prime = lift.len();
    ReferencePrepared {
        precision: spec.precision,
        in_features: spec.in_features,
        weight_t: transposed_values(&slid, &device),
        scale: scale_row(&slid, &device),
        bias: weights.bias.map(|b| b.unsqueeze_dim(0)),
        lift: Some(Tensor::from_data(TensorData::new(lift, [k_prime]), &device)),
    }
}

/// The dense baseline's prepared weights: the same as SlideSparse's without a lift.
pub fn prepare_dense<B: Backend>(weights: DenseTensors<B>) -> ReferencePrepared<B> {
    let device = weights.device.clone();
    ReferencePrepared {
        precision: weights.precision(),
        in_features: weights.weight.cols,
        weight_t: transposed_values(&weights.weight, &device),
        scale: scale_row(&weights.weight, &device),
        bias: weights.bias.map(|b| b.unsqueeze_dim(0)),
        lift: None,
    }
}

/// `W^T [cols, rows]` code values (INT8 integers, decoded E4M3, or the floats) in the
/// backend's float type, transposed on the host: a transposed view would be copied by some
/// backends (NdArray) on every matmul. Code values are exact in every float type that holds
/// the precision (INT8 and E4M3 in bf16/f16/f32).
fn transposed_values<B: Backend>(w: &QuantizedWeight, device: &B::Device) -> Tensor<B, 2> {
    let values = w.codes.to_f32();
    let (rows, cols) = (w.rows, w.cols);
    let mut t = vec![0.0f32; values.len()];
    for (r, row) in values.chunks_exact(cols.max(1)).enumerate() {
        for (c, &v) in row.iter().enumerate() {
            t[c * rows + r] = v;
        }
    }
    float_tensor(TensorData::new(t, [cols, rows]), device)
}

/// The f32 per-row scales as a `[1, out]` row in the backend's float type.
fn scale_row<B: Backend>(w: &QuantizedWeight, device: &B::Device) -> Tensor<B, 2> {
    float_tensor(TensorData::new(w.scales.clone(), [1, w.rows]), device)
}

/// A tensor in the backend's float type, named explicitly: burn 0.21 otherwise uses the
/// device's default dtype, which another backend on the same device may have set.
fn float_tensor<B: Backend>(data: TensorData, device: &B::Device) -> Tensor<B, 2> {
    let options = burn::tensor::TensorCreationOptions::default()
        .with_device(device.clone())
        .with_dtype(<B::FloatElem as burn::tensor::Element>::dtype());
    Tensor::from_data(data, options)
}

/// The lifted `X' [M, K']`: `X'[m, o] = X[m, src(o)]`, zero where `src(o)` is padding.
pub fn lift<B: Backend>(x: Tensor<B, 2>, lift: Tensor<B, 1, Int>) -> Tensor<B, 2> {
    let [m, _] = x.dims();
    let zero = Tensor::zeros([m, 1], (&x.device(), x.dtype()));
    Tensor::cat(vec![x, zero], 1).select(1, lift)
}

/// Per-token scale `s_x [M, 1] = max(absmax(X[m,:]), eps) / qmax`, NaN for tokens holding a
/// non-finite value.
pub fn token_scales<B: Backend>(x: Tensor<B, 2>, qmax: f32) -> Tensor<B, 2> {
    let non_finite = x.clone().is_finite().bool_not().any_dim(1);
    let absmax = x.abs().max_dim(1).clamp_min(ACTIVATION_EPS);
    (absmax / qmax).mask_fill(non_finite, f32::NAN)
}

/// Rounds `v` (already divided by its scale) to the precision's grid, as the GPU does.
pub fn quantize_codes<B: Backend>(v: Tensor<B, 2>, precision: Precision) -> Tensor<B, 2> {
    match precision {
        Precision::Int8 => v.round().clamp(-127.0, 127.0),
        Precision::Fp8 => round_e4m3(v),
        _ => v,
    }
}

/// E4M3 round-to-nearest-even with saturation, with exact tensor ops: the binade's quantum is
/// built by comparisons and powers of two only (no log/exp, whose rounding is not exact).
fn round_e4m3<B: Backend>(v: Tensor<B, 2>) -> Tensor<B, 2> {
    let sign = v.clone().sign();
    let a = v.abs().clamp_max(fp8::E4M3_MAX);
    // Quantum 2^(e-3) for a in [2^e, 2^(e+1)), e >= -6; subnormals share 2^-9.
    let mut quantum = a.zeros_like().add_scalar(2f32.powi(-9));
    for e in -5..=8 {
        let doubled = a.clone().greater_equal_elem(2f32.powi(e));
        quantum = quantum.clone().mask_where(doubled, quantum * 2.0);
    }
    let rounded = (a / quantum.clone()).round() * quantum;
    rounded.clamp_max(fp8::E4M3_MAX) * sign
}

/// The reference forward of `X [M, K]`.
pub fn forward<B: Backend>(x: Tensor<B, 2>, prepared: &ReferencePrepared<B>) -> Tensor<B, 2> {
    let [_, k] = x.dims();
    assert_eq!(
        k, prepared.in_features,
        "SlideSparse layer expects {} input features, got {k}",
        prepared.in_features
    );
    let lifted = match &prepared.lift {
        Some(map) => lift(x.clone(), map.clone()),
        None => x.clone(),
    };
    let out = match prepared.precision.qmax() {
        Some(qmax) => {
            let s_x = token_scales(x, qmax);
            let codes = quantize_codes(lifted / s_x.clone(), prepared.precision);
            let acc = codes.matmul(prepared.weight_t.clone());
            acc * s_x * prepared.scale.clone()
        }
        None => lifted.matmul(prepared.weight_t.clone()) * prepared.scale.clone(),
    };
    match &prepared.bias {
        Some(b) => out + b.clone(),
        None => out,
    }
}

#[cfg(test)]
mod tests {
    use burn::backend::NdArray;

    use super::*;

    /// `quantize_codes` on a tensor of `values`, back on the host.
    fn codes(values: &[f32], precision: Precision) -> Vec<f32> {
        let v = Tensor::<NdArray, 2>::from_data(
            TensorData::new(values.to_vec(), [1, values.len()]),
            &Default::default(),
        );
        quantize_codes(v, precision).into_data().into_vec().unwrap()
    }

    /// Every E4M3 value, every midpoint between neighbours and the f32s next to both, both
    /// signs, and values past saturation.
    fn e4m3_probes() -> Vec<f32> {
        let mut values: Vec<f32> = (0..=0x7Eu8).map(fp8::e4m3_to_f32).collect();
        let midpoints: Vec<f32> = values.windows(2).map(|w| (w[0] + w[1]) / 2.0).collect();
        values.extend(midpoints);
        let mut probes = Vec::new();
        for v in values {
            for bits in v.to_bits().saturating_sub(2)..=v.to_bits() + 2 {
                let p = f32::from_bits(bits);
                probes.extend([p, -p]);
            }
        }
        probes.extend([449.0, -449.0, 500.0, 1e9, -1e9]);
        probes
    }

    /// The reference path's tensor E4M3 rounding and the host encoder (the kernels' own) must
    /// agree: one runs on any burn backend, the other packs weights and checks the GPU.
    #[test]
    fn tensor_e4m3_rounding_equals_the_host_encoder() {
        let probes = e4m3_probes();
        let got = codes(&probes, Precision::Fp8);
        for (&x, &g) in probes.iter().zip(&got) {
            let expected = fp8::round_to_e4m3(x);
            // -0 and +0 are the same value.
            assert!(g == expected, "x = {x:e}: tensor {g:e}, host {expected:e}");
        }
    }

    #[test]
    fn tensor_int8_rounding_is_half_to_even_and_clamped() {
        let probes = [
            -128.5f32, -127.5, -2.5, -1.5, -0.5, 0.5, 1.5, 2.5, 126.5, 127.5, 300.0,
        ];
        let got = codes(&probes, Precision::Int8);
        let expected: Vec<f32> = probes
            .iter()
            .map(|x| x.round_ties_even().clamp(-127.0, 127.0))
            .collect();
        assert_eq!(got, expected);
    }
}
