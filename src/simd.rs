//! Run-time choice of the instruction set for the hot loops.
//!
//! The kernels are plain Rust loops written so the compiler vectorizes them. [`multiversion!`]
//! compiles such a function three times on x86-64 — for the baseline (SSE2), for AVX2 and for
//! AVX-512 (F, BW, VL), both with the bit instructions every AVX2 CPU has (BMI1, BMI2, LZCNT,
//! POPCNT: a `count_ones`, `trailing_zeros` or variable shift is one instruction) — and calls the
//! widest build the CPU runs. The hand-written AVX2 and AVX-512 functions (`select::key_window`,
//! `select::ranks`, `method::statistics::l1`) enable the same features as the level they are
//! called at: the two lists in [`multiversion!`] are the only ones (tests/architecture.rs holds
//! every `target_feature` under src/ to them). On arm64 the baseline already has NEON. The
//! results cannot differ: every build performs the same IEEE operations on the same values (Rust
//! never contracts `a * b + c` into a fused multiply-add), only more lanes at a time.
//!
//! `RLMERGE_SIMD=baseline` or `RLMERGE_SIMD=avx2` caps the builds used (the tests compare them).

/// The instruction sets the kernels are built for, narrowest first.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Level {
    Baseline,
    Avx2,
    Avx512,
}

/// The widest build the CPU runs, capped by `RLMERGE_SIMD` (`baseline`, `avx2`).
pub fn level() -> Level {
    static LEVEL: std::sync::OnceLock<Level> = std::sync::OnceLock::new();
    *LEVEL.get_or_init(|| {
        let cap = match std::env::var("RLMERGE_SIMD").as_deref() {
            Ok("baseline") => Level::Baseline,
            Ok("avx2") => Level::Avx2,
            _ => Level::Avx512,
        };
        detected().min(cap)
    })
}

/// The widest build the CPU runs, whatever `RLMERGE_SIMD` says.
#[cfg(target_arch = "x86_64")]
pub(crate) fn detected() -> Level {
    use std::arch::is_x86_feature_detected as has;
    // The bit instructions every AVX2 CPU has (Haswell, Zen on): `count_ones`, `trailing_zeros`
    // and variable shifts become one instruction each in the builds.
    let bits = has!("bmi1") && has!("bmi2") && has!("lzcnt") && has!("popcnt");
    if bits && has!("avx512f") && has!("avx512bw") && has!("avx512vl") && has!("avx2") {
        Level::Avx512
    } else if bits && has!("avx2") {
        Level::Avx2
    } else {
        Level::Baseline
    }
}

#[cfg(not(target_arch = "x86_64"))]
pub(crate) fn detected() -> Level {
    Level::Baseline
}

/// Defines a function whose body is compiled for the baseline, AVX2 and AVX-512, and calls the
/// widest build [`level`] allows (see the module docs). No generic parameters.
macro_rules! multiversion {
    ($(#[$meta:meta])* $vis:vis fn $name:ident($($arg:ident: $ty:ty),* $(,)?) $(-> $ret:ty)? $body:block) => {
        $(#[$meta])*
        $vis fn $name($($arg: $ty),*) $(-> $ret)? {
            #[inline(always)]
            fn body($($arg: $ty),*) $(-> $ret)? $body
            #[cfg(target_arch = "x86_64")]
            {
                #[target_feature(enable = "avx2,bmi1,bmi2,lzcnt,popcnt")]
                fn avx2($($arg: $ty),*) $(-> $ret)? {
                    body($($arg),*)
                }
                #[target_feature(enable = "avx2,avx512f,avx512bw,avx512vl,bmi1,bmi2,lzcnt,popcnt")]
                fn avx512($($arg: $ty),*) $(-> $ret)? {
                    body($($arg),*)
                }
                match $crate::simd::level() {
                    // SAFETY: the CPU supports AVX-512 F/BW/VL, detected by `level`.
                    $crate::simd::Level::Avx512 => return unsafe { avx512($($arg),*) },
                    // SAFETY: the CPU supports AVX2, detected by `level`.
                    $crate::simd::Level::Avx2 => return unsafe { avx2($($arg),*) },
                    $crate::simd::Level::Baseline => {}
                }
            }
            body($($arg),*)
        }
    };
}

pub(crate) use multiversion;
