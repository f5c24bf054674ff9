"""The ``racer model`` subcommands; racer/cli.py registers them with `add_model_parser`.

    racer model train --trace KIND [--path P] --out DIR [--epochs 60] [--embedding-dim 64] ...
    racer model eval DIR --trace KIND [--path P] [--json]
    racer model show DIR [--json]

``racer --help`` stays fast: it builds none of these parsers (``racer model train``'s reads its
defaults, help and ranges from `TrainConfig`, importing torch). Errors a user can fix raise
ValueError / FileNotFoundError (racer's ``main`` prints them as one line, exit status 2).
"""

from __future__ import annotations

import argparse
import json
import sys

from common.config import add_config_arguments, config_kwargs, default_of
from node_agent.registry_client import add_push_arguments

# `racer model train` options whose default, help and range are read from TrainConfig's fields
TRAIN_FIELDS = ("max_seq_len", "max_epochs", "patience", "batch_size", "lr", "weight_decay", "dropout", "negatives",
                "num_negatives", "positions_per_seq", "max_minutes", "item_dtype")


def _positive_int(s: str) -> int:
    try:
        v = int(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{s!r} is not an integer") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {v}")
    return v


def _positive_float(s: str) -> float:
    try:
        v = float(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{s!r} is not a number") from None
    if not v > 0 or v != v or v == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive number, got {s}")
    return v


def _load_trace(args):
    from workloads.loaders import load_trace

    kw = {}
    if getattr(args, "max_rows", None):
        kw["max_rows"] = args.max_rows
    return load_trace(args.trace, args.path, **kw)


def _set_threads(n: int | None) -> None:
    import torch

    if n:
        torch.set_num_threads(n)


def cmd_model_train(args) -> int:
    from .hstu import ModelConfig
    from .train import TrainConfig, train

    _set_threads(args.threads)
    trace = _load_trace(args)
    cfg = TrainConfig(
        model=ModelConfig(embedding_dim=args.embedding_dim, num_layers=args.num_layers, num_heads=args.num_heads,
                          qk_dim=args.head_dim, v_dim=args.head_dim, seed=args.seed),
        **config_kwargs(args, TRAIN_FIELDS), use_timestamps=args.use_timestamps,
        item_features=not args.no_item_features, seed=args.seed, device=args.device)

    def say(msg: str) -> None:
        print(f"racer model train: {msg}", file=sys.stderr, flush=True)

    say(f"{trace.name}: {trace.num_users} users, {trace.num_items} items, {trace.num_interactions} interactions")
    res = train(trace, cfg, args.out, progress=not args.no_progress, resume=not args.restart, log=say)
    m = res.manifest
    out = {"out": res.out_dir, "digest": m["digest"], "best_epoch": res.best_epoch, "epochs_run": len(res.history),
           "stopped": res.stopped, "seconds": res.seconds, "device": m["train"]["device_used"],
           "test_sampled": m["test"]}
    if args.json:
        print(json.dumps(out))
    else:
        t = m["test"]
        print(f"wrote {res.out_dir} (digest {m['digest'][:16]}..): best epoch {res.best_epoch} of "
              f"{len(res.history)} ({res.stopped}), {res.seconds:.0f} s on {out['device']}\n"
              f"  test HR@10 {t['hr@10_sampled']:.4f}  NDCG@10 {t['ndcg@10_sampled']:.4f} "
              f"(100 sampled negatives; `racer model eval {res.out_dir} --trace {args.trace}` for all figures)")
    return 0


def cmd_model_eval(args) -> int:
    from tqdm import tqdm

    from .checkpoint import load_checkpoint
    from .eval import evaluate
    from .train import leave_one_out

    _set_threads(args.threads)
    trace = _load_trace(args)
    ckpt = load_checkpoint(args.dir, item_keys=list(trace.item_keys))
    from .train import resolve_device

    model = ckpt.model.to(resolve_device(args.device))
    train_info = ckpt.manifest.get("train", {})
    max_seq_len = args.max_seq_len or int(train_info.get("max_seq_len", 50))
    use_ts = bool(train_info.get("use_timestamps", False))
    split = leave_one_out(trace)
    n = int((split.test >= 0).sum()) if args.max_users is None else min(args.max_users, int((split.test >= 0).sum()))
    with tqdm(total=n, desc="racer model eval", unit="user", disable=args.no_progress, file=sys.stderr,
              delay=1.0) as bar:
        res = evaluate(model, ckpt.item_table, split, "test", max_seq_len=max_seq_len, full=not args.sampled_only,
                       seed=args.seed, use_timestamps=use_ts, popularity=True, max_users=args.max_users,
                       progress=lambda: bar.update(1))
    res = {**res, "digest": ckpt.digest, "trace": trace.name, "split": "test (last item per user)",
           "max_seq_len": max_seq_len, "num_items": trace.num_items}
    if args.json:
        print(json.dumps(res))
    else:
        p = res["popularity"]
        print(f"{trace.name}, {res['num_users']} users, {trace.num_items} items, checkpoint {ckpt.digest[:16]}..")
        print(f"{'':<18}{'model':>10}{'popularity':>12}")
        for k in [k for k in ("hr@10_sampled", "ndcg@10_sampled", "hr@10_full", "ndcg@10_full") if k in res]:
            print(f"{k:<18}{res[k]:>10.4f}{p[k]:>12.4f}")
    return 0


def cmd_model_show(args) -> int:
    from .checkpoint import load_checkpoint

    ckpt = load_checkpoint(args.dir)
    m = ckpt.manifest
    out = {"digest": m["digest"], "config": m["config"], "num_items": m["num_items"], "trace": m.get("trace"),
           "train": m.get("train"), "test": m.get("test")}
    print(json.dumps(out, indent=None if args.json else 1))
    return 0


def cmd_model_push(args) -> int:
    """Register a checkpoint with the control plane's model registry (``POST /api/v1/models``,
    where the checkpoint loader verifies it) and activate it with ``--activate``. The checkpoint is
    verified here first. Exit status 1 when the control plane refuses it (its reason on stderr), 2
    for a bad directory or option."""
    import sys
    from pathlib import Path

    from common.artifact_pack import CHECKPOINT_FILES, pack_directory
    from node_agent.registry_client import push_from_args

    from .checkpoint import load_checkpoint

    src = Path(args.dir)
    ck = load_checkpoint(src)  # CheckpointError (a ValueError): exit 2 with its message
    rc, out = push_from_args("models", pack_directory(src, CHECKPOINT_FILES), args, prog="racer model push")
    if rc:
        return rc
    if out["version"] != ck.digest:
        print(f"racer model push: the control plane registered {out['version']}, not {ck.digest}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(out))
    else:
        print(f"model {out['version']} {'registered' if out['created'] else 'already registered'}, "
              f"status {out['status']}")  # the whole digest: the API names a model by it
    return 0


def add_model_parser(subparsers) -> None:
    """Add ``model`` (train, eval, show) to racer's top-level subparsers."""
    from workloads.loaders import LOADERS

    model = subparsers.add_parser("model", help="train and evaluate the GR model that node agents serve",
                                  description="Train the HSTU-style model on a trace (next-item prediction, "
                                              "leave-one-out split), evaluate it against a popularity baseline, "
                                              "and inspect checkpoints. See docs/model.md.")
    sub = model.add_subparsers(dest="model_command", metavar="SUBCOMMAND", required=True)

    def trace_args(p):
        p.add_argument("--trace", required=True, choices=sorted(LOADERS), help="trace format")
        p.add_argument("--path", default=None,
                       help="trace file (default: the sample under $RACER_DATA_DIR or ../shared/data)")
        p.add_argument("--max-rows", type=_positive_int, default=None, help="read at most this many interactions")
        p.add_argument("--threads", type=_positive_int, default=None,
                       help="torch intra-op threads on the CPU (default: torch's choice)")
        p.add_argument("--no-progress", action="store_true", help="no progress bar")
        p.add_argument("--json", action="store_true", help="print the result as one JSON object")

    tr = sub.add_parser("train", help="train the model on a trace's sequences; write a checkpoint directory",
                        description="Next-item training (SASRec/HSTU protocol: each user's last item is the test "
                                    "target, the one before the validation target, the rest training), sampled "
                                    "softmax, early stopping on validation NDCG@10. Resumes from DIR's "
                                    "train_state.pt when it was written for the same trace and config.")
    trace_args(tr)
    tr.add_argument("--out", required=True, help="checkpoint directory (created; an earlier run there resumes)")
    from .train import TrainConfig

    model_default = default_of(TrainConfig, "model")
    g = tr.add_argument_group("model")
    for flag, value, text in (("--embedding-dim", model_default.embedding_dim, "item embedding / model width"),
                              ("--num-layers", model_default.num_layers, "HSTU layers"),
                              ("--num-heads", model_default.num_heads, "attention heads"),
                              ("--head-dim", model_default.qk_dim, "per-head size of Q, K and V")):
        g.add_argument(flag, type=_positive_int, default=value, help=f"{text} (default {value})")
    g = tr.add_argument_group("training")
    add_config_arguments(g, TrainConfig, TRAIN_FIELDS[:-2], flags={"max_epochs": "--epochs"})
    g.add_argument("--use-timestamps", action="store_true",
                   help="train with the trace's times (the time bias); default off, as requests to nodes "
                        "carry no timestamps by default")
    g.add_argument("--no-item-features", action="store_true",
                   help="train each item's row alone (default: its row plus its category's and its popularity "
                        "bucket's, summed into the one row the checkpoint stores)")
    add_config_arguments(g, TrainConfig, TRAIN_FIELDS[-2:])
    g.add_argument("--device", default="auto", help="auto (CUDA when present), cpu, cuda[:N]")
    g.add_argument("--seed", type=int, default=0, help="seed of weights, batches and negatives (default 0)")
    g.add_argument("--restart", action="store_true", help="ignore DIR's train_state.pt and start afresh")
    tr.set_defaults(func=cmd_model_train)

    ev = sub.add_parser("eval", help="HR@10 / NDCG@10 of a checkpoint on the held-out last items, beside "
                                     "popularity",
                        description="Rank each user's held-out last item through the serving path, against 100 "
                                    "sampled negatives (SASRec's protocol) and against every item, beside a "
                                    "popularity baseline on the same split and candidates.")
    ev.add_argument("dir", help="checkpoint directory")
    trace_args(ev)
    ev.add_argument("--max-seq-len", type=_positive_int, default=None,
                    help="history items per user (default: the checkpoint's training value)")
    ev.add_argument("--max-users", type=_positive_int, default=None, help="evaluate the first N users only")
    ev.add_argument("--sampled-only", action="store_true", help="skip the full-item-set ranking (faster)")
    ev.add_argument("--seed", type=int, default=0, help="seed of the sampled negatives (default 0)")
    ev.add_argument("--device", default="auto", help="auto (CUDA when present), cpu, cuda[:N]")
    ev.set_defaults(func=cmd_model_eval)

    sh = sub.add_parser("show", help="verify a checkpoint and print its manifest",
                        description="Verify a checkpoint's files against its manifest and print it.")
    sh.add_argument("dir", help="checkpoint directory")
    sh.add_argument("--json", action="store_true", help="one line of JSON")
    sh.set_defaults(func=cmd_model_show)

    pu = sub.add_parser("push", help="register a checkpoint with the control plane (and activate it)",
                        description="Upload a checkpoint directory to the control plane's model registry "
                                    "(POST /api/v1/models: verified there by the checkpoint loader) and, with "
                                    "--activate, make it the model every node serves. For scripts; roll it out "
                                    "to a canary first with POST /api/v1/rollouts (kind model).")
    pu.add_argument("dir", help="checkpoint directory (the one `racer model train` wrote)")
    add_push_arguments(pu, prog="racer model push", timeout_s=120.0, timeout_type=_positive_float)
    pu.set_defaults(func=cmd_model_push)
