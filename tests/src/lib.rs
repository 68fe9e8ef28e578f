//! Helpers shared by the cross-crate integration tests in `tests/tests/`.

use burn::{
    module::Module,
    nn::LinearConfig,
    tensor::{DType, Tensor, TensorData, backend::Backend},
};
use burn_slidesparse::{MaybeSparseLinear, Precision, VisitLinears};
use rand::{Rng, SeedableRng, rngs::StdRng};

/// A two-layer model that lists its linears by name: `up` (`[d_in -> d_hidden]`) and
/// `head` (`[d_hidden -> d_out]`), both dense at first.
#[derive(Module, Debug)]
pub struct TwoLayers<B: Backend> {
    pub up: MaybeSparseLinear<B>,
    pub head: MaybeSparseLinear<B>,
}

impl<B: Backend> TwoLayers<B> {
    pub fn new(d_in: usize, d_hidden: usize, d_out: usize, device: &B::Device) -> Self {
        Self {
            up: LinearConfig::new(d_in, d_hidden).init(device).into(),
            head: LinearConfig::new(d_hidden, d_out).init(device).into(),
        }
    }
}

impl<B: Backend> VisitLinears<B> for TwoLayers<B> {
    fn visit_linears(
        &mut self,
        f: &mut dyn FnMut(&str, &mut MaybeSparseLinear<B>) -> burn_slidesparse::Result<()>,
    ) -> burn_slidesparse::Result<()> {
        f("up", &mut self.up)?;
        f("head", &mut self.head)
    }
}

/// A deterministic RNG per test (fresh data per seed; seeds differ between tests).
pub fn rng(seed: u64) -> StdRng {
    StdRng::seed_from_u64(seed)
}

/// `len` random values in [-1, 1).
pub fn random_f32(rng: &mut StdRng, len: usize) -> Vec<f32> {
    (0..len).map(|_| rng.random_range(-1.0f32..1.0)).collect()
}

/// `len` random small nonzero integers as f32 (products and sums stay exact in f32).
pub fn random_small_ints(rng: &mut StdRng, len: usize, max: i32) -> Vec<f32> {
    (0..len)
        .map(|_| {
            let v = rng.random_range(1..=max) as f32;
            if rng.random_bool(0.5) { v } else { -v }
        })
        .collect()
}

/// `Y = X . W^T + b` in f64, for row-major `X [m, k]`, `W [n, k]`.
pub fn dense_linear(
    x: &[f32],
    w: &[f32],
    b: Option<&[f32]>,
    m: usize,
    k: usize,
    n: usize,
) -> Vec<f64> {
    let mut y = vec![0.0f64; m * n];
    for i in 0..m {
        for j in 0..n {
            let mut acc = 0.0f64;
            for t in 0..k {
                acc += x[i * k + t] as f64 * w[j * k + t] as f64;
            }
            y[i * n + j] = acc + b.map_or(0.0, |b| b[j] as f64);
        }
    }
    y
}

/// `||a - b|| / ||b||` (absolute norm when `b` is zero).
pub fn relative_error(a: &[f32], b: &[f64]) -> f64 {
    assert_eq!(a.len(), b.len());
    let num: f64 = a.iter().zip(b).map(|(&x, &y)| (x as f64 - y).powi(2)).sum();
    let den: f64 = b.iter().map(|y| y * y).sum();
    if den == 0.0 {
        num.sqrt()
    } else {
        (num / den).sqrt()
    }
}

/// Host W8A8 of the dense baseline: per-token quantization, exact integer/FP8 products,
/// dequantization and bias.
pub fn host_w8a8(
    x: &[f32],
    qw: &burn_slidesparse::QuantizedWeight,
    b: &[f32],
    (m, k, n): (usize, usize, usize),
    precision: Precision,
) -> Vec<f32> {
    use burn_slidesparse::internals::reference::ACTIVATION_EPS;
    let wq = qw.codes.to_f32();
    let qmax = precision.qmax().unwrap();
    let mut expected = vec![0f32; m * n];
    for i in 0..m {
        let row = &x[i * k..(i + 1) * k];
        let s = row
            .iter()
            .fold(0f32, |a, v| a.max(v.abs()))
            .max(ACTIVATION_EPS)
            / qmax;
        let q: Vec<f32> = row.iter().map(|&v| precision.quantize(v, s)).collect();
        for j in 0..n {
            let acc: f64 = (0..k).map(|t| q[t] as f64 * wq[j * k + t] as f64).sum();
            expected[i * n + j] = (acc as f32) * s * qw.scales[j] + b[j];
        }
    }
    expected
}

/// The quant+lift kernel's codes (`[m_pad, k_out]` bytes) and scales (`[m_pad]`) against the
/// spec computed on the host from `x` (`[m, k]`), bit for bit: `source(o)` is the input column
/// lifted to output column `o` (`None`: a padding column), rows `m..m_pad` are padding (scale
/// 1, zero codes); FP8's +0 and -0 are the same code value.
pub fn check_quant_codes(
    x: &[f32],
    got: &[u8],
    got_scales: &[f32],
    (m, m_pad, k, k_out): (usize, usize, usize, usize),
    source: &dyn Fn(usize) -> Option<usize>,
    precision: Precision,
    label: &str,
) {
    use burn_slidesparse::internals::{fp8, reference::ACTIVATION_EPS};
    let qmax = precision.qmax().unwrap();
    for row in 0..m_pad {
        let xr = if row < m {
            &x[row * k..(row + 1) * k]
        } else {
            &[][..]
        };
        let absmax = xr.iter().fold(0.0f32, |a, v| a.max(v.abs()));
        let s = if row < m {
            absmax.max(ACTIVATION_EPS) / qmax
        } else {
            1.0
        };
        assert_eq!(got_scales[row].to_bits(), s.to_bits(), "{label} row {row}");
        for o in 0..k_out {
            let v = source(o).filter(|_| row < m).map_or(0.0, |src| xr[src]);
            let expected = match precision {
                Precision::Int8 => (v / s).round_ties_even().clamp(-127.0, 127.0) as i8 as u8,
                _ => fp8::f32_to_e4m3((v / s).clamp(-448.0, 448.0)),
            };
            let got = got[row * k_out + o];
            let same =
                got == expected || (precision == Precision::Fp8 && (got | expected) & 0x7F == 0);
            assert!(
                same,
                "{label} row {row} col {o}: got {got:#x}, expected {expected:#x}"
            );
        }
    }
}

/// `n` values uniform in [-2, 2) from `seed`: the GPU tests' activations and weights.
pub fn uniform_values(seed: u64, n: usize) -> Vec<f32> {
    let mut r = rng(seed);
    (0..n).map(|_| r.random_range(-2.0f32..2.0)).collect()
}

/// A tensor of `data` in `dtype` on `B`'s default device.
pub fn tensor_of<B: Backend, const N: usize>(
    data: &[f32],
    shape: [usize; N],
    dtype: DType,
) -> Tensor<B, N> {
    Tensor::from_data(
        TensorData::new(data.to_vec(), shape),
        (&Default::default(), dtype),
    )
}

/// A tensor's values read back to the host as f32.
pub fn to_host<B: Backend, const N: usize>(t: Tensor<B, N>) -> Vec<f32> {
    t.into_data().convert::<f32>().into_vec::<f32>().unwrap()
}

/// `||got - want|| / ||want||`.
pub fn relative_l2(got: &[f32], want: &[f32]) -> f64 {
    assert_eq!(got.len(), want.len());
    let (mut err, mut norm) = (0f64, 0f64);
    for (g, w) in got.iter().zip(want) {
        err += (*g as f64 - *w as f64).powi(2);
        norm += (*w as f64).powi(2);
    }
    (err / norm.max(1e-30)).sqrt()
}

/// Asserts that two tensors have the same shape and the same bits in every element.
pub fn assert_same_bits<B: Backend, const N: usize>(
    what: &str,
    got: Tensor<B, N>,
    want: Tensor<B, N>,
) {
    assert_eq!(got.dims(), want.dims(), "{what}");
    let (got, want) = (to_host(got), to_host(want));
    let differ = got
        .iter()
        .zip(&want)
        .filter(|(g, w)| g.to_bits() != w.to_bits())
        .count();
    assert_eq!(
        differ,
        0,
        "{what}: {differ} of {} elements differ",
        got.len()
    );
}
