"""Host memory for O_DIRECT reads (subspec.hostmem): private mappings that really get transparent huge pages."""
from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import torch

from subspec.hostmem import HUGE_PAGE, aligned_view, huge_page_map

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/smaps (Linux)")


def _mapping(addr: int) -> tuple[str, dict[str, int]]:
    """(permissions, kB fields) of this process's mapping that holds ``addr`` (/proc/self/smaps)."""
    found = None
    for line in Path("/proc/self/smaps").read_text().splitlines():
        m = re.match(r"^([0-9a-f]+)-([0-9a-f]+) (\S+) ", line)
        if m:
            if found is not None:
                break
            if int(m.group(1), 16) <= addr < int(m.group(2), 16):
                found = (m.group(3), {})
        elif found is not None and line.endswith(" kB"):
            key, value = line.split(":")
            found[1][key] = int(value.split()[0])
    assert found is not None, f"no mapping holds {addr:#x}"
    return found


def _thp_mode() -> str:
    try:
        text = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return "never"
    return re.search(r"\[(\w+)\]", text).group(1)


def test_huge_page_map_is_private_aligned_and_gets_huge_pages():
    n = 8 << 20
    m = huge_page_map(n)
    view = aligned_view(m, n)
    assert view.numel() == n and view.data_ptr() % HUGE_PAGE == 0
    view.fill_(1)  # faulted in
    perms, kb = _mapping(view.data_ptr())
    # shared anonymous memory ("rw-s") is shmem: the kernel's default shmem_enabled=never gives it no huge pages
    assert perms == "rw-p", perms
    if _thp_mode() in ("always", "madvise"):
        assert kb["AnonHugePages"] >= HUGE_PAGE >> 10, kb  # at least one 2 MiB page of the four (compaction may lag)
    assert int(view.sum()) == n  # the memory holds what was written
    del view
    m.close()


def test_the_disk_tiers_staging_slots_are_private_memory(tmp_path):
    from conftest import save_tiny, tiny_config
    from subspec.layout import layer_layout
    from subspec.loading import open_model
    from subspec.tiers import DiskTier, packed_layers

    src = open_model(save_tiny(tmp_path / "m", tiny_config("qwen2", False, vocab=96, layers=4)))
    layout = layer_layout(src.config, src.family, torch.float32)
    tier = DiskTier(packed_layers(src, layout, [1, 2, 3]), layout, [1, 2, 3], n_slots=2)
    try:
        for host in tier._host:
            host[::4096].fill_(0)
            assert _mapping(host.data_ptr())[0] == "rw-p"
    finally:
        tier.close()
