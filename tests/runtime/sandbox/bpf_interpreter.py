"""A classic-BPF interpreter for seccomp programs: enough of the instruction set to run what
seccomp.build_filter emits (ld W abs, jeq/jge/jset K, ja, ret K), with the kernel's checks that a
program must pass (forward jumps that land inside it, no fall-through off its end, aligned
32-bit loads inside struct seccomp_data) so a malformed filter fails here as it would in
prctl(2)."""

from __future__ import annotations

import struct

_DATA_SIZE = 64  # struct seccomp_data: nr, arch, instruction_pointer, args[6]
_MAX_INSNS = 4096


class BadProgram(Exception):
    pass


def seccomp_data(nr: int, arch: int, args: tuple[int, ...] = ()) -> bytes:
    padded = (tuple(args) + (0,) * 6)[:6]
    return struct.pack("<iIQ6Q", nr, arch, 0, *padded)


def run(program: bytes, data: bytes) -> int:
    if not program or len(program) % 8 or len(program) // 8 > _MAX_INSNS:
        raise BadProgram(f"program of {len(program)} bytes")
    insns = [struct.unpack_from("<HBBI", program, offset) for offset in range(0, len(program), 8)]
    acc = 0
    pc = 0
    while True:
        if pc >= len(insns):
            raise BadProgram("ran off the end of the program")
        code, jt, jf, k = insns[pc]
        if code == 0x20:  # ld W abs
            if k % 4 or k + 4 > _DATA_SIZE:
                raise BadProgram(f"load at offset {k}")
            acc = struct.unpack_from("<I", data, k)[0]
            pc += 1
        elif code == 0x06:  # ret K
            return k
        elif code == 0x05:  # ja
            pc += 1 + k
        elif code in (0x15, 0x35, 0x45):
            taken = {0x15: acc == k, 0x35: acc >= k, 0x45: bool(acc & k)}[code]
            pc += 1 + (jt if taken else jf)
        else:
            raise BadProgram(f"unsupported opcode {code:#x} at {pc}")
