"""Result files: a regular file is replaced atomically, a symlink is written through to its
target (the link stays), a device is written to (never replaced), a directory or a missing
folder is refused before any work."""

from __future__ import annotations

import json
import os
import stat

import pytest

from memshard.cli import main
from memshard.core.errors import MemshardError
from memshard.core.files import check_output_path, write_text_atomically

PLAN = ["plan", "--model", "gpt2", "--mesh", "2", "--layers", "1", "--batch", "2", "--seq", "32"]


def test_a_regular_file_is_replaced_whole_and_keeps_its_mode(tmp_path):
    path = tmp_path / "out.json"
    path.write_text("old\n")
    os.chmod(path, 0o640)
    write_text_atomically(str(path), "new\n")
    assert path.read_text() == "new\n"
    assert stat.S_IMODE(path.stat().st_mode) == 0o640
    assert [p.name for p in tmp_path.iterdir()] == ["out.json"]  # no temporary file left


def test_a_symlink_is_written_through_and_stays_a_link(tmp_path, capsys):
    target = tmp_path / "real.json"
    target.write_text("old\n")
    link = tmp_path / "link.json"
    link.symlink_to(target)
    assert main([*PLAN, "--json", str(link)]) == 0
    capsys.readouterr()
    assert link.is_symlink() and os.readlink(link) == str(target)
    assert json.loads(target.read_text())["schema"] == "memshard.plan/3"


def test_a_device_is_written_to_not_replaced(capsys):
    before = os.stat("/dev/null")
    assert main([*PLAN, "--json", "/dev/null"]) == 0
    capsys.readouterr()
    after = os.stat("/dev/null")
    assert stat.S_ISCHR(after.st_mode) and (after.st_ino, after.st_rdev) == (before.st_ino, before.st_rdev)


@pytest.mark.parametrize("make, message", [
    (lambda d: str(d), "it is a directory"),
    (lambda d: str(d / "missing" / "out.json"), "does not exist"),
    (lambda d: "", "empty"),
    (lambda d: "   ", "empty"),
])
def test_unwritable_paths_are_refused_before_any_work(make, message, tmp_path):
    with pytest.raises(MemshardError, match=message):
        check_output_path(make(tmp_path))
    with pytest.raises(MemshardError, match=message):
        write_text_atomically(make(tmp_path), "x")


def test_a_dangling_symlink_writes_its_target(tmp_path):
    link = tmp_path / "link.json"
    link.symlink_to(tmp_path / "new.json")
    write_text_atomically(str(link), "made\n")
    assert (tmp_path / "new.json").read_text() == "made\n" and link.is_symlink()
