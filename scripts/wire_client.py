#!/usr/bin/env python3
"""A minimal engine-core client written from protocol/README.md alone (pyzmq + msgpack, no evenflow).

    python scripts/wire_client.py --engine tcp://127.0.0.1:7100 --prompt 1 5 9 --max-tokens 16

Sends hello, then one request with a token-id prompt, and prints each token as it streams back.
Exit code 0 when the request finishes, 1 on an engine error, 2 when the engine does not answer.
"""

from __future__ import annotations

import argparse
import sys
import time

import msgspec
import zmq

PROTOCOL_VERSION = 1


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engine", default="tcp://127.0.0.1:7100", help="engine-core address")
    ap.add_argument("--prompt", type=int, nargs="+", required=True, help="prompt token ids")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--timeout", type=float, default=30.0, help="seconds to wait for any frame")
    args = ap.parse_args()

    sock = zmq.Context().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(args.engine)
    pack, unpack = msgspec.msgpack.encode, msgspec.msgpack.decode

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


if __name__ == "__main__":
    sys.exit(main())
