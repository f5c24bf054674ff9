"""What a gateway sends the control plane: what its clients see, one report per
``client_report_interval_s`` (``POST /api/v1/gateways/{gateway_id}/reports``, built by
`gateway.client_view.ClientView`), and the traffic it samples (``POST
/api/v1/gateways/{gateway_id}/samples``, built by `gateway.traffic_sample.Sampler`). Both keep
what was not taken and send it again; `gateway.decisions.client_report_step` reads the control
plane's answer to a batch. `Uplink` holds these methods of `gateway.gateway.Gateway`."""

from __future__ import annotations

import json
import logging
import os
import re
import socket
from collections.abc import Awaitable, Callable

import httpx

from .decisions import client_report_step
from .state import GatewayState

log = logging.getLogger("racer.gateway")

MAX_PENDING_CLIENT_REPORTS = 600  # reports kept while the control plane does not take them (oldest dropped)
SAMPLE_BATCH = 250  # traffic samples per batch (the control plane takes 500: common.contract.MAX_SAMPLE_BATCH)
SAMPLE_BATCH_BYTES = 512 * 2**10  # and about this much JSON (its max_sample_body_bytes: 1 MiB by default)
CLIENT_REPORT_BATCH = 60
_GATEWAY_ID_BAD = re.compile(r"[^A-Za-z0-9_.:\-]")


def gateway_id_from(text: str) -> str:
    """An id the control plane accepts (``[A-Za-z0-9_.:-]``, at most 128 characters) made from ``text``."""
    return (_GATEWAY_ID_BAD.sub("-", text.split("://", 1)[-1].rstrip("/")) or "gateway")[:128]


class Uplink(GatewayState):
    """Client reports and traffic samples to the control plane, under the gateway's ``gateway_id``:
    the pending reports and their counts (``client_reports``, ``client_reports_sent``,
    ``client_reports_dropped``, ``client_report_error``), the sampler's batches and theirs
    (``sampler``, ``samples_sent``, ``sample_error``)."""

    # ------------------------------------------------------------------- client reports ---
    async def report_clients(self) -> None:
        """End the client-side interval and send every pending report to the control plane
        (batches of `CLIENT_REPORT_BATCH`). A report the control plane refuses for good (403,
        413, 422) is dropped, counted and logged; on a connection error, 401, 409 or 5xx it is kept
        and sent again next interval (idempotent there on gateway id and seq); a batch over the
        control plane's body cap (413) or refused as invalid (422) is sent again in halves, so only
        the one report refused alone is dropped."""
        live = {l.node_id: l.live for l in self.links}
        self.client_reports.append(self.client_view.close(num_live_nodes=sum(live.values()), num_nodes=len(live),
                                                          live=live))
        if not self.control_plane or self.client is None:
            return
        self._ensure_gateway_id()
        url = f"{self.control_plane}/api/v1/gateways/{self.gateway_id}/reports"
        pending = self.client_reports

        async def post(batch: list) -> httpx.Response:
            return await self.client.post(url, json={"reports": batch}, headers=self._headers(), timeout=5.0)

        def settle(batch: list, r: httpx.Response, dropped: bool) -> None:
            for _ in batch:
                pending.popleft()
            if dropped:
                self.client_reports_dropped += len(batch)
                self._client_report_failed(f"{r.status_code}: {r.text[:300]} ({len(batch)} reports dropped)")
                return
            self.client_reports_sent += len(batch)
            self.client_report_error = None

        await self._send_batches(CLIENT_REPORT_BATCH, lambda size: [pending[k] for k in range(min(size, len(pending)))],
                                 post, self._client_report_failed, settle)

    def _ensure_gateway_id(self) -> None:
        """The id this gateway reports and samples under: given, else one from host and process."""
        if self.gateway_id is None:
            self.gateway_id = gateway_id_from(f"{socket.gethostname()}-{os.getpid()}")

    def _client_report_failed(self, error: str) -> None:
        if error != self.client_report_error:
            log.warning(json.dumps({"event": "client_report_failed", "gateway_id": self.gateway_id, "error": error,
                                    "pending": len(self.client_reports)}))
        self.client_report_error = error

    # ------------------------------------------------------------------ traffic samples ---
    async def send_samples(self) -> None:
        """Hash what was sampled since the last round (`Sampler.prepare`) and send every ready sample
        to the control plane (batches of `SAMPLE_BATCH`, about `SAMPLE_BATCH_BYTES`), with the reports'
        refusal handling (`client_report_step`): kept on no answer, 401, 409, 429 or 5xx (idempotent
        there on gateway id and seq); a 413 or 422 batch sent again in halves; dropped and counted
        (``refused``) when refused alone or with another 4xx."""
        smp = self.sampler
        if smp is None:
            return
        await smp.prepare()
        if not self.control_plane or self.client is None:
            return
        self._ensure_gateway_id()
        url = f"{self.control_plane}/api/v1/gateways/{self.gateway_id}/samples"

        async def post(batch: list) -> httpx.Response:
            content = await smp.body(batch)
            return await self.client.post(url, content=content, timeout=10.0,
                                          headers={**self._headers(), "content-type": "application/json"})

        def settle(batch: list, r: httpx.Response, dropped: bool) -> None:
            if dropped:
                smp.drop(batch, "refused")
                self._sample_failed(f"{r.status_code}: {r.text[:300]} ({len(batch)} samples dropped)")
                return
            smp.pop(batch)
            self.samples_sent += len(batch)
            self.metrics.samples_sent.inc(len(batch))
            self.sample_error = None

        await self._send_batches(SAMPLE_BATCH, lambda size: smp.peek(size, SAMPLE_BATCH_BYTES) if smp.ready else [],
                                 post, self._sample_failed, settle)

    def _sample_failed(self, error: str) -> None:
        if error != self.sample_error:  # an answer may echo what was sent: hashes, never a raw id
            log.warning(json.dumps({"event": "traffic_samples_failed", "gateway_id": self.gateway_id, "error": error,
                                    "pending": self.sampler.pending if self.sampler else 0}))
        self.sample_error = error

    # ----------------------------------------------------------------------- both sends ---
    async def _send_batches(self, max_batch: int, next_batch: Callable[[int], list],
                            post: Callable[[list], Awaitable[httpx.Response]], failed: Callable[[str], None],
                            settle: Callable[[list, httpx.Response, bool], None]) -> None:
        """Send a backlog to the control plane batch by batch, as `client_report_step` reads each
        answer: ``next_batch(size)`` is the backlog's oldest, at most ``size`` (empty: nothing
        left), ``post`` sends it; on no answer or an answer that keeps the batch the rest waits for
        the next round (``failed`` says why); a batch too large or invalid is sent again in halves;
        ``settle(batch, answer, dropped)`` once it is stored, or refused for good (``dropped``)."""
        size = max_batch
        while batch := next_batch(size):
            try:
                r = await post(batch)
            except httpx.HTTPError as e:
                failed(f"{type(e).__name__}: {e}")
                return
            step = client_report_step(r.status_code, len(batch), max_batch)
            if step.action == "keep":
                failed(f"{r.status_code}: {r.text[:200]}")
                return
            size = step.next_size or size
            if step.action != "split":
                settle(batch, r, step.action == "drop")

    # ---------------------------------------------------------------------- inspection ---
    def describe_clients(self) -> dict:
        """The client-side view: the interval so far (not yet reported) and the reporting state."""
        v = self.client_view
        return {"gateway_id": self.gateway_id, "slo_ms": v.slo_ms, "next_seq": v.seq,
                "interval_so_far": {"num_requests": sum(v.outcomes.values()), "outcomes": dict(v.outcomes),
                                    "num_retried": v.retried, "load_phase": v.last_phase},
                "pending_reports": len(self.client_reports), "reports_sent": self.client_reports_sent,
                "reports_dropped": self.client_reports_dropped,
                "report_error": self.client_report_error,
                "reporting_to": self.control_plane,
                "samples": None if self.sampler is None else {**self.sampler.describe(), "sent": self.samples_sent,
                                                              "error": self.sample_error}}
