"""`capsnet train` asks torch's CPU allocator for transparent huge pages, unless the user chose otherwise."""

import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from capsnet.cli import main
from capsnet.training.train import use_transparent_huge_pages

THP_SETTING = Path("/sys/kernel/mm/transparent_hugepage/enabled")
THP_MODE = re.search(r"\[(\w+)\]", THP_SETTING.read_text()).group(1) if THP_SETTING.exists() else "absent"

# What `capsnet train` imports before training, then the call, then a 256 MiB buffer; prints its huge pages in kB.
PROBE = """
import re
from capsnet import cli
from capsnet.training.train import use_transparent_huge_pages
use_transparent_huge_pages()
import torch
buffer = torch.ones(64 << 20)
rollup = open("/proc/self/smaps_rollup").read()
print(int(re.search(r"AnonHugePages:\\s+(\\d+) kB", rollup).group(1)))
"""


def huge_page_kb(environ: dict[str, str]) -> int:
    result = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=120, env=environ,
                            check=True)
    return int(result.stdout)


@pytest.mark.skipif(THP_MODE not in ("madvise", "always"), reason=f"transparent huge pages are {THP_MODE} here")
def test_the_training_process_gets_huge_pages_before_its_first_allocation():
    environ = {k: v for k, v in os.environ.items() if k != "THP_MEM_ALLOC_ENABLE"}
    # at least one 2 MiB page: the kernel may fall back to small pages for some of the 256 MiB when memory is fragmented
    assert huge_page_kb(environ) >= 2048


@pytest.mark.skipif(THP_MODE != "madvise", reason="only with THP in madvise mode does the allocator's request decide")
def test_a_value_the_user_set_is_kept():
    assert huge_page_kb({**os.environ, "THP_MEM_ALLOC_ENABLE": "0"}) == 0


def test_train_sets_it_only_where_unset():
    environ = {}
    use_transparent_huge_pages(environ)
    assert environ == {"THP_MEM_ALLOC_ENABLE": "1"}
    environ = {"THP_MEM_ALLOC_ENABLE": "0"}
    use_transparent_huge_pages(environ)
    assert environ == {"THP_MEM_ALLOC_ENABLE": "0"}


def test_capsnet_train_asks_for_them(monkeypatch, tmp_path, idx_dataset):
    monkeypatch.delenv("THP_MEM_ALLOC_ENABLE", raising=False)
    rng = np.random.default_rng(0)
    data = idx_dataset(rng.integers(0, 256, (40, 28, 28)), np.arange(40) % 10,
                       rng.integers(0, 256, (10, 28, 28)), np.arange(10) % 10)
    assert main(["train", "--data", str(data), "--preset", "tiny", "--epochs", "1", "--val-fraction", "0",
                 "--device", "cpu", "--no-progress", "--out", str(tmp_path / "m.ckpt")]) == 0
    assert os.environ["THP_MEM_ALLOC_ENABLE"] == "1"
