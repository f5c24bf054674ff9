"""What every route module shares: the roles a route accepts (its dependency and its OpenAPI
marker, which `control_plane.gate` reads from the route), the error responses it documents, and
small helpers to reach the app's state (``request.app.state``) and look rows up."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, HTTPException, Path, Query, Request

from common.contract import INT64_MAX
from db.models import ModelVersion, Node, Override, Policy, Rollout, Router, Token

from ..auth import Principal, Require
from ..schemas import ErrorOut

NODE, OPERATOR, VIEWER, ROUTER = "node", "operator", "viewer", "router"


def roles(*r: str) -> dict:
    """Dependencies and OpenAPI marker of a route that accepts roles ``r``."""
    return {"dependencies": [Depends(Require(*r))], "openapi_extra": {"x-racer-roles": list(r)}}


def principal(*r: str):
    return Annotated[Principal, Depends(Require(*r))]


ERROR_DESCRIPTIONS = {
    401: "missing, unknown or revoked token", 403: "the token's role may not do this",
    404: "the named object does not exist", 409: "conflicts with the object's current state",
    413: "body too large", 422: "invalid input: `detail` lists each refused field (`loc`) and why (`msg`)",
    503: "database unavailable; retry later"}


def errors(*codes: int) -> dict:
    """OpenAPI ``responses`` for error statuses ``codes``: all answer the one error model, `ErrorOut`."""
    return {c: {"model": ErrorOut, "description": ERROR_DESCRIPTIONS[c]} for c in codes}


def invalid(loc: list, msg: str) -> HTTPException:
    """A 422 in the shape of pydantic's validation errors, naming the refused field (``loc``)."""
    return HTTPException(422, [{"loc": list(loc), "msg": msg, "type": "value_error"}])


Id64 = Annotated[int, Path(ge=0, le=INT64_MAX, description="an id (0 <= id < 2^63)")]
Offset = Annotated[int, Query(ge=0, le=INT64_MAX)]
PageLimit = Annotated[int, Query(ge=1, le=1000)]  # rows of one page of a list


def begin(request: Request):
    """A session in a transaction of its own (``with begin(request) as s``): committed when the
    block ends, rolled back on an exception. The route owns it."""
    return request.app.state.factory.begin()


def session(request: Request):
    """A session for reads (``with session(request) as s``)."""
    return request.app.state.factory()


def now_s(request: Request) -> float:
    """The app's clock (injected into `control_plane.api.create_app`; tests drive virtual time)."""
    return request.app.state.clock()


def settings(request: Request):
    """The app's `control_plane.settings.Settings`."""
    return request.app.state.settings


# 404 messages of the rows a route looks up by key (one wording per kind of row)
_NOT_FOUND = {Node: "node_id {!r} is not registered", Router: "url {!r} is not a registered router",
              Override: "override_id {} does not exist", Policy: "policy version {!r} is not in the registry",
              Rollout: "rollout_id {} does not exist", ModelVersion: "model version {!r} is not in the registry",
              Token: "token_id {} does not exist"}


def get_or_404(s, model, key):
    """The row of ``model`` with primary key ``key``, or a 404 that names the key."""
    row = s.get(model, key)
    if row is None:
        raise HTTPException(404, _NOT_FOUND[model].format(key))
    return row
