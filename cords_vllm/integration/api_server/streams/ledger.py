"""The KV pool committed to open streams, shared by every API server of one ``vllm serve``, per engine.

A stream is admitted with the most KV blocks it can ever hold (its *footprint*) on one engine's pool. With data
parallelism (``--data-parallel-size N``) each engine has its own pool and a stream's KV lives in one of them;
with several API servers (``--api-server-count M``, which vLLM defaults to the data-parallel size) each API
server opens its own streams against the same engines. So admission must see every API server's streams on every
engine, or two API servers would each fill the same pool.

:class:`PoolLedger` keeps that account. Each API server owns one *slot*, a small JSON file in the server's shared
publication directory (``CORDS_VLLM_METRICS_DIR``, inherited by every process of the server) listing its open
streams' commitments; admission (:meth:`PoolLedger.admit`) reads every slot and writes its own under one
``fcntl`` lock, so two API servers never both take the last room. A stream that ends or closes leaves its owner's
slot at the owner's next write (at the latest the stream registry's next expiry tick): another server may see
it a few seconds longer than it lives, which only refuses early, never over-commits.

With one API server there are no files and no lock: admission is a synchronous call on the event loop.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Commitment:
    """One open stream's claim: at most ``blocks`` KV blocks on engine ``engine`` (a data-parallel rank)."""

    stream_id: str
    engine: int
    blocks: int


class TooManyStreams(RuntimeError):
    """No engine's pool has room for the stream's footprint, or the cap on open streams is reached."""


class PoolLedger:
    """Every API server's stream commitments on every engine's KV pool.

    Parameters
    ----------
    engines:
        Data-parallel engines this API server places streams on (each has its own pool).
    pool_blocks:
        Usable KV blocks of one engine's pool (``None``: unknown, admission by the cap alone).
    max_streams:
        Most streams open at once on the whole server (every API server together).
    directory, index, count:
        The shared directory holding the slots, this API server's index and the number of API servers. With
        ``count == 1`` (or no directory) the ledger lives in memory only.
    """

    def __init__(self, *, engines: int = 1, pool_blocks: int | None = None, max_streams: int = 64,
                 directory: Path | None = None, index: int = 0, count: int = 1) -> None:
        if engines < 1:
            raise ValueError(f"engines must be at least 1, got {engines}")
        self.engines = engines
        self.pool_blocks = pool_blocks
        self.max_streams = max_streams
        self.index, self.count = index, count
        self.directory = directory if count > 1 else None
        self._own: dict[str, Commitment] = {}

    # ------------------------------------------------------------------------------------------------
    @property
    def shared(self) -> bool:
        return self.directory is not None

    def _slot(self, index: int) -> Path:
        assert self.directory is not None
        return self.directory / f"streams-ledger-{index}.slot"

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        if self.directory is None:
            yield
            return
        with open(self.directory / "streams-ledger.lock", "a+") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

    def _others(self) -> list[Commitment]:
        if self.directory is None:
            return []
        found: list[Commitment] = []
        for index in range(self.count):
            if index == self.index:
                continue
            try:
                rows = json.loads(self._slot(index).read_text())
            except (FileNotFoundError, json.JSONDecodeError):  # not written yet, or being replaced
                continue
            found.extend(Commitment(str(r[0]), int(r[1]), int(r[2])) for r in rows)
        return found

    def _write_own(self) -> None:
        if self.directory is None:
            return
        path = self._slot(self.index)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps([[c.stream_id, c.engine, c.blocks] for c in self._own.values()]))
        tmp.replace(path)

    # ------------------------------------------------------------------------------------------------
    def commitments(self) -> list[Commitment]:
        """Every API server's open streams' commitments (this one's first)."""
        return [*self._own.values(), *self._others()]

    def committed_per_engine(self, commitments: Iterable[Commitment] | None = None) -> list[int]:
        """``[engines]``: blocks committed on each engine's pool."""
        per = [0] * self.engines
        for c in self.commitments() if commitments is None else commitments:
            if 0 <= c.engine < self.engines:
                per[c.engine] += c.blocks
        return per

    def place(self, blocks: int, commitments: Iterable[Commitment]) -> int | None:
        """The engine with the most free room that fits ``blocks`` given ``commitments`` (``None``: none fits)."""
        committed = self.committed_per_engine(commitments)
        if self.pool_blocks is None:
            return min(range(self.engines), key=lambda e: (committed[e], e))
        free = [self.pool_blocks - c for c in committed]
        best = max(range(self.engines), key=lambda e: (free[e], -e))
        return best if free[best] >= blocks else None

    def admit(self, stream_id: str, blocks: int, *, local_open: int = 0) -> int:
        """Commit ``blocks`` for a new stream on the engine with most room; returns that engine.

        ``local_open`` counts this API server's streams that take a place under the cap without a commitment
        (ended streams still listed). Raises :class:`TooManyStreams` when no engine has room or the cap is reached.
        """
        with self._locked():
            commitments = self.commitments()
            open_streams = len(commitments) + local_open
            if open_streams >= self.max_streams:
                raise TooManyStreams(
                    f"{open_streams} streams are open, the most this server allows (--kv-stream-max-open "
                    f"{self.max_streams}); close one or wait for one to expire")
            engine = self.place(blocks, commitments)
            if engine is None:
                committed = self.committed_per_engine(commitments)
                where = (f"the KV pool ({self.pool_blocks} blocks)" if self.engines == 1 else
                         f"every engine's KV pool ({self.pool_blocks} blocks each, {self.engines} data-parallel "
                         f"engines)")
                raise TooManyStreams(
                    f"{where} is committed to {len(commitments)} open streams ({sum(committed)} blocks at most"
                    f"{'' if self.engines == 1 else ', ' + ' / '.join(map(str, committed)) + ' per engine'}); a "
                    f"new stream may hold up to {blocks} blocks. Close a stream, wait for one to expire, or open "
                    f"one with a smaller kv_policy budget")
            self._own[stream_id] = Commitment(stream_id, engine, blocks)
            self._write_own()
        return engine

    def sync(self, live: Iterable[str]) -> None:
        """Keep only this API server's commitments of ``live`` stream ids (ended and closed ones leave)."""
        keep = set(live)
        if keep >= set(self._own):
            return
        with self._locked():
            self._own = {sid: c for sid, c in self._own.items() if sid in keep}
            self._write_own()

    def release(self, stream_id: str) -> None:
        """Drop one stream's commitment (it closed)."""
        if stream_id in self._own:
            with self._locked():
                self._own.pop(stream_id, None)
                self._write_own()
