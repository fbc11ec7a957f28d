"""Reading input files with one clear error, and writing result files so that a crash never
leaves a half-written one behind and nothing but the file asked for is replaced.

A result goes to a regular file atomically (a temporary file beside it, renamed over it);
through a symlink to the file it points to; into a device or pipe (``/dev/null``,
``/dev/stdout``) by writing to it, never by replacing the node. A directory, a missing folder
or an empty path is refused before any work (``check_output_path``).
"""

from __future__ import annotations

import json
import os
import stat
import tempfile

from memshard.core.errors import MemshardError


def read_json(path: str, what: str):
    """The JSON in ``path`` (a ``what``: "plan", "config"), or one clear MemshardError."""
    if not isinstance(path, (str, os.PathLike)) or not str(path):
        raise MemshardError(f"a {what} is a path to a JSON file, got {path!r}")
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except OSError as e:
        raise MemshardError(f"cannot read {what} {path}: {e.strerror}") from None
    except UnicodeDecodeError:
        raise MemshardError(f"{what} {path} is not a text file (expected JSON)") from None
    except json.JSONDecodeError as e:
        raise MemshardError(f"{what} {path} is not valid JSON: {e.msg} (line {e.lineno})") from None
    except RecursionError:
        raise MemshardError(f"{what} {path} is nested too deeply to be a {what}") from None


def check_output_path(path: str, what: str = "output") -> None:
    """Refuse, before any work, a result path that cannot be written: empty, a directory, in
    a folder that does not exist or cannot be written."""
    if not isinstance(path, (str, os.PathLike)) or not str(path).strip():
        raise MemshardError(f"the {what} path is empty")
    path = str(path)
    target = os.path.realpath(path)
    if os.path.isdir(target):
        raise MemshardError(f"cannot write {path}: it is a directory")
    if os.path.exists(target) and not stat.S_ISREG(os.stat(target).st_mode):
        if not os.access(target, os.W_OK):
            raise MemshardError(f"cannot write {path}: permission denied")
        return  # a device or pipe: written through
    directory = os.path.dirname(target)
    if not os.path.isdir(directory):
        raise MemshardError(f"cannot write {path}: directory {os.path.dirname(os.path.abspath(path))} does not exist")
    if not os.access(directory, os.W_OK):
        raise MemshardError(f"cannot write {path}: permission denied in {directory}")


def write_text_atomically(path: str, text: str) -> None:
    """Write ``text`` to ``path``: atomically for a regular file (or a symlink to one), by a
    plain write for a device or pipe. Errors are one MemshardError naming ``path``."""
    check_output_path(path)
    target = os.path.realpath(str(path))
    try:
        if os.path.exists(target) and not stat.S_ISREG(os.stat(target).st_mode):
            with open(target, "w", encoding="utf-8") as f:
                f.write(text)
            return
        _replace(target, text)
    except OSError as e:
        raise MemshardError(f"cannot write {path}: {e.strerror}") from None


def _replace(target: str, text: str) -> None:
    """A temporary file beside ``target``, renamed over it (keeping its permissions)."""
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(target), prefix=".memshard-", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            if os.path.exists(target):
                mode = stat.S_IMODE(os.stat(target).st_mode)
            else:  # mkstemp makes it private; results are ordinary files
                umask = os.umask(0)
                os.umask(umask)
                mode = 0o666 & ~umask
            os.fchmod(f.fileno(), mode)
            f.write(text)
        os.replace(tmp, target)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
