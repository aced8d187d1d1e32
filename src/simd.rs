//! Run-time choice of the instruction set for the hot loops.
//!
//! The kernels are plain Rust loops written so the compiler vectorizes them. [`multiversion!`]
//! compiles such a function twice on x86-64, for the baseline (SSE2) and for AVX2, and picks the
//! AVX2 build at run time where the CPU has it. On arm64 the baseline already has NEON. The
//! results cannot differ: both builds perform the same IEEE operations on the same values (Rust
//! never contracts `a * b + c` into a fused multiply-add), only more lanes at a time.
//!
//! `RLMERGE_SIMD=baseline` turns the AVX2 builds off (the tests compare both).

/// Whether the AVX2 builds run: the CPU has AVX2 and `RLMERGE_SIMD` is not `baseline`.
#[cfg(target_arch = "x86_64")]
pub fn avx2() -> bool {
    static AVX2: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *AVX2.get_or_init(|| {
        std::arch::is_x86_feature_detected!("avx2")
            && std::env::var("RLMERGE_SIMD").map_or(true, |v| v != "baseline")
    })
}

/// Defines a function whose body is compiled for the baseline and for AVX2, and calls the AVX2
/// build where the CPU supports it (see the module docs). No generic parameters.
macro_rules! multiversion {
    ($(#[$meta:meta])* $vis:vis fn $name:ident($($arg:ident: $ty:ty),* $(,)?) $(-> $ret:ty)? $body:block) => {
        $(#[$meta])*
        $vis fn $name($($arg: $ty),*) $(-> $ret)? {
            #[inline(always)]
            fn body($($arg: $ty),*) $(-> $ret)? $body
            #[cfg(target_arch = "x86_64")]
            {
                #[target_feature(enable = "avx2")]
                fn avx2($($arg: $ty),*) $(-> $ret)? {
                    body($($arg),*)
                }
                if $crate::simd::avx2() {
                    // SAFETY: the CPU supports AVX2, checked just above.
                    return unsafe { avx2($($arg),*) };
                }
            }
            body($($arg),*)
        }
    };
}

pub(crate) use multiversion;
