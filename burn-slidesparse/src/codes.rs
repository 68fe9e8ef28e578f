//! `WeightCodesModule`: a quantized layer weight (codes and per-channel scales) as a burn
//! module field, kept on the host.
//!
//! Why on the host: a prepared layer's device copy is the backend's own (cuSPARSELt's
//! compressed weight on CUDA, a float tensor on the reference backends). Keeping the codes
//! as a device tensor too would hold a second, larger copy of every weight on the GPU for
//! nothing but saving; the host copy costs the code bytes once in RAM, saves without a device
//! read, and moves to any device for free. A SlideSparse INT8 / FP8 layer's codes are held in
//! the compact layout ([`HostCodes`]: 0.83 bytes a weight at 6:8 where the slid codes take 1.5),
//! which the CPU's integer kernel reads in place and the Hopper compact GEMM uploads as it is;
//! the slid codes are rebuilt from it for cuSPARSELt's preparation and for the record. The
//! record holds the codes in their own width (INT8 as `I8`, FP8 as E4M3 bytes `U8`, 16-bit
//! precisions as `BF16`/`F16`, F32 as `F32`) and the scales in f32, whatever the recorder's
//! precision settings: records round-trip bit-exactly.
//!
//! burn's tensor visitors (`Module::visit`, `num_params`, burn-store snapshots) do not see
//! these codes: save such modules with burn's recorders or the packed safetensors format.

use std::{
    fmt,
    sync::{
        Arc,
        atomic::{AtomicU64, Ordering},
    },
};

use burn::{
    module::{
        AutodiffModule, Content, Devices, Module, ModuleDisplay, ModuleDisplayDefault,
        ModuleMapper, ModuleVisitor,
    },
    record::{PrecisionSettings, Record},
    tensor::{
        DType, TensorData,
        backend::{AutodiffBackend, Backend},
    },
};
use half::{bf16, f16};

use crate::{
    compact::HostCodes,
    permute::InputPermutation,
    weight_quant::{Precision, QuantizedWeight, WeightCodes},
};

/// Identifies one set of codes, for the prepared-weight cache: a fresh value for every new
/// or loaded weight, shared by clones.
fn fresh_id() -> u64 {
    static NEXT: AtomicU64 = AtomicU64::new(1);
    NEXT.fetch_add(1, Ordering::Relaxed)
}

/// A layer's quantized weight `[rows, cols]` (codes and per-row f32 scales) on the host (a
/// SlideSparse INT8 / FP8 layer's in the compact layout, [`HostCodes`]), the order of the input
/// channels its columns were pruned in (a SlideSparse layer packed with an input permutation),
/// and the device the layer lives on.
#[derive(Clone)]
pub struct WeightCodesModule<B: Backend> {
    weight: HostCodes,
    input_permutation: Option<InputPermutation>,
    id: u64,
    device: B::Device,
}

impl<B: Backend> WeightCodesModule<B> {
    /// Codes and scales of a dense layer on `device`, kept as they are.
    pub fn new(weight: QuantizedWeight, device: &B::Device) -> Self {
        Self::held(HostCodes::Codes(Arc::new(weight)), device)
    }

    /// Codes and scales held as `weight` (a SlideSparse layer's: [`HostCodes::sparse`]).
    pub fn held(weight: HostCodes, device: &B::Device) -> Self {
        Self {
            weight,
            input_permutation: None,
            id: fresh_id(),
            device: device.clone(),
        }
    }

    /// The same codes read through `permutation` (position `j` of the layer's input order is
    /// input channel `order[j]`), as a new set of codes for the prepared-weight cache.
    pub fn with_input_permutation(self, permutation: Option<InputPermutation>) -> Self {
        Self {
            input_permutation: permutation,
            id: fresh_id(),
            ..self
        }
    }

    /// The input order the codes were pruned in, if not the original one.
    pub fn input_permutation(&self) -> Option<&InputPermutation> {
        self.input_permutation.as_ref()
    }

    /// The codes and scales in their full form (`W`, or slid `W'`): shared where held so,
    /// rebuilt from the compact layout otherwise ([`HostCodes::full`]).
    pub fn weight(&self) -> Arc<QuantizedWeight> {
        self.weight.full()
    }

    /// The codes and scales as held.
    pub fn codes(&self) -> &HostCodes {
        &self.weight
    }

    /// The device the layer's prepared weights are built on.
    pub fn device(&self) -> &B::Device {
        &self.device
    }

    /// Identifies these codes (changes when a record is loaded).
    pub(crate) fn id(&self) -> u64 {
        self.id
    }

    fn with_device<C: Backend>(&self, device: C::Device) -> WeightCodesModule<C> {
        WeightCodesModule {
            weight: self.weight.clone(),
            input_permutation: self.input_permutation.clone(),
            id: self.id,
            device,
        }
    }
}

impl<B: Backend> fmt::Debug for WeightCodesModule<B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let (rows, cols) = self.weight.shape();
        f.debug_struct("WeightCodesModule")
            .field("rows", &rows)
            .field("cols", &cols)
            .field("precision", &self.weight.precision())
            .field("compact", &self.weight.compact().is_some())
            .field("input_permutation", &self.input_permutation)
            .field("device", &self.device)
            .finish()
    }
}

/// The record of a [`WeightCodesModule`]: codes in their own width, scales in f32, and the
/// input permutation if there is one.
///
/// The permutation field is new with input permutations: self-describing recorders (named
/// MessagePack, JSON) read older records as without one; binary (bincode) records written
/// before it do not load.
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
pub struct WeightCodesRecord {
    /// `[rows, cols]` codes: `I8` (INT8), `U8` (E4M3 bytes), `BF16`, `F16` or `F32`.
    pub codes: TensorData,
    /// `[rows]` per-row scales, `F32`.
    pub scales: TensorData,
    /// `order[j]`: the input channel of position `j` (see [`InputPermutation`]).
    #[serde(default)]
    pub input_permutation: Option<Vec<u32>>,
}

impl<B: Backend> Record<B> for WeightCodesRecord {
    // Deliberately independent of the precision settings: a code is a code.
    type Item<S: PrecisionSettings> = WeightCodesRecord;

    fn into_item<S: PrecisionSettings>(self) -> Self::Item<S> {
        self
    }

    fn from_item<S: PrecisionSettings>(item: Self::Item<S>, _device: &B::Device) -> Self {
        item
    }
}

impl WeightCodesRecord {
    /// The record of a weight.
    pub fn from_weight(weight: &QuantizedWeight) -> Self {
        let shape = vec![weight.rows, weight.cols];
        let codes = match &weight.codes {
            WeightCodes::I8(v) => TensorData::new(v.clone(), shape),
            WeightCodes::Fp8(v) => TensorData::new(v.clone(), shape),
            WeightCodes::Bf16(v) => TensorData::new(v.clone(), shape),
            WeightCodes::F16(v) => TensorData::new(v.clone(), shape),
            WeightCodes::F32(v) => TensorData::new(v.clone(), shape),
        };
        Self {
            codes,
            scales: TensorData::new(weight.scales.clone(), [weight.rows]),
            input_permutation: None,
        }
    }

    /// The weight this record holds, checked against the precision and shape the module
    /// expects (`Err` names what differs).
    pub fn into_weight(
        self,
        precision: Precision,
        (rows, cols): (usize, usize),
    ) -> Result<QuantizedWeight, String> {
        let expected = codes_dtype(precision);
        if self.codes.dtype != expected {
            return Err(format!(
                "the record's codes are {:?}, the layer's precision {precision} stores {expected:?}",
                self.codes.dtype
            ));
        }
        let shape = self.codes.shape.to_vec();
        if shape != [rows, cols] || self.scales.shape.to_vec() != [rows] {
            return Err(format!(
                "the record's codes are {shape:?} with {:?} scales, the layer is [{rows}, {cols}]",
                self.scales.shape.to_vec()
            ));
        }
        let bad = |e| format!("unreadable codes: {e:?}");
        let codes = match precision {
            Precision::Int8 => WeightCodes::I8(self.codes.into_vec::<i8>().map_err(bad)?),
            Precision::Fp8 => WeightCodes::Fp8(self.codes.into_vec::<u8>().map_err(bad)?),
            Precision::Bf16 => WeightCodes::Bf16(self.codes.into_vec::<bf16>().map_err(bad)?),
            Precision::F16 => WeightCodes::F16(self.codes.into_vec::<f16>().map_err(bad)?),
            Precision::F32 => WeightCodes::F32(self.codes.into_vec::<f32>().map_err(bad)?),
        };
        let scales = self
            .scales
            .into_vec::<f32>()
            .map_err(|e| format!("unreadable scales: {e:?}"))?;
        Ok(QuantizedWeight {
            rows,
            cols,
            codes,
            scales,
        })
    }
}

/// The record dtype of a precision's codes.
fn codes_dtype(precision: Precision) -> DType {
    match precision {
        Precision::Int8 => DType::I8,
        Precision::Fp8 => DType::U8,
        Precision::Bf16 => DType::BF16,
        Precision::F16 => DType::F16,
        Precision::F32 => DType::F32,
    }
}

impl<B: Backend> Module<B> for WeightCodesModule<B> {
    type Record = WeightCodesRecord;

    /// The codes and scales are the layer's parameters, though not float `Param`s (burn's
    /// default count, which visits float parameters, would say 0); derived modules sum
    /// their fields' counts.
    fn num_params(&self) -> usize {
        self.weight.full_len()
    }

    fn collect_devices(&self, mut devices: Devices<B>) -> Devices<B> {
        if !devices.contains(&self.device) {
            devices.push(self.device.clone());
        }
        devices
    }

    fn fork(self, device: &B::Device) -> Self {
        self.to_device(device)
    }

    fn to_device(self, device: &B::Device) -> Self {
        Self {
            device: device.clone(),
            ..self
        }
    }

    fn visit<V: ModuleVisitor<B>>(&self, _visitor: &mut V) {}

    fn map<M: ModuleMapper<B>>(self, _mapper: &mut M) -> Self {
        self
    }

    /// Replaces the codes. `Module::load_record` cannot return an error, so a record of
    /// another precision or shape panics like burn's own mismatches do (the crate's
    /// `load_record` / `load_file` turn that into `SlideSparseError::Record`).
    fn load_record(self, record: Self::Record) -> Self {
        let precision = self.weight.precision();
        let shape = self.weight.shape();
        let permutation = record.input_permutation.clone().map(InputPermutation::new);
        match (
            record.into_weight(precision, shape),
            permutation.transpose(),
        ) {
            (Ok(weight), Ok(p)) => {
                Self::held(self.weight.like(weight), &self.device).with_input_permutation(p)
            }
            (Err(why), _) => panic!("loading a SlideSparse weight record: {why}"),
            (_, Err(why)) => panic!("loading a SlideSparse weight record: {why}"),
        }
    }

    fn into_record(self) -> Self::Record {
        WeightCodesRecord {
            input_permutation: self.input_permutation.map(Vec::from),
            ..WeightCodesRecord::from_weight(&self.weight.full())
        }
    }
}

impl<B: AutodiffBackend> AutodiffModule<B> for WeightCodesModule<B> {
    type InnerModule = WeightCodesModule<B::InnerBackend>;

    fn valid(&self) -> Self::InnerModule {
        self.with_device(self.device.clone())
    }

    fn from_inner(module: Self::InnerModule) -> Self {
        module.with_device(module.device.clone())
    }
}

impl<B: Backend> ModuleDisplayDefault for WeightCodesModule<B> {
    fn content(&self, content: Content) -> Option<Content> {
        let ((rows, cols), precision) = (self.weight.shape(), self.weight.precision());
        let form = if self.weight.compact().is_some() {
            "compact, on the host"
        } else {
            "on the host"
        };
        content
            .add_formatted(&format!(
                "WeightCodes {{shape: [{rows}, {cols}], precision: {precision}, {form}}}"
            ))
            .optional()
    }

    fn num_params(&self) -> usize {
        let (rows, cols) = self.weight.shape();
        rows * cols
    }
}

impl<B: Backend> ModuleDisplay for WeightCodesModule<B> {}
