"""scripts/bench_real_model.py's prefix part on the real GGUF, as a user runs it (a few seconds at 8 tokens
an answer): it finishes and its table says the cache hit on the later turns and not with the cache off."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.bench.conftest import run_script

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def test_prefix_part_reports_hits_with_the_cache_on_only(smollm2_gguf: Path) -> None:
    proc = run_script("bench_real_model.py", ["--model", str(smollm2_gguf), "--parts", "prefix", "--rounds", "1",
                                              "--max-tokens", "8"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = {m[1]: (int(m[2]), float(m[3])) for m in re.finditer(r"^\| (on|off) \| (\d+)% \| (\d+) ms \|", proc.stdout,
                                                                   re.MULTILINE)}
    assert set(rows) == {"on", "off"}, proc.stdout[-2000:]
    assert rows["on"][0] >= 50 and rows["off"][0] == 0  # four chats behind one system prompt, 3 turns each
    assert rows["on"][1] > 0 and rows["off"][1] > 0
