//! A backend exported as a plugin of ABI 2.0: its table ends before the 2.1 entries (`kv_alloc`,
//! `copy_blocks`). The host must load it, treat those entries as absent (allocating f32 KV caches
//! itself, refusing block copies) and run graphs on it. It computes `Scale` and `Add` on f32 inputs,
//! enough to prove the calls work, and panics when asked to scale by NaN.

use mlxcel_plugin_api::*;

pub struct OlderMinor;

pub struct Context;

impl Backend for OlderMinor {
    const NAME: &'static str = "older-minor";
    const DESCRIPTION: &'static str = "test backend of ABI 2.0 (scale and add on f32)";
    type Context = Context;

    fn describe() -> BackendDescription {
        BackendDescription {
            score: 1,
            features: "scalar".into(),
            reason: "test plugin".into(),
            devices: vec![DeviceDescription {
                name: "test device".into(),
                kind: DeviceKind::Cpu,
                memory_bytes: 1 << 30,
                free_memory_bytes: 1 << 29,
            }],
        }
    }

    fn create(_n_threads: u32, _device: u32) -> Result<Context, PluginError> {
        Ok(Context)
    }
}

fn f32s(bytes: &[u8]) -> Vec<f32> {
    bytes.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect()
}

impl BackendContext for Context {
    type Buffer = Vec<u8>;

    unsafe fn buffer_from_host(&mut self, ptr: *const u8, len: usize) -> Result<Vec<u8>, PluginError> {
        // SAFETY: the host keeps `ptr` readable for `len` bytes (trait contract).
        Ok(unsafe { slice_from(ptr, len) }.to_vec())
    }
    fn buffer_alloc(&mut self, len: usize) -> Result<Vec<u8>, PluginError> {
        Ok(vec![0; len])
    }
    fn buffer_write(&mut self, buf: &mut Vec<u8>, offset: usize, src: &[u8]) -> Result<(), PluginError> {
        let dst = buf.get_mut(offset..offset + src.len()).ok_or_else(|| PluginError::invalid("out of range"))?;
        dst.copy_from_slice(src);
        Ok(())
    }
    fn buffer_read(&mut self, buf: &Vec<u8>, offset: usize, dst: &mut [u8]) -> Result<(), PluginError> {
        dst.copy_from_slice(buf.get(offset..offset + dst.len()).ok_or_else(|| PluginError::invalid("out of range"))?);
        Ok(())
    }
    fn supports(&self, node: &Node) -> bool {
        matches!(node.opcode(), Some(OpCode::Input | OpCode::Scale | OpCode::Add)) && node.dtype() == DType::F32
    }
    unsafe fn compute(&mut self, args: &ComputeArgs) -> Result<(), PluginError> {
        // SAFETY: the host's pointers are valid for the sizes it states (trait contract).
        let (nodes, outputs, inputs, outs) = unsafe {
            (
                args.graph.nodes(),
                args.graph.outputs(),
                slice_from(args.inputs, args.n_inputs),
                slice_from(args.outputs, args.n_outputs),
            )
        };
        let mut vals: Vec<Vec<f32>> = Vec::with_capacity(nodes.len());
        for n in nodes.iter() {
            let v = match n.opcode() {
                Some(OpCode::Input) => {
                    let t = inputs.get(n.iparams[0] as usize).ok_or_else(|| PluginError::invalid("input"))?;
                    // SAFETY: host input of `len` bytes.
                    f32s(unsafe { slice_from(t.ptr, t.len) })
                }
                // A NaN factor makes this test backend panic, so the host's handling of a panicking
                // plugin can be tested.
                Some(OpCode::Scale) if n.fparams[0].is_nan() => panic!("scale by NaN"),
                Some(OpCode::Scale) => vals[n.src[0] as usize].iter().map(|x| x * n.fparams[0]).collect(),
                Some(OpCode::Add) => {
                    vals[n.src[0] as usize].iter().zip(&vals[n.src[1] as usize]).map(|(a, b)| a + b).collect()
                }
                _ => return Err(PluginError::invalid("unsupported op")),
            };
            vals.push(v);
        }
        for (&o, dst) in outputs.iter().zip(outs) {
            let v = &vals[o as usize];
            if dst.len != v.len() * 4 {
                return Err(PluginError::invalid("output size"));
            }
            for (i, x) in v.iter().enumerate() {
                // SAFETY: `dst` holds `len` writable bytes.
                unsafe { std::ptr::copy_nonoverlapping(x.to_le_bytes().as_ptr(), dst.ptr.add(i * 4), 4) };
            }
        }
        Ok(())
    }
    fn kv_alloc(&mut self, _desc: &KvCacheDesc) -> Result<(Vec<u8>, u64), PluginError> {
        unreachable!("absent from an ABI 2.0 table")
    }
    fn copy_blocks(&mut self, _: &mut Vec<u8>, _: &KvCacheDesc, _: &[BlockCopy]) -> Result<(), PluginError> {
        unreachable!("absent from an ABI 2.0 table")
    }
}

export_backend!(OlderMinor, minor = 0, name = "older-minor");
