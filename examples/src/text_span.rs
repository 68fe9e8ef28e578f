//! Token ranges of text files (`FILE` or `FILE@START`), and calibration batches read from
//! them that stay clear of the evaluated tokens; shared by the `perplexity` and
//! `finetune_then_pack` examples.

use std::path::{Path, PathBuf};

use crate::tokenizer::Tokenizer;

type Error = Box<dyn std::error::Error>;

/// A token range of a text file.
pub struct TextSpan {
    /// The file.
    pub path: PathBuf,
    /// The first token's index in the whole file.
    pub start: usize,
    /// The tokens.
    pub ids: Vec<u32>,
}

impl TextSpan {
    /// `FILE` or `FILE@START`, tokenized, `count` tokens from `START` (fewer at the end).
    pub fn load(spec: &str, count: usize, tok: &Tokenizer) -> Result<Self, Error> {
        let (path, start) = match spec.rsplit_once('@') {
            Some((p, s)) if s.parse::<usize>().is_ok() => (p, s.parse::<usize>()?),
            _ => (spec, 0),
        };
        let path = PathBuf::from(path);
        let text =
            std::fs::read_to_string(&path).map_err(|e| format!("{}: {e}", path.display()))?;
        let ids = tok.encode(&text)?;
        if start >= ids.len() {
            return Err(format!("{spec}: the text has only {} tokens", ids.len()).into());
        }
        let ids = ids[start..(start + count).min(ids.len())].to_vec();
        Ok(Self { path, start, ids })
    }

    /// Whether the two ranges share a token of the same file.
    pub fn overlaps(&self, other: &TextSpan) -> bool {
        same_file(&self.path, &other.path)
            && self.start < other.start + other.ids.len()
            && other.start < self.start + self.ids.len()
    }

    /// `file@start`.
    pub fn name(&self) -> String {
        let file = self.path.file_name().map_or_else(
            || self.path.display().to_string(),
            |f| f.to_string_lossy().into_owned(),
        );
        format!("{file}@{}", self.start)
    }
}

fn same_file(a: &Path, b: &Path) -> bool {
    match (a.canonicalize(), b.canonicalize()) {
        (Ok(a), Ok(b)) => a == b,
        _ => a == b,
    }
}

/// The calibration tokens of `specs` (`FILE[@START]` each, `tokens` tokens from each), cut to
/// whole sequences of `seq` tokens per text so that no sequence spans two texts (a single
/// text shorter than `seq` is one shorter sequence); an error if a range overlaps one of
/// `evaluated`, or if one of several texts is shorter than `seq`. Prints what it read.
pub fn calibration_ids(
    specs: &[String],
    tokens: usize,
    seq: usize,
    evaluated: &[TextSpan],
    tok: &Tokenizer,
) -> Result<Vec<u32>, Error> {
    let mut ids = Vec::new();
    for spec in specs {
        let calib = TextSpan::load(spec, tokens, tok)?;
        if let Some(t) = evaluated.iter().find(|t| t.overlaps(&calib)) {
            return Err(format!(
                "the calibration tokens {} overlap the evaluated tokens {}",
                calib.name(),
                t.name()
            )
            .into());
        }
        let seq_here = seq.min(calib.ids.len());
        if specs.len() > 1 && seq_here < seq {
            return Err(format!(
                "calibration text {} has {} tokens, fewer than the sequence length {seq}",
                calib.name(),
                calib.ids.len(),
            )
            .into());
        }
        let used = calib.ids.len() / seq_here * seq_here;
        println!(
            "calibration: {used} tokens of {} from token {}",
            calib.path.display(),
            calib.start
        );
        ids.extend_from_slice(&calib.ids[..used]);
    }
    Ok(ids)
}
