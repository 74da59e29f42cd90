"""The ALFWorld archives are extracted once per content: a fresh copy of the same archives (a new
checkout of the shared data, a CI clone) is not extracted again; a changed archive is."""

from __future__ import annotations

import lzma
import os
import shutil
import tarfile
import time

import pytest

from comap_async.envs.alfworld_games import extract_archives


def make_archive(path, text: str):
    src = path.parent / "src"
    (src / "json_2.1.1" / "valid_seen").mkdir(parents=True)
    (src / "json_2.1.1" / "valid_seen" / "game.txt").write_text(text)
    with tarfile.open(path, "w:xz") as tar:
        tar.add(src / "json_2.1.1", arcname="json_2.1.1")
    return path


def test_a_copy_of_the_same_archive_is_not_extracted_again_and_a_changed_one_is(tmp_path):
    dest = tmp_path / "cache"
    first = make_archive(tmp_path / "a.tar.xz", "one")
    assert extract_archives([first], dest) == [first]
    copy = tmp_path / "elsewhere" / "a.tar.xz"
    copy.parent.mkdir()
    shutil.copy(first, copy)
    later = time.time() + 3600
    os.utime(copy, (later, later))  # a new mtime, as a fresh copy has
    assert extract_archives([copy], dest) == []
    (dest / "json_2.1.1" / "valid_seen" / "game.txt").unlink()
    (tmp_path / "b").mkdir()
    changed = make_archive(tmp_path / "b" / "a.tar.xz", "two")
    assert extract_archives([changed], dest) == [changed]
    assert (dest / "json_2.1.1" / "valid_seen" / "game.txt").read_text() == "two"


def test_an_extraction_cut_short_leaves_the_games_already_there_whole(tmp_path):
    dest = tmp_path / "cache"
    whole = os.urandom(200_000).hex()  # incompressible: the cut falls inside the game's data
    good = make_archive(tmp_path / "a.tar.xz", whole)
    extract_archives([good], dest)
    (tmp_path / "b").mkdir()
    newer = make_archive(tmp_path / "b" / "a.tar.xz", os.urandom(200_000).hex())
    newer.write_bytes(newer.read_bytes()[: newer.stat().st_size // 2])  # a download or copy cut short
    with pytest.raises((tarfile.TarError, EOFError, lzma.LZMAError)):
        extract_archives([newer], dest)
    assert (dest / "json_2.1.1" / "valid_seen" / "game.txt").read_text() == whole
    assert not list(dest.glob(".extracting-*"))
