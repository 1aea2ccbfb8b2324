"""What a run asks of its checkpoints (`checkpoint.*` in the trainer config), and the error
checkpointing reports."""

from __future__ import annotations

import re
from pathlib import Path

import pydantic


class CheckpointError(RuntimeError):
    """A checkpoint could not be saved, found or loaded; the message says which, why and what to do."""


class CheckpointConfig(pydantic.BaseModel):
    # Each field's docstring documents it; pydantic is not asked to read them (trainer.config's _Section).
    model_config = pydantic.ConfigDict(extra="forbid")

    dir: str | None = None
    """Primary location; one file system for all nodes (FSx, /shared). Unset: no checkpoints."""
    interval: int = 1000
    """A checkpoint every N optimizer steps, plus one at the last step."""
    mirror_dir: str | None = None
    """A second copy on another file system, verified after copying."""
    mirror_s3: str | None = None
    """A second copy in S3 (`s3://bucket/prefix`), verified after uploading."""
    keep_last: int = 3
    """Keep the newest N checkpoints in each copy."""
    max_age_days: float = 7.0
    """Delete local checkpoints older than this; the newest verified one always stays."""
    async_save: bool = True
    """Write in the background; training blocks only while the state is staged."""
    resume: str = "auto"
    """auto: the newest verified checkpoint in any copy; none: start fresh; or a checkpoint path."""
    hf_export_dir: str | None = None
    """At the end of training, write the model here as a Hugging Face directory (config.json, sharded
    safetensors with an index, the tokenizer files, a SHA256 manifest) in the model's original dtype,
    or a PEFT adapter directory for LoRA runs (parallel.lora.export)."""

    @pydantic.field_validator("interval")
    @classmethod
    def _positive_interval(cls, value: int) -> int:
        if value < 1:
            raise ValueError(f"checkpoint interval must be at least 1 step, got {value}; "
                             "fix: --checkpoint-interval 1000 (or leave --checkpoint-dir unset to disable)")
        return value

    @pydantic.field_validator("keep_last")
    @classmethod
    def _keep_at_least_one(cls, value: int) -> int:
        if value < 1:
            raise ValueError(f"keep_last must be at least 1 (the newest checkpoint is never deleted), "
                             f"got {value}")
        return value

    @pydantic.field_validator("max_age_days")
    @classmethod
    def _positive_age(cls, value: float) -> float:
        if not value > 0:
            raise ValueError(f"max_age_days must be a positive number of days, got {value}; fix: e.g. 7")
        return value

    @pydantic.field_validator("mirror_s3")
    @classmethod
    def _s3_url(cls, value: str | None) -> str | None:
        if value is not None:
            parse_s3_url(value)
        return value

    @pydantic.field_validator("resume")
    @classmethod
    def _resume_choice(cls, value: str) -> str:
        if not value:
            raise ValueError("resume must be 'auto', 'none' or the path of a checkpoint directory, got ''")
        return value

    @pydantic.model_validator(mode="after")
    def _distinct_copies(self) -> CheckpointConfig:
        if self.mirror_dir is not None and self.dir is None:
            raise ValueError(f"mirror_dir={self.mirror_dir!r} needs a primary checkpoint dir; "
                             "fix: set --checkpoint-dir as well")
        if self.mirror_s3 is not None and self.dir is None:
            raise ValueError(f"mirror_s3={self.mirror_s3!r} needs a primary checkpoint dir; "
                             "fix: set --checkpoint-dir as well")
        if self.dir is not None and self.mirror_dir is not None and (
                Path(self.dir).resolve() == Path(self.mirror_dir).resolve()):
            raise ValueError(f"mirror_dir={self.mirror_dir!r} is the checkpoint dir itself, so it is no "
                             "second copy; fix: point it at another file system (e.g. /shared/checkpoints)")
        return self


def parse_s3_url(url: str) -> tuple[str, str]:
    """``s3://bucket/some/prefix`` -> (bucket, "some/prefix") with no trailing slash."""
    match = re.fullmatch(r"s3://([a-z0-9][a-z0-9.\-]{1,61}[a-z0-9])(?:/(.*))?", url)
    if match is None:
        raise ValueError(f"mirror_s3={url!r} is not an S3 URL; fix: s3://<bucket>[/<prefix>], e.g. "
                         "the stack output checkpoint_bucket as s3://<checkpoint_bucket>/<run name>")
    return match.group(1), (match.group(2) or "").strip("/")

