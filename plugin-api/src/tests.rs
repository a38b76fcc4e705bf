//! The evolution rule at the level of single structs: an older reader takes the prefix it knows, a
//! newer reader sees zeros for fields the writer did not have, and a writer never fills more than the
//! reader's room.

#![allow(clippy::undocumented_unsafe_blocks)]

use crate::ffi::{read_versioned, read_versioned_array, write_versioned, Versioned};

/// "2.0" of a struct…
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq)]
struct Old {
    size: usize,
    a: u32,
}
// SAFETY: repr(C), `size` first, plain data.
unsafe impl Versioned for Old {}

/// …and "2.1", with a field appended.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq)]
struct New {
    size: usize,
    a: u32,
    b: u64,
}
// SAFETY: repr(C), `size` first, plain data.
unsafe impl Versioned for New {}

#[test]
fn newer_reader_sees_zero_for_fields_an_older_writer_lacks() {
    let old = Old { a: 7, ..Old::zeroed() };
    let read: New = unsafe { read_versioned(&old as *const Old as *const New) }.unwrap();
    assert_eq!(read.a, 7);
    assert_eq!(read.b, 0);
}

#[test]
fn older_reader_takes_only_its_prefix() {
    let new = New { a: 3, b: u64::MAX, ..New::zeroed() };
    let read: Old = unsafe { read_versioned(&new as *const New as *const Old) }.unwrap();
    assert_eq!(read.a, 3);
}

#[test]
fn writer_fills_no_more_than_the_readers_room() {
    // An older caller's struct followed by a canary the callee must not touch.
    #[repr(C)]
    struct Guarded {
        out: Old,
        canary: u64,
    }
    let mut g = Guarded { out: Old::zeroed(), canary: 0xdead_beef };
    let value = New { a: 9, b: 1, ..New::zeroed() };
    unsafe { write_versioned(&mut g.out as *mut Old as *mut New, &value) };
    assert_eq!(g.out.a, 9);
    assert_eq!(g.canary, 0xdead_beef);
    assert_eq!(g.out.size, std::mem::size_of::<Old>());
}

#[test]
fn arrays_are_read_with_the_writers_stride() {
    let olds = [Old { a: 1, ..Old::zeroed() }, Old { a: 2, ..Old::zeroed() }];
    let news: Vec<New> = unsafe { read_versioned_array(olds.as_ptr() as *const New, 2) };
    assert_eq!(news.iter().map(|n| (n.a, n.b)).collect::<Vec<_>>(), [(1, 0), (2, 0)]);
    let news = [New { a: 5, b: 6, ..New::zeroed() }, New { a: 7, b: 8, ..New::zeroed() }];
    let olds: Vec<Old> = unsafe { read_versioned_array(news.as_ptr() as *const Old, 2) };
    assert_eq!(olds.iter().map(|o| o.a).collect::<Vec<_>>(), [5, 7]);
}

#[test]
fn null_and_undersized_structs_are_refused() {
    assert!(unsafe { read_versioned::<New>(std::ptr::null()) }.is_none());
    let bogus = Old { size: 2, a: 0 };
    assert!(unsafe { read_versioned(&bogus as *const Old as *const New) }.is_none());
}

#[test]
fn nodes_of_another_layout_are_read_by_prefix() {
    use crate::graph::{Graph, GraphRef, Node, OpCode};
    let mut g = Graph::new();
    let x = g.input(0, crate::DType::F32, &[2, 3]);
    g.op_with(OpCode::Scale, &[2, 3], &[x], &[], &[0.5]);
    // A newer writer's nodes are 16 bytes longer: same prefix, padding after.
    let stride = std::mem::size_of::<Node>() + 16;
    let mut bytes = vec![0xffu8; stride * 2];
    for (i, n) in g.nodes.iter().enumerate() {
        let src = unsafe { std::slice::from_raw_parts(n as *const Node as *const u8, std::mem::size_of::<Node>()) };
        bytes[i * stride..][..src.len()].copy_from_slice(src);
    }
    let r = GraphRef { nodes: bytes.as_ptr() as *const Node, n_nodes: 2, node_size: stride, ..g.as_ref() };
    let nodes = unsafe { r.nodes() };
    assert_eq!(nodes[1].opcode(), Some(OpCode::Scale));
    assert_eq!(nodes[1].sources(), &[0]);
    assert_eq!(nodes[1].fparams[0], 0.5);
}
