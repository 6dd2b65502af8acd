"""A decode route's head asking the prefill route to run a long prompt (``POST /kv/prefill``).

The tracker hands a head a signed prefill route (``X-Meshnet-Prefill-Route``)
and the prompt length from which to use it. For such a prompt the head first
checks that the prefill group's registered cache layout is its own (a
mismatch would make the handoff useless), then sends the prompt's token ids
to the prefill route's head, with its own decode route and signed with its
hop key (the prefill nodes hold the KV for that route's nodes alone,
:mod:`services.node.pd.kv_auth`), which runs them through every prefill stage;
its tail samples the first token, which comes back here and streams at
once. The decode route then takes the KV over
(:meth:`services.node.head.chain.SessionChain.adopt`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Final

import httpx
import orjson
from pydantic import ValidationError

from meshwire import headers as h
from meshwire.hop_proof import sign_request
from meshwire.kv_handoff import DECODE_ROUTE, PREFILL_PATH, PrefillAnswer
from meshwire.route_keys import SigningKey
from meshwire.sampling_params import SamplingParams
from services.node.hop.routing import RoutedHop
from services.node.pd.kv_pull import KvPuller

logger = logging.getLogger(__name__)

MAX_PREFILL_ANSWER_BYTES: Final = 1 << 20


class PrefillUnavailable(Exception):
    """The prefill route did not run the prompt (unreachable, refused, failed): the decode route prefills it."""


@dataclass(frozen=True)
class PrefillPlan:
    """A verified prefill route for this request."""

    hop: RoutedHop

    @property
    def token(self) -> str:
        return self.hop.token


class PdHead:
    """What a head needs for prefill/decode handoffs: the layout check and the prefill call."""

    def __init__(self, *, http: httpx.AsyncClient, node_id: str, hop_key: SigningKey, puller: KvPuller,
                 timeout_s: float) -> None:
        self._http = http
        self._node_id = node_id
        self._hop_key = hop_key
        self.puller = puller
        self._timeout_s = timeout_s

    async def prefill(self, plan: PrefillPlan, decode: RoutedHop, session_id: str, ids: tuple[int, ...],
                      sampling: SamplingParams) -> PrefillAnswer:
        """Run ``ids`` along ``plan``'s route, holding its KV under ``session_id`` for the nodes of ``decode``
        (this head's route); the first token."""
        head = plan.hop.route.head
        headers = {"Content-Type": "application/json", h.ROUTE: plan.token, DECODE_ROUTE: decode.token,
                   h.SESSION: session_id, h.SAMPLING: orjson.dumps(sampling.model_dump()).decode()}
        body = orjson.dumps({"ids": list(ids)})
        headers.update(sign_request(self._hop_key, self._node_id, PREFILL_PATH, headers, body))
        try:
            response = await self._http.post(f"{head.endpoint.rstrip('/')}{PREFILL_PATH}", headers=headers,
                                             content=body, timeout=self._timeout_s)
        except httpx.HTTPError as exc:
            raise PrefillUnavailable(f"the prefill head {head.node_id} could not be reached: "
                                     f"{type(exc).__name__}: {exc}") from None
        if response.status_code != 200:
            raise PrefillUnavailable(f"the prefill head {head.node_id} answered {response.status_code}: "
                                     f"{response.text[:300]}")
        if len(response.content) > MAX_PREFILL_ANSWER_BYTES:
            raise PrefillUnavailable(f"the prefill head {head.node_id} answered over {MAX_PREFILL_ANSWER_BYTES} bytes")
        try:
            return PrefillAnswer.model_validate_json(response.content)
        except ValidationError as exc:
            raise PrefillUnavailable(f"the prefill head {head.node_id} answered no prefill answer: "
                                     f"{exc.errors()[0]['msg']}") from None
