"""A GGUF that cannot be served is refused at start with one line naming the file and the reason:
not a GGUF, truncated (in the header or in the tensor data), an unknown architecture, a storage
type evenflow does not dequantize. The engine-core prints that line and exits 2."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
from evenflow.protocol.gguf_file import GGUFFileError, is_gguf_path, open_gguf
from evenflow.protocol.hf_config import read_hf_config

from tests.checkpoints import make_checkpoint
from tests.gguf_files import write_gguf


@pytest.fixture(scope="module")
def good(checkpoint_root: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    qwen2 = make_checkpoint(checkpoint_root, model_type="qwen2", architectures=["Qwen2ForCausalLM"], seed=3)
    return write_gguf(qwen2, tmp_path_factory.mktemp("gguf") / "good.gguf")


def refusal(path: Path) -> str:
    with pytest.raises(GGUFFileError) as info:
        read_hf_config(path)
    message = str(info.value)
    assert "\n" not in message and message.startswith(str(path.resolve()))
    return message


def test_good_file_reads(good: Path) -> None:
    assert is_gguf_path(good)
    cfg = read_hf_config(good)
    assert cfg.raw["architectures"] == ["Qwen2ForCausalLM"] and cfg.raw["hidden_size"] == 64


def test_not_a_gguf(tmp_path: Path) -> None:
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"PK\x03\x04" + bytes(100))
    assert "not a GGUF file" in refusal(bad)


@pytest.mark.parametrize("keep", [0.3, 0.9])  # 0.3: inside the tensor data; the header is cut below
def test_truncated(good: Path, tmp_path: Path, keep: float) -> None:
    data = good.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: int(len(data) * keep)])
    assert "truncated" in refusal(cut)


def test_truncated_in_the_header(good: Path, tmp_path: Path) -> None:
    cut = tmp_path / "head.gguf"
    cut.write_bytes(good.read_bytes()[:200])
    assert "truncated" in refusal(cut)


def test_unknown_architecture(checkpoint_root: Path, tmp_path: Path) -> None:
    path = write_gguf(make_checkpoint(checkpoint_root), tmp_path / "phi.gguf", arch_override="phi3")
    assert "unsupported GGUF architecture 'phi3'" in refusal(path)


def test_unsupported_quant_type(tmp_path: Path) -> None:
    path = tmp_path / "q2k.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    for key, value in (("block_count", 1), ("embedding_length", 256), ("feed_forward_length", 256),
                       ("attention.head_count", 4)):
        writer.add_uint32(f"llama.{key}", value)
    block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType.Q2_K]
    raw = np.zeros((256, 256 // block * size), dtype=np.uint8)
    writer.add_tensor("blk.0.attn_q.weight", raw, raw_dtype=gguf.GGMLQuantizationType.Q2_K)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert "stored as Q2_K, which evenflow does not load" in refusal(path)


def test_engine_core_prints_one_line_and_exits_2(tmp_path: Path) -> None:
    bad = tmp_path / "junk.gguf"
    bad.write_bytes(b"GGUF\x03\x00\x00\x00" + bytes(7))
    proc = subprocess.run([sys.executable, "-m", "evenflow.core.cli", "--model", str(bad), "--listen",
                           f"ipc://{tmp_path}/e.sock"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("engine-core: error: ") and str(bad) in last and "truncated" in last


def test_missing_file_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(GGUFFileError, match="no such GGUF file"):
        open_gguf(tmp_path / "absent.gguf")
