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
    // The cpu backend, and the mlx one (usable or, built without libmlx, scoring 0 with its reason).
    let names: Vec<&str> = cat.backends.iter().map(|b| b.name()).collect();
    assert_eq!(names, ["cpu", "mlx"]);
    // Every staged family's architectures, sorted (other family plugins add theirs).
    let archs = cat.architectures();
    assert!(archs.windows(2).all(|p| p[0] < p[1]), "{archs:?}");
    for a in ["llama", "mistral", "qwen2", "qwen3"] {
        assert!(archs.iter().any(|x| x == a), "{a} missing from {archs:?}");
    }
    let best = cat.select_backend(None).unwrap();
    assert!(best.describe().score > 0);
    let mlx = cat.backends.iter().find(|b| b.name() == "mlx").unwrap().describe();
    assert!(mlx.score > 0 || mlx.reason.contains("libmlx not found at build time"), "{}", mlx.reason);
    if mlx.devices.iter().all(|d| d.kind == "cpu") {
        assert_eq!(best.name(), "cpu", "on a CPU the cpu backend outranks MLX");
    }
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
        p.reason.contains("`future-abi`")
            && p.reason.contains("ABI 3.0")
            && p.reason.contains("ABI 2.")
            && p.reason.contains("newer"),
        "{}",
        p.reason
    );
}

#[test]
fn a_plugin_of_abi_major_1_is_refused_by_name_as_older() {
    let old = common::built("mlxcel_testplugin_abi_1");
    let dir = folder_with(&[(&old, "libold.so")]);
    let cat = Catalog::load(&PluginSearch { dirs: vec![dir.path().to_path_buf()] });
    assert!(cat.backends.is_empty());
    assert_eq!(cat.problems.len(), 1);
    let p = &cat.problems[0];
    assert!(p.path.ends_with("libold.so"));
    assert!(
        p.reason.contains("`abi-one`") && p.reason.contains("ABI 1.0") && p.reason.contains("rebuild"),
        "{}",
        p.reason
    );
}

/// The evolution rule end to end: a backend exported as ABI 2.0 (its table ends before `kv_alloc`
/// and `copy_blocks`) loads beside current plugins, its missing entries are treated as absent, and its
/// 2.0 entries run graphs.
#[test]
fn a_plugin_of_an_older_minor_loads_and_runs() {
    use mlxcel_plugin_api::*;
    let older = common::built("mlxcel_testplugin_older_minor");
    let staged = common::staged_dir();
    let dir = folder_with(&[
        (&older, "libolder.so"),
        (&staged.join(common::lib("mlxcel_backend_cpu")), &common::lib("mlxcel_backend_cpu")),
    ]);
    let cat = Catalog::load(&PluginSearch { dirs: vec![dir.path().to_path_buf()] });
    assert!(cat.problems.is_empty(), "{:?}", cat.problems);
    let plugin = cat.backends.iter().find(|b| b.name() == "older-minor").expect("older-minor loaded");
    assert_eq!((plugin.meta.abi_major, plugin.meta.abi_minor), (ABI_MAJOR, 0));
    assert!(!plugin.owns_kv_layout(), "kv_alloc is past the end of a 2.0 table");
    let cpu = cat.backends.iter().find(|b| b.name() == "cpu").unwrap();
    assert!(cpu.owns_kv_layout());
    let d = plugin.describe();
    assert_eq!((d.score, d.devices.len(), d.devices[0].free_memory_bytes), (1, 1, 1 << 29));

    let mut ctx = plugin.create(1, 0).unwrap();
    // Absent entries: the host allocates f32 caches itself and refuses block copies.
    let desc =
        KvCacheDesc { num_blocks: 2, block_size: 4, n_kv_heads: 1, head_dim: 8, dtype: 0, ..Versioned::zeroed() };
    let mut kv = ctx.kv_alloc(&desc).unwrap();
    assert_eq!(kv.len(), 2 * 4 * 8 * 4);
    let e = ctx.copy_blocks(&mut kv, &desc, &[BlockCopy { src: 0, dst: 1 }]).unwrap_err();
    assert!(e.message.contains("2.0"), "{}", e.message);

    // `2x + x` through the plugin's 2.0 entries.
    let x = [1.0f32, -2.0, 3.5];
    let mut g = Graph::new();
    let xi = g.input(0, DType::F32, &[1, 3]);
    let s = g.op_with(OpCode::Scale, &[1, 3], &[xi], &[], &[2.0]);
    let o = g.op(OpCode::Add, &[1, 3], &[s, xi]);
    g.mark_output(o);
    assert!(g.nodes.iter().all(|n| ctx.supports(n)));
    let mut out = [0f32; 3];
    let inputs = [HostTensor { ptr: x.as_ptr() as *mut u8, len: 12 }];
    let outputs = [HostTensor { ptr: out.as_mut_ptr() as *mut u8, len: 12 }];
    let args = ComputeArgs {
        graph: g.as_ref(),
        inputs: inputs.as_ptr(),
        n_inputs: 1,
        outputs: outputs.as_ptr(),
        n_outputs: 1,
        ..Versioned::zeroed()
    };
    unsafe { ctx.compute(&args) }.unwrap();
    assert_eq!(out, [3.0, -6.0, 10.5]);
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
    assert!(e.contains("`mamba9`") && e.contains("installed architectures: ") && e.contains("family plugin"), "{e}");
    assert!(cat.architectures().iter().all(|a| e.contains(a.as_str())), "{e}");
}

/// A panic inside a plugin call comes back as an error naming it, and the context is never used again:
/// every later call says it must be rebuilt (its state may be half-written).
#[test]
fn a_context_whose_plugin_panicked_is_poisoned() {
    use mlxcel_plugin_api::*;
    let older = common::built("mlxcel_testplugin_older_minor");
    let dir = folder_with(&[(&older, "libolder.so")]);
    let cat = Catalog::load(&PluginSearch { dirs: vec![dir.path().to_path_buf()] });
    let mut ctx = cat.backends[0].create(1, 0).unwrap();
    let run = |ctx: &mut mlxcel_plugins::BackendContext, factor: f32| {
        let x = [1.0f32];
        let mut g = Graph::new();
        let xi = g.input(0, DType::F32, &[1, 1]);
        let o = g.op_with(OpCode::Scale, &[1, 1], &[xi], &[], &[factor]);
        g.mark_output(o);
        let mut out = [0f32; 1];
        let inputs = [HostTensor { ptr: x.as_ptr() as *mut u8, len: 4 }];
        let outputs = [HostTensor { ptr: out.as_mut_ptr() as *mut u8, len: 4 }];
        let args = ComputeArgs {
            graph: g.as_ref(),
            inputs: inputs.as_ptr(),
            n_inputs: 1,
            outputs: outputs.as_ptr(),
            n_outputs: 1,
            ..Versioned::zeroed()
        };
        unsafe { ctx.compute(&args) }.map(|_| out[0])
    };
    assert_eq!(run(&mut ctx, 2.0).unwrap(), 2.0);
    let e = run(&mut ctx, f32::NAN).unwrap_err();
    assert_eq!(e.status, Status::PANIC.0);
    assert!(e.message.contains("panicked") && e.message.contains("scale by NaN"), "{}", e.message);
    let e = run(&mut ctx, 2.0).unwrap_err();
    assert!(e.message.contains("rebuilt"), "{}", e.message);
    // A fresh context works.
    let mut fresh = cat.backends[0].create(1, 0).unwrap();
    assert_eq!(run(&mut fresh, 3.0).unwrap(), 3.0);
}
