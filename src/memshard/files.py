"""Reading input files with one clear error, and writing result files so a crash never
leaves a half-written one behind."""

from __future__ import annotations

import json
import os
import tempfile

from memshard.errors import MemshardError


def read_json(path: str, what: str):
    """The JSON in ``path`` (a ``what``: "plan", "config"), or one clear MemshardError."""
    try:
        with open(path) as f:
            return json.load(f)
    except OSError as e:
        raise MemshardError(f"cannot read {what} {path}: {e.strerror}") from None
    except json.JSONDecodeError as e:
        raise MemshardError(f"{what} {path} is not valid JSON: {e.msg} (line {e.lineno})") from None


def write_text_atomically(path: str, text: str) -> None:
    """Write ``text`` to a temporary file beside ``path``, then rename it over ``path``."""
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".memshard-", suffix=".tmp")
    try:
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp makes it private; results are ordinary files
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
