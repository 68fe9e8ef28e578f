//! Tokenization through the Hugging Face `tokenizers` crate, from a `tokenizer.json` file or
//! from a GGUF file's vocabulary.
//!
//! A `tokenizer.json` is run by that crate as is: its normalizer, pre-tokenizer, model (BPE
//! with or without byte fallback, Unigram, WordPiece, WordLevel), post-processor and decoder
//! are the reference implementation's, so the ids are the reference ids. A file naming a
//! component the crate does not know is an error.
//!
//! A GGUF vocabulary (`tokenizer.ggml.model = gpt2`: byte-level BPE) is turned into the
//! equivalent `tokenizer.json` pipeline: the vocabulary and merges from the file, and the
//! pre-tokenizer named by `tokenizer.ggml.pre` (see [`GGUF_PRE_TOKENIZERS`]). Any other model
//! or pre-tokenizer is an error rather than a guess, since a wrong split gives the model ids
//! it was never trained on, without any visible failure.

use std::collections::HashSet;

use burn_slidesparse::{
    SlideSparseError,
    gguf::{GgufFile, GgufValue},
};
use serde_json::{Value, json};

/// The `tokenizer.ggml.pre` values a GGUF vocabulary may name here.
pub const GGUF_PRE_TOKENIZERS: &[&str] = &["smollm", "gpt-2", "llama-bpe", "qwen2"];

/// Llama-3's split: contractions in any case, a letter run with at most one leading
/// non-letter (such as a space), numbers in groups of up to three digits, punctuation runs
/// with the line breaks after them, line-break runs, and other whitespace.
const LLAMA3_SPLIT: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// Qwen2's split: Llama-3's with every digit on its own.
const QWEN2_SPLIT: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// GGUF token types (`tokenizer.ggml.token_type`) that are special tokens, never produced by
/// the merges: control (3) and user-defined (4).
const CONTROL: i64 = 3;
const USER_DEFINED: i64 = 4;

/// Encoder and decoder.
pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    /// Beginning-of-sequence id, if the tokenizer has one.
    pub bos: Option<u32>,
    /// End-of-sequence id, if the tokenizer has one.
    pub eos: Option<u32>,
    /// Whether a prompt starts with `bos` ([`Tokenizer::encode_prompt`]) for GGUF files;
    /// a `tokenizer.json` says so through its post-processor instead.
    add_bos: bool,
    /// Bytes a GGUF byte-level vocabulary has no token for (see [`Tokenizer::encode`]).
    missing_bytes: Vec<u8>,
}

fn err(what: impl std::fmt::Display) -> SlideSparseError {
    SlideSparseError::Backend(format!("tokenizer: {what}"))
}

fn strings<'a>(file: &'a GgufFile, key: &str) -> Result<Vec<&'a str>, SlideSparseError> {
    match file.metadata.get(key) {
        Some(GgufValue::Array(items)) => items
            .iter()
            .map(|v| v.as_str().ok_or_else(|| err(format!("{key}: not strings"))))
            .collect(),
        _ => Err(err(format!("GGUF metadata {key:?} missing"))),
    }
}

/// GPT-2's reversible map from bytes to printable characters (the alphabet of byte-level
/// BPE vocabularies).
fn byte_level_alphabet() -> Vec<char> {
    let printable = |b: u32| {
        (0x21..=0x7E).contains(&b) || (0xA1..=0xAC).contains(&b) || (0xAE..=0xFF).contains(&b)
    };
    let mut extra = 0;
    (0..256u32)
        .map(|b| {
            if printable(b) {
                char::from_u32(b).expect("a Latin-1 code point")
            } else {
                extra += 1;
                char::from_u32(255 + extra).expect("a code point below 0x200")
            }
        })
        .collect()
}

/// A `tokenizer.json` of plain byte-level BPE without merges for a vocabulary of `size >= 256`
/// ids: token `b < 256` is byte `b`, the ids above spell `<extra_ID>` (never produced by
/// encoding, decodable). For checkpoints written with random weights, where no real
/// vocabulary exists.
pub fn byte_level_tokenizer_json(size: usize) -> String {
    let vocab: serde_json::Map<String, Value> = byte_level_alphabet()
        .into_iter()
        .map(|c| c.to_string())
        .chain((256..size).map(|id| format!("<extra_{id}>")))
        .enumerate()
        .map(|(i, token)| (token, i.into()))
        .collect();
    let byte_level = json!({"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true});
    json!({
        "version": "1.0",
        "added_tokens": [],
        "normalizer": null,
        "pre_tokenizer": byte_level,
        "post_processor": null,
        "decoder": byte_level,
        "model": {"type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
                  "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false,
                  "ignore_merges": false, "vocab": vocab, "merges": []},
    })
    .to_string()
}

/// The `tokenizer.json` pre-tokenizer (and normalizer) of a GGUF `tokenizer.ggml.pre`, and
/// whether whole words found in the vocabulary skip the merges (Llama-3's `ignore_merges`).
fn gguf_pre_tokenizer(pre: &str) -> Result<(Value, Value, bool), SlideSparseError> {
    let byte_level = |use_regex: bool| json!({"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": use_regex});
    let split = |pattern: &str| {
        json!({"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": pattern}, "behavior": "Isolated", "invert": false},
            byte_level(false),
        ]})
    };
    Ok(match pre {
        // SmolLM: every digit on its own, then GPT-2's split.
        "smollm" => (
            Value::Null,
            json!({"type": "Sequence", "pretokenizers": [
                {"type": "Digits", "individual_digits": true},
                byte_level(true),
            ]}),
            false,
        ),
        "gpt-2" => (Value::Null, byte_level(true), false),
        "llama-bpe" => (Value::Null, split(LLAMA3_SPLIT), true),
        "qwen2" => (json!({"type": "NFC"}), split(QWEN2_SPLIT), false),
        other => {
            return Err(err(format!(
                "GGUF pre-tokenizer {other:?} is not supported ({}); load the model's \
                 tokenizer.json instead (--hf)",
                GGUF_PRE_TOKENIZERS.join(", ")
            )));
        }
    })
}

impl Tokenizer {
    /// From a GGUF file's byte-level BPE vocabulary: `tokenizer.ggml.tokens`, `.merges`,
    /// `.token_type`, `.pre`, and the special ids.
    pub fn from_gguf(file: &GgufFile) -> Result<Self, SlideSparseError> {
        let meta = |key: &str| file.metadata.get(key);
        let model = meta("tokenizer.ggml.model")
            .and_then(|v| v.as_str())
            .unwrap_or("?");
        if model != "gpt2" {
            return Err(err(format!(
                "GGUF tokenizer model {model:?} is not supported (gpt2: byte-level BPE); \
                 load the model's tokenizer.json instead (--hf)"
            )));
        }
        let pre = meta("tokenizer.ggml.pre")
            .and_then(|v| v.as_str())
            .ok_or_else(|| err("GGUF metadata \"tokenizer.ggml.pre\" missing"))?;
        let (normalizer, pre_tokenizer, ignore_merges) = gguf_pre_tokenizer(pre)?;
        let tokens = strings(file, "tokenizer.ggml.tokens")?;
        let merges = strings(file, "tokenizer.ggml.merges")?;
        let types: Vec<i64> = match meta("tokenizer.ggml.token_type") {
            Some(GgufValue::Array(items)) if items.len() == tokens.len() => items
                .iter()
                .map(|v| match *v {
                    GgufValue::I32(t) => Ok(t as i64),
                    _ => v
                        .as_u64()
                        .map(|t| t as i64)
                        .ok_or_else(|| err("token_type: not integers")),
                })
                .collect::<Result<_, _>>()?,
            Some(_) => return Err(err("tokenizer.ggml.token_type does not match the tokens")),
            None => vec![1; tokens.len()],
        };
        let mut vocab = serde_json::Map::with_capacity(tokens.len());
        let mut added = Vec::new();
        for (id, (&token, &kind)) in tokens.iter().zip(&types).enumerate() {
            if vocab.insert(token.to_string(), id.into()).is_some() {
                return Err(err(format!("GGUF vocabulary lists {token:?} twice")));
            }
            if kind == CONTROL || kind == USER_DEFINED {
                added.push(json!({
                    "id": id, "content": token, "single_word": false, "lstrip": false,
                    "rstrip": false, "normalized": false, "special": kind == CONTROL,
                }));
            }
        }
        // Byte-level BPE spells any text from the 256 byte symbols, but vocabularies leave
        // out bytes their training text never had (SmolLM2: six control bytes, the bytes
        // that never occur in UTF-8 and the lead bytes of unassigned planes). The library
        // would silently drop such a byte, so `encode` refuses text containing one; a
        // vocabulary without printable ASCII is not byte-level at all.
        let known: HashSet<&str> = tokens.iter().copied().collect();
        let missing_bytes: Vec<u8> = byte_level_alphabet()
            .iter()
            .enumerate()
            .filter(|(_, c)| !known.contains(c.to_string().as_str()))
            .map(|(b, _)| b as u8)
            .collect();
        if missing_bytes.iter().any(|b| (0x20..=0x7E).contains(b)) {
            return Err(err(format!(
                "GGUF vocabulary has no token for bytes {missing_bytes:02X?}: not a byte-level BPE vocabulary"
            )));
        }
        for merge in &merges {
            if merge.split(' ').count() != 2 {
                return Err(err(format!("GGUF merge {merge:?} is not two tokens")));
            }
        }
        let json = json!({
            "version": "1.0",
            "added_tokens": added,
            "normalizer": normalizer,
            "pre_tokenizer": pre_tokenizer,
            "post_processor": null,
            "decoder": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true},
            "model": {
                "type": "BPE", "dropout": null, "unk_token": null,
                "continuing_subword_prefix": null, "end_of_word_suffix": null,
                "fuse_unk": false, "byte_fallback": false, "ignore_merges": ignore_merges,
                "vocab": vocab, "merges": merges,
            },
        });
        let inner = json
            .to_string()
            .parse::<tokenizers::Tokenizer>()
            .map_err(|e| err(format!("building the GGUF tokenizer: {e}")))?;
        let id = |key: &str| meta(key).and_then(|v| v.as_u64()).map(|v| v as u32);
        let add_bos = matches!(
            meta("tokenizer.ggml.add_bos_token"),
            Some(GgufValue::Bool(true))
        );
        let bos = id("tokenizer.ggml.bos_token_id");
        if add_bos && bos.is_none() {
            return Err(err(
                "tokenizer.ggml.add_bos_token is set but there is no bos_token_id",
            ));
        }
        Ok(Self {
            inner,
            bos,
            eos: id("tokenizer.ggml.eos_token_id"),
            add_bos,
            missing_bytes,
        })
    }

    /// From a Hugging Face `tokenizer.json`; `bos` / `eos` are looked up by their token text
    /// (absent ones are `None`).
    pub fn from_tokenizer_json(
        json: &str,
        bos: Option<&str>,
        eos: Option<&str>,
    ) -> Result<Self, SlideSparseError> {
        let inner = json
            .parse::<tokenizers::Tokenizer>()
            .map_err(|e| err(format!("tokenizer.json: {e}")))?;
        let find = |text: Option<&str>| text.and_then(|t| inner.token_to_id(t));
        let (bos, eos) = (find(bos), find(eos));
        Ok(Self {
            inner,
            bos,
            eos,
            add_bos: false,
            missing_bytes: Vec::new(),
        })
    }

    /// Token ids of `text`, without any special token added. Text with a byte the GGUF
    /// vocabulary cannot spell (some leave out control bytes) is an error.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>, SlideSparseError> {
        self.check_spellable(text)?;
        let encoding = self
            .inner
            .encode(text, false)
            .map_err(|e| err(format!("encoding: {e}")))?;
        Ok(encoding.get_ids().to_vec())
    }

    /// Token ids of a prompt, with the special tokens the model expects around it: the
    /// `tokenizer.json` post-processor's (Llama-3's `<|begin_of_text|>`), or the GGUF's BOS
    /// where `tokenizer.ggml.add_bos_token` is set.
    pub fn encode_prompt(&self, text: &str) -> Result<Vec<u32>, SlideSparseError> {
        self.check_spellable(text)?;
        let encoding = self
            .inner
            .encode(text, true)
            .map_err(|e| err(format!("encoding: {e}")))?;
        let mut ids = Vec::with_capacity(encoding.len() + 1);
        if let (true, Some(bos)) = (self.add_bos, self.bos) {
            ids.push(bos);
        }
        ids.extend_from_slice(encoding.get_ids());
        Ok(ids)
    }

    fn check_spellable(&self, text: &str) -> Result<(), SlideSparseError> {
        match text.bytes().find(|b| self.missing_bytes.contains(b)) {
            Some(b) => Err(err(format!(
                "the text contains byte 0x{b:02X}, which the vocabulary has no token for"
            ))),
            None => Ok(()),
        }
    }

    /// Text of token ids, special tokens included; bytes that do not form UTF-8 (a token
    /// boundary inside a character) come out as U+FFFD. An id outside the vocabulary is an
    /// error.
    pub fn decode(&self, ids: &[u32]) -> Result<String, SlideSparseError> {
        if let Some(bad) = ids.iter().find(|&&id| self.inner.id_to_token(id).is_none()) {
            return Err(err(format!("token id {bad} is not in the vocabulary")));
        }
        self.inner
            .decode(ids, false)
            .map_err(|e| err(format!("decoding: {e}")))
    }

    /// Number of tokens, added tokens included.
    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }
}
