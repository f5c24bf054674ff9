"""The ``racer policy`` subcommands; racer/cli.py registers them with `add_policy_parser`.

    racer policy export --checkpoint CKPT --out DIR [--num-golden 64] [--seed 0] [--tolerance 1e-5] [--force] [--json]
    racer policy verify DIR [--json]
    racer policy widen SRC --out DIR [--force] [--json]
    racer policy train [--total-steps N] [--out DIR] [--seed S] [--trace taobao,amazon] [...] [--json]
    racer policy push DIR --control-plane URL --token T [--activate] [--reason WHY] [--json]

Errors a user can fix (missing checkpoint, refused export, bad artifact) raise ValueError /
FileNotFoundError / FileExistsError subclasses, which racer's ``main`` prints as one line with
exit status 2.
"""

from __future__ import annotations

import argparse
import json

from node_agent.argtypes import positive_float
from node_agent.registry_client import add_push_arguments


def cmd_policy_export(args) -> int:
    from .export import export_checkpoint

    try:
        manifest = export_checkpoint(args.checkpoint, args.out, num_golden=args.num_golden, seed=args.seed,
                                     tolerance=args.tolerance, overwrite=args.force)
    except FileExistsError as e:  # racer's main prints ValueError / FileNotFoundError as usage errors
        raise ValueError(str(e)) from None
    summary = {"artifact": str(args.out), "policy_id": manifest["policy_id"],
               "onnx_sha256": manifest["onnx_sha256"], "onnx_bytes": manifest["onnx_bytes"],
               "feature_schema_version": manifest["feature_schema_version"], "num_golden": manifest["num_golden"],
               "parity_max_abs_diff": manifest["parity"]["max_abs_diff"], "tolerance": manifest["parity"]["tolerance"]}
    if args.json:
        print(json.dumps(summary))
    else:
        print(f"exported policy {summary['policy_id']} to {args.out} "
              f"(parity max |ort - torch| = {summary['parity_max_abs_diff']:.2e} <= {summary['tolerance']:g}, "
              f"{summary['num_golden']} golden inputs, {summary['onnx_bytes']} bytes)")
    return 0


def cmd_policy_verify(args) -> int:
    from .export import verify_artifact

    manifest = verify_artifact(args.artifact)
    summary = {"artifact": str(args.artifact), "policy_id": manifest["policy_id"], "accepted": True,
               "feature_schema_version": manifest["feature_schema_version"]}
    print(json.dumps(summary) if args.json else f"{args.artifact}: policy {manifest['policy_id']} accepted")
    return 0


def cmd_policy_widen(args) -> int:
    """An artifact of an older feature schema whose features are this schema's first N (schema 2)
    re-exported for this schema: the same policy, zero weights on the features it never saw."""
    from pathlib import Path

    from node_agent.features import SCHEMA_PREFIX, SCHEMA_VERSION

    from .actor import ActorConfig, make_initial_actor
    from .export import export_actor, verify_artifact
    from .train_ppo import artifact_schema, load_policy_weights, read_older_artifact

    src = Path(args.src)
    schema = artifact_schema(src)
    if schema == SCHEMA_VERSION:
        raise ValueError(f"{src}: already of feature schema {schema}; nothing to widen")
    if schema not in SCHEMA_PREFIX:
        verify_artifact(src)  # raises, saying why (unreadable, or a schema whose features are not a prefix of ours)
    old, _, _ = read_older_artifact(src, schema)
    cfg = old["actor_config"]
    actor = make_initial_actor(0, ActorConfig(hidden_sizes=tuple(cfg["hidden_sizes"]),
                                              activation=cfg.get("activation", "tanh")))
    loaded = load_policy_weights(actor, src)
    training = {**(old.get("training_config") or {}), "widened_from": {**loaded["widened_from"],
                                                                       "policy_id": loaded["policy_id"]}}
    try:
        manifest = export_actor(actor, args.out, training_config=training, evaluation=old.get("evaluation") or {},
                                overwrite=args.force, source=f"widened from {src} ({loaded['policy_id']})")
    except FileExistsError as e:
        raise ValueError(str(e)) from None
    summary = {"artifact": str(args.out), "policy_id": manifest["policy_id"], "widened_from": loaded["policy_id"],
               "feature_schema_version": manifest["feature_schema_version"],
               "golden_max_abs_diff": loaded["golden_max_abs_diff"]}
    print(json.dumps(summary) if args.json else
          f"widened policy {loaded['policy_id']} (schema {loaded['widened_from']['feature_schema_version']}) to "
          f"{manifest['policy_id']} (schema {manifest['feature_schema_version']}) at {args.out}; its shares on the old "
          f"golden inputs differ by {loaded['golden_max_abs_diff']:.1e}")
    return 0


PUSH_FILES = ("manifest.json", "policy.onnx", "golden.npz")


def cmd_policy_push(args) -> int:
    """Register an artifact with the control plane (``POST /api/v1/policies``, where the node
    agent's loader checks it), and activate it with ``--activate``. Exit status 1 when the control
    plane refuses it (its reason on stderr), 2 for a bad directory or option."""
    from pathlib import Path

    from common.artifact_pack import pack_directory
    from node_agent.registry_client import push_from_args

    src = Path(args.artifact)
    if not src.is_dir():
        raise FileNotFoundError(f"{src}: not a directory (the one `racer policy export` wrote)")
    missing = [f for f in PUSH_FILES if not (src / f).is_file()]
    if missing:
        raise FileNotFoundError(f"{src}: lacks {', '.join(missing)} (an artifact has {', '.join(PUSH_FILES)})")
    rc, out = push_from_args("policies", pack_directory(src, PUSH_FILES), args, prog="racer policy push")
    if rc:
        return rc
    if args.json:
        print(json.dumps(out))
    else:
        print(f"policy {out['version']} {'registered' if out['created'] else 'already registered'} "
              f"(digest {out['digest'][:12]}), status {out['status']}")
    return 0


def cmd_policy_train(args) -> int:
    from .train_ppo import cmd_train

    return cmd_train(args)


def add_policy_parser(subparsers) -> argparse.ArgumentParser:
    """Add ``policy`` (with ``train``, ``export`` and ``verify``) to racer's top-level subparsers."""
    from .train_ppo import add_train_arguments

    pol = subparsers.add_parser("policy", help="train, export and verify SmartAllocator policies",
                                description="SmartAllocator base policies: ONNX artifacts with parity checks.")
    sub = pol.add_subparsers(dest="policy_command", metavar="SUBCOMMAND", required=True)

    e = sub.add_parser("export", help="export a trained actor checkpoint to an ONNX policy artifact",
                       description="ONNX export + onnx.checker + ORT-vs-torch parity on golden inputs; the "
                                   "artifact (policy.onnx, golden.npz, manifest.json) is written only if all pass.")
    e.add_argument("--checkpoint", required=True, help="actor checkpoint (policies.actor.save_checkpoint)")
    e.add_argument("--out", required=True, help="artifact directory to create")
    e.add_argument("--num-golden", type=int, default=64, help="golden inputs stored with the artifact (default 64)")
    e.add_argument("--seed", type=int, default=0, help="seed of the golden inputs (default 0)")
    e.add_argument("--tolerance", type=positive_float, default=1e-5,
                   help="max |onnxruntime - torch| on the golden inputs (default 1e-5)")
    e.add_argument("--force", action="store_true", help="replace an existing artifact directory")
    e.add_argument("--json", action="store_true", help="print one JSON object")
    e.set_defaults(func=cmd_policy_export)

    v = sub.add_parser("verify", help="re-check an artifact (manifest, sha256, checker, parity, probes)",
                       description="Check a policy artifact from its files alone, as the node agent does on load.")
    v.add_argument("artifact", help="artifact directory")
    v.add_argument("--json", action="store_true", help="print one JSON object")
    v.set_defaults(func=cmd_policy_verify)

    w = sub.add_parser("widen", help="re-export an older feature schema's artifact for this schema",
                       description="An artifact of feature schema 2 (whose 16 features are schema 3's first 16) "
                                   "as a schema-3 artifact: the same policy, zero weights on the new features; "
                                   "checked against its own golden outputs.")
    w.add_argument("src", help="the older artifact directory")
    w.add_argument("--out", required=True, help="artifact directory to create")
    w.add_argument("--force", action="store_true", help="replace an existing artifact directory")
    w.add_argument("--json", action="store_true", help="print one JSON object")
    w.set_defaults(func=cmd_policy_widen)

    pu = sub.add_parser("push", help="register an artifact with the control plane (and activate it)",
                        description="Upload an artifact directory to the control plane's policy registry "
                                    "(POST /api/v1/policies: the node agent's loader checks it there) and, with "
                                    "--activate, make it the active policy. For scripts; the dashboard's Policies "
                                    "tab does the same.")
    pu.add_argument("artifact", help="artifact directory (manifest.json, policy.onnx, golden.npz)")
    add_push_arguments(pu, prog="racer policy push", timeout_s=60.0)
    pu.set_defaults(func=cmd_policy_push)

    t = sub.add_parser("train", help="train the base policy on the cluster simulator: behaviour cloning, PPO or both",
                       description="Behaviour cloning (--bc-data, --bc-episodes) then PPO (policies/train_ppo.py; "
                                   "--total-steps 0: cloning alone, as the shipped policy was made) on "
                                   "policies/env.py: one step is one control "
                                   "interval of the simulated cluster, every node an agent sharing the policy. "
                                   "Writes actor.pt (export it with `racer policy export`), curve.png/json/csv "
                                   "and evaluation.json to --out.")
    add_train_arguments(t)
    t.set_defaults(func=cmd_policy_train)
    return pol
