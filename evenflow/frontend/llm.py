"""Offline inference: ``LLM(model=DIR, **engine_args).generate(prompts, SamplingParams(...))``.

``LLM`` starts an engine-core (and through it the workers) as a subprocess listening on an
``ipc://`` socket in a private temp folder, connects a ``BlockingEngineClient`` to it (its event
loop runs in a thread for the LLM's lifetime, so heartbeats keep the engine from dropping the
client between two ``generate()`` calls), and runs batches through the same output path as the
HTTP server (incremental detokenization, stop strings, ``n`` samples). ``shutdown()`` (also at interpreter exit) stops the
engine-core by PID.

``in_process=True`` runs the engine-core on a thread of this process instead, with the model on an
in-process executor (evenflow/in_process_engine.py): one process a debugger can step through.
"""

from __future__ import annotations

import asyncio
import atexit
import itertools
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import msgspec

from evenflow.protocol import AdapterRef, LoRALoad
from evenflow.protocol import SamplingParams as EngineSamplingParams
from evenflow.protocol.lifeline import runtime_dir, stop_processes, with_runtime_dir
from evenflow.protocol.lora import LoRARequest
from evenflow.protocol.validation import check_context_length, check_prompt_token_ids, check_sampling_params

from evenflow.frontend.generation import Generation
from evenflow.frontend.lora_adapters import LoRAAdapters
from evenflow.frontend.choices import ChoicePlan, fan_out, stop_strings
from evenflow.frontend.structured_outputs import offline_structured_outputs
from evenflow.frontend.chat_template import render_chat
from evenflow.frontend.logprobs import LogprobEntry
from evenflow.frontend.progress import Progress
from evenflow.frontend.prompt_logprobs import PromptLogprobEntries, prompt_logprob_entries
from evenflow.frontend.tokenizer import Tokenizer


class SamplingParams(EngineSamplingParams, kw_only=True):
    """The engine's SamplingParams plus what the frontend handles: ``n``, stop strings, text options."""

    n: int = 1
    stop: str | list[str] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True

    def engine_params(self) -> EngineSamplingParams:
        """The part the engine sees (the protocol Struct, without the frontend-only fields)."""
        return EngineSamplingParams(**{f: getattr(self, f) for f in EngineSamplingParams.__struct_fields__})


@dataclass
class CompletionOutput:
    """One sample of one prompt."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    stop_reason: int | str | None = None
    logprobs: list[LogprobEntry] | None = None


@dataclass
class RequestOutput:
    """All samples of one prompt; ``.text`` etc. are those of the first sample."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    num_cached_tokens: int = 0
    # vLLM's: None for the first prompt token, then {token_id: Logprob} (prompt token and top-k).
    prompt_logprobs: PromptLogprobEntries | None = None

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason


def engine_args_to_flags(engine_args: dict[str, Any]) -> list[str]:
    """``max_num_batched_tokens=64`` -> ``--max-num-batched-tokens 64``; ``flag=True`` -> ``--flag``,
    ``flag=False`` -> ``--no-flag`` (every engine-core switch takes both: ``enable_prefix_caching=False``
    turns the cache off, as in vLLM); None: the engine's default."""
    flags: list[str] = []
    for key, value in engine_args.items():
        if value is None:
            continue
        flag = "--" + key.replace("_", "-")
        if value is False:
            flags.append("--no-" + key.replace("_", "-"))
            continue
        if isinstance(value, dict):  # e.g. speculative_config={...}: the flag takes JSON
            value = json.dumps(value)
        if isinstance(value, (list, tuple)):  # e.g. lora_modules=["name=path", ...]
            flags += [flag, *map(str, value)] if value else []
            continue
        flags += [flag] if value is True else [flag, str(value)]
    return flags


class LLM:
    """An engine-core in the background and a synchronous API in front of it."""

    def __init__(self, model: str | os.PathLike[str] | None = None, *, tokenizer: str | None = None,
                 chat_template: str | None = None, startup_timeout: float = 600.0, in_process: bool = False,
                 **engine_args: Any) -> None:
        from evenflow.frontend.clients.blocking import BlockingEngineClient

        from evenflow.frontend.default_model import choose_demo, is_demo_request

        if is_demo_request(None if model is None else str(model)):
            model = choose_demo(None if model is None else str(model)).model
        self.model = str(model)
        self._tmpdir = tempfile.mkdtemp(prefix="evenflow-llm-", dir=runtime_dir())
        self.address = f"ipc://{self._tmpdir}/engine.sock"
        self.log_path = Path(self._tmpdir) / "engine-core.log"
        flags = engine_args_to_flags(engine_args)
        self._log = open(self.log_path, "wb")
        self._proc: subprocess.Popen | None = None
        self._in_process: Any = None  # an InProcessEngine
        if in_process:
            # The one place the frontend reaches the other parts: on request, for a debuggable run.
            from evenflow.in_process_engine import InProcessEngine

            try:
                self._in_process = InProcessEngine(self.model, self.address, flags)
            except BaseException:
                self._log.close()
                shutil.rmtree(self._tmpdir, ignore_errors=True)
                raise
        else:
            cmd = [sys.executable, "-m", "evenflow.core.cli", "--model", self.model, "--listen", self.address, *flags]
            self._proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT,
                                          env=with_runtime_dir(dict(os.environ), self._tmpdir))
        self._client = BlockingEngineClient(self.address, client_name=f"llm-{os.getpid()}")
        self._ids = itertools.count()
        atexit.register(self.shutdown)
        try:
            self.ready = self._connect(startup_timeout)
            self.tokenizer = Tokenizer.from_dir(tokenizer or self.ready.model_path, chat_template=chat_template)
            self._lora = LoRAAdapters.from_ready(self.ready)
        except BaseException:
            self.shutdown()
            raise

    def _connect(self, timeout: float) -> Any:
        # The engine-core binds its socket once its workers are ready. Until then no Hello is sent:
        # a Hello that outlived its attempt would register a client that is gone by the engine's reply.
        deadline = time.monotonic() + timeout
        sock_path = Path(self.address.removeprefix("ipc://"))
        while True:
            self._check_engine_alive()
            if sock_path.exists():
                try:
                    return self._client.connect(timeout=max(1.0, min(30.0, deadline - time.monotonic())))
                except Exception as e:
                    self._check_engine_alive()
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"engine-core did not answer within {timeout:.0f} s ({e})\n"
                                           f"{self._log_tail()}") from None
            elif time.monotonic() > deadline:
                raise RuntimeError(f"engine-core did not start within {timeout:.0f} s\n{self._log_tail()}")
            else:
                time.sleep(0.05)

    def _check_engine_alive(self) -> None:
        if self._proc is not None and self._proc.poll() is not None:
            raise RuntimeError(f"engine-core exited with code {self._proc.returncode}:\n{self._log_tail()}")
        if self._in_process is not None and not self._in_process.is_alive():
            raise RuntimeError(f"the in-process engine-core exited with code {self._in_process.exit_code}")

    def _log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def generate(self, prompts: str | Sequence[str] | Sequence[int] | Sequence[Sequence[int]],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True,
                 lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None) -> list[RequestOutput]:
        """Complete every prompt (text or token ids); one RequestOutput per prompt, in order.

        ``lora_request``: a LoRA adapter for every prompt, or one (or None) per prompt; the engine
        needs ``enable_lora=True``. An adapter is loaded on first use (again when its path changes).
        """
        texts, id_lists = self._normalize_prompts(prompts)
        return self._run(texts, id_lists, sampling_params, use_tqdm, lora_request)

    def chat(self, messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = True, add_generation_prompt: bool = True) -> list[RequestOutput]:
        """Answer one conversation (a list of messages) or many (a list of lists)."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        texts = [render_chat(self.tokenizer.chat_template, list(c), add_generation_prompt,  # type: ignore[arg-type]
                             self.tokenizer.bos_token, self.tokenizer.eos_token) for c in conversations]
        ids = [self.tokenizer.encode(t, add_special_tokens=False) for t in texts]
        return self._run(texts, ids, sampling_params, use_tqdm)

    def _normalize_prompts(self, prompts: Any) -> tuple[list[str | None], list[list[int]]]:
        if isinstance(prompts, str):
            return [prompts], [self.tokenizer.encode(prompts)]
        prompts = list(prompts)
        if prompts and all(isinstance(p, int) for p in prompts):
            return [None], [list(prompts)]
        texts: list[str | None] = [p if isinstance(p, str) else None for p in prompts]
        str_ids = iter(self.tokenizer.encode_batch([p for p in prompts if isinstance(p, str)]))
        return texts, [next(str_ids) if isinstance(p, str) else list(p) for p in prompts]

    def _run(self, texts: list[str | None], id_lists: list[list[int]], sampling_params: Any,
             use_tqdm: bool, lora_request: Any = None) -> list[RequestOutput]:
        if sampling_params is None or isinstance(sampling_params, EngineSamplingParams):
            params_list = [sampling_params or SamplingParams()] * len(id_lists)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(id_lists):
                raise ValueError(f"{len(params_list)} sampling params for {len(id_lists)} prompts")
        if lora_request is None or isinstance(lora_request, LoRARequest):
            lora_list = [lora_request] * len(id_lists)
        else:
            lora_list = list(lora_request)
            if len(lora_list) != len(id_lists):
                raise ValueError(f"{len(lora_list)} lora requests for {len(id_lists)} prompts")
        adapters = [None if lr is None else self._adapter(lr) for lr in lora_list]
        gens = [self._generation(ids, sp, adapter) for ids, sp, adapter in zip(id_lists, params_list, adapters)]
        progress = Progress(len(gens), enabled=use_tqdm and len(gens) >= 8)
        self._client.run(self._run_all(gens, progress))
        progress.close()
        results = []
        for gen, text, ids in zip(gens, texts, id_lists):
            outs = [CompletionOutput(j.index, j.assembler.text, j.assembler.token_ids, j.assembler.finish_reason,
                                     j.assembler.stop_reason, j.assembler.logprobs if j.params.logprobs is not None else None)
                    for j in gen.jobs]
            first = gen.jobs[0]
            prompt_logprobs = (prompt_logprob_entries(self.tokenizer, first.assembler.prompt_logprobs)
                               if first.params.prompt_logprobs is not None else None)
            results.append(RequestOutput(first.engine_id.rsplit("-", 1)[0], text, ids, outs, gen.num_cached_tokens,
                                         prompt_logprobs))
        return results

    def _adapter(self, lora_request: LoRARequest) -> AdapterRef:
        """The engine's adapter for ``lora_request``, loading it when its name or path is new."""
        loaded = self._lora.get(lora_request.lora_name)
        path = str(Path(lora_request.lora_path).expanduser().resolve()) if lora_request.lora_path else ""
        if loaded is not None and (not path or loaded.path == path):
            return loaded
        if not self._lora.enabled:
            raise ValueError("lora_request needs an engine with LoRA on: LLM(..., enable_lora=True)")
        if not path:
            raise ValueError(f"LoRA adapter {lora_request.lora_name!r} is not loaded and has no lora_path")
        call = self._client.async_client.call_utility(
            "load_lora_adapter", lora=LoRALoad(lora_request.lora_name, path, load_inplace=loaded is not None))
        try:
            self._lora.replace(self._client.run(call).lora_adapters)
        except Exception as e:
            raise ValueError(getattr(e, "message", "") or str(e)) from None
        return self._lora.by_name[lora_request.lora_name]

    def _generation(self, prompt_ids: list[int], sp: EngineSamplingParams, lora: AdapterRef | None = None
                    ) -> Generation:
        n = getattr(sp, "n", 1)
        engine = sp.engine_params() if isinstance(sp, SamplingParams) else sp
        max_len = self.ready.max_model_len
        problem = (check_prompt_token_ids(prompt_ids, self.ready.vocab_size)
                   or check_context_length(len(prompt_ids), None, max_len))
        if problem is not None:
            raise ValueError(problem.message)
        if len(prompt_ids) + engine.max_tokens > max_len:
            room = max_len - len(prompt_ids)
            engine = msgspec.structs.replace(engine, max_tokens=room, min_tokens=min(engine.min_tokens, room))
        problem = check_sampling_params(engine, self.ready.vocab_size)
        if problem is not None:
            raise ValueError(problem.message)
        if engine.structured_outputs is not None:
            engine = msgspec.structs.replace(engine, structured_outputs=offline_structured_outputs(engine.structured_outputs))
        plan = ChoicePlan(prompt_ids, fan_out(engine, n), stop_strings(getattr(sp, "stop", None)),
                          getattr(sp, "include_stop_str_in_output", False), getattr(sp, "skip_special_tokens", True), 0)
        return Generation(self._client.async_client, self.tokenizer, f"llm{next(self._ids)}", [plan], lora=lora)

    async def _run_all(self, gens: list[Generation], progress: Progress) -> None:
        async def one(gen: Generation) -> None:
            await gen.run_to_end()
            progress.update()

        await asyncio.gather(*(one(g) for g in gens))

    def shutdown(self) -> None:
        """Close the client and stop the engine-core (SIGTERM, then SIGKILL after 10 s; in process:
        a graceful stop of its thread)."""
        proc, self._proc = self._proc, None
        in_process, self._in_process = self._in_process, None
        if proc is None and in_process is None:
            return
        try:
            self._client.close()
        except Exception:
            pass
        if in_process is not None:
            in_process.stop(timeout=10)
        if proc is not None:
            stop_processes([proc], timeout=10)
        self._log.close()
        shutil.rmtree(self._tmpdir, ignore_errors=True)
        atexit.unregister(self.shutdown)

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
