"""The audit log: every change an operator, a node or the system made, newest first."""

from __future__ import annotations

from fastapi import APIRouter, Request

from db import queries

from ..schemas import AuditPage
from .deps import OPERATOR, VIEWER, Offset, PageLimit, roles, session

router = APIRouter()


@router.get("/audit", response_model=AuditPage, **roles(OPERATOR, VIEWER))
def audit_log(request: Request, actor: str | None = None, action: str | None = None, target: str | None = None,
              start_s: float | None = None, end_s: float | None = None,
              offset: Offset = 0, limit: PageLimit = 100):
    with session(request) as s:
        total, rows = queries.audit_page(s, start_s=start_s, end_s=end_s, actor=actor, action=action,
                                         target=target, offset=offset, limit=limit)
        return AuditPage(total=total, offset=offset, limit=limit, items=rows)
