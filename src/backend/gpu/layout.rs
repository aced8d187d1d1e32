//! The Rust side of the layouts the shaders share: the uniform blocks (`Params` in
//! shaders/chunk.wgsl, `Comb` in shaders/combine.wgsl), the keep-rule words and the codes the WGSL
//! compares against. A test reads the WGSL source with naga and fails on any difference.

use crate::backend::Tile;
use crate::checkpoint::DType;
use crate::method::combine::Keep;

/// Constants the WGSL source declares under the same names; `layout_matches_the_wgsl` holds the
/// two sides equal.
pub(super) mod wgsl {
    /// Invocations per workgroup (`WG`, chunk.wgsl).
    pub const WG: u32 = 256;
    /// Agents a probe counts at most (probe.wgsl).
    pub const MAX_AGENTS: u32 = 32;
    /// Element codes (dtype.wgsl).
    pub const DT_BF16: u32 = 0;
    pub const DT_F16: u32 = 1;
    pub const DT_F32: u32 = 2;
    /// Keep rules, word 0 of an agent's 8 (combine.wgsl).
    pub const KEEP_ALL: u32 = 0;
    pub const KEEP_BAND: u32 = 1;
    pub const KEEP_RANDOM: u32 = 2;
    pub const KEEP_FLAGGED: u32 = 3;
    /// `Comb::norm_mode` (combine.wgsl).
    pub const NORM_NONE: u32 = 0;
    pub const NORM_FIXED: u32 = 1;
    pub const NORM_TABLE: u32 = 2;
    /// `Params::shared_rule`: the RAM merge's rule for the shared region (merge.wgsl).
    pub const SHARED_MEAN: u32 = 0;
    pub const SHARED_CONSENSUS: u32 = 1;

    /// Every constant above with its WGSL name.
    #[cfg(test)]
    pub const ALL: [(&str, u32); 14] = [
        ("WG", WG),
        ("MAX_AGENTS", MAX_AGENTS),
        ("DT_BF16", DT_BF16),
        ("DT_F16", DT_F16),
        ("DT_F32", DT_F32),
        ("KEEP_ALL", KEEP_ALL),
        ("KEEP_BAND", KEEP_BAND),
        ("KEEP_RANDOM", KEEP_RANDOM),
        ("KEEP_FLAGGED", KEEP_FLAGGED),
        ("NORM_NONE", NORM_NONE),
        ("NORM_FIXED", NORM_FIXED),
        ("NORM_TABLE", NORM_TABLE),
        ("SHARED_MEAN", SHARED_MEAN),
        ("SHARED_CONSENSUS", SHARED_CONSENSUS),
    ];
}

pub(super) const WORKGROUP: u32 = wgsl::WG;

/// Workgroups per dispatch dimension (WebGPU's minimum limit, which every adapter meets).
pub(super) const MAX_GROUPS_PER_DIM: u32 = 65_535;

/// The uniform block every kernel reads (`struct Params` in shaders/chunk.wgsl).
#[repr(C)]
#[derive(Clone, Copy, bytemuck::Pod, bytemuck::Zeroable)]
pub(super) struct Params {
    pub(super) len: u32,
    pub(super) pairs: u32,
    pub(super) n: u32,
    pub(super) in_dt: u32,
    pub(super) out_dt: u32,
    pub(super) stride: u32,
    pub(super) eps: f32,
    pub(super) zero: u32,
    pub(super) groups_x: u32,
    pub(super) shared_rule: u32,
    pub(super) _pad: [u32; 2],
}

/// The uniforms of a chunk of `len` elements of `tile`.
pub(super) fn chunk_params(
    tile: &Tile,
    len: usize,
    out_dt: DType,
    (eps, shared): (f32, u32),
) -> Params {
    let pairs = len.div_ceil(2);
    let groups = (pairs as u32).div_ceil(WORKGROUP).max(1);
    // Words per agent segment, even, so an f32 pair never reads past its segment.
    let words = match tile.dtype {
        DType::F32 => len,
        _ => len.div_ceil(2),
    };
    Params {
        len: len as u32,
        pairs: pairs as u32,
        n: tile.agents.len() as u32,
        in_dt: dtype_code(tile.dtype),
        out_dt: dtype_code(out_dt),
        stride: (words.max(1).div_ceil(2) * 2) as u32,
        eps,
        zero: 0,
        groups_x: groups.min(MAX_GROUPS_PER_DIM),
        shared_rule: shared,
        _pad: [0; 2],
    }
}

/// The uniform block of the combine kernel (`struct Comb` in shaders/combine.wgsl).
#[repr(C)]
#[derive(Clone, Copy, bytemuck::Pod, bytemuck::Zeroable)]
pub(super) struct Comb {
    pub(super) start: u32,
    pub(super) row_len: u32,
    pub(super) first_row: u32,
    pub(super) delta: u32,
    pub(super) consensus: u32,
    pub(super) norm_mode: u32,
    pub(super) lambda: f32,
    pub(super) fixed_recip: f32,
    pub(super) nearswap: u32,
    pub(super) nearswap_t: f32,
    pub(super) element_keep: u32,
    pub(super) element_value: u32,
    pub(super) element_index: u32,
    pub(super) inv_n: f32,
    pub(super) sign_of_values: u32,
    pub(super) row_period: u32,
}

/// An agent's keep rule as the 8 words `rules` holds.
pub(super) fn rule_words(k: &Keep) -> [u32; 8] {
    match *k {
        Keep::All => [wgsl::KEEP_ALL, 0, 0, 0, 0, 0, 0, 0],
        Keep::Flagged => [wgsl::KEEP_FLAGGED, 0, 0, 0, 0, 0, 0, 0],
        Keep::Band { lo, hi } => [
            wgsl::KEEP_BAND,
            lo.value,
            lo.index,
            hi.value,
            hi.index,
            lo.high_first as u32 | (hi.high_first as u32) << 1,
            0,
            0,
        ],
        Keep::Random { threshold, key } => {
            [wgsl::KEEP_RANDOM, 0, 0, 0, 0, threshold, key[0], key[1]]
        }
    }
}

pub(super) fn dtype_code(d: DType) -> u32 {
    match d {
        DType::BF16 => wgsl::DT_BF16,
        DType::F16 => wgsl::DT_F16,
        DType::F32 => wgsl::DT_F32,
    }
}

/// Each kernel's bindings in `@binding` order, by their WGSL names: the one list its bind group is
/// made from (`buffers.rs`), checked against the shader by [`tests::bindings_match_the_wgsl`].
pub(super) const PROBE_BINDINGS: [&str; 4] = ["p", "base", "agents", "hist"];
/// See [`PROBE_BINDINGS`].
pub(super) const MERGE_BINDINGS: [&str; 5] = ["p", "base", "agents", "lambdas", "out"];
/// See [`PROBE_BINDINGS`].
pub(super) const COMBINE_BINDINGS: [&str; 9] = [
    "p", "base", "agents", "c", "rules", "coefs", "recips", "out", "flags",
];
/// See [`PROBE_BINDINGS`].
pub(super) const UPDATE_BINDINGS: [&str; 5] = ["p", "base", "agents", "delta", "out"];
/// See [`PROBE_BINDINGS`]: the GEMM's (`gemm.wgsl`, a standalone kernel).
pub(super) const GEMM_BINDINGS: [&str; 4] = ["dims", "a", "b", "c"];

/// The GEMM's uniform (`Dims` in gemm.wgsl): one panel of B against a block of A's rows.
#[repr(C)]
#[derive(Clone, Copy, bytemuck::Pod, bytemuck::Zeroable)]
pub(super) struct Dims {
    pub rows: u32,
    pub k: u32,
    pub cols: u32,
    /// Columns of C per row (a panel writes its own columns).
    pub c_stride: u32,
    /// C's first column for the panel.
    pub c_offset: u32,
    pub pad: [u32; 3],
}

/// Rows and columns of C each GEMM workgroup computes (`TILE` in gemm.wgsl).
pub(super) const GEMM_TILE: usize = 16;

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::gpu::{
        shader_source, COMBINE_WGSL, GEMM_WGSL, MERGE_WGSL, PROBE_WGSL, UPDATE_WGSL,
    };
    use std::mem::{offset_of, size_of};

    /// A kernel's module as the host builds it (dtype.wgsl + chunk.wgsl + the kernel; the GEMM
    /// alone, a standalone kernel).
    fn module(kernel: &str) -> naga::Module {
        let source = match kernel == GEMM_WGSL {
            true => kernel.to_string(),
            false => shader_source(kernel),
        };
        naga::front::wgsl::parse_str(&source).expect("the shaders parse")
    }

    /// (member name, byte offset) of WGSL struct `name`, and its size.
    fn wgsl_struct(m: &naga::Module, name: &str) -> (Vec<(String, usize)>, usize) {
        let ty = m
            .types
            .iter()
            .find(|(_, t)| t.name.as_deref() == Some(name))
            .unwrap_or_else(|| panic!("no struct {name} in the WGSL"))
            .1;
        let naga::TypeInner::Struct { members, span } = &ty.inner else {
            panic!("{name} is not a struct");
        };
        let fields = members
            .iter()
            .map(|f| (f.name.clone().unwrap_or_default(), f.offset as usize))
            .collect();
        (fields, *span as usize)
    }

    /// The value of WGSL constant `name` (a u32 literal), if the module declares it.
    fn wgsl_const(m: &naga::Module, name: &str) -> Option<u32> {
        let (_, c) = m
            .constants
            .iter()
            .find(|(_, c)| c.name.as_deref() == Some(name))?;
        match m.global_expressions[c.init] {
            naga::Expression::Literal(naga::Literal::U32(v)) => Some(v),
            ref e => panic!("WGSL constant {name} is not a u32 literal: {e:?}"),
        }
    }

    /// Every kernel's bind-group table lists its WGSL's group-0 bindings by name, in order, and
    /// nothing else: a binding added, moved or renamed on one side fails here.
    #[test]
    fn bindings_match_the_wgsl() {
        for (kernel, table) in [
            (PROBE_WGSL, &PROBE_BINDINGS[..]),
            (MERGE_WGSL, &MERGE_BINDINGS[..]),
            (COMBINE_WGSL, &COMBINE_BINDINGS[..]),
            (UPDATE_WGSL, &UPDATE_BINDINGS[..]),
            (GEMM_WGSL, &GEMM_BINDINGS[..]),
        ] {
            let m = module(kernel);
            let mut bound: Vec<(u32, String)> = m
                .global_variables
                .iter()
                .filter_map(|(_, v)| {
                    let b = v.binding.as_ref()?;
                    assert_eq!(b.group, 0, "{:?}: one bind group", v.name);
                    Some((b.binding, v.name.clone().unwrap_or_default()))
                })
                .collect();
            bound.sort();
            let names: Vec<&str> = bound.iter().map(|(_, n)| n.as_str()).collect();
            assert_eq!(names, table, "bindings of the WGSL vs the Rust table");
            let slots: Vec<u32> = bound.iter().map(|(b, _)| *b).collect();
            assert_eq!(slots, (0..table.len() as u32).collect::<Vec<_>>());
        }
    }

    /// The uniform blocks match field by field (names, offsets, size rounded up to 16 bytes as a
    /// uniform binding is), and every shared constant has one value on both sides: a field or a
    /// code changed on one side only fails here.
    #[test]
    fn layout_matches_the_wgsl() {
        macro_rules! fields {
            ($t:ty; $($f:ident),*) => {
                (vec![$((stringify!($f).to_string(), offset_of!($t, $f))),*], size_of::<$t>())
            };
        }
        let params =
            fields!(Params; len, pairs, n, in_dt, out_dt, stride, eps, zero, groups_x, shared_rule);
        let comb = fields!(Comb; start, row_len, first_row, delta, consensus, norm_mode, lambda,
            fixed_recip, nearswap, nearswap_t, element_keep, element_value, element_index, inv_n,
            sign_of_values, row_period);
        let dims = fields!(Dims; rows, k, cols, c_stride, c_offset);
        let combine = module(COMBINE_WGSL);
        let gemm = module(GEMM_WGSL);
        for (name, (fields, size)) in [("Params", params), ("Comb", comb), ("Dims", dims)] {
            let m = if name == "Dims" { &gemm } else { &combine };
            let (mut wgsl, span) = wgsl_struct(m, name);
            // Padding is not a field either side names alike; the size checks it.
            wgsl.retain(|(f, _)| !f.starts_with("_pad"));
            assert_eq!(fields, wgsl, "{name}: Rust and WGSL fields differ");
            assert_eq!(
                size,
                span.div_ceil(16) * 16,
                "{name}: Rust size vs WGSL span {span}"
            );
        }
        let modules = [
            module(PROBE_WGSL),
            module(MERGE_WGSL),
            combine,
            module(UPDATE_WGSL),
        ];
        for (name, value) in wgsl::ALL {
            let found: Vec<u32> = modules.iter().filter_map(|m| wgsl_const(m, name)).collect();
            assert!(!found.is_empty(), "WGSL declares no constant {name}");
            assert!(
                found.iter().all(|&v| v == value),
                "{name}: Rust {value}, WGSL {found:?}"
            );
        }
        assert_eq!(super::super::GPU_MAX_AGENTS, wgsl::MAX_AGENTS as usize);
        assert_eq!(
            wgsl_const(&gemm, "TILE"),
            Some(GEMM_TILE as u32),
            "the GEMM's tile"
        );
    }
}
