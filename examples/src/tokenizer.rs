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
        let id = |key: &str| {
            file.metadata
                .get(key)
                .and_then(|v| v.as_u64())
                .map(|v| v as u32)
        };
        Ok(Self {
            tokens,
            ids,
            ranks,
            byte_to_char,
            char_to_byte,
            bos: id("tokenizer.ggml.bos_token_id"),
            eos: id("tokenizer.ggml.eos_token_id"),
        })
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
