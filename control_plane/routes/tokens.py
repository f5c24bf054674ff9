"""Identity and tokens: who a token is (``GET /whoami``) and new tokens (``POST /tokens``)."""

from __future__ import annotations

from fastapi import APIRouter, Request

from db import queries

from ..auth import new_secret
from ..schemas import TokenIn, TokenOut, WhoAmIOut
from .deps import NODE, OPERATOR, ROUTER, VIEWER, begin, errors, now_s, principal, roles

router = APIRouter()


@router.get("/whoami", response_model=WhoAmIOut, **roles(NODE, OPERATOR, VIEWER, ROUTER))
def whoami(p: principal(NODE, OPERATOR, VIEWER, ROUTER)):
    return WhoAmIOut(token_id=p.token_id, name=p.name, role=p.role, node_id=p.node_id)


@router.post("/tokens", response_model=TokenOut, status_code=201, responses=errors(413), **roles(OPERATOR))
def create_token(body: TokenIn, request: Request, p: principal(OPERATOR)):
    secret = new_secret()
    now = now_s(request)
    with begin(request) as s:
        replaced = queries.revoke_node_tokens(s, body.node_id) if body.replace else []
        t = queries.add_token(s, name=body.name, role=body.role, secret=secret, now_s=now, node_id=body.node_id)
        queries.audit(s, ts_s=now, actor=p.name, action="token.create", target=f"token:{t.id}",
                      before={"revoked_token_ids": replaced} if replaced else None,
                      after={"name": body.name, "role": body.role, "node_id": body.node_id}, reason="")
        out = TokenOut(id=t.id, name=t.name, role=t.role, node_id=t.node_id, token=secret,
                       replaced_token_ids=replaced)
    if replaced:
        request.app.state.tokens.forget_node(body.node_id)
    return out
