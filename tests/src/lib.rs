//! Helpers shared by the cross-crate integration tests in `tests/tests/`.

use burn::{module::Module, nn::LinearConfig, tensor::backend::Backend};
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
