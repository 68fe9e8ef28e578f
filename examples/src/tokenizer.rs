//! A byte-level BPE tokenizer (GPT-2 style, as in `tokenizer.ggml.model = gpt2`) built from
//! a GGUF file's vocabulary and merges. Pre-tokenization follows the GPT-2 pattern with
//! digits split one by one (SmolLM's `pre = smollm`).

use std::collections::HashMap;

use burn_slidesparse::{
    SlideSparseError,
    gguf::{GgufFile, GgufValue},
};

/// Encoder and decoder.
pub struct Tokenizer {
    tokens: Vec<String>,
    ids: HashMap<String, u32>,
    ranks: HashMap<(String, String), usize>,
    byte_to_char: [char; 256],
    char_to_byte: HashMap<char, u8>,
    pub bos: Option<u32>,
    pub eos: Option<u32>,
}

/// GPT-2's reversible map from bytes to printable characters.
fn bytes_to_unicode() -> [char; 256] {
    let mut printable: Vec<u32> = (b'!' as u32..=b'~' as u32)
        .chain(0xA1..=0xAC)
        .chain(0xAE..=0xFF)
        .collect();
    let mut chars = [' '; 256];
    let mut extra = 0;
    for b in 0..256u32 {
        if printable.contains(&b) {
            chars[b as usize] = char::from_u32(b).expect("valid");
        } else {
            chars[b as usize] = char::from_u32(256 + extra).expect("valid");
            extra += 1;
        }
    }
    printable.clear();
    chars
}

fn strings(file: &GgufFile, key: &str) -> Result<Vec<String>, SlideSparseError> {
    match file.metadata.get(key) {
        Some(GgufValue::Array(items)) => items
            .iter()
            .map(|v| {
                v.as_str()
                    .map(String::from)
                    .ok_or_else(|| SlideSparseError::Backend(format!("{key}: not strings")))
            })
            .collect(),
        _ => Err(SlideSparseError::Backend(format!(
            "GGUF metadata {key:?} missing"
        ))),
    }
}

impl Tokenizer {
    /// From `tokenizer.ggml.tokens` and `tokenizer.ggml.merges`.
    pub fn from_gguf(file: &GgufFile) -> Result<Self, SlideSparseError> {
        let model = file
            .metadata
            .get("tokenizer.ggml.model")
            .and_then(|v| v.as_str())
            .unwrap_or("?");
        if model != "gpt2" {
            return Err(SlideSparseError::Backend(format!(
                "tokenizer model {model:?} is not supported (gpt2)"
            )));
        }
        let tokens = strings(file, "tokenizer.ggml.tokens")?;
        let merges = strings(file, "tokenizer.ggml.merges")?;
        let id = |key: &str| {
            file.metadata
                .get(key)
                .and_then(|v| v.as_u64())
                .map(|v| v as u32)
        };
        Ok(Self::from_parts(
            tokens,
            &merges,
            id("tokenizer.ggml.bos_token_id"),
            id("tokenizer.ggml.eos_token_id"),
        ))
    }

    /// From a Hugging Face `tokenizer.json` with a byte-level BPE model (`model.type = BPE`,
    /// `vocab` and `merges` as `"a b"` strings or `["a", "b"]` pairs); `bos` / `eos` are
    /// looked up by their token text among `added_tokens` and the vocabulary.
    pub fn from_tokenizer_json(
        json: &str,
        bos: Option<&str>,
        eos: Option<&str>,
    ) -> Result<Self, SlideSparseError> {
        let err = |what: String| SlideSparseError::Backend(format!("tokenizer.json: {what}"));
        let root: serde_json::Value =
            serde_json::from_str(json).map_err(|e| err(format!("not JSON: {e}")))?;
        let model = &root["model"];
        if model["type"].as_str() != Some("BPE") {
            return Err(err(format!(
                "model type {} is not supported (BPE)",
                model["type"]
            )));
        }
        let vocab = model["vocab"]
            .as_object()
            .ok_or_else(|| err("model.vocab missing".into()))?;
        let mut by_id: Vec<(u32, String)> = Vec::with_capacity(vocab.len());
        for (token, id) in vocab {
            let id = id
                .as_u64()
                .ok_or_else(|| err(format!("id of {token:?} is not an integer")))?;
            by_id.push((id as u32, token.clone()));
        }
        for added in root["added_tokens"].as_array().into_iter().flatten() {
            if let (Some(id), Some(content)) = (added["id"].as_u64(), added["content"].as_str()) {
                by_id.push((id as u32, content.to_string()));
            }
        }
        by_id.sort();
        by_id.dedup_by_key(|(id, _)| *id);
        if by_id
            .iter()
            .enumerate()
            .any(|(i, (id, _))| *id as usize != i)
        {
            return Err(err("token ids are not 0..n without gaps".into()));
        }
        let tokens: Vec<String> = by_id.into_iter().map(|(_, t)| t).collect();
        let merges: Vec<String> = model["merges"]
            .as_array()
            .ok_or_else(|| err("model.merges missing".into()))?
            .iter()
            .map(|m| match m {
                serde_json::Value::String(s) => Ok(s.clone()),
                serde_json::Value::Array(pair) if pair.len() == 2 => Ok(format!(
                    "{} {}",
                    pair[0].as_str().unwrap_or_default(),
                    pair[1].as_str().unwrap_or_default()
                )),
                other => Err(err(format!("merge {other} is not a pair"))),
            })
            .collect::<Result<_, _>>()?;
        let find = |text: Option<&str>| {
            text.and_then(|t| tokens.iter().position(|x| x == t).map(|i| i as u32))
        };
        let (bos, eos) = (find(bos), find(eos));
        Ok(Self::from_parts(tokens, &merges, bos, eos))
    }

    /// From the vocabulary (index = id), the merges (`"a b"`, by rank) and special ids.
    pub fn from_parts(
        tokens: Vec<String>,
        merges: &[String],
        bos: Option<u32>,
        eos: Option<u32>,
    ) -> Self {
        let ids = tokens
            .iter()
            .enumerate()
            .map(|(i, t)| (t.clone(), i as u32))
            .collect();
        let ranks = merges
            .iter()
            .enumerate()
            .filter_map(|(r, m)| {
                m.split_once(' ')
                    .map(|(a, b)| ((a.to_string(), b.to_string()), r))
            })
            .collect();
        let byte_to_char = bytes_to_unicode();
        let char_to_byte = byte_to_char
            .iter()
            .enumerate()
            .map(|(b, &c)| (c, b as u8))
            .collect();
        Self {
            tokens,
            ids,
            ranks,
            byte_to_char,
            char_to_byte,
            bos,
            eos,
        }
    }

    /// Token ids of `text` (no BOS added).
    pub fn encode(&self, text: &str) -> Vec<u32> {
        pre_tokenize(text)
            .iter()
            .flat_map(|piece| self.bpe(piece))
            .collect()
    }

    fn bpe(&self, piece: &str) -> Vec<u32> {
        let mut parts: Vec<String> = piece
            .bytes()
            .map(|b| self.byte_to_char[b as usize].to_string())
            .collect();
        loop {
            let best = (0..parts.len().saturating_sub(1))
                .filter_map(|i| {
                    self.ranks
                        .get(&(parts[i].clone(), parts[i + 1].clone()))
                        .map(|&r| (r, i))
                })
                .min();
            let Some((_, i)) = best else { break };
            let merged = format!("{}{}", parts[i], parts[i + 1]);
            parts.splice(i..i + 2, [merged]);
        }
        parts
            .iter()
            .filter_map(|p| self.ids.get(p).copied())
            .collect()
    }

    /// Text of token ids (invalid UTF-8 replaced).
    pub fn decode(&self, ids: &[u32]) -> String {
        let bytes: Vec<u8> = ids
            .iter()
            .filter_map(|&i| self.tokens.get(i as usize))
            .flat_map(|t| {
                t.chars()
                    .map(|c| self.char_to_byte.get(&c).copied().unwrap_or(b'?'))
            })
            .collect();
        String::from_utf8_lossy(&bytes).into_owned()
    }
}

#[derive(PartialEq, Clone, Copy)]
enum Class {
    Letter,
    Digit,
    Space,
    Other,
}

fn class(c: char) -> Class {
    if c.is_alphabetic() {
        Class::Letter
    } else if c.is_numeric() {
        Class::Digit
    } else if c.is_whitespace() {
        Class::Space
    } else {
        Class::Other
    }
}

/// GPT-2 pre-tokenization: contractions, ` ?letters`, single digits, ` ?other`, and
/// whitespace runs (a run before a word leaves its last space to that word).
pub fn pre_tokenize(text: &str) -> Vec<String> {
    let chars: Vec<char> = text.chars().collect();
    let mut out = Vec::new();
    let mut i = 0;
    while i < chars.len() {
        let rest: String = chars[i..chars.len().min(i + 3)].iter().collect();
        if let Some(c) = ["'s", "'t", "'re", "'ve", "'m", "'ll", "'d"]
            .iter()
            .find(|c| rest.starts_with(**c))
        {
            out.push(c.to_string());
            i += c.chars().count();
            continue;
        }
        let start = i;
        // A single leading space joins letters and other symbols, never digits (SmolLM
        // splits digits off before the GPT-2 pattern runs).
        let lead_space = chars[i] == ' '
            && i + 1 < chars.len()
            && !matches!(class(chars[i + 1]), Class::Space | Class::Digit);
        let j = if lead_space { i + 1 } else { i };
        let kind = class(chars[j]);
        let mut end = j + 1;
        match kind {
            Class::Digit => {}
            Class::Space => {
                while end < chars.len() && class(chars[end]) == Class::Space {
                    end += 1;
                }
                // `\s+(?!\S)`: keep the last space for the next word.
                if end < chars.len() && end - start > 1 && chars[end - 1] == ' ' {
                    end -= 1;
                }
            }
            k => {
                while end < chars.len() && class(chars[end]) == k {
                    end += 1;
                }
            }
        }
        out.push(chars[start..end].iter().collect());
        i = end;
    }
    out
}
