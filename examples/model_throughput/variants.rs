//! Building each variant: the block linears converted with the packer, or replaced by
//! random codes that satisfy the pattern (no packer: fast at full depth).

use burn::{
    module::{Module, ModuleVisitor, Param},
    tensor::{Tensor, backend::Backend},
};
use burn_slidesparse::{
    DEFAULT_ALIGNMENT, PackOptions, PackedLinear, Precision, QuantizedLinear, QuantizedWeight,
    SlideSparseBackend, SlideSparseLinear, SparsityPattern, VisitLinears, WeightCodes, prepare_all,
    quantize_dense, sparsify,
};
use slidesparse_examples::llama::{Llama, LlamaConfig};

use crate::args::{Args, config};

/// Converts the block linears of `model` (never the LM head) to `variant`.
pub(crate) fn convert<B: SlideSparseBackend>(
    model: &mut Llama<B>,
    variant: &str,
) -> Result<(), Box<dyn std::error::Error>> {
    let blocks_only = |name: &str| name != "lm_head";
    match variant {
        "bf16" => {}
        "dense-int8" => drop(quantize_dense(model, Precision::Int8, blocks_only)?),
        "dense-fp8" => drop(quantize_dense(model, Precision::Fp8, blocks_only)?),
        sparse => {
            let (pattern, precision) = sparse
                .split_once('-')
                .ok_or_else(|| format!("variant {sparse}: expected PATTERN-PRECISION"))?;
            let options = PackOptions::new(pattern.parse::<SparsityPattern>()?, precision.parse()?);
            sparsify(model, &options, blocks_only)?;
        }
    }
    Ok(())
}

/// The head `--head` gives `args.model`: `auto` is `int8` for an untied head, `bf16` for one
/// tied to the embedding matrix; `int8` on a tied head is an error.
pub(crate) fn head_kind(args: &Args) -> Result<&'static str, Box<dyn std::error::Error>> {
    let tied = config(&args.model, 0)?.tie_embeddings;
    match (args.head.as_str(), tied) {
        ("auto", false) | ("int8", false) => Ok("int8"),
        ("auto", true) | ("bf16", _) => Ok("bf16"),
        ("int8", true) => Err(format!(
            "--head int8: {} ties its LM head to the embedding matrix; an INT8 head would be \
             a second copy of it (more memory, not less)",
            args.model
        )
        .into()),
        (other, _) => Err(format!("--head {other}: expected auto, int8 or bf16").into()),
    }
}

/// The LM head of a quantized variant (and of the zero-block model that the per-block
/// figures subtract) as [`head_kind`] says: a dense INT8 layer, or burn's bf16 head kept.
pub(crate) fn convert_head<B: SlideSparseBackend>(
    model: &mut Llama<B>,
    args: &Args,
    variant: &str,
) -> Result<(), Box<dyn std::error::Error>> {
    if head_kind(args)? == "bf16" || variant == "bf16" {
        return Ok(());
    }
    drop(quantize_dense(model, Precision::Int8, |name| {
        name == "lm_head"
    })?);
    Ok(())
}

/// A cheap deterministic generator (xorshift64*) for random codes.
pub(crate) struct Noise(pub(crate) u64);

impl Noise {
    pub(crate) fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
}

/// `rows x cols` random codes of `precision`, filled on every core, nonzero in the first
/// `used` columns of each row only (the rest is a slid weight's alignment padding); with
/// `two_of_four`, only the first two of every four columns are nonzero (a valid slid weight).
pub(crate) fn random_codes(
    precision: Precision,
    (rows, cols, used): (usize, usize, usize),
    two_of_four: bool,
) -> WeightCodes {
    let mut bytes = vec![0u8; rows * cols];
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    let rows_per = rows.div_ceil(threads).max(1);
    std::thread::scope(|scope| {
        for (t, chunk) in bytes.chunks_mut(rows_per * cols).enumerate() {
            scope.spawn(move || {
                let mut noise = Noise(0x9E37_79B9_7F4A_7C15 ^ (t as u64 + 1));
                for (j, b) in chunk.iter_mut().enumerate() {
                    if (two_of_four && (j % cols) % 4 >= 2) || j % cols >= used {
                        continue;
                    }
                    let r = noise.next() >> 32;
                    *b = match precision {
                        // INT8 in [-127, 127].
                        Precision::Int8 => ((r % 255) as i32 - 127) as i8 as u8,
                        // E4M3 with exponent field <= 14: always finite.
                        _ => (r as u8) & 0xF7,
                    };
                }
            });
        }
    });
    match precision {
        Precision::Int8 => WeightCodes::I8(bytes.into_iter().map(|b| b as i8).collect()),
        _ => WeightCodes::Fp8(bytes),
    }
}

/// Replaces the block linears of `model` (never the LM head) by random layers of `variant`
/// that satisfy its pattern, without the packer.
pub(crate) fn convert_random<B: SlideSparseBackend>(
    model: &mut Llama<B>,
    variant: &str,
) -> Result<(), Box<dyn std::error::Error>> {
    if variant == "bf16" {
        return Ok(());
    }
    let (pattern, precision) = variant.split_once('-').ok_or_else(|| {
        format!("variant {variant}: expected dense-PRECISION or PATTERN-PRECISION")
    })?;
    let precision: Precision = precision.parse()?;
    if !precision.is_quantized() {
        return Err(format!("variant {variant}: random codes are INT8 or FP8").into());
    }
    let device = Default::default();
    model.visit_linears(&mut |name, layer| {
        if name == "lm_head" {
            return Ok(());
        }
        let (k, n) = layer.features();
        let bias = layer.has_bias().then(|| vec![0.01f32; n]);
        *layer = if pattern == "dense" {
            let weight = QuantizedWeight {
                rows: n,
                cols: k,
                codes: random_codes(precision, (n, k, k), false),
                scales: vec![1e-3; n],
            };
            QuantizedLinear::from_quantized_owned(weight, bias.as_deref(), &device).into()
        } else {
            let pattern: SparsityPattern = pattern.parse()?;
            let geometry = pattern.geometry(k, DEFAULT_ALIGNMENT);
            let (kp, used) = (
                geometry.k_prime(),
                geometry.blocks() * geometry.slid_block_len(),
            );
            let packed = PackedLinear {
                name: format!("{name}.weight"),
                pattern,
                in_features: k,
                alignment: DEFAULT_ALIGNMENT,
                weight: QuantizedWeight {
                    rows: n,
                    cols: kp,
                    codes: random_codes(precision, (n, kp, used), true),
                    scales: vec![1e-3; n],
                },
                bias,
                input_permutation: None,
            };
            SlideSparseLinear::from_packed_owned(packed, &device).into()
        };
        Ok(())
    })?;
    Ok(())
}

/// `variant` (or the zero-block model, `head-only`) with random codes, prepared, every
/// parameter materialized and what is queued run.
pub(crate) fn build_random<B: SlideSparseBackend>(
    args: &Args,
    config: &LlamaConfig,
    variant: &str,
    fuse: bool,
) -> Result<Llama<B>, Box<dyn std::error::Error>> {
    let device = Default::default();
    let mut model = if variant == "head-only" {
        LlamaConfig {
            layers: 0,
            ..config.clone()
        }
        .init::<B>(&device)
    } else {
        let mut model = config.init::<B>(&device);
        convert_random(&mut model, variant)?;
        model
    };
    convert_head(&mut model, args, variant)?;
    // burn initializes parameters lazily, on first use: materialize them all (the bf16
    // linears, embeddings and head) so that the report counts the whole model.
    model.visit(&mut Materialize);
    if fuse {
        model.fuse_projections()?;
        prepare_all(&mut model)?;
    }
    // Fusion creates tensors lazily: run what is queued before reading the allocator.
    B::sync(&device)?;
    Ok(model)
}

/// Reads every float parameter once, which initializes the lazily initialized ones.
pub(crate) struct Materialize;

impl<B: Backend> ModuleVisitor<B> for Materialize {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        let _ = param.val();
    }
}
