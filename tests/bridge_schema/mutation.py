"""Byte-level mutations of valid payloads, shared by the decoder fuzz test and the socket fuzz test."""

from __future__ import annotations

import random


def mutate(payload: bytes, rng: random.Random) -> bytes:
    data = bytearray(payload)
    for _ in range(rng.randint(1, 4)):
        op = rng.randrange(6)
        pos = rng.randrange(len(data) + 1)
        if op == 0 and data:  # flip one bit
            i = rng.randrange(len(data))
            data[i] ^= 1 << rng.randrange(8)
        elif op == 1 and data:  # overwrite a byte
            data[rng.randrange(len(data))] = rng.randrange(256)
        elif op == 2:  # insert random bytes
            data[pos:pos] = rng.randbytes(rng.randint(1, 8))
        elif op == 3 and data:  # delete a range
            del data[pos : pos + rng.randint(1, 16)]
        elif op == 4:  # truncate
            del data[pos:]
        else:  # duplicate a chunk
            data[pos:pos] = data[rng.randrange(len(data) + 1) :][: rng.randint(1, 32)]
    return bytes(data)
