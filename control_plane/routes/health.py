"""Outside ``/api/v1`` and without a token: liveness (``GET /healthz``: this replica, whether it
leads the scheduler) and the Prometheus metrics (``GET /metrics``)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

router = APIRouter()


#: the tables whose first rows `/healthz` reads (each read touches its b-tree's root and first leaf)
PROBED_TABLES = ("nodes", "node_reports", "tokens", "policies", "models", "rollouts", "overrides", "audit_log")
PROBE_EVERY_S = 2.0


def _probe(request: Request) -> str | None:
    """None if the database answers a read of each of `PROBED_TABLES`, else why not; cached for
    ``PROBE_EVERY_S`` so a health check costs at most one probe per period."""
    import time

    from sqlalchemy import text
    from sqlalchemy.exc import SQLAlchemyError

    st = request.app.state
    now = time.monotonic()
    cached = getattr(st, "db_probe", None)
    if cached is not None and now - cached[0] < PROBE_EVERY_S:
        return cached[1]
    why = None
    try:
        with st.engine.connect() as conn:
            for t in PROBED_TABLES:
                conn.execute(text(f"SELECT * FROM {t} LIMIT 1")).first()  # the table itself, not an index
    except SQLAlchemyError as e:
        why = f"{t}: {type(getattr(e, 'orig', e)).__name__}: {str(getattr(e, 'orig', e))[:200]}"
    st.db_probe = (now, why)
    return why


@router.get("/healthz")
def healthz(request: Request):
    """This replica: 200 while its database answers a read of every main table; 503 saying which
    read failed (a corrupted table, an unreachable server) otherwise."""
    sch = getattr(request.app.state, "scheduling", None)
    out = {"ok": True, "instance": getattr(request.app.state, "instance", None), "leader": bool(sch and sch.leader)}
    why = _probe(request) if getattr(request.app.state, "engine", None) is not None else None
    if why is not None:
        return JSONResponse(status_code=503, content={**out, "ok": False, "database": why})
    return out


@router.get("/metrics", response_class=PlainTextResponse,
            responses={200: {"content": {"text/plain": {}}, "description": "Prometheus text format"}})
def metrics(request: Request):
    return Response(generate_latest(request.app.state.metrics.registry), media_type=CONTENT_TYPE_LATEST)
