//! `mlxcel arch`: what the installed plugins provide. Nothing here is hard-coded: architectures come
//! from the family plugins, devices and scores from the backend plugins.

use anyhow::Result;
use clap::Args;
use serde_json::json;

use super::GlobalArgs;

#[derive(Args, Debug)]
pub struct ArchArgs {
    /// Machine-readable output.
    #[arg(long)]
    pub json: bool,
}

pub fn run(global: &GlobalArgs, args: &ArchArgs) -> Result<()> {
    let cat = global.catalog();
    let families: Vec<_> = cat
        .families
        .iter()
        .map(|f| {
            json!({
                "name": f.meta.name,
                "version": f.meta.version,
                "abi": format!("{}.{}", f.meta.abi_major, f.meta.abi_minor),
                "description": f.meta.description,
                "architectures": f.architectures(),
                "path": f.meta.path.display().to_string(),
            })
        })
        .collect();
    let backends: Vec<_> = cat
        .backends
        .iter()
        .map(|b| {
            let d = b.describe();
            json!({
                "name": b.meta.name,
                "version": b.meta.version,
                "abi": format!("{}.{}", b.meta.abi_major, b.meta.abi_minor),
                "description": b.meta.description,
                "score": d.score,
                "features": d.features,
                "reason": d.reason,
                "devices": d.devices.iter().map(|dev| json!({"name": dev.name, "kind": dev.kind, "memory_bytes": dev.memory_bytes})).collect::<Vec<_>>(),
                "path": b.meta.path.display().to_string(),
            })
        })
        .collect();
    let refused: Vec<_> =
        cat.problems.iter().map(|p| json!({"path": p.path.display().to_string(), "reason": p.reason})).collect();
    let selected = cat.select_backend(None).ok().map(|b| b.name().to_string());

    if args.json {
        let out = json!({
            "abi": format!("{}.{}", mlxcel_plugin_api::ABI_MAJOR, mlxcel_plugin_api::ABI_MINOR),
            "families": families,
            "backends": backends,
            "selected_backend": selected,
            "architectures": cat.architectures(),
            "refused": refused,
            "searched": cat.searched.iter().map(|p| p.display().to_string()).collect::<Vec<_>>(),
        });
        println!("{}", serde_json::to_string_pretty(&out)?);
        return Ok(());
    }

    println!(
        "mlxcel {} (plugin ABI {}.{})",
        env!("CARGO_PKG_VERSION"),
        mlxcel_plugin_api::ABI_MAJOR,
        mlxcel_plugin_api::ABI_MINOR
    );
    println!();
    println!("FAMILIES");
    if cat.families.is_empty() {
        println!("  (none installed)");
    }
    for f in &cat.families {
        println!("  {:<10} {:<8} {}", f.meta.name, f.meta.version, f.architectures().join(", "));
    }
    println!();
    println!("BACKENDS");
    if cat.backends.is_empty() {
        println!("  (none installed)");
    }
    for b in &cat.backends {
        let d = b.describe();
        let mark = if selected.as_deref() == Some(b.name()) { "*" } else { " " };
        let devices = d.devices.iter().map(|x| format!("{} [{}]", x.name, x.kind)).collect::<Vec<_>>().join(", ");
        println!("{mark} {:<10} {:<8} score {:<4} {:<8} {}", b.meta.name, b.meta.version, d.score, d.features, devices);
        if d.score == 0 {
            // Unusable here: say why in one line (no driver, built without its library, …).
            println!("    unusable: {}", d.reason);
        }
    }
    if !cat.problems.is_empty() {
        println!();
        println!("REFUSED");
        for p in &cat.problems {
            println!("  {}: {}", p.path.display(), p.reason);
        }
    }
    Ok(())
}
