"""The control plane's API routes, one module per resource (base path ``/api/v1``).

Each module declares its routes at module level on its own ``router`` (a FastAPI `APIRouter`),
with the roles each accepts (`deps.roles`, read by `control_plane.gate` from each route);
`control_plane.api.create_app` includes them in this order:

    tokens       GET /whoami, POST /tokens
    nodes        POST /nodes/register, POST /nodes/{node_id}/reports, GET /nodes,
                 POST /nodes/{node_id}/retire, GET /nodes/{node_id}
    directives   GET /nodes/{node_id}/directives, POST /nodes/{node_id}/policy, POST /nodes/{node_id}/model
    history      GET /reports, /decisions, /bursts, /summary, /jobs, /alerts
    routers      POST, GET, DELETE /routers; GET /router/weights, /router/weights/history
    overrides    GET, POST /overrides; POST /overrides/{override_id}/clear
    audit        GET /audit
    policies     POST, GET /policies; GET /policies/{version}, /policies/{version}/artifact;
                 POST /policies/{version}/activate
    models       POST, GET /models; GET /models/{version}, /models/{version}/artifact;
                 POST /models/{version}/activate (checkpoints; version = checkpoint digest)
    rollouts     POST, GET /rollouts (kind policy or model); GET /rollouts/{rollout_id};
                 POST /rollouts/{rollout_id}/{promote,pause,resume,rollback}
    gateways     POST /gateways/{gateway_id}/reports, GET /gateways, GET /gateway-reports
    whatif       POST, GET /whatif-runs; GET /whatif-runs/latest, /whatif-runs/{run_id}
    health       GET /healthz, GET /metrics (outside /api/v1, no token)

A route reaches the app's state through ``request.app.state`` (the session factory, the clock,
the settings, the token cache, the ingest writer, the metrics) and owns its transaction
(``with begin(request) as s``: commit on success, rollback on an exception); the `db.queries`
functions it calls take that session and never commit. `report_ingest` holds the report
ingestion the ``/nodes/{node_id}/reports`` route and its ASGI fast path share; `registry` the
upload, storing and download the policies and models routes share.
"""
