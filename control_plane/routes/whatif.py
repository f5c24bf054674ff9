"""What-if runs (`control_plane.whatif`): a stored window of traffic samples replayed through the
simulator for static splits, the look-ahead oracle, the active policy and the candidates.

    POST /api/v1/whatif-runs             start one over [start_s, end_s) (operator; 202; 409 while one
                                         runs; 422 for a bad window or one with no sample; 404 for an
                                         unknown candidate)
    GET  /api/v1/whatif-runs             the newest runs, without their results (operator, viewer)
    GET  /api/v1/whatif-runs/latest      the newest run (``state=done``: the newest finished), with its
                                         result and sentence (404: none yet)
    GET  /api/v1/whatif-runs/{run_id}    one run, with its result (poll it for ``progress``)
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from fastapi import APIRouter, HTTPException, Query, Request
from pydantic import Field

from common.contract import In, Out, ReportTime, Version
from db import queries
from db.models import WhatIfRun

from ..whatif import EmptyWindow, WhatIfRunner, check_window, run_dict, start_run
from .deps import OPERATOR, VIEWER, Id64, begin, errors, invalid, now_s, principal, roles, session, settings

router = APIRouter()


class WhatIfIn(In):
    start_s: ReportTime
    end_s: ReportTime
    candidate: Version | None = None  # judge this registered policy (with the active one); None: every candidate


class WhatIfOut(Out):
    id: int
    state: Literal["running", "done", "failed"]
    created_by: str
    created_at_s: float
    updated_s: float
    finished_s: float | None
    window_start_s: float
    window_end_s: float
    candidate: str | None
    progress: Annotated[float, Field(ge=0, le=1)]
    progress_note: str
    num_samples: int | None
    cut: dict[str, Any] | None
    profile: dict[str, Any] | None
    code_version: str | None
    error: str | None
    result: dict[str, Any] | None
    sentence: str | None


def _out(run: WhatIfRun, with_result: bool = True) -> WhatIfOut:
    return WhatIfOut.model_validate(run_dict(run, with_result=with_result))


@router.post("/whatif-runs", response_model=WhatIfOut, status_code=202, responses=errors(404, 409),
             **roles(OPERATOR))
def start_whatif(body: WhatIfIn, request: Request, p: principal(OPERATOR)):
    now = now_s(request)
    st = settings(request)
    bad = check_window(body.start_s, body.end_s, now_s=now, max_window_s=st.whatif_max_window_s)
    if bad is not None:
        raise invalid(["body", bad[0]], bad[1])
    try:
        with begin(request) as s:
            run = start_run(s, st, start_s=body.start_s, end_s=body.end_s, candidate=body.candidate, actor=p.name,
                            now_s=now)
            out = _out(run)
    except EmptyWindow as e:
        raise invalid(["body", "start_s"], str(e)) from None
    _runner(request).start(out.id)
    return out


def _runner(request: Request) -> WhatIfRunner:
    """The app's what-if runner (made on the first start)."""
    st = request.app.state
    if getattr(st, "whatif", None) is None:
        st.whatif = WhatIfRunner(st.factory, st.settings, clock=st.clock)
    return st.whatif


@router.get("/whatif-runs", response_model=list[WhatIfOut], **roles(OPERATOR, VIEWER))
def list_whatif(request: Request, limit: Annotated[int, Query(ge=1, le=100)] = 20,
                state: Annotated[str | None, Query(pattern="^(running|done|failed)$")] = None):
    with session(request) as s:
        return [_out(r, with_result=False) for r in queries.whatif_runs(s, limit=limit, state=state)]


@router.get("/whatif-runs/latest", response_model=WhatIfOut, responses=errors(404), **roles(OPERATOR, VIEWER))
def latest_whatif(request: Request, state: Annotated[str | None, Query(pattern="^(running|done|failed)$")] = None,
                  candidate: Annotated[str | None, Query(min_length=1, max_length=256)] = None):
    with session(request) as s:
        run = queries.latest_whatif(s, state=state, candidate=candidate)
        if run is None:
            raise HTTPException(404, "no what-if run yet" + (f" naming {candidate!r}" if candidate else ""))
        return _out(run)


@router.get("/whatif-runs/{run_id}", response_model=WhatIfOut, responses=errors(404), **roles(OPERATOR, VIEWER))
def get_whatif(run_id: Id64, request: Request):
    with session(request) as s:
        run = s.get(WhatIfRun, run_id)
        if run is None:
            raise HTTPException(404, f"whatif run {run_id} does not exist")
        return _out(run)
