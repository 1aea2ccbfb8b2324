"""The checkpoint's copy in S3 (boto3 honours AWS_ENDPOINT_URL / AWS_ENDPOINT_URL_S3, which is how
tests reach moto)."""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

from trainer.checkpoint.config import CheckpointError, parse_s3_url
from trainer.checkpoint.manifest import CHECKPOINT_NAME, HASH_CHUNK, MANIFEST, parse_manifest, read_manifest


class S3Location:
    def __init__(self, url: str):
        try:
            import boto3  # only runs that mirror to S3 need boto3 on the node
        except ImportError:
            raise CheckpointError(f"mirror_s3={url} needs boto3 on every node; fix: pip install boto3 into "
                                  "the trainer's environment, or drop mirror_s3") from None

        self.url = url.rstrip("/")
        self.bucket, self.prefix = parse_s3_url(url)
        self.client = boto3.client("s3")

    def key(self, *parts: str) -> str:
        return "/".join(part for part in (self.prefix, *parts) if part)

    def checkpoints(self) -> tuple[list[tuple[int, str]], list[str]]:
        """(committed step names newest first, names of partial uploads without a manifest)."""
        names: dict[str, bool] = {}
        base = self.key() + "/" if self.prefix else ""
        for page in self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=base):
            for item in page.get("Contents", []):
                name, _, rest = item["Key"][len(base):].partition("/")
                if CHECKPOINT_NAME.match(name):
                    names[name] = names.get(name, False) or rest == MANIFEST
        committed = sorted(((int(CHECKPOINT_NAME.match(n).group(1)), n) for n, ok in names.items() if ok),
                           reverse=True)
        return committed, sorted(n for n, ok in names.items() if not ok)

    def upload(self, path: Path, manifest: dict[str, Any]) -> None:
        """Upload the files, then the manifest last (its presence marks the copy committed), then read
        every object back and check it against the manifest."""
        for name in sorted(manifest["files"]):
            self.client.upload_file(str(path / name), self.bucket, self.key(path.name, name))
        self.client.upload_file(str(path / MANIFEST), self.bucket, self.key(path.name, MANIFEST))
        problems = self.verify(path.name)
        if problems:
            # Without its manifest the broken copy is never taken for a checkpoint.
            self.client.delete_object(Bucket=self.bucket, Key=self.key(path.name, MANIFEST))
            raise CheckpointError("the uploaded copy does not verify: " + "; ".join(problems))

    def read_manifest(self, name: str) -> tuple[dict[str, Any] | None, str | None]:
        where = f"{self.url}/{name}"
        try:
            body = self.client.get_object(Bucket=self.bucket, Key=self.key(name, MANIFEST))["Body"].read()
        except self.client.exceptions.NoSuchKey:
            return None, f"{where}: {MANIFEST} is missing (upload never finished)"
        return parse_manifest(body.decode(errors="replace"), where)

    def verify(self, name: str) -> list[str]:
        """The S3 copy's problems, like verify_checkpoint: listing, sizes, then SHA256 of every object."""
        manifest, problem = self.read_manifest(name)
        if problem:
            return [problem]
        where, base = f"{self.url}/{name}", self.key(name) + "/"
        sizes = {}
        for page in self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=base):
            sizes.update({item["Key"][len(base):]: item["Size"] for item in page.get("Contents", [])})
        problems = [f"{where}: {file}: not in the manifest (unexpected object)"
                    for file in sorted(sizes) if file != MANIFEST and file not in manifest["files"]]
        for file, entry in sorted(manifest["files"].items()):
            if file not in sizes:
                problems.append(f"{where}: {file}: missing")
            elif sizes[file] != entry["size"]:
                problems.append(f"{where}: {file}: size {sizes[file]} bytes, manifest says {entry['size']}")
        if problems:
            return problems
        for file, entry in sorted(manifest["files"].items()):
            body = self.client.get_object(Bucket=self.bucket, Key=self.key(name, file))["Body"]
            digest = hashlib.sha256()
            for chunk in iter(lambda body=body: body.read(HASH_CHUNK), b""):
                digest.update(chunk)
            if digest.hexdigest() != entry["sha256"]:
                problems.append(f"{where}: {file}: SHA256 mismatch")
        return problems

    def prune(self, keep_last: int, log: Callable[[str], None]) -> None:
        """Delete all but the newest ``keep_last`` committed checkpoints; call right after a verified
        upload, so the newest is a verified one."""
        committed, _ = self.checkpoints()
        for step, name in committed[keep_last:]:
            paginator = self.client.get_paginator("list_objects_v2")
            for page in paginator.paginate(Bucket=self.bucket, Prefix=self.key(name) + "/"):
                keys = [{"Key": item["Key"]} for item in page.get("Contents", [])]
                # the manifest goes first, so that an interrupted deletion leaves an ignored partial copy
                keys.sort(key=lambda item: not item["Key"].endswith("/" + MANIFEST))
                if keys:
                    self.client.delete_objects(Bucket=self.bucket, Delete={"Objects": keys, "Quiet": True})
            log(f"checkpoint: deleted {self.url}/{name} (step {step}): more than keep_last={keep_last} "
                "newer checkpoints")

    def download_manifest(self, name: str, target: Path) -> dict[str, Any]:
        self.client.download_file(self.bucket, self.key(name, MANIFEST), str(target / MANIFEST))
        manifest, problem = read_manifest(target)
        if problem:
            raise CheckpointError(f"{self.url}/{name}: {problem}")
        return manifest

    def download_files(self, name: str, target: Path, files: list[str]) -> None:
        for file in files:
            self.client.download_file(self.bucket, self.key(name, file), str(target / file))

