//! Files: writing so that a crash or a full disk never leaves a half-written file under the
//! final name (packed files, checkpoints, the GPU algorithm cache); memory-mapped reading.

use std::{
    fs::File,
    io::Write,
    path::{Path, PathBuf},
};

use crate::error::{Result, SlideSparseError};

/// Writes `bytes` to `NAME.tmp-<pid>` next to `path`, syncs it and renames it over `path`
/// (crate-private: `files` is a private module; `pub` lets `internals` re-export it).
///
/// The temporary file sits in the same directory because a rename is only atomic within one
/// file system; the process id keeps two processes writing the same file apart. On error the
/// temporary file is removed.
pub fn write_atomically(path: &Path, bytes: &[u8]) -> Result<()> {
    let tmp = temporary_path(path)?;
    let written = write_synced(&tmp, bytes)
        .and_then(|()| std::fs::rename(&tmp, path).map_err(|e| SlideSparseError::io(path, e)));
    if written.is_err() {
        // Best effort: the write already failed, and that error is the one to report.
        let _ = std::fs::remove_file(&tmp);
    }
    written
}

fn temporary_path(path: &Path) -> Result<PathBuf> {
    let name = path.file_name().ok_or_else(|| {
        SlideSparseError::io(
            path,
            std::io::Error::new(std::io::ErrorKind::InvalidInput, "not a file name"),
        )
    })?;
    let mut tmp_name = name.to_os_string();
    tmp_name.push(format!(".tmp-{}", std::process::id()));
    Ok(path.with_file_name(tmp_name))
}

fn write_synced(path: &Path, bytes: &[u8]) -> Result<()> {
    let mut file = File::create(path).map_err(|e| SlideSparseError::io(path, e))?;
    file.write_all(bytes)
        .and_then(|()| file.sync_all())
        .map_err(|e| SlideSparseError::io(path, e))
}

/// Memory-maps a file for reading.
pub(crate) fn map_file(path: &Path) -> Result<memmap2::Mmap> {
    let file = std::fs::File::open(path).map_err(|e| SlideSparseError::io(path, e))?;
    // SAFETY: the file is only read; concurrent truncation by another process would be a
    // user error that the safetensors bounds checks turn into an error or a SIGBUS, as with
    // any memory-mapped reader.
    unsafe { memmap2::Mmap::map(&file) }.map_err(|e| SlideSparseError::io(path, e))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn replaces_the_file_and_leaves_no_temporary() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("out.bin");
        write_atomically(&path, b"first").unwrap();
        write_atomically(&path, b"second").unwrap();
        assert_eq!(std::fs::read(&path).unwrap(), b"second");
        let names: Vec<_> = std::fs::read_dir(dir.path()).unwrap().collect();
        assert_eq!(names.len(), 1);
    }

    #[test]
    fn a_missing_directory_is_an_error_naming_the_temporary() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("missing").join("out.bin");
        let err = write_atomically(&path, b"x").unwrap_err().to_string();
        assert!(err.contains("out.bin.tmp-"), "{err}");
    }

    #[test]
    fn a_path_without_a_file_name_is_an_error() {
        assert!(write_atomically(Path::new("/"), b"x").is_err());
    }
}
