"""Text and chat records (JSON lines or Parquet) -> token documents -> rows packed with document
masking.

A document is one record's tokens and which of them the loss counts: every token of a text, only the
assistant replies of a chat. Documents are cut at data.seq_len tokens and packed, in file order and
never split, first-fit into rows of seq_len + 1 slots; padding fills the rest. Each slot carries its
document's index within the row (the model attends only within a document), its position within the
document (rotary positions restart at 0) and whether it counts as a target.

The whole data set is tokenized when the source is built, on every rank: meant for fine-tuning sets.
Pre-tokenize large pretraining corpora once into token files instead (`python -m trainer.data
tokenize`, data.source tokens), which are memory-mapped and never loaded whole.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from itertools import islice
from pathlib import Path
from typing import Any

import numpy as np
import torch

from trainer.batch import IGNORE, Batch, DataError
from trainer.tokenizer import Tokenizer, check_vocabulary

_ENCODE_CHUNK = 1024  # texts per tokenizers.encode_batch call (it spreads a batch over threads)


# -- records -----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Record:
    where: str  # "FILE:LINE" or "FILE row N": what an error about this record names
    value: Any  # the field's value


def data_files(path: str | Path, suffix: str) -> list[Path]:
    """data.path: one file, or every `*{suffix}` file directly in a directory, in sorted order."""
    root = Path(path)
    if root.is_dir():
        files = sorted(p for p in root.glob(f"*{suffix}") if p.is_file())
        if not files:
            raise DataError(f"data.path={path}: no *{suffix} files in this directory; point data.path at "
                            f"a {suffix} file or a directory of them")
        return files
    if root.is_file():
        return [root]
    raise DataError(f"data.path={path}: no such file or directory")


def read_jsonl(path: Path, field: str, setting: str) -> Iterator[Record]:
    """Each non-blank line is one JSON object; yields its `field` (setting: the option naming it)."""
    try:
        with open(path, encoding="utf-8") as f:
            for number, line in enumerate(f, 1):
                if not line.strip():
                    continue
                where = f"{path}:{number}"
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as e:
                    raise DataError(f"{where}: not JSON ({e.msg}, column {e.colno}), so no field {field!r} "
                                    f"({setting}); write one JSON object per line") from None
                if not isinstance(record, dict) or field not in record:
                    keys = list(record) if isinstance(record, dict) else []
                    raise DataError(f"{where}: no field {field!r} ({setting}); the keys are {keys}: set "
                                    f"{setting} to the one holding the data")
                yield Record(where, record[field])
    except UnicodeDecodeError as e:
        raise DataError(f"{path}: not UTF-8 text ({e}); JSON lines files must be UTF-8") from None


def read_parquet(path: Path, field: str, setting: str) -> Iterator[Record]:
    """The `field` column of a Parquet file, row by row, read a row group slice at a time."""
    import pyarrow  # only data.source parquet needs it
    import pyarrow.parquet

    try:
        parquet = pyarrow.parquet.ParquetFile(path)
    except (pyarrow.ArrowException, OSError) as e:
        raise DataError(f"{path}: not a Parquet file ({e})") from None
    columns = parquet.schema_arrow.names
    if field not in columns:
        raise DataError(f"{path}: no column {field!r} ({setting}); the columns are {columns}: set {setting} "
                        "to the one holding the data")
    row = 0
    for chunk in parquet.iter_batches(columns=[field], batch_size=_ENCODE_CHUNK):
        for value in chunk.column(0).to_pylist():
            yield Record(f"{path} row {row}", value)
            row += 1


def read_records(data_cfg) -> Iterator[Record]:
    """The configured field of every record under data.path, in file order."""
    field, setting = _field(data_cfg)
    reader = read_jsonl if data_cfg.source == "jsonl" else read_parquet
    for path in data_files(data_cfg.path, f".{data_cfg.source}"):
        yield from reader(path, field, setting)


def _field(data_cfg) -> tuple[str, str]:
    if data_cfg.messages_field:
        return data_cfg.messages_field, "data.messages_field"
    return data_cfg.text_field, "data.text_field"


def record_text(record: Record, setting: str) -> str:
    if not isinstance(record.value, str):
        raise DataError(f"{record.where}: the {setting} field holds a {type(record.value).__name__}, not a "
                        f"string; point {setting} at a field of text")
    return record.value


# -- documents ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Document:
    ids: np.ndarray  # [n] int32 token ids
    trainable: np.ndarray  # [n] bool: the token counts as a target (when not a document's first)


def with_eos(tokenizer: Tokenizer, ids: list[int]) -> list[int]:
    """A text document's ids, closed by EOS: the model learns where a text ends, which is what lets it
    stop generating. Some tokenizers' post-processors add EOS already; it is not doubled then."""
    eos = tokenizer.eos_id
    return [*ids, eos] if eos is not None and (not ids or ids[-1] != eos) else ids


def chat_document(tokenizer: Tokenizer, record: Record, setting: str) -> Document:
    messages = record.value
    if not (isinstance(messages, list) and messages
            and all(isinstance(m, dict) and isinstance(m.get("role"), str) for m in messages)):
        shown = repr(messages)[:120]
        raise DataError(f"{record.where}: {setting} must hold a non-empty list of {{role, content}} "
                        f"messages, got {shown}")
    try:
        ids, mask = tokenizer.encode_chat(messages)
    except DataError as e:
        raise DataError(f"{record.where}: {e}") from None
    return Document(np.asarray(ids, dtype=np.int32), np.asarray(mask, dtype=bool))


def load_documents(data_cfg, tokenizer: Tokenizer, append_eos: bool = True) -> Iterator[Document]:
    """The records under data.path as documents, in file order: chats when data.messages_field is set
    (only the assistant replies count), else texts (every token counts; closed by EOS unless
    append_eos is False, for evaluation sets scored as the tokenizer alone encodes them)."""
    records = read_records(data_cfg)
    _, setting = _field(data_cfg)
    if data_cfg.messages_field:
        for record in records:
            yield chat_document(tokenizer, record, setting)
        return
    while chunk := list(islice(records, _ENCODE_CHUNK)):
        for ids in tokenizer.encode_batch([record_text(r, setting) for r in chunk]):
            ids = with_eos(tokenizer, ids) if append_eos else ids
            yield Document(np.asarray(ids, dtype=np.int32), np.ones(len(ids), dtype=bool))


# -- packing -----------------------------------------------------------------------------------------


def first_fit(lengths: list[int], capacity: int) -> list[int]:
    """The row of each item: the first row (in opening order) with room for it, else a new row.
    A max-tree over the rows' free space finds that row in O(log n); rows not yet opened hold the full
    capacity, so the leftmost fitting leaf is an open row when one fits, else the next new one."""
    size = 1
    while size < len(lengths):
        size *= 2
    free = [capacity] * (2 * size)
    rows = []
    for length in lengths:
        node = 1
        while node < size:
            node = 2 * node if free[2 * node] >= length else 2 * node + 1
        free[node] -= length
        rows.append(node - size)
        node //= 2
        while node:
            free[node] = max(free[2 * node], free[2 * node + 1])
            node //= 2
    return rows


@dataclass(frozen=True)
class PackStats:
    documents: int  # packed
    tokens: int  # in the packed documents
    counted: int  # targets the loss counts
    truncated: int  # documents cut at seq_len
    dropped: int  # documents without a counted target (e.g. a chat cut before any reply)
    rows: int
    slots: int  # rows * (seq_len + 1)

    def __str__(self) -> str:
        return (f"{self.documents} documents, {self.tokens} tokens ({self.counted} counted targets), "
                f"{self.truncated} cut at data.seq_len, {self.dropped} without a counted token dropped; "
                f"packed into {self.rows} rows, {1 - self.tokens / max(1, self.slots):.1%} padding")


class PackedSource:
    """Documents packed first-fit into rows of seq_len + 1 slots; sample i is row i. Rows are in the
    order they were opened, so reading rows 0, 1, ... visits the documents in file order."""

    def __init__(self, documents: Iterable[Document], seq_len: int, pad_id: int):
        self.seq_len, self.pad_id = seq_len, pad_id
        ids, trainable, lengths = [], [], []
        truncated = dropped = 0
        for doc in documents:
            if len(doc.ids) > seq_len:
                doc = Document(doc.ids[:seq_len], doc.trainable[:seq_len])
                truncated += 1
            # A document's first token is never a target (nothing before it in its document).
            if not doc.trainable[1:].any():
                dropped += 1
                continue
            ids.append(doc.ids)
            trainable.append(doc.trainable)
            lengths.append(len(doc.ids))
        self._tokens = np.concatenate(ids) if ids else np.zeros(0, dtype=np.int32)
        self._trainable = np.concatenate(trainable) if trainable else np.zeros(0, dtype=bool)
        self._lengths = np.asarray(lengths, dtype=np.int64)
        self._starts = np.concatenate([[0], np.cumsum(self._lengths)[:-1]]).astype(np.int64)
        rows = np.asarray(first_fit(lengths, seq_len + 1), dtype=np.int64)
        self.num_samples = int(rows.max()) + 1 if len(rows) else 0
        # Row r holds documents _members[_row_start[r]:_row_start[r + 1]], in file order.
        self._members = np.argsort(rows, kind="stable")
        self._row_start = np.searchsorted(rows[self._members], np.arange(self.num_samples + 1))
        self.stats = PackStats(documents=len(lengths), tokens=len(self._tokens),
                               counted=int(sum(t[1:].sum() for t in trainable)), truncated=truncated,
                               dropped=dropped, rows=self.num_samples, slots=self.num_samples * (seq_len + 1))

    def samples(self, indices: torch.Tensor) -> Batch:
        slots = self.seq_len + 1
        count = len(indices)
        tokens = np.full((count, slots), self.pad_id, dtype=np.int64)
        document = np.empty((count, slots), dtype=np.int64)
        position = np.empty((count, slots), dtype=np.int64)
        trainable = np.zeros((count, slots), dtype=bool)
        ramp = np.arange(slots)
        for out, row in enumerate(indices.tolist()):
            at = 0
            members = self._members[self._row_start[row]: self._row_start[row + 1]].tolist()
            for local, doc in enumerate(members):
                start, length = int(self._starts[doc]), int(self._lengths[doc])
                tokens[out, at: at + length] = self._tokens[start: start + length]
                trainable[out, at: at + length] = self._trainable[start: start + length]
                document[out, at: at + length] = local
                position[out, at: at + length] = ramp[:length]
                at += length
            # Padding is a document of its own: no real token attends to it.
            document[out, at:] = len(members)
            position[out, at:] = ramp[: slots - at]
        # A target counts when it is trainable and continues the input's document: never across a
        # document boundary, never padding (which is not trainable).
        counted = trainable[:, 1:] & (document[:, 1:] == document[:, :-1])
        targets = np.where(counted, tokens[:, 1:], IGNORE)
        return Batch(inputs=torch.from_numpy(np.ascontiguousarray(tokens[:, :-1])),
                     targets=torch.from_numpy(targets),
                     positions=torch.from_numpy(np.ascontiguousarray(position[:, :-1])),
                     document_ids=torch.from_numpy(np.ascontiguousarray(document[:, :-1])))


def packed_source(data_cfg, tokenizer: Tokenizer, vocab_size: int,
                  log: Callable[[str], None] = lambda _message: None, append_eos: bool = True
                  ) -> PackedSource:
    """data.path's records tokenized and packed (data.source jsonl or parquet); also the evaluation
    set (see eval_batches). Logs what was packed."""
    check_vocabulary(tokenizer, vocab_size)
    source = PackedSource(load_documents(data_cfg, tokenizer, append_eos), data_cfg.seq_len,
                          tokenizer.pad_id or 0)
    log(f"data: {data_cfg.path}: {source.stats}")
    if source.num_samples == 0:
        raise DataError(f"data.path={data_cfg.path}: no document has a token the loss counts (empty, or "
                        "chats without an assistant reply within data.seq_len); check the data and "
                        "data.seq_len")
    return source


def eval_batches(source: PackedSource, batch_size: int, rank: int = 0, world_size: int = 1
                 ) -> Iterator[Batch]:
    """Every row once, in file order, no shuffle, split across ranks: step s gives rank r rows
    [(s * world_size + r) * batch_size, ... + batch_size). Every rank yields the same number of
    batches of batch_size rows (a sharded model's forward is a collective); rows past the end repeat
    row 0 with no counted target. Sum the NLL of the counted targets and their number over the batches
    and ranks: their ratio is the mean next-token NLL, each document scored on its own."""
    per_step = batch_size * world_size
    steps = -(-source.num_samples // per_step)
    for step in range(steps):
        rows = step * per_step + rank * batch_size + torch.arange(batch_size)
        past_end = rows >= source.num_samples
        batch = source.samples(torch.where(past_end, 0, rows))
        batch.targets[past_end] = IGNORE
        yield batch
