"""One-time conversion of raw episode files into memory-mapped TensorDicts."""

from __future__ import annotations

import glob
import hashlib
import json
import logging
import os
import re
import shutil
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeAlias

import psutil
import torch
from tensordict import TensorDict, TensorDictBase
from torch.utils.data import Dataset

__all__ = ["MemmapEpisodeDataset", "memmap_episodes"]

_logger = logging.getLogger("torchrl_ext")

PathLike: TypeAlias = str | os.PathLike[str]

# Written last into the temporary directory, just before the atomic rename.
_COMPLETE_MARKER = ".torchrl_ext_complete.json"
_FORMAT_VERSION = 1
_TMP_RE = re.compile(r"^\.(?P<name>.+)\.tmp-(?P<pid>\d+)-[0-9a-f]+$")


class MemmapEpisodeDataset(Dataset[TensorDictBase]):
    """Map-style dataset over memory-mapped episode directories; item ``i`` is episode ``i``.

    Each item is ``TensorDict.load_memmap(dirs[i])``: only metadata is read, the tensors are
    memory-mapped, so fetching an episode on reset is cheap and pages load on first touch.
    Items are backed by the files: ``clone()`` one before editing it in place. Picklable and
    usable with DataLoader workers (the memmap tensors travel by file name).

    Example:
        >>> import tempfile, torch
        >>> from tensordict import TensorDict
        >>> d = tempfile.mkdtemp()
        >>> _ = TensorDict({"obs": torch.zeros(4, 2)}, batch_size=[4]).memmap_(d)
        >>> ds = MemmapEpisodeDataset([d])
        >>> len(ds), ds[0]["obs"].shape
        (1, torch.Size([4, 2]))
    """

    def __init__(self, dirs: Sequence[PathLike]) -> None:
        self._dirs = tuple(Path(d) for d in dirs)
        missing = [str(d) for d in self._dirs if not d.is_dir()]
        if missing:
            raise FileNotFoundError(f"episode directories not found: {missing[:3]}")

    @property
    def dirs(self) -> tuple[Path, ...]:
        """The episode directories, in item order."""
        return self._dirs

    def __len__(self) -> int:
        return len(self._dirs)

    def __getitem__(self, index: int) -> TensorDictBase:
        return TensorDict.load_memmap(self._dirs[index])

    def __repr__(self) -> str:
        return f"{type(self).__name__}(num_episodes={len(self._dirs)})"


def episode_dir_name(path: PathLike) -> str:
    """Output directory name for a raw episode file: its stem plus a hash of its full path.

    Example:
        >>> episode_dir_name("/data/ep_001.npz").startswith("ep_001-")
        True
    """
    full = str(Path(path).resolve())
    digest = hashlib.sha256(full.encode("utf-8", "surrogateescape")).hexdigest()[:12]
    return f"{Path(path).stem}-{digest}"


def _is_complete(directory: Path) -> bool:
    return (directory / _COMPLETE_MARKER).is_file()


def _to_tensordict(data: Any, path: PathLike) -> TensorDictBase:
    if isinstance(data, TensorDictBase):
        td = data
    elif isinstance(data, Mapping):
        td = TensorDict(dict(data), batch_size=[])
    else:
        raise TypeError(
            f"parse_fn({str(path)!r}) returned {type(data).__name__}; expected a dict of tensors "
            "or a TensorDict"
        )
    if td.batch_dims == 0:
        first = next(
            (v for v in td.values(include_nested=True, leaves_only=True) if isinstance(v, torch.Tensor)),
            None,
        )
        if first is None or first.ndim == 0:
            raise ValueError(f"parse_fn({str(path)!r}) must return tensors with a leading time dimension")
        td = td.copy() if td is data else td
        td.batch_size = torch.Size([first.shape[0]])
    return td


def _remove_stale_tmp(out_dir: Path, name: str) -> None:
    """Delete leftovers of interrupted conversions of ``name`` whose process is gone."""
    for entry in out_dir.glob(f".{glob.escape(name)}.tmp-*"):
        match = _TMP_RE.match(entry.name)
        if match is None or match["name"] != name:
            continue
        pid = int(match["pid"])
        if pid != os.getpid() and psutil.pid_exists(pid):
            continue  # possibly a concurrent converter
        shutil.rmtree(entry, ignore_errors=True)


def _convert(path: PathLike, parse_fn: Callable[[Any], Any], final: Path) -> None:
    tmp = final.parent / f".{final.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        td = _to_tensordict(parse_fn(path), path)
        td.memmap_(str(tmp))
        del td
        marker = {"source": str(Path(path).resolve()), "format": _FORMAT_VERSION}
        (tmp / _COMPLETE_MARKER).write_text(json.dumps(marker))
        if final.exists() and not _is_complete(final):
            shutil.rmtree(final)  # an incomplete directory from elsewhere: replace it
        try:
            os.rename(tmp, final)
        except OSError:
            if not _is_complete(final):
                raise
            # Another converter finished the same file first; keep its result.
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def memmap_episodes(
    paths: Iterable[PathLike],
    parse_fn: Callable[[Any], Mapping[str, Any] | TensorDictBase],
    out_dir: PathLike,
) -> MemmapEpisodeDataset:
    """Convert raw episode files once into memory-mapped TensorDicts; return a dataset over them.

    ``parse_fn(path)`` (called with each element of ``paths`` as given) returns a dict of tensors
    (nesting allowed) or a TensorDict whose tensors share a leading time dimension. Episode
    ``i`` is written to ``out_dir/<stem>-<hash of the full path>`` through a temporary directory
    and an atomic rename, so an interrupted conversion leaves nothing that looks finished and is
    simply redone; files already converted are skipped without calling ``parse_fn``. A source
    file that changes later is NOT reconverted: delete its directory to force it.

    Example:
        >>> import tempfile, torch
        >>> from pathlib import Path
        >>> raw = Path(tempfile.mkdtemp())
        >>> torch.save({"obs": torch.arange(6.0).reshape(3, 2)}, raw / "ep0.pt")
        >>> ds = memmap_episodes([raw / "ep0.pt"], torch.load, raw / "memmap")
        >>> ds[0]["obs"][2].tolist(), ds[0].batch_size
        ([4.0, 5.0], torch.Size([3]))
    """
    root = Path(out_dir)
    root.mkdir(parents=True, exist_ok=True)
    dirs: list[Path] = []
    converted = skipped = 0
    for path in paths:
        final = root / episode_dir_name(path)
        if _is_complete(final):
            skipped += 1
        else:
            _remove_stale_tmp(root, final.name)
            _convert(path, parse_fn, final)
            converted += 1
        dirs.append(final)
    _logger.info("memmap_episodes: %d converted, %d already present in %s", converted, skipped, root)
    return MemmapEpisodeDataset(dirs)
