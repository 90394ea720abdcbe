#!/usr/bin/env python3
"""A minimal engine-core client written from the wire spec (evenflow/protocol/README.md) alone (pyzmq + msgpack, no evenflow).

    python scripts/wire_client.py --engine tcp://127.0.0.1:7100 --prompt 1 5 9 --max-tokens 16
    python scripts/wire_client.py --engine tcp://127.0.0.1:7100 --check

The first form sends hello, then one request with a token-id prompt, and prints each token as it
streams back: exit code 0 when the request finishes, 1 on an engine error, 2 when the engine does
not answer. ``--check`` walks the README's rules one by one against the live engine (each line
says ok or FAIL and why; exit code 0 when all hold). It takes a few seconds plus
``--client-timeout`` (the engine's, default 3 s), since one check stays silent until dropped.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from collections.abc import Callable

import msgspec
import zmq

PROTOCOL_VERSION = 4
INT64_MAX = 2**63 - 1
pack, unpack = msgspec.msgpack.encode, msgspec.msgpack.decode


class Conn:
    """One DEALER to the engine: frames are plain msgpack arrays, as the README writes them."""

    def __init__(self, ctx: zmq.Context, address: str) -> None:
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(address)

    def send(self, msg: object) -> None:
        self.sock.send(pack(msg))

    def recv(self, timeout: float = 10.0) -> list:
        if not self.sock.poll(int(timeout * 1000)):
            raise TimeoutError(f"no frame from the engine within {timeout} s")
        return unpack(self.sock.recv())

    def ask(self, msg: object, raw: bool = False) -> list:
        """Send ``msg`` (or raw bytes); return the first answer that is not an empty ``outputs``."""
        self.sock.send(msg) if raw else self.send(msg)  # type: ignore[arg-type]
        return self.next_reply()

    def next_reply(self) -> list:
        while True:
            msg = self.recv()
            if msg[0] != "outputs" or msg[1]:
                return msg

    def hello(self) -> list:
        ready = self.ask(["hello", PROTOCOL_VERSION, "wire_client"])
        assert ready[0] == "ready", ready
        return ready

    def run(self, request_id: str, prompt: list[int], params: dict) -> list[list]:
        """Submit a request; return its outputs up to the one with a finish_reason."""
        self.send(["request", request_id, prompt, params])
        outs: list[list] = []
        while not outs or outs[-1][2] is None:
            msg = self.next_reply()
            assert msg[0] == "outputs", msg
            outs += [o for o in msg[1] if o[0] == request_id]
        return outs

    def close(self) -> None:
        self.sock.close(0)


def expect_error(msg: list, code: str, request_id: str | None = None) -> str:
    assert msg[0] == "error" and msg[1] == code and msg[3] == request_id, msg
    return msg[2]


GREEDY = {"temperature": 0.0, "ignore_eos": True}


def check_bad_frame_before_hello(c: Conn, ready: list, args: argparse.Namespace) -> None:
    expect_error(c.ask(b"\xc1 not msgpack", raw=True), "bad_frame")


def check_no_hello_in_wire_words(c: Conn, ready: list, args: argparse.Namespace) -> None:
    assert expect_error(c.ask(["heartbeat"]), "no_hello") == "send hello before heartbeat"
    assert expect_error(c.ask(["request", "x", [1]]), "no_hello") == "send hello before request"


def check_hello_again_keeps_live_requests(c: Conn, ready: list, args: argparse.Namespace) -> None:
    c.hello()
    c.send(["request", "long", [1, 5, 9], {"max_tokens": 24, **GREEDY}])
    c.send(["hello", PROTOCOL_VERSION, "wire_client"])
    outs, tags = [], set()
    while not outs or outs[-1][2] is None or "ready" not in tags:
        msg = c.next_reply()
        tags.add(msg[0])
        if msg[0] == "outputs":
            outs += [o for o in msg[1] if o[0] == "long"]
    assert tags == {"ready", "outputs"}, tags
    assert sum(len(o[1]) for o in outs) == 24 and outs[-1][2] == "length", outs


def check_bad_params_name_request_and_key(c: Conn, ready: list, args: argparse.Namespace) -> None:
    c.hello()
    for i, (params, key) in enumerate([({"max_tokens": 16.0}, "max_tokens"), ({"ignore_eos": 1}, "ignore_eos"),
                                       ({"n": 2}, "`n`"), ([16], "sampling_params")]):
        message = expect_error(c.ask(["request", f"bad-{i}", [1, 2], params]), "invalid_request", f"bad-{i}")
        assert key in message, message


def check_sampling_ranges(c: Conn, ready: list, args: argparse.Namespace) -> None:
    c.hello()
    vocab_size = ready[5]
    cases = [({"temperature": -1.0}, "temperature"), ({"temperature": math.nan}, "temperature"),
             ({"temperature": math.inf}, "temperature"), ({"max_tokens": 4, "min_tokens": 5}, "min_tokens"),
             ({"logprobs": 21}, "logprobs"), ({"stop_token_ids": [vocab_size]}, "stop_token_ids"),
             ({"seed": 2**64 - 1}, "seed"), ({"repetition_penalty": math.inf}, "repetition_penalty"),
             ({"top_p": 0.0}, "top_p"), ({"max_tokens": 0}, "max_tokens"), ({"top_k": -2}, "top_k"),
             ({"min_p": 1.5}, "min_p"), ({"presence_penalty": 2.5}, "presence_penalty"),
             ({"frequency_penalty": -2.5}, "frequency_penalty"), ({"repetition_penalty": 0.0}, "repetition_penalty"),
             ({"max_tokens": ready[4]}, "max_model_len")]
    for i, (params, key) in enumerate(cases):
        message = expect_error(c.ask(["request", f"r{i}", [1], params]), "invalid_request", f"r{i}")
        assert key in message, (params, message)
    edges = {"max_tokens": 2, "min_tokens": 2, "logprobs": 20, "stop_token_ids": [vocab_size - 1],
             "seed": INT64_MAX, "temperature": 0.0, "top_k": -1, "min_p": 1.0, "presence_penalty": 2.0,
             "frequency_penalty": -2.0, "top_p": 1.0}
    assert c.run("edges", [1], edges)[-1][2] == "length"


def check_int64(c: Conn, ready: list, args: argparse.Namespace) -> None:
    c.hello()
    assert "call_id" in expect_error(c.ask(["utility", 2**63, "get_stats"]), "bad_frame")
    answer = c.ask(["utility", INT64_MAX, "get_stats"])
    assert answer[:3] == ["utility_result", INT64_MAX, True], answer
    assert "priority" in expect_error(c.ask(["request", "p", [1], {}, 2**63]), "invalid_request", "p")


def check_arity_counted_alike(c: Conn, ready: list, args: argparse.Namespace) -> None:
    c.hello()
    few = expect_error(c.ask(["request", "r"]), "bad_frame")
    many = expect_error(c.ask(["request", "r", [1], {}, 0, 0.0, 0.0, "", 9]), "bad_frame")
    assert few.endswith("got 1") and many.endswith("got 8"), (few, many)
    assert few.rsplit(", got", 1)[0] == many.rsplit(", got", 1)[0], (few, many)


def check_unknown_method_is_a_utility_result(c: Conn, ready: list, args: argparse.Namespace) -> None:
    c.hello()
    answer = c.ask(["utility", 7, "no_such_method"])
    assert answer[0] == "utility_result" and answer[1:3] == [7, False] and answer[4], answer


def check_stats_types(c: Conn, ready: list, args: argparse.Namespace) -> None:
    c.hello()
    c.send(["heartbeat"])
    stats = c.recv()[2]
    # One array per owner, in the README's order; a later engine may append fields to a part, or parts.
    parts = [[int] * 7 + [float] * 2, [float, int, int], [float] * 4, [list, float, int],
             [float, int, list, int, float, float, int, int], [int] * 3 + [list]]
    assert len(stats) >= len(parts), stats
    for part, types in zip(stats, parts):
        assert len(part) >= len(types) and [type(v) for v in part[:len(types)]] == types, stats
    assert all(isinstance(v, int) for v in stats[3][0] + stats[4][2] + stats[5][3]), stats


def check_stop_token_is_in_new_token_ids(c: Conn, ready: list, args: argparse.Namespace) -> None:
    c.hello()
    tokens = [t for o in c.run("free", [1, 5, 9], {"max_tokens": 8, **GREEDY}) for t in o[1]]
    k = next((i for i in range(1, len(tokens)) if tokens[i] not in tokens[:i]), 0)  # first time seen
    outs = c.run("stopped", [1, 5, 9], {"max_tokens": 8, "stop_token_ids": [tokens[k]], **GREEDY})
    assert [t for o in outs for t in o[1]] == tokens[:k + 1], (tokens, outs)
    assert outs[-1][2] == "stop" and outs[-1][5] == tokens[k], outs[-1]


def check_num_cached_tokens_on_every_output(c: Conn, ready: list, args: argparse.Namespace) -> None:
    c.hello()
    block_size = ready[7]
    prompt = [(7 * i) % 50 + 3 for i in range(2 * block_size + 3)]
    c.run("warm", prompt, {"max_tokens": 1, **GREEDY})
    outs = c.run("cached", prompt, {"max_tokens": 6, **GREEDY})
    cached = {o[3] for o in outs}
    assert len(outs) > 1 and len(cached) == 1 and cached.pop() >= 2 * block_size, outs


def check_frame_size_rule(c: Conn, ready: list, args: argparse.Namespace) -> None:
    limit = ready[11] if len(ready) > 11 else 0
    if not 0 < limit <= 8 << 20:
        raise Skip(f"max_frame_bytes is {limit}: too large to send twice over")
    c.hello()
    assert "exceeds the limit" in expect_error(c.ask(b"\x00" * (2 * limit), raw=True), "bad_frame")
    c.sock.send(b"\x00" * (2 * limit + 1))  # the engine's ZMQ closes this connection
    time.sleep(1.0)
    while c.sock.poll(0):
        assert c.recv()[0] == "outputs", "the oversize frame got an answer"
    expect_error(c.ask(["heartbeat"]), "no_hello")  # reconnected by ZMQ as a new peer


def check_silent_client_is_dropped_and_told(c: Conn, ready: list, args: argparse.Namespace) -> None:
    c.hello()
    c.send(["request", "live", [1, 5, 9], {"max_tokens": ready[4] - 3, **GREEDY}])
    time.sleep(args.client_timeout + 1.0)  # silent: no heartbeat, nothing read
    told = None
    while c.sock.poll(0):
        msg = c.recv()
        if told is not None:  # after client_dropped, nothing about the old requests
            assert msg[0] != "outputs" or not msg[1], msg
        elif msg[0] == "error":
            told = expect_error(msg, "client_dropped")
    assert told is not None and "dropped" in told, told
    expect_error(c.ask(["heartbeat"]), "no_hello")
    c.hello()
    assert c.run("live", [1, 5, 9], {"max_tokens": 3, **GREEDY})[-1][2] == "length"  # the id is free again


class Skip(Exception):
    """The engine's settings make a check impractical."""


CHECKS: list[Callable[[Conn, list, argparse.Namespace], None]] = [
    check_bad_frame_before_hello, check_no_hello_in_wire_words, check_hello_again_keeps_live_requests,
    check_bad_params_name_request_and_key, check_sampling_ranges, check_int64, check_arity_counted_alike,
    check_unknown_method_is_a_utility_result, check_stats_types, check_stop_token_is_in_new_token_ids,
    check_num_cached_tokens_on_every_output, check_frame_size_rule, check_silent_client_is_dropped_and_told,
]


def run_checks(args: argparse.Namespace) -> int:
    ctx = zmq.Context()
    probe = Conn(ctx, args.engine)
    ready = probe.hello()
    probe.close()
    failed = 0
    for check in CHECKS:  # each on a fresh connection: a new, unregistered client
        conn = Conn(ctx, args.engine)
        name = check.__name__.removeprefix("check_")
        try:
            check(conn, ready, args)
            print(f"ok    {name}")
        except Skip as e:
            print(f"skip  {name}: {e}")
        except (AssertionError, TimeoutError) as e:
            failed += 1
            print(f"FAIL  {name}: {e!r}")
        finally:
            conn.close()
    ctx.term()
    return 1 if failed else 0


def stream_one(args: argparse.Namespace) -> int:
    sock = zmq.Context().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(args.engine)

    def recv() -> list:
        if not sock.poll(int(args.timeout * 1000)):
            print(f"no answer from {args.engine} within {args.timeout} s", file=sys.stderr)
            sys.exit(2)
        return unpack(sock.recv())

    # Handshake: ["hello", protocol_version, client_name] -> ["ready", ...] or ["error", ...].
    sock.send(pack(["hello", PROTOCOL_VERSION, "wire_client"]))
    msg = recv()
    if msg[0] == "error":
        print(f"engine refused us: [{msg[1]}] {msg[2]}", file=sys.stderr)
        return 1
    _, version, model_name, _path, max_model_len, vocab_size, eos_ids, *_ = msg
    print(f"connected: model {model_name}, protocol {version}, max_model_len {max_model_len}, "
          f"vocab {vocab_size}, eos {eos_ids}", file=sys.stderr)

    # ["request", request_id, prompt_token_ids, sampling_params (a map), priority, arrival_time]
    params = {"max_tokens": args.max_tokens, "temperature": args.temperature}
    sock.send(pack(["request", "req-0", args.prompt, params, 0, time.time()]))
    last_heartbeat = time.monotonic()
    while True:
        if time.monotonic() - last_heartbeat > 1.0:  # stay alive on long generations
            sock.send(pack(["heartbeat"]))
            last_heartbeat = time.monotonic()
        msg = recv()
        if msg[0] == "error":
            code, text = msg[1], msg[2]
            print(f"\nerror [{code}]: {text}", file=sys.stderr)
            return 1
        if msg[0] != "outputs":
            continue
        for out in msg[1]:  # [request_id, new_token_ids, finish_reason, num_cached_tokens, ...]
            if out[0] != "req-0":
                continue
            for token in out[1]:
                print(token, end=" ", flush=True)
            finish_reason = out[2] if len(out) > 2 else None
            if finish_reason is not None:
                print(f"\nfinished: {finish_reason}", file=sys.stderr)
                return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engine", default="tcp://127.0.0.1:7100", help="engine-core address")
    ap.add_argument("--prompt", type=int, nargs="+", help="prompt token ids (streaming mode)")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--timeout", type=float, default=30.0, help="seconds to wait for any frame")
    ap.add_argument("--check", action="store_true", help="check every rule of evenflow/protocol/README.md")
    ap.add_argument("--client-timeout", type=float, default=3.0, help="the engine's --client-timeout")
    args = ap.parse_args()
    if args.check:
        return run_checks(args)
    if not args.prompt:
        ap.error("--prompt is required unless --check")
    return stream_one(args)


if __name__ == "__main__":
    sys.exit(main())
