"""tests/tools/fatbin_keep.py: a library's device code cut to one architecture, on a small ELF file built here."""

import os
import struct
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "tools"))
import fatbin_keep  # noqa: E402


def entry(kind: int, arch: int, payload: bytes) -> bytes:
    head = bytearray(64)
    struct.pack_into("<HHIQ", head, 0, kind, 0x101, 64, len(payload))
    struct.pack_into("<I", head, 28, arch)
    return bytes(head) + payload


def container(*entries: bytes) -> bytes:
    body = b"".join(entries)
    return struct.pack("<IHHQ", fatbin_keep.MAGIC, 1, 16, len(body)) + body


def elf(fatbin: bytes) -> bytes:
    """An ELF64 file with sections: null, .nv_fatbin, .shstrtab."""
    names = b"\0.nv_fatbin\0.shstrtab\0"
    fat_off = 64
    str_off = fat_off + len(fatbin)
    sh_off = (str_off + len(names) + 7) // 8 * 8
    head = bytearray(64)
    head[:6] = b"\x7fELF\x02\x01"
    struct.pack_into("<Q", head, 0x28, sh_off)
    struct.pack_into("<HHH", head, 0x3A, 64, 3, 2)
    sections = [struct.pack("<IIQQQQ", 0, 0, 0, 0, 0, 0) + bytes(24),
                struct.pack("<IIQQQQ", 1, 1, 2, 0, fat_off, len(fatbin)) + bytes(24),
                struct.pack("<IIQQQQ", 12, 3, 0, 0, str_off, len(names)) + bytes(24)]
    return bytes(head) + fatbin + names + bytes(sh_off - str_off - len(names)) + b"".join(sections)


def test_only_the_architectures_elf_entries_are_left_and_the_rest_is_zeros():
    sm90_a, sm90_b = os.urandom(40), os.urandom(24)
    first = container(entry(2, 75, os.urandom(32)), entry(1, 89, os.urandom(16)), entry(2, 90, sm90_a))
    fat = (first + bytes(8)  # containers are 8-byte aligned, zeros between them
           + container(entry(2, 90, sm90_b), entry(2, 100, os.urandom(48))))
    data = elf(fat)
    out, n, kept = fatbin_keep.keep(data, 90)

    assert len(out) == len(data) and n == 2 and kept == 2 * 64 + 40 + 24
    off, size = fatbin_keep.sections(bytes(out))[".nv_fatbin"]
    found = [[(kind, arch, bytes(out[e + 64:e + length])) for e, kind, arch, length in ents]
             for _, _, ents in fatbin_keep.containers(bytes(out), off, off + size)]
    assert found == [[(2, 90, sm90_a)], [(2, 90, sm90_b)]]
    # what is left of each container after its new end is zeros, and nothing outside the section changed
    assert not any(out[64 + 16 + 64 + 40:64 + len(first)])
    assert out[:64] == data[:64] and out[off + size:] == data[off + size:]


def test_a_container_without_the_architecture_is_an_error():
    data = elf(container(entry(2, 80, os.urandom(32)), entry(1, 89, os.urandom(8))))
    with pytest.raises(ValueError, match="has no ELF entry for sm 90"):
        fatbin_keep.keep(data, 90)


def test_a_section_that_is_not_containers_is_an_error():
    with pytest.raises(ValueError, match="no fatbin container at"):
        fatbin_keep.keep(elf(b"\x01" * 32), 90)
    with pytest.raises(ValueError, match="not a 64-bit little-endian ELF file"):
        fatbin_keep.keep(b"MZ" + bytes(100), 90)
