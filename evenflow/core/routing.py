"""Which client owns which request: engine-wide ids out, client ids and identities back."""

from __future__ import annotations

from evenflow.protocol import RequestOutput


class RequestRouter:
    """Maps the scheduler's ids (``"{client_index}:{request_id}"``, unique across clients) to the
    (ROUTER identity, client's own id) that asked, and groups outputs per client."""

    def __init__(self) -> None:
        self._live: dict[str, tuple[bytes, str]] = {}
        self._by_client: dict[bytes, set[str]] = {}

    @staticmethod
    def engine_id(client_index: int, request_id: str) -> str:
        return f"{client_index}:{request_id}"

    def __contains__(self, engine_id: str) -> bool:
        return engine_id in self._live

    def __len__(self) -> int:
        return len(self._live)

    def live_ids(self) -> list[str]:
        return list(self._live)

    def add(self, engine_id: str, identity: bytes, request_id: str) -> None:
        self._live[engine_id] = (identity, request_id)
        self._by_client.setdefault(identity, set()).add(engine_id)

    def pop(self, engine_id: str) -> tuple[bytes, str] | None:
        """Forget one request; return (identity, client's id) of its owner, or None if unknown."""
        route = self._live.pop(engine_id, None)
        if route is not None:
            self._by_client[route[0]].discard(engine_id)
        return route

    def drop_client(self, identity: bytes) -> set[str]:
        """Forget a client; return the engine ids of its live requests (to abort)."""
        ids = self._by_client.pop(identity, set())
        for eid in ids:
            self._live.pop(eid, None)
        return ids

    def clear(self) -> None:
        self._live.clear()
        self._by_client.clear()

    def route(self, outputs: list[RequestOutput]) -> dict[bytes, list[RequestOutput]]:
        """Group outputs by client, renamed to the client's ids; finished requests are forgotten.
        Outputs of requests whose client is gone are dropped."""
        per_client: dict[bytes, list[RequestOutput]] = {}
        live = self._live
        for out in outputs:
            route = live.get(out.request_id)
            if route is None:
                continue
            identity, client_id = route
            if out.finish_reason is not None:
                del live[out.request_id]
                self._by_client[identity].discard(out.request_id)
            out.request_id = client_id
            per_client.setdefault(identity, []).append(out)
        return per_client
