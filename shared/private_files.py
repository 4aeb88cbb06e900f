"""Files only their owner may read: the home directory and what llmfleet writes in it.

The home holds the SQLite database (tenants, key hashes, usage), Redis's append-only file
(queued prompts), the secrets and the logs, so nothing in it is for other users of the
machine: directories are created 0700 and files 0600. `PRIVATE_UMASK` is the process umask
that gives the same modes to files created by code that takes no mode (SQLite's WAL files,
redis-server's AOF and its rewrites, prometheus_client's value files).
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import BinaryIO

PRIVATE_DIR_MODE = 0o700
PRIVATE_FILE_MODE = 0o600
PRIVATE_UMASK = 0o077


def make_private_dir(path: Path) -> Path:
    """Create `path` and any missing parents with mode 0700, and take group and other access
    away from an existing `path` of ours (a home created by an older version).
    `Path.mkdir(parents=True, mode=...)` would give the mode to the last directory only."""
    for directory in reversed([p for p in (path, *path.parents) if not p.exists()]):
        directory.mkdir(mode=PRIVATE_DIR_MODE, exist_ok=True)
    _tighten(path)
    return path


def touch_private(path: Path) -> Path:
    """Create `path` (in an existing directory) empty with mode 0600 unless it exists; an
    existing one loses group and other access."""
    os.close(os.open(path, os.O_WRONLY | os.O_CREAT, PRIVATE_FILE_MODE))
    _tighten(path)
    return path


def open_private_log(path: Path) -> BinaryIO:
    """`path` opened for appending (binary), created 0600 in a 0700 directory."""
    make_private_dir(path.parent)
    return touch_private(path).open("ab")


def _tighten(path: Path) -> None:
    # Only our own files: chmod of someone else's would fail, and is not ours to decide.
    info = path.stat()
    mode = stat.S_IMODE(info.st_mode)
    if info.st_uid == os.getuid() and mode & 0o077:
        path.chmod(mode & ~0o077)
