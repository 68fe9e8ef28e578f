//! Running one of this crate's CUDA operations on a generic burn backend's tensors: a checked
//! downcast of the backend's float tensors (as in `cube.rs`) to burn-cuda's `CubeTensor`
//! (any `CubeBackend<CudaRuntime, ..>`: the operation runs at once) or to `FusionTensor` over
//! it (`burn::backend::Cuda`: the operation is queued as a custom fusion operation and runs
//! in stream order when fusion executes it). Any other backend gets `None` and runs the
//! caller's reference.
//!
//! A fused execution cannot return its error: its outputs are NaN (never a stale result) and
//! the error is recorded against the operation's cubecl stream (`crate::deferred`), whose
//! next call returns it as `SlideSparseError::Deferred`.

use std::{
    any::{Any, TypeId},
    fmt,
};

use burn::tensor::{DType, Shape, Tensor, backend::Backend};
use burn_cubecl::{CubeBackend, fusion::FusionCubeRuntime, tensor::CubeTensor};
use burn_fusion::{
    FusionTensor,
    stream::{Operation, OperationStreams},
};
use burn_ir::{CustomOpIr, HandleContainer, OperationIr, TensorIr};

use crate::{
    cuda::runtime::Runtime,
    deferred,
    error::{Result, SlideSparseError},
};

/// burn-cuda's tensors, in the order an operation takes or returns them.
pub type NativeTensors = Vec<CubeTensor<Runtime>>;

type Cuda = CubeBackend<Runtime, f32, i32, u8>;
type FusedCuda = FusionTensor<FusionCubeRuntime<Runtime>>;
type Kernel = Box<dyn Fn(NativeTensors) -> Result<NativeTensors> + Send + Sync>;

/// Whether every dtype is bf16 or every one f16 (what the kernels take).
pub fn same_16_bit(dtypes: &[DType]) -> bool {
    dtypes.iter().all(|d| *d == DType::BF16) || dtypes.iter().all(|d| *d == DType::F16)
}

/// Whether `B`'s float tensors are burn-cuda's, plain or fused (what [`run`] takes).
pub fn is_cuda<B: Backend>() -> bool {
    let id = TypeId::of::<B::FloatTensorPrimitive>();
    id == TypeId::of::<CubeTensor<Runtime>>() || id == TypeId::of::<FusedCuda>()
}

/// The backend's float primitive of `t` (for [`run`]'s inputs), moved: on fusion an input
/// whose last handle the operation takes is freed when the operation runs, where a clone
/// would leave the caller's copy to queue one more (drop) operation.
pub fn float<B: Backend, const D: usize>(t: Tensor<B, D>) -> B::FloatTensorPrimitive {
    t.into_primitive().tensor()
}

/// A float primitive [`run`] returned, as a tensor.
pub fn wrap<B: Backend, const D: usize>(p: B::FloatTensorPrimitive) -> Tensor<B, D> {
    Tensor::from_primitive(burn::tensor::TensorPrimitive::Float(p))
}

fn cast<A: 'static, T: 'static>(value: A) -> std::result::Result<T, A> {
    let boxed = Box::new(value) as Box<dyn Any>;
    match boxed.downcast::<T>() {
        Ok(t) => Ok(*t),
        Err(b) => Err(*b.downcast::<A>().expect("the value's own type")),
    }
}

/// All of `values` as `T`, or all of them back (they share one type, so all or none cast).
fn cast_all<A: 'static, T: 'static>(values: Vec<A>) -> std::result::Result<Vec<T>, Vec<A>> {
    let mut out = Vec::with_capacity(values.len());
    let mut rest = values.into_iter();
    for value in rest.by_ref() {
        match cast::<A, T>(value) {
            Ok(t) => out.push(t),
            Err(a) => {
                assert!(out.is_empty(), "tensors of one backend share one type");
                return Err(std::iter::once(a).chain(rest).collect());
            }
        }
    }
    Ok(out)
}

/// `t` as burn-cuda's plain tensor, if `B` is the plain backend (a clone of its primitive).
pub fn plain_cuda<B: Backend, const D: usize>(t: &Tensor<B, D>) -> Option<CubeTensor<Runtime>> {
    cast::<_, CubeTensor<Runtime>>(t.clone().into_primitive().tensor()).ok()
}

/// A plain burn-cuda tensor as `B`'s (when `B` is the plain backend).
pub fn from_plain_cuda<B: Backend, const D: usize>(t: CubeTensor<Runtime>) -> Option<Tensor<B, D>> {
    cast::<_, B::FloatTensorPrimitive>(t).ok().map(wrap)
}

/// `kernel` on `inputs` if they are burn-cuda's (plain: at once; fused: queued, after
/// `prepare(device index)` compiled what it launches), with outputs of `outputs` shapes in
/// `dtype`; `None` for every other backend.
pub fn run<B: Backend>(
    name: &'static str,
    prepare: fn(usize) -> Result<()>,
    inputs: Vec<B::FloatTensorPrimitive>,
    outputs: Vec<Shape>,
    dtype: DType,
    kernel: impl Fn(NativeTensors) -> Result<NativeTensors> + Send + Sync + 'static,
) -> Option<Result<Vec<B::FloatTensorPrimitive>>> {
    let inputs = match cast_all::<_, CubeTensor<Runtime>>(inputs) {
        Ok(plain) => return Some(kernel(plain).map(back::<B, _>)),
        Err(inputs) => inputs,
    };
    let fused = cast_all::<_, FusedCuda>(inputs).ok()?;
    Some(queue(name, prepare, fused, outputs, dtype, Box::new(kernel)).map(back::<B, _>))
}

/// Outputs of the type the inputs were cast from, back as the backend's.
fn back<B: Backend, T: 'static>(outputs: Vec<T>) -> Vec<B::FloatTensorPrimitive> {
    cast_all(outputs).unwrap_or_else(|_| unreachable!("the type the inputs were cast from"))
}

/// The custom fusion operation: `outputs = kernel(inputs)` on the inner CUDA tensors.
struct KernelOp {
    inputs: Vec<TensorIr>,
    outputs: Vec<TensorIr>,
    kernel: Kernel,
}

impl fmt::Debug for KernelOp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("KernelOp")
            .field("inputs", &self.inputs)
            .field("outputs", &self.outputs)
            .finish_non_exhaustive()
    }
}

impl KernelOp {
    /// Whether `outputs` are the tensors this operation declared to fusion (their number,
    /// shapes and dtypes): what the fused graph after it was built for.
    fn declared(&self, outputs: &NativeTensors) -> bool {
        outputs.len() == self.outputs.len()
            && outputs.iter().zip(&self.outputs).all(|(out, ir)| {
                out.meta.shape().as_ref() == ir.shape.as_ref() && out.dtype == ir.dtype
            })
    }
}

impl Operation<FusionCubeRuntime<Runtime>> for KernelOp {
    fn execute(
        &self,
        handles: &mut HandleContainer<
            <FusionCubeRuntime<Runtime> as burn_fusion::FusionRuntime>::FusionHandle,
        >,
    ) {
        let inputs: NativeTensors = self
            .inputs
            .iter()
            .map(|ir| handles.get_float_tensor::<Cuda>(ir))
            .collect();
        let device = inputs[0].device.clone();
        let outputs = match deferred::executing(|| (self.kernel)(inputs)) {
            Ok(outputs) if self.declared(&outputs) => outputs,
            result => {
                let error = result
                    .err()
                    .unwrap_or_else(|| SlideSparseError::Unsupported {
                        what: "fused operation".into(),
                        why: "returned outputs of other shapes or dtypes than it declared".into(),
                    });
                deferred::record_current(error);
                self.outputs
                    .iter()
                    .map(|ir| nan_like(ir, &device))
                    .collect()
            }
        };
        for (ir, out) in self.outputs.iter().zip(outputs) {
            handles.register_float_tensor::<Cuda>(&ir.id, out);
        }
    }
}

/// A NaN tensor of `ir`'s shape and dtype (what a failed execution leaves in its outputs).
fn nan_like(
    ir: &TensorIr,
    device: &<Cuda as burn::tensor::backend::BackendTypes>::Device,
) -> CubeTensor<Runtime> {
    // An explicit dtype: the device's default is the caller's to set (burn fixes it at the
    // first tensor created with it).
    let flat = Tensor::<Cuda, 1>::full([ir.shape.num_elements()], f32::NAN, (device, DType::F32))
        .cast(ir.dtype)
        .into_primitive()
        .tensor();
    CubeTensor::new_contiguous(
        flat.client,
        flat.device,
        ir.shape.clone(),
        flat.handle,
        ir.dtype,
    )
}

/// Compiles the kernels with `prepare` if needed (so that the execution has nothing left to
/// fail on but the launches) and queues the operation.
fn queue(
    name: &'static str,
    prepare: fn(usize) -> Result<()>,
    inputs: Vec<FusedCuda>,
    outputs: Vec<Shape>,
    dtype: DType,
    kernel: Kernel,
) -> Result<Vec<FusedCuda>> {
    deferred::take_current()?;
    let client = inputs[0].client.clone();
    prepare(client.device().index)?;
    let streams = OperationStreams::with_inputs(&inputs);
    let inputs: Vec<TensorIr> = inputs.into_iter().map(FusionTensor::into_ir).collect();
    let outputs: Vec<TensorIr> = outputs
        .into_iter()
        .map(|shape| TensorIr::uninit(client.create_empty_handle(), shape, dtype))
        .collect();
    let ir = CustomOpIr::new(name, &inputs, &outputs);
    let op = KernelOp {
        inputs,
        outputs,
        kernel,
    };
    Ok(client.register(streams, OperationIr::Custom(ir), op))
}
