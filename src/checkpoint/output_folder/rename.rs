//! The one rename that cannot replace anything: how a finished output goes into place.

use std::io;
use std::path::Path;

/// `to` must not exist: the rename fails with `AlreadyExists` instead of replacing anything.
/// Linux: `renameat2(RENAME_NOREPLACE)`; macOS: `renamex_np(RENAME_EXCL)`. Where the filesystem
/// or OS has neither, a check and a plain rename: in the instant between them only an empty
/// folder can be replaced (POSIX `rename` fails on a non-empty folder and on a file).
pub fn rename_noreplace(from: &Path, to: &Path) -> io::Result<()> {
    match os_rename_noreplace(from, to) {
        Some(Err(e)) if exists_error(&e) => Err(io::ErrorKind::AlreadyExists.into()),
        Some(result) => result,
        None => {
            if to.symlink_metadata().is_ok() {
                return Err(io::ErrorKind::AlreadyExists.into());
            }
            std::fs::rename(from, to).map_err(|e| {
                if exists_error(&e) {
                    io::ErrorKind::AlreadyExists.into()
                } else {
                    e
                }
            })
        }
    }
}

fn exists_error(e: &io::Error) -> bool {
    #[cfg(unix)]
    if matches!(e.raw_os_error(), Some(libc::EEXIST | libc::ENOTEMPTY)) {
        return true;
    }
    e.kind() == io::ErrorKind::AlreadyExists
}

/// The OS's atomic no-replace rename; `None` where there is none, or the filesystem refuses the
/// flag (the caller falls back).
#[cfg(unix)]
fn os_rename_noreplace(from: &Path, to: &Path) -> Option<io::Result<()>> {
    use std::os::unix::ffi::OsStrExt;
    let c_path = |p: &Path| {
        std::ffi::CString::new(p.as_os_str().as_bytes())
            .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "path holds a NUL byte"))
    };
    let (f, t) = match (c_path(from), c_path(to)) {
        (Ok(f), Ok(t)) => (f, t),
        (Err(e), _) | (_, Err(e)) => return Some(Err(e)),
    };
    if raw_rename_noreplace(&f, &t)? == 0 {
        return Some(Ok(()));
    }
    let e = io::Error::last_os_error();
    match e.raw_os_error() {
        // An old kernel, or a filesystem without the flag.
        Some(libc::ENOSYS | libc::EINVAL | libc::ENOTSUP) => None,
        _ => Some(Err(e)),
    }
}

/// `renameat2(RENAME_NOREPLACE)`: its return value.
#[cfg(any(target_os = "linux", target_os = "android"))]
fn raw_rename_noreplace(from: &std::ffi::CStr, to: &std::ffi::CStr) -> Option<i64> {
    const RENAME_NOREPLACE: libc::c_uint = 1;
    // SAFETY: both paths are NUL-terminated C strings that outlive the call.
    let r = unsafe {
        libc::syscall(
            libc::SYS_renameat2,
            libc::AT_FDCWD,
            from.as_ptr(),
            libc::AT_FDCWD,
            to.as_ptr(),
            RENAME_NOREPLACE,
        )
    };
    Some(r as i64)
}

/// `renamex_np(RENAME_EXCL)`: its return value.
#[cfg(any(target_os = "macos", target_os = "ios"))]
fn raw_rename_noreplace(from: &std::ffi::CStr, to: &std::ffi::CStr) -> Option<i64> {
    // SAFETY: both paths are NUL-terminated C strings that outlive the call.
    Some(unsafe { libc::renamex_np(from.as_ptr(), to.as_ptr(), libc::RENAME_EXCL) } as i64)
}

#[cfg(all(
    unix,
    not(any(
        target_os = "linux",
        target_os = "android",
        target_os = "macos",
        target_os = "ios"
    ))
))]
fn raw_rename_noreplace(_from: &std::ffi::CStr, _to: &std::ffi::CStr) -> Option<i64> {
    None
}

#[cfg(not(unix))]
fn os_rename_noreplace(_from: &Path, _to: &Path) -> Option<io::Result<()>> {
    None
}
