"""An endless, reseedable, epoch-based index sampler."""

from __future__ import annotations

import hashlib
import secrets
import struct
from collections.abc import Iterator

import torch
from torch.utils.data import Sampler

__all__ = ["EpisodeSampler", "derive_seed"]

_U64 = 2**64
_U63_MASK = 2**63 - 1


def derive_seed(seed: int, *salt: int) -> int:
    """Mix ``seed`` with integer ``salt`` values into a well-spread 63-bit seed.

    Nearby inputs (``seed`` and ``seed + 1``, epoch 0 and epoch 1) give unrelated outputs,
    so they can seed independent ``torch.Generator`` streams.

    Example:
        >>> derive_seed(0, 1) == derive_seed(0, 1) != derive_seed(0, 2)
        True
    """
    packed = struct.pack(f"<{1 + len(salt)}Q", *(int(v) % _U64 for v in (seed, *salt)))
    digest = hashlib.blake2b(packed, digest_size=8, person=b"torchrl_ext").digest()
    return int.from_bytes(digest, "little") & _U63_MASK


class EpisodeSampler(Sampler[int]):
    """Endless sampler over ``range(num_episodes)``: one fresh order per epoch, forever.

    With ``shuffle=True`` epoch ``e`` is ``torch.randperm`` drawn from a generator seeded with
    ``derive_seed(seed, e)``, so the whole stream is a pure function of ``seed``; with
    ``shuffle=False`` it is ``0..n-1`` repeated. Every index appears exactly once per epoch.
    ``seed=None`` draws a random seed (non-reproducible). :meth:`set_seed` takes effect the
    next time the sampler is iterated, which restarts at epoch 0. The sampler has no length.

    Example:
        >>> from itertools import islice
        >>> s = EpisodeSampler(4, seed=0)
        >>> sorted(islice(iter(s), 4)) == [0, 1, 2, 3]
        True
        >>> list(islice(iter(EpisodeSampler(3, shuffle=False)), 5))
        [0, 1, 2, 0, 1]
    """

    def __init__(self, num_episodes: int, shuffle: bool = True, seed: int | None = None) -> None:
        if num_episodes <= 0:
            raise ValueError(f"num_episodes must be positive, got {num_episodes}")
        self._n = int(num_episodes)
        self._shuffle = bool(shuffle)
        self._seed = self._resolve(seed)

    @staticmethod
    def _resolve(seed: int | None) -> int:
        return secrets.randbits(63) if seed is None else int(seed)

    @property
    def num_episodes(self) -> int:
        """Number of distinct indices (episodes per epoch)."""
        return self._n

    @property
    def shuffle(self) -> bool:
        """Whether each epoch is a random permutation."""
        return self._shuffle

    @property
    def seed(self) -> int:
        """The seed the next iteration will use."""
        return self._seed

    def set_seed(self, seed: int | None) -> None:
        """Reseed; iterators created afterwards start again at epoch 0 with the new seed."""
        self._seed = self._resolve(seed)

    def epoch_order(self, epoch: int) -> list[int]:
        """The indices of ``epoch`` in delivery order (for the current seed)."""
        return _epoch_order(self._n, self._shuffle, self._seed, epoch)

    def __iter__(self) -> Iterator[int]:
        # The seed is captured here, so a later ``set_seed`` leaves running iterators alone.
        return _endless(self._n, self._shuffle, self._seed)


def _endless(n: int, shuffle: bool, seed: int) -> Iterator[int]:
    epoch = 0
    while True:
        yield from _epoch_order(n, shuffle, seed, epoch)
        epoch += 1


def _epoch_order(n: int, shuffle: bool, seed: int, epoch: int) -> list[int]:
    if not shuffle:
        return list(range(n))
    gen = torch.Generator()
    gen.manual_seed(derive_seed(seed, epoch))
    order: list[int] = torch.randperm(n, generator=gen).tolist()
    return order
