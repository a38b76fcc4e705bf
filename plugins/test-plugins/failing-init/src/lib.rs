//! A plugin whose `init` fails: the host must report it with the reason and keep the others.

use mlxcel_plugin_api::*;

unsafe extern "C" fn init(err: *mut ErrorBuf) -> Status {
    // SAFETY: the host passes a valid or null error buffer.
    unsafe { guard(err, || Err(PluginError::failed("this test plugin always fails to initialise"))) }
}

static ROOT: PluginRoot = PluginRoot {
    abi_major: ABI_MAJOR,
    abi_minor: ABI_MINOR,
    kind: PluginKind::Backend as u32,
    name: StrRef::from_static("failing-init"),
    version: StrRef::from_static("0.0.1"),
    description: StrRef::from_static("test plugin whose init fails"),
    init,
    backend: std::ptr::null(),
    family: std::ptr::null(),
};

export_plugin!(ROOT);
