"""Independent, reproducible random streams keyed by integers (seed, parameter, chunk, sample, epoch):
the same key gives the same stream on every rank, whatever the world size."""

from __future__ import annotations

import hashlib


def stream_seed(*keys: int | str) -> int:
    """A 63-bit generator seed from the keys (a hash, so nearby keys give unrelated streams)."""
    digest = hashlib.blake2b(repr(keys).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1
