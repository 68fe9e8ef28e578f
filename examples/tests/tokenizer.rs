//! The tokenizer against ids known in advance: small `tokenizer.json` files and GGUF
//! vocabularies built here, whose expected ids follow from the vocabulary (byte `b` is token
//! `b`, the merged tokens come after) and from the documented split of each pre-tokenizer,
//! worked out by hand in the comments; plus SmolLM2's real GGUF vocabulary against ids
//! recorded in `fixtures/smollm2_ids.json` (skipped when the model is not cached).

use burn_slidesparse::gguf::GgufFile;
use serde_json::{Value, json};
use slidesparse_examples::tokenizer::Tokenizer;

/// GPT-2's byte-to-character map: printable Latin-1 bytes stand for themselves, the other
/// 68 bytes (in byte order) for U+0100, U+0101, ... (space 0x20 is U+0120 'Ġ', '\n' U+010A 'Ċ').
fn byte_char(b: u8) -> char {
    let printable = |b: u8| matches!(b, 0x21..=0x7E | 0xA1..=0xAC | 0xAE..=0xFF);
    if printable(b) {
        b as char
    } else {
        let rank = (0..b).filter(|&x| !printable(x)).count() as u32;
        char::from_u32(0x100 + rank).unwrap()
    }
}

/// Merges (in rank order) of the byte-level fixtures; merge `i` makes token `256 + i`.
const MERGES: [(&str, &str); 13] = [
    ("1", "2"),  // 256 "12"
    ("12", "3"), // 257 "123"
    ("3", "4"),  // 258 "34": only when 3 and 4 share a piece
    ("Ġ", "1"),  // 259 " 1": only when a space joins a digit
    ("'", "m"),  // 260 "'m"
    ("'", "M"),  // 261 "'M"
    ("Ġ", "a"),  // 262 " a"
    ("p", "p"),  // 263 "pp"
    ("Ġ", "Ġ"),  // 264 "  "
    ("!", "!"),  // 265 "!!"
    ("!!", "!"), // 266 "!!!"
    ("Ċ", "Ċ"),  // 267 "\n\n"
    ("Ã", "©"),  // 268 "é" (bytes C3 A9)
];

/// Byte tokens 0..256, the merged tokens 256..269, then the control token `<|eot|>` (269).
fn byte_level_vocab() -> Vec<String> {
    let mut tokens: Vec<String> = (0..=255u8).map(|b| byte_char(b).to_string()).collect();
    tokens.extend(MERGES.iter().map(|(a, b)| format!("{a}{b}")));
    tokens.push("<|eot|>".into());
    tokens
}

fn byte_level_json(normalizer: Value, pre_tokenizer: Value, ignore_merges: bool) -> String {
    let tokens = byte_level_vocab();
    let vocab: serde_json::Map<String, Value> = tokens
        .iter()
        .take(269)
        .enumerate()
        .map(|(i, t)| (t.clone(), i.into()))
        .collect();
    json!({
        "version": "1.0",
        "added_tokens": [{"id": 269, "content": "<|eot|>", "single_word": false, "lstrip": false,
                          "rstrip": false, "normalized": false, "special": true}],
        "normalizer": normalizer,
        "pre_tokenizer": pre_tokenizer,
        "post_processor": null,
        "decoder": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true},
        "model": {"type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
                  "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false,
                  "ignore_merges": ignore_merges, "vocab": vocab,
                  "merges": MERGES.iter().map(|(a, b)| format!("{a} {b}")).collect::<Vec<_>>()},
    })
    .to_string()
}

/// The split patterns as published in Llama-3's and Qwen2's `tokenizer.json`.
const LLAMA3: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const QWEN2: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

fn split_then_bytes(pattern: &str) -> Value {
    json!({"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": pattern}, "behavior": "Isolated", "invert": false},
        {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": false},
    ]})
}

fn ids(tok: &Tokenizer, text: &str) -> Vec<u32> {
    tok.encode(text).unwrap()
}

#[test]
fn llama3_style_tokenizer_json_gives_the_reference_ids() {
    let tok = Tokenizer::from_tokenizer_json(
        &byte_level_json(Value::Null, split_then_bytes(LLAMA3), true),
        None,
        Some("<|eot|>"),
    )
    .unwrap();
    assert_eq!(tok.eos, Some(269));
    // "I" | "'m" | " " | "123" | "45" | " apples": digits in threes, the space before a
    // number on its own (so merge 259 " 1" never applies, nor 258 "34" across "123"|"45").
    // " apples" = Ġ a p p l e s → " a" (262), "pp" (263), l e s.
    assert_eq!(
        ids(&tok, "I'm 12345 apples"),
        [73, 260, 32, 257, 52, 53, 262, 263, 108, 101, 115]
    );
    // "WE" | "'M" (contractions in any case) | " " | " ok" (the last space of a run joins
    // the word) | "!!!\n\n" (punctuation keeps the line breaks after it) | "bye".
    // "!!!\n\n": "! !" (265) merges leftmost, then "!! !" (266) before "Ċ Ċ" (267).
    assert_eq!(
        ids(&tok, "WE'M  ok!!!\n\nbye"),
        [87, 69, 261, 32, 32, 111, 107, 266, 267, 98, 121, 101]
    );
    // "café" | " 🙂": é is a letter (bytes C3 A9 → 268); the emoji is 4 bytes F0 9F 99 82
    // with the space before it.
    assert_eq!(
        ids(&tok, "café 🙂"),
        [99, 97, 102, 268, 32, 240, 159, 153, 130]
    );
    // A control token in the text is matched whole; decoding gives the text back.
    assert_eq!(ids(&tok, "a<|eot|>"), [97, 269]);
    let text = "WE'M  ok!!!\n\nbye café 🙂<|eot|>";
    assert_eq!(tok.decode(&ids(&tok, text)).unwrap(), text);
    assert!(tok.decode(&[270]).unwrap_err().to_string().contains("270"));
}

#[test]
fn qwen2_style_tokenizer_json_gives_the_reference_ids() {
    let tok = Tokenizer::from_tokenizer_json(
        &byte_level_json(json!({"type": "NFC"}), split_then_bytes(QWEN2), false),
        None,
        None,
    )
    .unwrap();
    // As Llama-3 but every digit alone: "1" | "2" | "3" | "4" | "5", no "12"/"123" merges.
    assert_eq!(
        ids(&tok, "I'm 12345 apples"),
        [73, 260, 32, 49, 50, 51, 52, 53, 262, 263, 108, 101, 115]
    );
    // NFC first: "e" + combining acute (U+0301) becomes "é" (C3 A9 → 268).
    assert_eq!(
        ids(&tok, "cafe\u{301} 🙂"),
        [99, 97, 102, 268, 32, 240, 159, 153, 130]
    );
    // A whitespace run leaves its last space to the word after it: "x" | "\t " | " y", so
    // the two spaces are in different pieces and merge 264 ("Ġ Ġ") does not apply.
    assert_eq!(ids(&tok, "x\t  y"), [120, 9, 32, 32, 121]);
}

#[test]
fn byte_fallback_tokenizer_json_spells_unknown_characters_as_bytes() {
    // SentencePiece-style BPE (Llama-2, Mistral): spaces become "▁", a leading "▁" is
    // prepended, and a character outside the vocabulary is spelled as its UTF-8 bytes
    // <0xNN>, which are tokens 3 + NN.
    let mut vocab = serde_json::Map::new();
    for (i, t) in ["<unk>", "<s>", "</s>"].iter().enumerate() {
        vocab.insert(t.to_string(), i.into());
    }
    for b in 0..=255u32 {
        vocab.insert(format!("<0x{b:02X}>"), (3 + b).into());
    }
    for (i, t) in ["▁", "h", "i", "▁h", "▁hi", "1", "2"].iter().enumerate() {
        vocab.insert(t.to_string(), (259 + i).into());
    }
    let json = json!({
        "version": "1.0",
        "added_tokens": [
            {"id": 0, "content": "<unk>", "single_word": false, "lstrip": false, "rstrip": false, "normalized": false, "special": true},
            {"id": 1, "content": "<s>", "single_word": false, "lstrip": false, "rstrip": false, "normalized": false, "special": true},
            {"id": 2, "content": "</s>", "single_word": false, "lstrip": false, "rstrip": false, "normalized": false, "special": true},
        ],
        "normalizer": {"type": "Sequence", "normalizers": [
            {"type": "Prepend", "prepend": "▁"},
            {"type": "Replace", "pattern": {"String": " "}, "content": "▁"},
        ]},
        "pre_tokenizer": null,
        "post_processor": {"type": "TemplateProcessing",
            "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
            "special_tokens": {"<s>": {"id": "<s>", "ids": [1], "tokens": ["<s>"]}}},
        "decoder": {"type": "Sequence", "decoders": [
            {"type": "Replace", "pattern": {"String": "▁"}, "content": " "},
            {"type": "ByteFallback"}, {"type": "Fuse"},
            {"type": "Strip", "content": " ", "start": 1, "stop": 0},
        ]},
        "model": {"type": "BPE", "dropout": null, "unk_token": "<unk>", "continuing_subword_prefix": null,
                  "end_of_word_suffix": null, "fuse_unk": true, "byte_fallback": true, "ignore_merges": false,
                  "vocab": vocab, "merges": ["▁ h", "▁h i"]},
    });
    let tok = Tokenizer::from_tokenizer_json(&json.to_string(), Some("<s>"), Some("</s>")).unwrap();
    assert_eq!((tok.bos, tok.eos), (Some(1), Some(2)));
    // "▁hi▁🙂x": "▁ h" then "▁h i" → "▁hi" (263); "▁" (259); 🙂 = F0 9F 99 82 → 243 162 156
    // 133; "x" (0x78) is not in the vocabulary either → 123.
    let expected = [263, 259, 243, 162, 156, 133, 123];
    assert_eq!(ids(&tok, "hi 🙂x"), expected);
    assert_eq!(tok.decode(&expected).unwrap(), "hi 🙂x");
    // The prompt form adds <s> through the file's post-processor.
    assert_eq!(tok.encode_prompt("hi12").unwrap(), [1, 263, 264, 265]);
}

#[test]
fn a_tokenizer_json_the_crate_cannot_run_is_an_error() {
    for bad in [
        "not json".to_string(),
        json!({"model": {"type": "NoSuchModel"}}).to_string(),
        byte_level_json(Value::Null, json!({"type": "NoSuchPreTokenizer"}), false),
    ] {
        let err = Tokenizer::from_tokenizer_json(&bad, None, None);
        assert!(err.is_err(), "{bad:.60} was accepted");
    }
}

// ---- GGUF vocabularies ----------------------------------------------------------------

fn gguf_string(out: &mut Vec<u8>, s: &str) {
    out.extend((s.len() as u64).to_le_bytes());
    out.extend(s.as_bytes());
}

/// A GGUF file with only tokenizer metadata.
fn tokenizer_gguf(model: &str, pre: &str, tokens: &[String], add_bos: bool) -> Vec<u8> {
    let mut kv: Vec<(&str, u32, Vec<u8>)> = Vec::new();
    let mut s = Vec::new();
    gguf_string(&mut s, model);
    kv.push(("tokenizer.ggml.model", 8, s));
    let mut s = Vec::new();
    gguf_string(&mut s, pre);
    kv.push(("tokenizer.ggml.pre", 8, s));
    let array = |items: Vec<String>| {
        let mut a = 8u32.to_le_bytes().to_vec();
        a.extend((items.len() as u64).to_le_bytes());
        items.iter().for_each(|t| gguf_string(&mut a, t));
        a
    };
    kv.push(("tokenizer.ggml.tokens", 9, array(tokens.to_vec())));
    let merges = MERGES.iter().map(|(a, b)| format!("{a} {b}")).collect();
    kv.push(("tokenizer.ggml.merges", 9, array(merges)));
    let mut types = 5u32.to_le_bytes().to_vec(); // int32 items
    types.extend((tokens.len() as u64).to_le_bytes());
    for t in tokens {
        let kind: i32 = if t == "<|eot|>" { 3 } else { 1 };
        types.extend(kind.to_le_bytes());
    }
    kv.push(("tokenizer.ggml.token_type", 9, types));
    kv.push((
        "tokenizer.ggml.bos_token_id",
        4,
        269u32.to_le_bytes().to_vec(),
    ));
    kv.push(("tokenizer.ggml.add_bos_token", 7, vec![add_bos as u8]));
    let mut out = b"GGUF".to_vec();
    out.extend(3u32.to_le_bytes());
    out.extend(0u64.to_le_bytes());
    out.extend((kv.len() as u64).to_le_bytes());
    for (k, t, v) in kv {
        gguf_string(&mut out, k);
        out.extend(t.to_le_bytes());
        out.extend(v);
    }
    out
}

fn from_gguf(model: &str, pre: &str, tokens: &[String]) -> Result<Tokenizer, String> {
    let bytes = tokenizer_gguf(model, pre, tokens, false);
    let file = GgufFile::parse("vocab", &bytes).unwrap();
    Tokenizer::from_gguf(&file).map_err(|e| e.to_string())
}

#[test]
fn gguf_vocabularies_split_as_their_named_pre_tokenizer() {
    let tokens = byte_level_vocab();
    // "WE'M 12345", split by each pre-tokenizer:
    for (pre, expected) in [
        // "WE" | "'M" | " " | "123" | "45"
        ("llama-bpe", vec![87, 69, 261, 32, 257, 52, 53]),
        // "WE" | "'M" | " " | "1" | "2" | "3" | "4" | "5"
        ("qwen2", vec![87, 69, 261, 32, 49, 50, 51, 52, 53]),
        // digits first, then GPT-2 (lower-case contractions only): "WE" | "'" | "M" | " " |
        // "1" | "2" | "3" | "4" | "5"
        ("smollm", vec![87, 69, 39, 77, 32, 49, 50, 51, 52, 53]),
        // GPT-2: "WE" | "'" | "M" | " 12345"; in " 12345" "12" (rank 0) merges before
        // " 1" (rank 3) can, then "123"; "45" stays apart.
        ("gpt-2", vec![87, 69, 39, 77, 32, 257, 52, 53]),
    ] {
        let tok = from_gguf("gpt2", pre, &tokens).unwrap();
        assert_eq!(ids(&tok, "WE'M 12345"), expected, "{pre}");
        assert_eq!(tok.decode(&expected).unwrap(), "WE'M 12345", "{pre}");
        // The control token (type 3) is one token, as in the file's reference tokenizer.
        assert_eq!(ids(&tok, "<|eot|>"), [269], "{pre}");
    }
    // The same vocabulary as a tokenizer.json gives the same ids as the GGUF path.
    let json = Tokenizer::from_tokenizer_json(
        &byte_level_json(Value::Null, split_then_bytes(LLAMA3), true),
        None,
        None,
    )
    .unwrap();
    let gguf = from_gguf("gpt2", "llama-bpe", &tokens).unwrap();
    let text = "WE'M  ok!!!\n\nbye café 🙂 1234567";
    assert_eq!(ids(&json, text), ids(&gguf, text));
    // add_bos_token puts the BOS id before a prompt.
    let bytes = tokenizer_gguf("gpt2", "llama-bpe", &tokens, true);
    let tok = Tokenizer::from_gguf(&GgufFile::parse("vocab", &bytes).unwrap()).unwrap();
    assert_eq!(tok.encode_prompt("12").unwrap(), [269, 256]);
}

#[test]
fn unsupported_gguf_vocabularies_are_errors() {
    let tokens = byte_level_vocab();
    let err = from_gguf("gpt2", "deepseek-coder", &tokens).err().unwrap();
    assert!(
        err.contains("deepseek-coder") && err.contains("llama-bpe"),
        "{err}"
    );
    let err = from_gguf("llama", "default", &tokens).err().unwrap();
    assert!(
        err.contains("\"llama\"") && err.contains("tokenizer.json"),
        "{err}"
    );
    // A byte-level vocabulary must spell every letter, digit and non-ASCII byte...
    let mut missing = tokens.clone();
    missing[0x41] = "not-A".into();
    let err = from_gguf("gpt2", "gpt-2", &missing).err().unwrap();
    assert!(err.contains("41"), "{err}");
    // ...and a text with a control byte it lacks is refused, not silently shortened.
    let mut missing = tokens.clone();
    missing[0x07] = "not-bell".into();
    let tok = from_gguf("gpt2", "gpt-2", &missing).unwrap();
    assert_eq!(ids(&tok, "ab"), [97, 98]);
    let err = tok.encode("a\u{7}b").unwrap_err().to_string();
    assert!(err.contains("0x07"), "{err}");
    let mut twice = tokens.clone();
    twice[268] = "12".into();
    let err = from_gguf("gpt2", "gpt-2", &twice).err().unwrap();
    assert!(err.contains("twice"), "{err}");
}

/// SmolLM2's GGUF vocabulary gives the ids recorded in `fixtures/smollm2_ids.json` (the
/// README prompt, the `assert` topic of Python's `pydoc_data/topics.py`, and a mixed text
/// with digits, contractions, whitespace runs, accents and an emoji). Skipped when the model
/// is not in the cache: CI has no model.
#[test]
fn smollm2_gguf_vocabulary_gives_the_recorded_ids_when_available() {
    let Some(home) = std::env::var_os("HOME") else {
        return;
    };
    let path = std::path::Path::new(&home)
        .join(".cache/burn-slidesparse/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf");
    let Ok(bytes) = std::fs::read(&path) else {
        eprintln!("SmolLM2 not cached: skipping the real-vocabulary check");
        return;
    };
    let file = GgufFile::parse("smollm2", &bytes).unwrap();
    let tok = Tokenizer::from_gguf(&file).unwrap();
    assert_eq!((tok.bos, tok.eos), (Some(1), Some(2)));
    let fixtures: Value = serde_json::from_str(include_str!("fixtures/smollm2_ids.json")).unwrap();
    for (name, case) in fixtures.as_object().unwrap() {
        let text = case["text"].as_str().unwrap();
        let expected: Vec<u32> = case["ids"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_u64().unwrap() as u32)
            .collect();
        assert_eq!(ids(&tok, text), expected, "{name}");
        assert_eq!(
            tok.encode_prompt(text).unwrap(),
            expected,
            "{name}: no BOS for SmolLM2"
        );
        assert_eq!(tok.decode(&expected).unwrap(), text, "{name}");
    }
}
