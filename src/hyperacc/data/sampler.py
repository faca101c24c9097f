"""A distributed sampler whose memory does not grow with the dataset.

``torch.utils.data.DistributedSampler`` materialises ``torch.randperm(N).tolist()`` on every rank at
every epoch: at N = 1e8 that is ~5 GB per rank and ~9 s before the first index (FACTS.md), a spike at
each epoch boundary. ``OnDemandDistributedSampler`` keeps the same contract (num_replicas, rank,
shuffle, seed, drop_last, ``set_epoch``, wrap-around padding, identical per-rank lengths, rank ``r``
takes positions ``r, r + R, r + 2R, ...``) but computes the permutation on demand: position ``p`` maps
to ``perm(p)`` through a keyed Feistel network on ``[0, 2^b)`` (``2^b >= N``, so ``2^b < 2N``) with
cycle walking back into ``[0, N)``. Memory is O(1) in N, the first index is immediate, and indices are
produced in vectorised numpy blocks. A Feistel network only ever makes even permutations and, for small
N, is far from uniform over orderings, so up to ``exact_max`` indices (default 65,536: 512 KiB) the
order is an exact seeded shuffle instead (``ExactPermutation``), with the same contract and resume. The
rule and its defaults are documented in docs/data.md.

The permutation is a pure function of ``(seed, epoch)``, so every rank computes the same one without
communicating, and any position can be mapped forward (``index_at``) or back (``position_of``): the
LMDB prefetcher uses that to know which samples a worker will read next.
"""

from __future__ import annotations

import itertools
import math
import operator
from collections.abc import Iterator, Sized
from typing import Any

import numpy as np
import torch
from torch.utils.data import Sampler

__all__ = ["EXACT_MAX", "ExactPermutation", "FeistelPermutation", "OnDemandDistributedSampler"]

_M64 = (1 << 64) - 1
_M32 = (1 << 32) - 1
_F32_1 = 0x85EBCA6B
_F32_2 = 0xC2B2AE35
_MUL1 = 0xBF58476D1CE4E5B9
_MUL2 = 0x94D049BB133111EB
_GOLDEN = 0x9E3779B97F4A7C15
EXACT_MAX = 1 << 16  # up to this many indices the order is an exact shuffle (docs/data.md)


def _splitmix64(state: int) -> tuple[int, int]:
    """One step of splitmix64: (new state, output). Used to derive round keys from (seed, epoch)."""
    state = (state + _GOLDEN) & _M64
    z = state
    z = ((z ^ (z >> 30)) * _MUL1) & _M64
    z = ((z ^ (z >> 27)) * _MUL2) & _M64
    return state, z ^ (z >> 31)


class FeistelPermutation:
    """A keyed pseudo-random permutation of ``[0, n)`` evaluated on demand.

    A Feistel network over ``b = max(2, bit_length(n - 1))`` bits, split into a high and a low part
    whose widths swap every round (so odd ``b`` works too). Each round is a bijection of ``[0, 2^b)``;
    values that land outside ``[0, n)`` are walked through the network again (cycle walking), which
    keeps a bijection of ``[0, n)``. Because ``2^b < 2n``, fewer than two passes are needed on average.
    """

    def __init__(self, n: int, key: int, rounds: int = 6) -> None:
        if n < 0:
            raise ValueError(f"permutation size must be >= 0, got {n}")
        if rounds < 3:
            raise ValueError(f"a Feistel permutation needs at least 3 rounds, got {rounds}")
        self.n = int(n)
        self.bits = max(2, (self.n - 1).bit_length())
        hi = (self.bits + 1) // 2
        lo = self.bits - hi
        state = key & _M64
        keys: list[int] = []
        widths: list[tuple[int, int]] = []
        for _ in range(rounds):
            state, k = _splitmix64(state)
            keys.append(k)
            widths.append((hi, lo))
            hi, lo = lo, hi
        # Domains up to 2^32 use 32-bit words (half the memory traffic of 64-bit, ~2x faster).
        self._narrow = self.bits <= 32
        self._dtype = np.uint32 if self._narrow else np.uint64
        self._keys = [k & _M32 for k in keys] if self._narrow else keys
        self._widths = widths
        self._np_keys = [self._dtype(k) for k in self._keys]

    # -- round function: a keyed integer hash (murmur3 finaliser for 32 bits, splitmix64 for 64)
    def _f(self, r: int, key: int) -> int:
        if self._narrow:
            z = r ^ key
            z ^= z >> 16
            z = (z * _F32_1) & _M32
            z ^= z >> 13
            z = (z * _F32_2) & _M32
            return z ^ (z >> 16)
        z = ((r ^ key) * _MUL1) & _M64
        z ^= z >> 31
        z = (z * _MUL2) & _M64
        return z ^ (z >> 29)

    def _f_np(self, z: np.ndarray) -> None:
        """The round function applied in place to an array already xored with the round key."""
        t = self._dtype
        if self._narrow:
            z ^= z >> t(16)
            z *= t(_F32_1)
            z ^= z >> t(13)
            z *= t(_F32_2)
            z ^= z >> t(16)
        else:
            z *= t(_MUL1)
            z ^= z >> t(31)
            z *= t(_MUL2)
            z ^= z >> t(29)

    # -- scalar path (Python ints): used for single lookups and inversion
    def _round_trip(self, x: int) -> int:
        for key, (hi, lo) in zip(self._keys, self._widths, strict=True):
            left = x >> lo
            right = x & ((1 << lo) - 1)
            x = (right << hi) | (left ^ (self._f(right, key) & ((1 << hi) - 1)))
        return x

    def _round_trip_inverse(self, x: int) -> int:
        for key, (hi, lo) in zip(reversed(self._keys), reversed(self._widths), strict=True):
            right = x >> hi
            left = (x & ((1 << hi) - 1)) ^ (self._f(right, key) & ((1 << hi) - 1))
            x = (left << lo) | right
        return x

    def __call__(self, position: int) -> int:
        if not 0 <= position < self.n:
            raise IndexError(f"position {position} outside [0, {self.n})")
        x = self._round_trip(position)
        while x >= self.n:
            x = self._round_trip(x)
        return x

    def inverse(self, value: int) -> int:
        if not 0 <= value < self.n:
            raise IndexError(f"value {value} outside [0, {self.n})")
        x = self._round_trip_inverse(value)
        while x >= self.n:
            x = self._round_trip_inverse(x)
        return x

    # -- vectorised path (numpy, wrapping arithmetic, in place to avoid temporaries)
    def _round_trip_np(self, x: np.ndarray) -> np.ndarray:
        t = self._dtype
        x = x.astype(t, copy=True)
        for key, (hi, lo) in zip(self._np_keys, self._widths, strict=True):
            right = x & t((1 << lo) - 1)
            x >>= t(lo)  # x is now the left part
            z = right ^ key
            self._f_np(z)
            z &= t((1 << hi) - 1)
            x ^= z
            right <<= t(hi)
            x |= right
        return x

    def apply(self, positions: np.ndarray) -> np.ndarray:
        """Map an array of positions (each in ``[0, n)``) to their permuted values (uint64)."""
        x = self._round_trip_np(np.asarray(positions))
        n = self._dtype(self.n) if self.n <= _M32 or not self._narrow else None
        if n is None:  # n == 2^32 exactly with 32-bit words: every value is already in range
            return x.astype(np.uint64)
        walk = np.flatnonzero(x >= n)
        while walk.size:
            again = self._round_trip_np(x[walk])
            x[walk] = again
            walk = walk[again >= n]
        return x.astype(np.uint64, copy=False)


class ExactPermutation:
    """A uniformly random permutation of ``[0, n)`` for key ``key``, held in memory (8 bytes per index).

    Sort order of ``n`` distinct pseudo-random 64-bit keys: key ``i`` is splitmix64's output for state
    ``key + (i + 1) x golden``, a bijection of ``i`` (so no two keys tie), and the order of ``n``
    distinct i.i.d. uniform keys is a uniformly random permutation: every ordering, even or odd, is
    equally likely. Same interface as :class:`FeistelPermutation`; no numpy version changes it (the
    keys are computed here, the sort of distinct keys has one answer)."""

    def __init__(self, n: int, key: int) -> None:
        if n < 0:
            raise ValueError(f"permutation size must be >= 0, got {n}")
        self.n = int(n)
        with np.errstate(over="ignore"):
            z = np.arange(1, self.n + 1, dtype=np.uint64)
            z *= np.uint64(_GOLDEN)
            z += np.uint64(key & _M64)
            z ^= z >> np.uint64(30)
            z *= np.uint64(_MUL1)
            z ^= z >> np.uint64(27)
            z *= np.uint64(_MUL2)
            z ^= z >> np.uint64(31)
        dtype = np.uint32 if self.n <= _M32 else np.uint64
        self._perm = np.argsort(z, kind="stable").astype(dtype)
        self._inv: np.ndarray | None = None

    def __call__(self, position: int) -> int:
        if not 0 <= position < self.n:
            raise IndexError(f"position {position} outside [0, {self.n})")
        return int(self._perm[position])

    def inverse(self, value: int) -> int:
        if not 0 <= value < self.n:
            raise IndexError(f"value {value} outside [0, {self.n})")
        inv = self._inv
        if inv is None:
            inv = np.empty_like(self._perm)
            inv[self._perm] = np.arange(self.n, dtype=self._perm.dtype)
            self._inv = inv
        return int(inv[value])

    def apply(self, positions: np.ndarray) -> np.ndarray:
        """Map an array of positions (each in ``[0, n)``) to their permuted values (uint64)."""
        return self._perm[np.asarray(positions, dtype=np.int64)].astype(np.uint64)


class OnDemandDistributedSampler(Sampler[int]):
    """Drop-in replacement for ``DistributedSampler`` with O(1) memory and an immediate first index.

    Args mirror ``torch.utils.data.DistributedSampler``; ``dataset`` may also be the length itself.
    ``block_size`` is how many indices are generated per vectorised block (the first block is small
    so the first index is immediate). ``rounds`` is the number of Feistel rounds. Datasets of up to
    ``exact_max`` indices get an exact shuffle (:class:`ExactPermutation`) instead of the Feistel
    network; ``exact_max=0`` always uses the network.

    Mid-epoch resume follows torchdata's convention: ``state_dict()`` returns ``{"yielded", "epoch",
    "seed"}`` for the iteration in progress, and ``load_state_dict`` makes the next ``__iter__`` start
    at that position of that epoch.
    """

    def __init__(
        self,
        dataset: Sized | int,
        num_replicas: int | None = None,
        rank: int | None = None,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
        *,
        block_size: int = 65536,
        rounds: int = 6,
        exact_max: int = EXACT_MAX,
    ) -> None:
        n = int(dataset) if isinstance(dataset, int | np.integer) else len(dataset)
        if n < 0:
            raise ValueError(f"dataset length must be >= 0, got {n}")
        if num_replicas is None or rank is None:
            import torch.distributed as dist

            if not (dist.is_available() and dist.is_initialized()):
                raise RuntimeError(
                    "OnDemandDistributedSampler: num_replicas/rank not given and torch.distributed is not "
                    "initialised; pass num_replicas= and rank= explicitly or call init_process_group first"
                )
            num_replicas = dist.get_world_size() if num_replicas is None else num_replicas
            rank = dist.get_rank() if rank is None else rank
        if num_replicas < 1:
            raise ValueError(f"num_replicas must be >= 1, got {num_replicas}")
        if not 0 <= rank < num_replicas:
            raise ValueError(f"Invalid rank {rank}, rank should be in the interval [0, {num_replicas - 1}]")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if exact_max < 0:
            raise ValueError(f"exact_max must be >= 0, got {exact_max}")
        self.n = n
        self.num_replicas = int(num_replicas)
        self.rank = int(rank)
        self.shuffle = bool(shuffle)
        self.seed = int(seed)
        self.drop_last = bool(drop_last)
        self.block_size = int(block_size)
        self.rounds = int(rounds)
        self.exact_max = int(exact_max)
        self._shared_epoch: torch.Tensor | None = None
        self._epoch = 0
        # Same arithmetic as DistributedSampler.
        if self.drop_last and n % self.num_replicas != 0:
            self.num_samples = math.ceil((n - self.num_replicas) / self.num_replicas)
        else:
            self.num_samples = math.ceil(n / self.num_replicas)
        self.total_size = self.num_samples * self.num_replicas
        self._perm_cache: tuple[tuple[int, int], FeistelPermutation | ExactPermutation] | None = None
        self._resume_at: int | None = None
        self._live: _Progress | None = None

    # ------------------------------------------------------------ DistributedSampler contract
    def __len__(self) -> int:
        return self.num_samples

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    @property
    def epoch(self) -> int:
        shared = self._shared_epoch
        return int(shared) if shared is not None else self._epoch

    @epoch.setter
    def epoch(self, value: int) -> None:
        self._epoch = int(value)
        if self._shared_epoch is not None:
            self._shared_epoch.fill_(self._epoch)

    def share_epoch(self) -> None:
        """Keep the epoch in shared memory, so that copies of this sampler in worker processes (the
        LMDB prefetcher's, in persistent workers too) see later ``set_epoch`` calls."""
        if self._shared_epoch is None:
            cell = torch.full((), self._epoch, dtype=torch.int64)
            cell.share_memory_()
            self._shared_epoch = cell

    def __iter__(self) -> Iterator[int]:
        start = 0
        if self._resume_at is not None:
            start, self._resume_at = self._resume_at, None
        progress = _Progress(self.epoch, self.seed, start)
        self._live = progress
        # chain() hands out the items of each block at C speed; Python runs once per block.
        return itertools.chain.from_iterable(self._blocks(progress, start))

    def _blocks(self, progress: _Progress, start: int) -> Iterator[Iterator[int]]:
        # First block small so the first index is immediate, then full blocks.
        step = min(self.block_size, 1024)
        pos = start
        while pos < self.num_samples:
            stop = min(pos + step, self.num_samples)
            items = iter(self._raw_indices(pos, stop).tolist())
            progress.block_stop = stop
            progress.block_iter = items
            yield items
            pos = stop
            step = self.block_size
        progress.block_iter = None
        progress.block_stop = self.num_samples

    # ------------------------------------------------------------ on-demand lookups
    def permutation(self) -> FeistelPermutation | ExactPermutation | None:
        """The permutation of ``[0, N)`` for the current (seed, epoch); None when not shuffling."""
        if not self.shuffle or self.n == 0:
            return None
        key = (self.seed, self.epoch)
        cached = self._perm_cache  # one attribute, so a reader in another thread sees a matching pair
        if cached is not None and cached[0] == key:
            return cached[1]
        state, _ = _splitmix64((self.seed & _M64) ^ 0x243F6A8885A308D3)
        state, k = _splitmix64(state ^ (self.epoch & _M64))
        if self.n <= self.exact_max:
            perm: FeistelPermutation | ExactPermutation = ExactPermutation(self.n, k)
        else:
            perm = FeistelPermutation(self.n, k, self.rounds)
        self._perm_cache = (key, perm)
        return perm

    def indices(self, start: int, stop: int) -> np.ndarray:
        """This rank's indices at local positions ``[start, stop)`` as an int64 array (vectorised)."""
        return self._raw_indices(start, stop).astype(np.int64)

    def _raw_indices(self, start: int, stop: int) -> np.ndarray:
        start = max(0, start)
        stop = min(stop, self.num_samples)
        if stop <= start or self.n == 0:
            return np.empty(0, dtype=np.uint64)
        positions = np.arange(start, stop, dtype=np.uint64) * np.uint64(self.num_replicas)
        positions += np.uint64(self.rank)
        # Padding (not drop_last) wraps around the permuted list: position p >= N reads p mod N.
        if self.total_size > self.n:
            positions %= np.uint64(self.n)
        perm = self.permutation()
        return perm.apply(positions) if perm is not None else positions

    def index_at(self, local_position: int) -> int:
        """This rank's index at one local position (0-based within the epoch)."""
        if not 0 <= local_position < self.num_samples:
            raise IndexError(f"local position {local_position} outside [0, {self.num_samples})")
        p = (self.rank + local_position * self.num_replicas) % self.n
        perm = self.permutation()
        return perm(p) if perm is not None else p

    def position_of(self, index: int) -> int | None:
        """The local position at which this rank reads ``index`` this epoch, or None if another rank
        reads it. With padding an index can appear twice on a rank; the first position is returned."""
        if not 0 <= index < self.n:
            raise IndexError(f"index {index} outside [0, {self.n})")
        perm = self.permutation()
        p = perm.inverse(index) if perm is not None else index
        # Global positions that hold this index: p, p + N, p + 2N, ... below total_size.
        while p < self.total_size:
            if p % self.num_replicas == self.rank:
                return p // self.num_replicas
            p += self.n
        return None

    # ------------------------------------------------------------ resume (torchdata convention)
    def state_dict(self) -> dict[str, Any]:
        """``{"yielded": indices handed out by the current iteration, "epoch", "seed"}``."""
        live = self._live
        if live is not None:  # the epoch and seed of the iteration in progress, even after set_epoch
            return {"yielded": live.yielded(), "epoch": live.epoch, "seed": live.seed}
        return {"yielded": self._resume_at or 0, "epoch": self.epoch, "seed": self.seed}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Make the next ``__iter__`` resume after ``state_dict["yielded"]`` indices."""
        if "yielded" not in state_dict:
            raise ValueError("sampler state_dict has no 'yielded' entry; pass what state_dict() returned")
        yielded = int(state_dict["yielded"])
        if yielded < 0:
            raise ValueError(f"cannot resume at a negative position ({yielded})")
        if "epoch" in state_dict:
            self.epoch = int(state_dict["epoch"])
        if "seed" in state_dict:
            self.seed = int(state_dict["seed"])
        self._resume_at = min(yielded, self.num_samples)
        self._live = None

    def __getstate__(self) -> dict[str, Any]:
        # Pickled into DataLoader workers (via the LMDB dataset): drop the live iteration and cache.
        state = dict(self.__dict__)
        state["_live"] = None
        state["_perm_cache"] = None
        return state

    def __repr__(self) -> str:
        return (
            f"OnDemandDistributedSampler(n={self.n}, num_replicas={self.num_replicas}, rank={self.rank}, "
            f"shuffle={self.shuffle}, seed={self.seed}, drop_last={self.drop_last}, epoch={self.epoch})"
        )


class _Progress:
    """Where the live iteration is; read only when someone asks for ``state_dict``."""

    __slots__ = ("epoch", "seed", "block_stop", "block_iter")

    def __init__(self, epoch: int, seed: int, start: int) -> None:
        self.epoch = epoch
        self.seed = seed
        self.block_stop = start
        self.block_iter: Iterator[int] | None = None

    def yielded(self) -> int:
        # A list iterator knows how many items it still holds, so no per-index counter is needed.
        if self.block_iter is None:
            return self.block_stop
        return self.block_stop - operator.length_hint(self.block_iter)
