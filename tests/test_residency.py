"""`cache.residency.page_cache_bytes` on a real file: what was just read is in the page cache, to the byte; what
was dropped with POSIX_FADV_DONTNEED (mostly) is not; and the rebuild's split always adds up to the bytes read."""

from __future__ import annotations

import os
import sys

import pytest

from cache.residency import page_cache_bytes

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="mincore residency is Linux only")

PAGE = os.sysconf("SC_PAGE_SIZE")
SIZE = 64 * PAGE + 123  # a partial last page


@pytest.fixture
def data_file(tmp_path):
    path = tmp_path / "shard.bin"
    path.write_bytes(os.urandom(SIZE))
    fd = os.open(path, os.O_RDONLY)
    yield path, fd
    os.close(fd)


def drop(fd: int) -> None:
    os.fsync(fd)  # dirty pages cannot be dropped
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)


# (offset, nbytes): whole file, unaligned start and end inside pages, within one page, one byte, the tail
RANGES = [(0, SIZE), (PAGE // 2, 10 * PAGE + 7), (3 * PAGE + 5, 100), (SIZE - 1, 1), (60 * PAGE + 9, SIZE - 60 * PAGE - 9)]


@pytest.mark.parametrize("offset,nbytes", RANGES)
def test_bytes_just_read_are_in_the_page_cache_to_the_byte(data_file, offset, nbytes):
    path, fd = data_file
    drop(fd)
    assert os.pread(fd, nbytes, offset)
    assert page_cache_bytes(fd, offset, nbytes) == nbytes


def test_dropped_bytes_are_mostly_not_in_the_page_cache(data_file):
    path, fd = data_file
    os.pread(fd, SIZE, 0)
    assert page_cache_bytes(fd, 0, SIZE) == SIZE
    drop(fd)
    assert page_cache_bytes(fd, 0, SIZE) <= SIZE // 4  # the kernel may keep a few pages (e.g. mapped ones)


def test_only_the_pages_read_count(data_file):
    path, fd = data_file
    drop(fd)
    os.pread(fd, 8 * PAGE, 32 * PAGE)  # 8 of the 65 pages (readahead may bring in more, never fewer)
    assert page_cache_bytes(fd, 32 * PAGE, 8 * PAGE) == 8 * PAGE
    assert 8 * PAGE <= page_cache_bytes(fd, 0, SIZE) <= SIZE
    assert page_cache_bytes(fd, 0, 0) == 0


def test_rebuild_reports_page_cache_plus_disk_equal_to_the_bytes_read(tiny, tmp_path):
    """A cold and a warm rebuild of the tiny checkpoint: the split sums to the bytes read either way, and the
    warm one (right after the cold one read everything) is all page cache."""
    import shutil

    from model.layout import H3Checkpoint
    from tests.adaln_support import TINY_ADALN_BYTES, online_cache, open_weights, schedule

    root = shutil.copytree(tiny.path, tmp_path / "copy")
    checkpoint = H3Checkpoint.open(root)
    reader = open_weights(root)
    for shard in checkpoint.transformer_dir.glob("*.safetensors"):
        fd = os.open(shard, os.O_RDONLY)
        try:
            drop(fd)
        finally:
            os.close(fd)
    cold = online_cache(tiny, reader=reader, direct_io="never").prepare(schedule(0.3, 2))
    warm = online_cache(tiny, reader=reader, direct_io="never").prepare(schedule(0.3, 2))
    for prepared in (cold, warm):
        stats = prepared.stats
        assert stats.rebuild_bytes_read == TINY_ADALN_BYTES
        assert stats.page_cache_bytes + stats.disk_bytes == TINY_ADALN_BYTES
        prepared.release()
    assert (warm.stats.page_cache_bytes, warm.stats.disk_bytes) == (TINY_ADALN_BYTES, 0)
    assert cold.stats.disk_bytes > 0
