"""A CUDA library's device code cut down to one GPU architecture, for carrying it to a GPU machine of that kind.

    python tests/tools/fatbin_keep.py --sm 90 SRC.so DST.so

A library built for many GPUs holds, in its ``.nv_fatbin`` section, one *container* per translation unit, each with
an ELF (SASS) entry per architecture and PTX for a few.  On a GPU of architecture ``sm`` the CUDA driver loads that
architecture's ELF entry of each container.  This keeps those entries (each container's header then counts them alone)
and fills the rest of the section with zeros: the file keeps its size and layout, the device code that runs on that GPU
is byte for byte the original's, and the zeros compress to nothing.  comfy-kitchen 0.2.31's CUDA library: 176 MB with
six architectures, 21.4 MB as .tar.xz; sm 9.0 alone 2.6 MB.  The result runs on that architecture only.

Containers without an ELF entry for ``sm`` are an error (their kernels would not load), as is a section that does not
parse as containers.
"""

from __future__ import annotations

import argparse
import struct

MAGIC = 0xBA55ED50
ELF_KIND = 2


def sections(data: bytes) -> dict[str, tuple[int, int]]:
    """An ELF64 little-endian file's sections: name -> (offset, size)."""
    if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
        raise ValueError("not a 64-bit little-endian ELF file")
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", data, 0x3A)
    heads = [struct.unpack_from("<IIQQQQ", data, shoff + i * shentsize) for i in range(shnum)]
    stroff = heads[shstrndx][4]
    out = {}
    for name, _type, _flags, _addr, off, size in heads:
        end = data.index(b"\0", stroff + name)
        out[data[stroff + name:end].decode()] = (off, size)
    return out


def containers(data: bytes, start: int, end: int):
    """(offset, header size, [(entry offset, kind, arch, entry bytes)]) of every container in ``data[start:end]``
    (containers are 8-byte aligned, zeros between them)."""
    pos = start
    while pos < end:
        magic, _version, hsize, fsize = struct.unpack_from("<IHHQ", data, pos)
        if magic != MAGIC:
            if any(data[pos:pos + 8]):
                raise ValueError(f"no fatbin container at {pos:#x}")
            pos += 8
            continue
        entries, e, stop = [], pos + hsize, pos + hsize + fsize
        while e < stop:
            kind, _v, ehsize, psize = struct.unpack_from("<HHIQ", data, e)
            arch, = struct.unpack_from("<I", data, e + 28)
            entries.append((e, kind, arch, ehsize + psize))
            e += ehsize + psize
        if e != stop:
            raise ValueError(f"the container at {pos:#x} does not end where its header says")
        yield pos, hsize, entries
        pos = stop


def keep(data: bytes, sm: int) -> tuple[bytearray, int, int]:
    """``data`` with only ``sm``'s ELF entries left in its fatbin containers: (new bytes, containers, bytes kept)."""
    off, size = sections(data)[".nv_fatbin"]
    out = bytearray(data)
    n = kept = 0
    for pos, hsize, entries in containers(data, off, off + size):
        mine = [(e, length) for e, kind, arch, length in entries if kind == ELF_KIND and arch == sm]
        if not mine:
            raise ValueError(f"the container at {pos:#x} has no ELF entry for sm {sm}")
        body = b"".join(data[e:e + length] for e, length in mine)
        old = sum(length for *_, length in entries)
        first = pos + hsize
        out[first:first + old] = body + bytes(old - len(body))
        struct.pack_into("<Q", out, pos + 8, len(body))
        n += 1
        kept += len(body)
    return out, n, kept


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sm", type=int, required=True, help="the architecture to keep, e.g. 90 for H100/H200")
    ap.add_argument("src")
    ap.add_argument("dst")
    a = ap.parse_args(argv)
    with open(a.src, "rb") as f:
        data = f.read()
    out, n, kept = keep(data, a.sm)
    with open(a.dst, "wb") as f:
        f.write(out)
    print(f"{n} containers, sm {a.sm}: {kept / 1e6:.1f} MB of device code kept, the rest of the section zeros")


if __name__ == "__main__":
    main()
