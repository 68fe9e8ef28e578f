//! The on-disk memory of `cusparseLtMatmulSearch` results, so that a second process starts
//! fast: a small JSON map from "GPU | library version | shape bucket" to the winning
//! algorithm configuration id.
//!
//! Location: [`Config::cache_dir`] (`SLIDESPARSE_CACHE_DIR`, else
//! `$XDG_CACHE_HOME/burn-slidesparse`, else `~/.cache/burn-slidesparse`); file
//! `cusparselt-algorithms.json`. `SLIDESPARSE_ALGO_SEARCH=off` turns searching off (the
//! library's default algorithm is used).

use std::{collections::BTreeMap, path::PathBuf};

use super::{config::Config, cusparselt::GemmShape};

/// Search results, loaded lazily and written back after each new entry.
#[derive(Debug, Default)]
pub struct AlgoCache {
    path: Option<PathBuf>,
    entries: BTreeMap<String, i32>,
    /// Whether new shapes are searched (else the default algorithm is kept).
    pub search_enabled: bool,
}

/// The M bucket a search result is shared across: powers of two from 16.
pub fn m_bucket(m_pad: usize) -> usize {
    m_pad.next_power_of_two().max(16)
}

impl AlgoCache {
    /// Opens (or starts) the cache file of `config`.
    pub fn open(config: &Config) -> Self {
        let path = config
            .cache_dir
            .as_ref()
            .map(|d| d.join("cusparselt-algorithms.json"));
        let entries = path
            .as_ref()
            .and_then(|p| std::fs::read(p).ok())
            .and_then(|bytes| serde_json::from_slice(&bytes).ok())
            .unwrap_or_default();
        Self {
            path,
            entries,
            search_enabled: config.algo_search,
        }
    }

    /// Key of a shape on a GPU and library version.
    /// The full-precision accumulator (INT32/FP32) is implied, so that keys written before
    /// 16-bit accumulators existed stay valid.
    pub fn key(gpu: &str, version: i32, shape: &GemmShape) -> String {
        let mut key = format!(
            "{gpu}|cusparselt {version}|m<={} n={} k'={} {}",
            m_bucket(shape.m_pad),
            shape.n_pad,
            shape.k_prime,
            shape.precision
        );
        if !shape.accumulator.is_full_precision(shape.precision) {
            let acc = shape.accumulator;
            key += &format!(" out={:?} scaled={}", acc.ty, acc.channel_scaled);
        }
        key
    }

    /// The remembered configuration id of `key`.
    pub fn get(&self, key: &str) -> Option<i32> {
        self.entries.get(key).copied()
    }

    /// Records a result and rewrites the file (best effort: a read-only home only costs a
    /// search in the next process).
    pub fn insert(&mut self, key: String, config_id: i32) {
        self.entries.insert(key, config_id);
        if let Some(path) = &self.path {
            if let Some(dir) = path.parent() {
                let _ = std::fs::create_dir_all(dir);
            }
            if let Ok(json) = serde_json::to_vec_pretty(&self.entries) {
                let _ = crate::files::write_atomically(path, &json);
            }
        }
    }
}
