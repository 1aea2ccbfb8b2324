"""`python -m trainer.checkpoint verify DIR | list DIR` (a directory or an s3:// prefix)."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from trainer.checkpoint.config import parse_s3_url
from trainer.checkpoint.manifest import (
    CHECKPOINT_NAME,
    MANIFEST,
    committed_checkpoints,
    interrupted_saves,
    read_manifest,
    verify_checkpoint,
)
from trainer.checkpoint.mirror import S3Location


def _checkpoint_dirs(path: Path) -> Iterator[Path]:
    """``path`` itself if it is one checkpoint, else every checkpoint under it, newest first."""
    if (path / MANIFEST).is_file() or CHECKPOINT_NAME.match(path.name):
        yield path
    else:
        yield from (p for _, p in committed_checkpoints(path))


def _row(path: str, manifest: dict[str, Any] | None, problems: list[str], *,
         committed: bool = True) -> dict[str, Any]:
    return {"path": path, "step": manifest.get("step") if manifest else None,  # None: an HF export
            "world_size": manifest.get("world_size") if manifest else None,
            "created_at": manifest.get("created_at") if manifest else None,
            "bytes": sum(e["size"] for e in manifest["files"].values()) if manifest else None,
            "verified": not problems, "problems": problems, "committed": committed}


def _local_rows(path: Path) -> list[dict[str, Any]]:
    rows = [_row(str(c), read_manifest(c)[0], verify_checkpoint(c)) for c in _checkpoint_dirs(path)]
    for stale in interrupted_saves(path):
        rows.append(_row(str(stale), None, [f"{stale}: interrupted save (never committed)"], committed=False))
    return rows


def _s3_rows(url: str) -> list[dict[str, Any]]:
    bucket, prefix = parse_s3_url(url)
    parent, _, last = prefix.rpartition("/")
    if CHECKPOINT_NAME.match(last):
        s3, names, partial = S3Location(f"s3://{bucket}/{parent}"), [last], []
    else:
        s3 = S3Location(url)
        committed, partial = s3.checkpoints()
        names = [name for _, name in committed]
    rows = [_row(f"{s3.url}/{name}", s3.read_manifest(name)[0], s3.verify(name)) for name in names]
    for name in partial:
        rows.append(_row(f"{s3.url}/{name}", None, [f"{s3.url}/{name}: partial upload without {MANIFEST}"],
                         committed=False))
    return rows


def _cmd_verify(rows: list[dict[str, Any]], location: str) -> int:
    committed = [row for row in rows if row["committed"]]
    if not committed:
        print(f"no checkpoints in {location}", file=sys.stderr)
        return 1
    for row in committed:
        print(f"{'verified' if row['verified'] else 'FAILED'} {row['path']}")
        for problem in row["problems"]:
            print(f"  {problem}")
    return 0 if all(row["verified"] for row in committed) else 1


def _cmd_list(rows: list[dict[str, Any]], location: str, as_json: bool) -> int:
    if as_json:
        print(json.dumps(rows, indent=1))
        return 0
    if not rows:
        print(f"no checkpoints in {location}")
        return 0
    print(f"{'step':>8}  {'ranks':>5}  {'MB':>9}  {'created (UTC)':<25}  status  path")
    for row in rows:
        size = f"{row['bytes'] / 1e6:9.1f}" if row["bytes"] is not None else f"{'-':>9}"
        print(f"{row['step'] if row['step'] is not None else '-':>8}  {row['world_size'] or '-':>5}  {size}  "
              f"{row['created_at'] or '-':<25}  {'ok' if row['verified'] else 'BAD':<6}  {row['path']}")
        for problem in row["problems"]:
            print(f"{'':>10}{problem}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m trainer.checkpoint",
                                     description="Inspect and verify training checkpoints, on disk or in S3.")
    sub = parser.add_subparsers(dest="command", required=True)
    verify = sub.add_parser("verify", help="check every file of a checkpoint (or of all under a dir or S3 "
                                           "prefix) against its manifest; exit 1 on any problem")
    verify.add_argument("location", help="checkpoint dir, dir of checkpoints, or s3://bucket/prefix[/step_N]")
    listing = sub.add_parser("list", help="list the checkpoints under a dir or S3 prefix, verified")
    listing.add_argument("location", help="dir of checkpoints or s3://bucket/prefix")
    listing.add_argument("--json", action="store_true", help="machine-readable output")
    args = parser.parse_args(argv)
    if args.location.startswith("s3://"):
        try:
            rows = _s3_rows(args.location)
        except Exception as exc:  # credentials, bucket, network: say which, not a traceback
            print(f"{args.location}: {type(exc).__name__}: {exc}", file=sys.stderr)
            return 2
    elif not Path(args.location).is_dir():
        print(f"{args.location}: no such directory", file=sys.stderr)
        return 2
    else:
        rows = _local_rows(Path(args.location))
    if args.command == "verify":
        return _cmd_verify(rows, args.location)
    return _cmd_list(rows, args.location, args.json)
