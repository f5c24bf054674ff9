"""Pieces every RACER process shares and that depend on no other RACER folder: the wire contract
(`common.contract`: what a node agent and a gateway send the control plane, and what it sends
back), the HTTP serving base (`common.http_server`), the config validation helper
(`common.config`), the cost profiles and the router weights derived from them
(`common.weights`)."""
