//! A small model written as a burn user writes one, whose linear layers are swapped for
//! SlideSparse layers; it compiles for every burn backend the tests name, with nothing
//! backend-specific in it.

use burn::{
    module::Module,
    nn::{Linear, LinearConfig},
    tensor::{Tensor, TensorData, activation::relu, backend::Backend},
};
use burn_slidesparse::{
    MaybeSparseLinear, PackOptions, Precision, SlideSparseBackend, SparsityPattern, VisitLinears,
    sparsify,
};

/// Two linear layers with a ReLU between them.
#[derive(Module, Debug)]
pub struct Mlp<B: Backend> {
    /// `[d_in -> d_hidden]`.
    pub up: MaybeSparseLinear<B>,
    /// `[d_hidden -> d_out]`.
    pub down: MaybeSparseLinear<B>,
}

impl<B: Backend> VisitLinears<B> for Mlp<B> {
    fn visit_linears(
        &mut self,
        f: &mut dyn FnMut(&str, &mut MaybeSparseLinear<B>) -> burn_slidesparse::Result<()>,
    ) -> burn_slidesparse::Result<()> {
        f("up", &mut self.up)?;
        f("down", &mut self.down)
    }
}

/// Deterministic values in [-1, 1): the same weights on every backend.
pub fn values(len: usize, seed: u32) -> Vec<f32> {
    let mut state = seed.wrapping_mul(2_654_435_761).max(1);
    (0..len)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 17;
            state ^= state << 5;
            (state as f32 / u32::MAX as f32) * 2.0 - 1.0
        })
        .collect()
}

fn linear<B: Backend>(d_in: usize, d_out: usize, seed: u32, device: &B::Device) -> Linear<B> {
    let mut linear = LinearConfig::new(d_in, d_out).init::<B>(device);
    let weight = TensorData::new(values(d_in * d_out, seed), [d_in, d_out]);
    linear.weight = linear.weight.map(|_| Tensor::from_data(weight, device));
    let bias = TensorData::new(values(d_out, seed + 1), [d_out]);
    linear.bias = linear
        .bias
        .map(|b| b.map(|_| Tensor::from_data(bias, device)));
    linear
}

impl<B: SlideSparseBackend> Mlp<B> {
    /// The dense model, then every layer packed to 6:8 at `precision`.
    pub fn sparse(precision: Precision, device: &B::Device) -> burn_slidesparse::Result<Self> {
        let mut model = Self {
            up: linear(128, 256, 1, device).into(),
            down: linear(256, 64, 3, device).into(),
        };
        let options = PackOptions::new(SparsityPattern::P6_8, precision);
        sparsify(&mut model, &options, |_| true)?;
        Ok(model)
    }

    /// `[batch, 128] -> [batch, 64]`.
    pub fn forward(&self, x: Tensor<B, 2>) -> Tensor<B, 2> {
        self.down.forward(relu(self.up.forward(x)))
    }
}

/// The sparse model's output for a fixed input on backend `B`.
pub fn run<B: SlideSparseBackend>(precision: Precision, device: &B::Device) -> Vec<f32> {
    let model = Mlp::<B>::sparse(precision, device).expect("sparsify");
    let x = Tensor::<B, 2>::from_data(TensorData::new(values(8 * 128, 7), [8, 128]), device);
    model
        .forward(x)
        .into_data()
        .convert::<f32>()
        .into_vec::<f32>()
        .expect("f32 output")
}
