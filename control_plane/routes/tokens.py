"""Identity and tokens: who a token is (``GET /whoami``), new tokens (``POST /tokens``), the list
without secrets (``GET /tokens``) and revocation (``POST /tokens/{id}/revoke``)."""

from __future__ import annotations

from fastapi import APIRouter, HTTPException, Request
from sqlalchemy import select

from db import queries
from db.models import Token

from ..auth import new_secret
from ..schemas import ReasonIn, TokenIn, TokenInfoOut, TokenOut, WhoAmIOut
from .deps import NODE, OPERATOR, ROUTER, VIEWER, Id64, begin, errors, get_or_404, now_s, principal, roles, session

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


@router.get("/tokens", response_model=list[TokenInfoOut], **roles(OPERATOR))
def tokens(request: Request):
    """Every token, newest first: id, name, role, node, created, revoked (never a secret or a hash)."""
    with session(request) as s:
        return [TokenInfoOut(id=t.id, name=t.name, role=t.role, node_id=t.node_id, created_at_s=t.created_at_s,
                             revoked=bool(t.revoked)) for t in s.scalars(select(Token).order_by(Token.id.desc()))]


@router.post("/tokens/{token_id}/revoke", response_model=TokenInfoOut, responses=errors(404, 409),
             **roles(OPERATOR))
def revoke_token(token_id: Id64, body: ReasonIn, request: Request, p: principal(OPERATOR)):
    """Revoke any token (a leaked operator, viewer, router or node token). It stops working at
    once on this control-plane process and within the token cache's 5 s on the others. The last
    valid operator token is not revoked (409): nobody could act afterwards."""
    now = now_s(request)
    with begin(request) as s:
        t = get_or_404(s, Token, token_id)
        if t.revoked:
            raise HTTPException(409, f"token {token_id} is already revoked")
        if t.role == "operator" and queries.count_tokens(s, "operator", revoked=False) <= 1:
            raise HTTPException(409, f"token {token_id} is the last valid operator token: create another "
                                     f"(POST /tokens) before revoking it")
        t.revoked = True
        queries.audit(s, ts_s=now, actor=p.name, action="token.revoke", target=f"token:{t.id}",
                      before={"revoked": False}, after={"revoked": True}, reason=body.reason)
        out = TokenInfoOut(id=t.id, name=t.name, role=t.role, node_id=t.node_id, created_at_s=t.created_at_s,
                           revoked=True)
    request.app.state.tokens.forget_id(token_id)
    return out
