"""Pieces every RACER process shares and that depend on no other RACER folder: the HTTP serving
base (`common.http_server`) and the config validation helper (`common.config`)."""
