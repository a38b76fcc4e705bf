//! A plugin that claims a future ABI major: the host must refuse it by name and keep running.

use mlxcel_plugin_api::*;

unsafe extern "C" fn init(_err: *mut ErrorBuf) -> Status {
    Status::OK
}

static ROOT: PluginRoot = PluginRoot {
    abi_major: ABI_MAJOR + 1,
    abi_minor: 0,
    kind: PluginKind::Family as u32,
    name: StrRef::from_static("future-abi"),
    version: StrRef::from_static("9.9.9"),
    description: StrRef::from_static("test plugin built for a newer ABI major"),
    init,
    backend: std::ptr::null(),
    family: std::ptr::null(),
};

export_plugin!(ROOT);
