"""Outside ``/api/v1`` and without a token: liveness (``GET /healthz``: this replica, whether it
leads the scheduler) and the Prometheus metrics (``GET /metrics``)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

router = APIRouter()


@router.get("/healthz")
def healthz(request: Request):
    sch = getattr(request.app.state, "scheduling", None)
    return {"ok": True, "instance": getattr(request.app.state, "instance", None),
            "leader": bool(sch and sch.leader)}


@router.get("/metrics", response_class=PlainTextResponse,
            responses={200: {"content": {"text/plain": {}}, "description": "Prometheus text format"}})
def metrics(request: Request):
    return Response(generate_latest(request.app.state.metrics.registry), media_type=CONTENT_TYPE_LATEST)
