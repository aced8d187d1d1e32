//! The central directory of a zip archive — the container `torch.save` writes (`.bin`, `.pt`):
//! each entry's name, where its bytes start in the file and how many there are, read without
//! extracting anything (PKWARE's APPNOTE: end of central directory, its zip64 form for archives
//! and entries past 4 GiB, central and local headers). torch stores every entry uncompressed, so
//! a tensor's storage is a byte range of the file, read in tiles like a safetensors tensor's.
//! Bounded as a safetensors header is: at most [`MAX_ENTRIES`] entries and [`MAX_DIRECTORY`]
//! bytes of directory, names of at most 4 KiB, every range inside the file; an encrypted entry,
//! one split over disks, or a directory that does not parse is refused naming the file.

use super::cursor::Cursor;
use super::positional::read_vec_at;
use anyhow::{bail, ensure, Context, Result};
use std::fs::File;
use std::path::Path;

/// The most entries a torch archive may have (a storage each: DeepSeek-V3's 92k tensors fit).
pub const MAX_ENTRIES: u64 = 1 << 22;
/// The most bytes its central directory may take.
pub const MAX_DIRECTORY: u64 = 1 << 30;
/// The longest entry name.
const MAX_NAME: usize = 4096;

/// One entry of the archive.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ZipEntry {
    /// Its name (`archive/data/0`).
    pub name: String,
    /// Where its bytes start in the file.
    pub data_offset: u64,
    /// How many bytes it holds, as stored.
    pub size: u64,
    /// Stored without compression (the only way rlmerge reads an entry's bytes in place).
    pub stored: bool,
}

/// Where the central directory is and how many entries it lists: the end-of-central-directory
/// record, found in the archive's last 64 KiB + 22 bytes, and its zip64 form where a field says
/// so. The archive is bytes `base..base + len` of `file`; offsets are the archive's own.
fn directory(file: &File, base: u64, len: u64) -> Result<(u64, u64, u64)> {
    ensure!(len >= 22, "too short for a zip archive ({len} bytes)");
    let tail = len.min(22 + 65535);
    let bytes = read_vec_at(file, base + len - tail, tail as usize)?;
    let at = (0..=bytes.len() - 22)
        .rev()
        .find(|&i| bytes[i..i + 4] == [0x50, 0x4b, 0x05, 0x06])
        .context("no end of central directory: not a zip archive, or a truncated one")?;
    let eocd_at = len - tail + at as u64;
    let mut f = Cursor::new(&bytes[at + 4..], "a zip record ends before its fields");
    let (disk, cd_disk) = (f.u16()?, f.u16()?);
    let _on_disk = f.u16()?;
    let (count, size, offset) = (f.u16()?, f.u32()?, f.u32()?);
    let zip64 = count == 0xffff || size == 0xffff_ffff || offset == 0xffff_ffff;
    if !zip64 {
        ensure!(disk == 0 && cd_disk == 0, "a zip archive split over disks");
        return Ok((u64::from(offset), u64::from(size), u64::from(count)));
    }
    // The zip64 locator stands just before the record, and names the zip64 record.
    ensure!(eocd_at >= 20, "a zip64 archive without its locator");
    let locator = read_vec_at(file, base + eocd_at - 20, 20)?;
    ensure!(
        locator[..4] == [0x50, 0x4b, 0x06, 0x07],
        "a zip64 archive without its locator"
    );
    let record_at = u64::from_le_bytes(locator[8..16].try_into().expect("8 bytes"));
    ensure!(record_at + 56 <= len, "the zip64 record is past the end");
    let record = read_vec_at(file, base + record_at, 56)?;
    ensure!(
        record[..4] == [0x50, 0x4b, 0x06, 0x06],
        "the zip64 locator names no zip64 record"
    );
    let mut f = Cursor::new(&record[16..], "a zip record ends before its fields");
    let (disk, cd_disk) = (f.u32()?, f.u32()?);
    ensure!(disk == 0 && cd_disk == 0, "a zip archive split over disks");
    let _on_disk = f.u64()?;
    let (count, size, offset) = (f.u64()?, f.u64()?, f.u64()?);
    Ok((offset, size, count))
}

/// The entries of the zip archive `file` (`len` bytes, at `path`), in directory order.
pub fn entries(file: &File, path: &Path, len: u64) -> Result<Vec<ZipEntry>> {
    read_entries(file, 0, len)
        .with_context(|| format!("{}: not a zip archive torch wrote", path.display()))
}

/// The entries of the zip archive that is bytes `base..base + len` of `file` (a torch DCP
/// `.distcp` file holds one per tensor chunk); their data offsets are the file's.
pub fn entries_at(file: &File, path: &Path, (base, len): (u64, u64)) -> Result<Vec<ZipEntry>> {
    read_entries(file, base, len).with_context(|| {
        format!(
            "{}: bytes {base}..{} are not a zip archive torch wrote",
            path.display(),
            base.saturating_add(len)
        )
    })
}

fn read_entries(file: &File, base: u64, len: u64) -> Result<Vec<ZipEntry>> {
    let (offset, size, count) = directory(file, base, len)?;
    ensure!(
        count <= MAX_ENTRIES,
        "{count} entries (at most {MAX_ENTRIES})"
    );
    ensure!(size <= MAX_DIRECTORY, "a central directory of {size} bytes");
    ensure!(
        offset.checked_add(size).is_some_and(|end| end <= len),
        "the central directory is past the end of the file"
    );
    let directory = read_vec_at(file, base + offset, size as usize)?;
    let mut f = Cursor::new(&directory, "a zip record ends before its fields");
    let mut found = Vec::with_capacity(count as usize);
    for _ in 0..count {
        let entry = central_entry(&mut f)?;
        found.push(located(file, base, len, entry)?);
    }
    Ok(found)
}

/// A central directory entry: (name, flags, method, size, local header offset).
struct Central {
    name: String,
    flags: u16,
    method: u16,
    size: u64,
    local: u64,
}

fn central_entry(f: &mut Cursor) -> Result<Central> {
    ensure!(
        f.take(4)? == [0x50, 0x4b, 0x01, 0x02],
        "a central directory entry without its signature"
    );
    let _versions = f.take(4)?;
    let (flags, method) = (f.u16()?, f.u16()?);
    let _time_date_crc = f.take(8)?;
    let (mut compressed, mut size) = (u64::from(f.u32()?), u64::from(f.u32()?));
    let (name_len, extra_len, comment_len) = (f.u16()?, f.u16()?, f.u16()?);
    let disk = f.u16()?;
    let _attributes = f.take(6)?;
    let mut local = u64::from(f.u32()?);
    ensure!(
        usize::from(name_len) <= MAX_NAME,
        "an entry name of {name_len} bytes"
    );
    let name = std::str::from_utf8(f.take(name_len.into())?)
        .context("an entry name that is not UTF-8")?
        .to_string();
    // zip64: the fields at 0xffffffff are in the extra field 0x0001, in this order.
    let mut extra = Cursor::new(
        f.take(extra_len.into())?,
        "a zip record ends before its fields",
    );
    while extra.rest().len() >= 4 {
        let (id, n) = (extra.u16()?, extra.u16()?);
        let mut body = Cursor::new(extra.take(n.into())?, "a zip record ends before its fields");
        if id == 0x0001 {
            for field in [&mut size, &mut compressed, &mut local] {
                if *field == 0xffff_ffff {
                    *field = body.u64()?;
                }
            }
        }
    }
    f.take(comment_len.into())?;
    ensure!(
        disk == 0 || disk == 0xffff,
        "entry '{name}' is on another disk"
    );
    ensure!(
        compressed == size || method != 0,
        "entry '{name}' is stored but its sizes differ"
    );
    Ok(Central {
        name,
        flags,
        method,
        size: compressed,
        local,
    })
}

/// Where an entry's bytes start: after its local header (which has its own name and extra
/// field), all inside the archive (bytes `base..base + len` of `file`).
fn located(file: &File, base: u64, len: u64, c: Central) -> Result<ZipEntry> {
    ensure!(c.flags & 1 == 0, "entry '{}' is encrypted", c.name);
    ensure!(
        c.local.checked_add(30).is_some_and(|end| end <= len),
        "entry '{}' starts past the end of the file",
        c.name
    );
    let header = read_vec_at(file, base + c.local, 30)?;
    ensure!(
        header[..4] == [0x50, 0x4b, 0x03, 0x04],
        "entry '{}' has no local header where the directory says",
        c.name
    );
    let name_len = u64::from(u16::from_le_bytes([header[26], header[27]]));
    let extra_len = u64::from(u16::from_le_bytes([header[28], header[29]]));
    let data_offset = c.local + 30 + name_len + extra_len;
    match data_offset.checked_add(c.size) {
        Some(end) if end <= len => {}
        _ => bail!(
            "entry '{}' ({} bytes at {data_offset}) runs past the end of the file ({len} bytes): \
             a truncated archive",
            c.name,
            c.size
        ),
    }
    Ok(ZipEntry {
        name: c.name,
        data_offset: base + data_offset,
        size: c.size,
        stored: c.method == 0,
    })
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// A stored zip archive of `entries` (name, bytes), as torch.save lays one out; zip64
    /// records where `zip64` (as torch writes past 4 GiB), the first entry's data padded to
    /// `align` bytes through its extra field (torch aligns storages to 64).
    pub(crate) fn archive(entries: &[(&str, &[u8])], zip64: bool, align: usize) -> Vec<u8> {
        let mut out = Vec::new();
        let mut central = Vec::new();
        for (name, data) in entries {
            let local = out.len() as u64;
            let pad = (align - (out.len() + 30 + name.len() + 4) % align) % align;
            let mut extra = vec![0xff, 0xff];
            extra.extend_from_slice(&(pad as u16).to_le_bytes());
            extra.resize(4 + pad, 0);
            out.extend_from_slice(&[0x50, 0x4b, 0x03, 0x04, 20, 0, 0, 0, 0, 0]);
            out.extend_from_slice(&[0; 4]);
            out.extend_from_slice(&crc32fast::hash(data).to_le_bytes());
            out.extend_from_slice(&(data.len() as u32).to_le_bytes());
            out.extend_from_slice(&(data.len() as u32).to_le_bytes());
            out.extend_from_slice(&(name.len() as u16).to_le_bytes());
            out.extend_from_slice(&(extra.len() as u16).to_le_bytes());
            out.extend_from_slice(name.as_bytes());
            out.extend_from_slice(&extra);
            out.extend_from_slice(data);
            central.extend_from_slice(&[0x50, 0x4b, 0x01, 0x02, 45, 0, 45, 0, 0, 0, 0, 0]);
            central.extend_from_slice(&[0; 4]);
            central.extend_from_slice(&crc32fast::hash(data).to_le_bytes());
            let size = if zip64 { u32::MAX } else { data.len() as u32 };
            central.extend_from_slice(&size.to_le_bytes());
            central.extend_from_slice(&size.to_le_bytes());
            central.extend_from_slice(&(name.len() as u16).to_le_bytes());
            let z = if zip64 { 28u16 } else { 0 };
            central.extend_from_slice(&z.to_le_bytes());
            // Comment length, disk, internal and external attributes.
            central.extend_from_slice(&[0; 10]);
            let at = if zip64 { u32::MAX } else { local as u32 };
            central.extend_from_slice(&at.to_le_bytes());
            central.extend_from_slice(name.as_bytes());
            if zip64 {
                central.extend_from_slice(&[1, 0, 24, 0]);
                central.extend_from_slice(&(data.len() as u64).to_le_bytes());
                central.extend_from_slice(&(data.len() as u64).to_le_bytes());
                central.extend_from_slice(&local.to_le_bytes());
            }
        }
        let cd_at = out.len() as u64;
        out.extend_from_slice(&central);
        let n = entries.len() as u64;
        if zip64 {
            let record_at = out.len() as u64;
            out.extend_from_slice(&[0x50, 0x4b, 0x06, 0x06]);
            out.extend_from_slice(&44u64.to_le_bytes());
            out.extend_from_slice(&[45, 0, 45, 0, 0, 0, 0, 0, 0, 0, 0, 0]);
            for v in [n, n, central.len() as u64, cd_at] {
                out.extend_from_slice(&v.to_le_bytes());
            }
            out.extend_from_slice(&[0x50, 0x4b, 0x06, 0x07, 0, 0, 0, 0]);
            out.extend_from_slice(&record_at.to_le_bytes());
            out.extend_from_slice(&1u32.to_le_bytes());
            out.extend_from_slice(&[0x50, 0x4b, 0x05, 0x06, 0, 0, 0, 0, 0xff, 0xff, 0xff, 0xff]);
            out.extend_from_slice(&[0xff; 8]);
        } else {
            out.extend_from_slice(&[0x50, 0x4b, 0x05, 0x06, 0, 0, 0, 0]);
            out.extend_from_slice(&(n as u16).to_le_bytes());
            out.extend_from_slice(&(n as u16).to_le_bytes());
            out.extend_from_slice(&(central.len() as u32).to_le_bytes());
            out.extend_from_slice(&(cd_at as u32).to_le_bytes());
        }
        out.extend_from_slice(&[0, 0]);
        out
    }

    fn read(bytes: &[u8]) -> Result<Vec<ZipEntry>> {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("a.zip");
        std::fs::write(&path, bytes).unwrap();
        let file = File::open(&path).unwrap();
        entries(&file, &path, bytes.len() as u64)
    }

    #[test]
    fn entries_are_found_where_their_bytes_are() {
        for zip64 in [false, true] {
            let bytes = archive(
                &[("a/data.pkl", b"pickle"), ("a/data/0", &[7u8; 12])],
                zip64,
                64,
            );
            let found = read(&bytes).unwrap();
            assert_eq!(found.len(), 2);
            for (e, want) in found.iter().zip([&b"pickle"[..], &[7u8; 12][..]]) {
                let at = e.data_offset as usize;
                assert_eq!(&bytes[at..at + e.size as usize], want, "zip64 {zip64}");
                assert!(e.stored);
            }
            assert_eq!(
                found[1].data_offset % 64,
                0,
                "aligned as torch aligns storages"
            );
        }
    }

    #[test]
    fn damaged_archives_are_refused_by_name() {
        let bytes = archive(
            &[("a/data.pkl", b"pickle"), ("a/data/0", &[7u8; 1000])],
            false,
            1,
        );
        // Truncated inside the data: no end record.
        let e = read(&bytes[..bytes.len() / 2]).unwrap_err();
        assert!(format!("{e:#}").contains("not a zip archive"), "{e:#}");
        // The directory names an entry whose data runs past the end.
        let mut cut = bytes.clone();
        let cd = cut
            .windows(4)
            .position(|w| w == [0x50, 0x4b, 0x01, 0x02])
            .unwrap();
        let second = cd + 46 + "a/data.pkl".len();
        cut[second + 20..second + 24].copy_from_slice(&u32::MAX.wrapping_sub(1).to_le_bytes());
        cut[second + 24..second + 28].copy_from_slice(&u32::MAX.wrapping_sub(1).to_le_bytes());
        let e = read(&cut).unwrap_err();
        assert!(format!("{e:#}").contains("past the end"), "{e:#}");
        // Encrypted.
        let mut enc = bytes.clone();
        enc[cd + 8] |= 1;
        assert!(format!("{:#}", read(&enc).unwrap_err()).contains("encrypted"));
        assert!(read(b"PK\x05\x06").is_err());
        assert!(read(&[0u8; 100]).is_err());
    }
}
