"""Write-then-rename files and folders: nothing half-written, and the usual permissions on the result."""

import os
import stat

import pytest

from prunelight.atomic import atomic_dir, atomic_write_json, atomic_write_text


def _mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


@pytest.fixture
def umask_022():
    old = os.umask(0o022)
    yield
    os.umask(old)


def test_files_and_folders_get_the_mode_plain_open_and_mkdir_give(tmp_path, umask_022):
    f = atomic_write_json(tmp_path / "report.json", {"a": 1})
    with atomic_dir(tmp_path / "model") as d:
        (d / "config.json").write_text("{}")
    # mkstemp/mkdtemp alone would leave 0600 / 0700: unreadable by the other users of a shared run folder
    assert _mode(f) == 0o644
    assert _mode(tmp_path / "model") == 0o755


def test_a_failed_write_keeps_the_old_file_and_leaves_no_temporary(tmp_path):
    target = atomic_write_text(tmp_path / "plan.json", "old")
    with pytest.raises(RuntimeError):
        from prunelight.atomic import atomic_file

        with atomic_file(target) as f:
            f.write("half")
            raise RuntimeError("crash")
    assert target.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["plan.json"]


def test_a_failed_folder_write_keeps_the_old_folder(tmp_path):
    with atomic_dir(tmp_path / "model") as d:
        (d / "weights").write_text("good")
    with pytest.raises(RuntimeError):
        with atomic_dir(tmp_path / "model") as d:
            (d / "weights").write_text("half")
            raise RuntimeError("crash")
    assert (tmp_path / "model" / "weights").read_text() == "good"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]
