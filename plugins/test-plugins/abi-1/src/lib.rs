//! A plugin built for ABI major 1 (the foundation's): the host must refuse it by name, saying it is
//! older, and keep running.

use mlxcel_plugin_api::*;

unsafe extern "C" fn init(_err: *mut ErrorBuf) -> Status {
    Status::OK
}

static ROOT: PluginRoot = PluginRoot {
    abi_major: 1,
    abi_minor: 0,
    kind: PluginKind::Backend as u32,
    name: StrRef::from_static("abi-one"),
    version: StrRef::from_static("0.0.1"),
    description: StrRef::from_static("test plugin built for plugin ABI 1.0"),
    init,
    backend: std::ptr::null(),
    family: std::ptr::null(),
};

export_plugin!(ROOT);
