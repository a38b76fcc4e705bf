//! Plugin discovery and refusal: another ABI major, a file that is no plugin, and a failing init are
//! each reported with the path and the reason, while the good plugins load.

mod common;

use std::path::Path;

use mlxcel_plugins::{Catalog, PluginSearch};

fn folder_with(files: &[(&Path, &str)]) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    for (src, name) in files {
        std::fs::copy(src, dir.path().join(name)).unwrap();
    }
    dir
}

#[test]
fn good_plugins_load_and_provide_their_architectures() {
    let staged = common::staged_dir();
    let cat = Catalog::load(&PluginSearch { dirs: vec![staged] });
    assert!(cat.problems.is_empty(), "{:?}", cat.problems);
    assert_eq!(cat.backends.iter().map(|b| b.name()).collect::<Vec<_>>(), ["cpu"]);
    assert_eq!(cat.architectures(), ["llama", "mistral", "qwen2", "qwen3"]);
    let cpu = cat.select_backend(None).unwrap();
    assert!(cpu.describe().score > 0);
}

#[test]
fn another_abi_major_is_refused_by_name_and_the_rest_still_load() {
    let staged = common::staged_dir();
    let cpu = staged.join(common::lib("mlxcel_backend_cpu"));
    let future = common::built("mlxcel_testplugin_future_abi");
    let dir = folder_with(&[(&cpu, &common::lib("mlxcel_backend_cpu")), (&future, "libfuture.so")]);
    let cat = Catalog::load(&PluginSearch { dirs: vec![dir.path().to_path_buf()] });
    assert_eq!(cat.backends.len(), 1);
    assert_eq!(cat.problems.len(), 1);
    let p = &cat.problems[0];
    assert!(p.path.ends_with("libfuture.so"));
    assert!(
        p.reason.contains("`future-abi`") && p.reason.contains("ABI 2.0") && p.reason.contains("ABI 1."),
        "{}",
        p.reason
    );
}

#[test]
fn junk_file_is_refused_with_its_path() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("libjunk.so"), b"this is not an ELF file at all").unwrap();
    let cat = Catalog::load(&PluginSearch { dirs: vec![dir.path().to_path_buf()] });
    assert_eq!(cat.problems.len(), 1);
    assert!(cat.problems[0].reason.contains("not a loadable shared object"), "{}", cat.problems[0].reason);
    assert!(cat.backends.is_empty() && cat.families.is_empty());
}

#[test]
fn failing_init_is_reported_with_the_plugins_reason() {
    let failing = common::built("mlxcel_testplugin_failing_init");
    let dir = folder_with(&[(&failing, "libfailing.so")]);
    let cat = Catalog::load(&PluginSearch { dirs: vec![dir.path().to_path_buf()] });
    assert_eq!(cat.problems.len(), 1);
    assert!(cat.problems[0].reason.contains("always fails to initialise"), "{}", cat.problems[0].reason);
}

#[test]
fn no_backend_gives_an_actionable_error() {
    let dir = tempfile::tempdir().unwrap();
    let cat = Catalog::load(&PluginSearch { dirs: vec![dir.path().to_path_buf()] });
    let e = cat.select_backend(None).unwrap_err().to_string();
    assert!(e.contains("no backend plugin"), "{e}");
    let e = cat.select_backend(Some("cuda")).unwrap_err().to_string();
    assert!(e.contains("no backend plugin") || e.contains("cuda"), "{e}");
}

#[test]
fn unknown_model_type_lists_what_is_installed() {
    let cat = Catalog::load(&PluginSearch { dirs: vec![common::staged_dir()] });
    let e = cat.select_family(r#"{"model_type": "mamba9"}"#, "mamba9").unwrap_err().to_string();
    assert!(e.contains("`mamba9`") && e.contains("llama, mistral, qwen2, qwen3") && e.contains("family plugin"), "{e}");
}
