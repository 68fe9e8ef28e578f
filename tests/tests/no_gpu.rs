//! The CUDA path's host side without a (usable) GPU: a missing GPU is a typed error that
//! says what to do, never a panic, and the configuration from the environment is strict.
//! Runs in CI (no driver there) and on the GPU host (asking for a device index past the
//! last one), so it is not `#[ignore]`d.
#![cfg(feature = "cuda")]

use std::{collections::HashMap, path::PathBuf};

use burn_slidesparse::{
    SlideSparseError,
    cuda::{Config, GraphMode, Settings, SyncMode, cuda_driver_present, state::device_state},
};

fn config_of(vars: &[(&str, &str)]) -> burn_slidesparse::Result<Config> {
    let vars: HashMap<String, String> = vars
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    Config::from_lookup(|name| vars.get(name).cloned())
}

#[test]
fn an_empty_environment_gives_the_defaults() {
    let config = config_of(&[("HOME", "/home/u")]).unwrap();
    let defaults = Settings {
        sync: SyncMode::Stream,
        graphs: GraphMode::Queued,
    };
    assert_eq!(config.settings, defaults);
    assert!(config.algo_search);
    assert_eq!(
        config.cache_dir,
        Some(PathBuf::from("/home/u/.cache/burn-slidesparse"))
    );
    assert_eq!(config.cuda_path, PathBuf::from("/usr/local/cuda"));
    assert_eq!(config.cusparselt, None);
    assert_eq!(config.nccl, None);
}

#[test]
fn every_accepted_value_is_read() {
    let config = config_of(&[
        ("SLIDESPARSE_SYNC", "host"),
        ("SLIDESPARSE_GRAPHS", "off"),
        ("SLIDESPARSE_ALGO_SEARCH", "0"),
        ("SLIDESPARSE_CACHE_DIR", "/c"),
        ("XDG_CACHE_HOME", "/x"),
        ("SLIDESPARSE_CUSPARSELT", "/lib/libcusparseLt.so.0"),
        ("SLIDESPARSE_CUPTI", "/lib/libcupti.so"),
        ("SLIDESPARSE_NCCL", "/lib/libnccl.so.2"),
        ("CUDA_PATH", "/opt/cuda"),
    ])
    .unwrap();
    assert_eq!(config.settings.sync, SyncMode::Host);
    assert_eq!(config.settings.graphs, GraphMode::Off);
    assert!(!config.algo_search);
    assert_eq!(config.cache_dir, Some(PathBuf::from("/c")));
    assert_eq!(
        config.cusparselt,
        Some(PathBuf::from("/lib/libcusparseLt.so.0"))
    );
    assert_eq!(config.cupti, Some(PathBuf::from("/lib/libcupti.so")));
    assert_eq!(config.nccl, Some(PathBuf::from("/lib/libnccl.so.2")));
    assert_eq!(config.cuda_path, PathBuf::from("/opt/cuda"));
    for (value, mode) in [
        ("queued", GraphMode::Queued),
        ("blocking", GraphMode::Blocking),
    ] {
        let config = config_of(&[("SLIDESPARSE_GRAPHS", value)]).unwrap();
        assert_eq!(config.settings.graphs, mode);
    }
    let xdg = config_of(&[("XDG_CACHE_HOME", "/x"), ("HOME", "/h")]).unwrap();
    assert_eq!(xdg.cache_dir, Some(PathBuf::from("/x/burn-slidesparse")));
}

#[test]
fn an_unknown_value_is_an_error_naming_the_variable_and_the_accepted_values() {
    for (variable, value, accepted) in [
        ("SLIDESPARSE_GRAPHS", "of", "queued, blocking, off"),
        ("SLIDESPARSE_SYNC", "flags", "stream, host"),
        ("SLIDESPARSE_ALGO_SEARCH", "yes", "on, off, 1, 0"),
    ] {
        let err = config_of(&[(variable, value)]).unwrap_err();
        match &err {
            SlideSparseError::Config {
                variable: v,
                value: got,
                accepted: a,
            } => {
                assert_eq!((*v, got.as_str(), *a), (variable, value, accepted));
            }
            other => panic!("expected a Config error, got {other:?}"),
        }
        let text = err.to_string();
        assert!(text.contains(variable) && text.contains(accepted), "{text}");
    }
}

#[test]
fn a_missing_gpu_is_a_typed_error_not_a_panic() {
    let driver_present = cuda_driver_present();
    let index = if driver_present { 4096 } else { 0 };
    let err = match device_state(index) {
        Ok(_) => panic!("device {index} should not be usable here"),
        Err(e) => e,
    };
    assert!(matches!(err, SlideSparseError::NoGpu(_)), "{err}");
    let text = err.to_string();
    assert!(text.contains("reference backend"), "{text}");
    if !driver_present {
        assert!(text.contains("libcuda"), "{text}");
    }
}

#[test]
fn a_missing_nccl_is_a_typed_error_naming_what_was_searched() {
    use burn_slidesparse::cuda::nccl::{LIBRARY_NAME, Nccl, candidate_paths};
    let named = "/nonexistent/libnccl.so.2";
    let config = config_of(&[
        ("SLIDESPARSE_NCCL", named),
        ("VIRTUAL_ENV", "/nonexistent-venv"),
        ("HOME", "/nonexistent-home"),
    ])
    .unwrap();
    // The order of the search: the named file, the loader path, then the pip folders.
    let paths = candidate_paths(&config);
    assert_eq!(paths[0], PathBuf::from(named));
    assert_eq!(paths[1], PathBuf::from(LIBRARY_NAME));
    for wheel in ["nccl/lib", "cu13/lib"] {
        let pip = format!("/nonexistent-venv/lib/python3.12/site-packages/nvidia/{wheel}");
        assert!(
            paths.contains(&PathBuf::from(pip).join(LIBRARY_NAME)),
            "{paths:?}"
        );
    }
    match Nccl::load(&config) {
        // A host with NCCL on the loader path or in a system-wide pip folder (the GPU host):
        // it loads, and not from the file named, which does not exist.
        Ok(nccl) => {
            assert_ne!(nccl.path(), PathBuf::from(named));
            assert!(
                nccl.version().unwrap() >= 21800,
                "{}",
                nccl.path().display()
            );
        }
        Err(err) => {
            assert!(
                matches!(
                    err,
                    SlideSparseError::LibraryUnavailable {
                        library: "NCCL",
                        ..
                    }
                ),
                "{err:?}"
            );
            let text = err.to_string();
            for searched in [
                "/nonexistent/libnccl.so.2 (SLIDESPARSE_NCCL: no such file)",
                "libnccl.so.2 (",
                "nvidia/{nccl/lib,cu13/lib}",
                "/nonexistent-venv",
                "/nonexistent-home/.local",
                "/usr/local",
                "pip install nvidia-nccl-cu13",
            ] {
                assert!(text.contains(searched), "{text:?} lacks {searched:?}");
            }
        }
    }
}

#[test]
fn cusparselt_and_nccl_search_the_same_pip_folders_in_the_same_order() {
    use burn_slidesparse::cuda::{cusparselt::sys as cusparselt, nccl};
    let config = config_of(&[
        ("SLIDESPARSE_CUSPARSELT", "/x/libcusparseLt.so.0"),
        ("VIRTUAL_ENV", "/venv"),
        ("HOME", "/home/u"),
    ])
    .unwrap();
    let paths = cusparselt::candidate_paths(&config);
    let pip = |root: &str, py: &str, pkgs: &str, wheel: &str, file: &str| {
        PathBuf::from(format!("{root}/lib/{py}/{pkgs}/nvidia/{wheel}/{file}"))
    };
    let so = "libcusparseLt.so.0";
    assert_eq!(
        paths[..2],
        [PathBuf::from("/x/libcusparseLt.so.0"), PathBuf::from(so)]
    );
    assert_eq!(
        paths[2..6],
        [
            pip("/venv", "python3.10", "site-packages", "cusparselt/lib", so),
            pip("/venv", "python3.10", "site-packages", "cu13/lib", so),
            pip("/venv", "python3.10", "dist-packages", "cusparselt/lib", so),
            pip("/venv", "python3.10", "dist-packages", "cu13/lib", so),
        ]
    );
    // Environments: VIRTUAL_ENV, ~/.local, then /opt/torch/.venv, /usr/local, /usr; five
    // Python versions, two package folders, two wheels each.
    assert_eq!(paths.len(), 2 + 5 * 5 * 2 * 2);
    assert_eq!(
        paths.last().unwrap(),
        &pip("/usr", "python3.14", "dist-packages", "cu13/lib", so)
    );
    let nccl_paths = nccl::candidate_paths(&config);
    assert_eq!(
        nccl_paths.len(),
        1 + 5 * 5 * 2 * 2,
        "no SLIDESPARSE_NCCL given"
    );
    assert_eq!(
        nccl_paths[1],
        pip(
            "/venv",
            "python3.10",
            "site-packages",
            "nccl/lib",
            nccl::LIBRARY_NAME
        )
    );
}
