"""snapshot.write_pickle (and so Allocator.dump_snapshot) writes a path
whole or not at all: a failure part way leaves the old file, the mode is
kept, a symbolic link stays a link."""
import os
import stat

import pytest

from ccalloc import snapshot


class _Unpicklable:
    def __reduce__(self):
        raise RuntimeError("cannot pickle this")


def test_a_write_that_fails_part_way_leaves_the_old_file(tmp_path):
    path = tmp_path / "keep.pickle"
    path.write_bytes(b"old")
    os.chmod(path, 0o640)
    # 200 KB of bytes are written out before the object that cannot be pickled.
    with pytest.raises(RuntimeError, match="cannot pickle this"):
        snapshot.write_pickle([b"x" * 200000, _Unpicklable()], str(path))
    assert path.read_bytes() == b"old"
    assert sorted(os.listdir(tmp_path)) == ["keep.pickle"]
    snapshot.write_pickle({"segments": []}, str(path))
    assert path.read_bytes()[:1] == b"\x80"
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o640
    assert sorted(os.listdir(tmp_path)) == ["keep.pickle"]


def test_a_dangling_link_stays_and_its_target_is_written(tmp_path):
    (tmp_path / "x").mkdir()
    link = tmp_path / "s.pickle"
    link.symlink_to(tmp_path / "x" / "target.pickle")
    with pytest.raises(RuntimeError):
        snapshot.write_pickle([b"x" * 200000, _Unpicklable()], str(link))
    assert link.is_symlink() and os.listdir(tmp_path / "x") == []
    snapshot.write_pickle({"segments": []}, link)
    assert link.is_symlink()
    assert os.listdir(tmp_path / "x") == ["target.pickle"]
    assert (tmp_path / "x" / "target.pickle").read_bytes()[:1] == b"\x80"
