"""Routers (gateways that take pushed weights) and the router weights the control plane computes."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, HTTPException, Query, Request

from db import queries
from db.models import Router

from ..auth import push_token_for
from ..jobs import secret_key_of
from ..schemas import RouterIn, RouterOut, RouterRegisteredOut, RouterWeightsHistoryOut, RouterWeightsOut
from .deps import NODE, OPERATOR, ROUTER, VIEWER, PageLimit, begin, errors, get_or_404, now_s, principal, roles, session

router = APIRouter()


def _router_out(x: Router) -> RouterOut:
    return RouterOut(url=x.url, registered_at_s=x.registered_at_s, pushed_version=x.pushed_version,
                     last_push_s=x.last_push_s, last_error=x.last_error)


#: the most registered routers: each costs a push per weights version (the registry is not a
#: place to list arbitrary URLs for the control plane to call)
MAX_ROUTERS = 64


@router.post("/routers", response_model=RouterRegisteredOut, responses=errors(403, 409), **roles(ROUTER))
def register_router(body: RouterIn, request: Request, p: principal(ROUTER)):
    """A gateway registers the URL it takes weight pushes on, with its router token: the URL is
    then bound to that token (another router token may take it over only once the first is
    revoked), and at most ``MAX_ROUTERS`` are registered. The answer carries the push token the
    control plane's pushes to that URL will carry (derived from its secret key, never stored)."""
    now = now_s(request)
    key = secret_key_of(request.app.state.settings, request.app.state.factory)
    if key is None:
        raise HTTPException(409, "weight pushes are off: this control plane has no secret key (RACER_SECRET_KEY or "
                                 "--secret-key-file, the same on every replica); the gateway pulls the weights")
    with begin(request) as s:
        old = s.get(Router, body.url)
        if (old is not None and old.token_id is not None and old.token_id != p.token_id
                and queries.token_valid(s, old.token_id)):
            raise HTTPException(403, f"router {body.url!r} was registered with another router token (id "
                                     f"{old.token_id}, still valid): only that token changes it")
        if old is None and queries.count_routers(s) >= MAX_ROUTERS:
            raise HTTPException(409, f"{MAX_ROUTERS} routers are registered: delete one (DELETE /routers?url=...) "
                                     f"before registering another")
        rt, new = queries.upsert_router(s, body.url, now, token_id=p.token_id)
        if new:
            queries.audit(s, ts_s=now, actor=p.name, action="router.register", target=f"router:{body.url}",
                          after={"url": body.url}, reason="")
        return RouterRegisteredOut(**_router_out(rt).model_dump(),
                                   push_token=push_token_for(key, body.url, p.token_id))


@router.get("/routers", response_model=list[RouterOut], **roles(OPERATOR, VIEWER))
def routers(request: Request):
    with session(request) as s:
        return [_router_out(x) for x in queries.list_routers(s)]


@router.delete("/routers", response_model=RouterOut, responses=errors(404), **roles(OPERATOR))
def delete_router(request: Request, p: principal(OPERATOR),
                  url: Annotated[str, Query(min_length=1, max_length=512)]):
    with begin(request) as s:
        rt = get_or_404(s, Router, url)
        out = _router_out(rt)
        s.delete(rt)
        queries.audit(s, ts_s=now_s(request), actor=p.name, action="router.delete", target=f"router:{url}",
                      before={"url": url}, reason="")
        return out


@router.get("/router/weights", response_model=RouterWeightsOut, responses=errors(404),
            **roles(NODE, OPERATOR, VIEWER, ROUTER))
def router_weights(request: Request):
    with session(request) as s:
        w = queries.latest_weights(s)
        if w is None:
            raise HTTPException(404, "no router weights yet (no node has registered, or the weights job has "
                                     "not run)")
        return RouterWeightsOut(version=w.version, computed_at_s=w.computed_at_s, nodes=w.nodes)


@router.get("/router/weights/history", response_model=list[RouterWeightsHistoryOut], **roles(OPERATOR, VIEWER))
def router_weights_history(request: Request, limit: PageLimit = 100):
    with session(request) as s:
        return [RouterWeightsHistoryOut.model_validate(w) for w in queries.weights_history(s, limit)]
