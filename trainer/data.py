"""Training data: a deterministic synthetic stream, memory-mapped token files cut into fixed-length
windows, or text/chat records packed with document masking (trainer.documents); ordered by
(seed, step), split evenly across ranks, staged ahead on the device as `Batch`es.

Token file format (`.bin`): a 32-byte header, then the tokens as little-endian uint16 or uint32.
    magic  8 bytes  b"FSDPTOK1"
    itemsize u32    2 or 4
    reserved u32    0
    vocab_size u64
    num_tokens u64
Make them from text files with `python -m trainer.data build --output FILE.bin TEXT...` (byte-level
tokenizer: one token per UTF-8 byte, token 256 ends each document; nothing to download), or with a
model's own tokenizer: `python -m trainer.data tokenize --tokenizer MODEL_DIR --output FILE.bin
INPUTS...` (jsonl, parquet or text files; EOS ends each document).
"""

from __future__ import annotations

import argparse
import functools
import queue
import struct
import sys
import threading
from collections import deque
from collections.abc import Callable, Iterator
from itertools import islice
from pathlib import Path
from typing import Protocol

import numpy as np
import torch

from trainer.batch import Batch, DataError
from trainer.documents import Record, packed_source, read_jsonl, read_parquet, record_text, with_eos
from trainer.seeding import stream_seed
from trainer.tokenizer import Tokenizer

MAGIC = b"FSDPTOK1"
HEADER = struct.Struct("<8sIIQQ")
BYTE_VOCAB = 257  # 256 byte values + end-of-document
END_OF_DOCUMENT = 256
_WRITE_CHUNK = 16 << 20
_TOKENIZE_CHUNK = 1024  # documents per encode_batch call of `tokenize`
_PROGRESS_EVERY = 100_000  # documents between progress lines of `tokenize`


# -- token files -------------------------------------------------------------------------------------


class TokenFileWriter:
    """Streams tokens into a .bin file; the header's count is written on close."""

    def __init__(self, path: str | Path, vocab_size: int):
        self.path = Path(path)
        self.itemsize = 2 if vocab_size <= 1 << 16 else 4
        self.dtype = np.dtype(f"<u{self.itemsize}")
        self.vocab_size = vocab_size
        self.num_tokens = 0
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "wb")  # noqa: SIM115 - closed by close()/__exit__
        self._file.write(HEADER.pack(MAGIC, self.itemsize, 0, vocab_size, 0))

    def write(self, tokens: np.ndarray) -> None:
        if tokens.size and (tokens.min() < 0 or tokens.max() >= self.vocab_size):
            raise DataError(f"{self.path}: token ids must lie in [0, {self.vocab_size})")
        self._file.write(tokens.astype(self.dtype).tobytes())
        self.num_tokens += int(tokens.size)

    def close(self) -> None:
        self._file.seek(0)
        self._file.write(HEADER.pack(MAGIC, self.itemsize, 0, self.vocab_size, self.num_tokens))
        self._file.close()

    def __enter__(self) -> TokenFileWriter:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class TokenFile:
    """A memory-mapped token file: pages are read on demand, never the whole file."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        with open(self.path, "rb") as f:
            raw = f.read(HEADER.size)
        if len(raw) < HEADER.size:
            raise DataError(f"{self.path}: too short for a token file header; rebuild it with "
                            "`python -m trainer.data build`")
        magic, itemsize, _, self.vocab_size, self.num_tokens = HEADER.unpack(raw)
        if magic != MAGIC or itemsize not in (2, 4):
            raise DataError(f"{self.path}: not a token file (bad magic or item size); rebuild it with "
                            "`python -m trainer.data build`")
        expected = HEADER.size + itemsize * self.num_tokens
        if self.path.stat().st_size != expected:
            raise DataError(f"{self.path}: size {self.path.stat().st_size} bytes, header says {expected} "
                            "(truncated or still being written); rebuild it")
        self.tokens = np.memmap(self.path, dtype=f"<u{itemsize}", mode="r", offset=HEADER.size,
                                shape=(self.num_tokens,))


def text_files(inputs: list[str]) -> list[Path]:
    files: list[Path] = []
    for item in inputs:
        path = Path(item)
        if path.is_dir():
            files += sorted(p for p in path.rglob("*") if p.is_file())
        elif path.is_file():
            files.append(path)
        else:
            raise DataError(f"{item}: no such file or directory")
    if not files:
        raise DataError(f"no input files in {inputs}")
    return files


def build_byte_level(inputs: list[str], output: str | Path, progress=None) -> TokenFile:
    """Byte-level tokenisation of text files: each file is one document ending in END_OF_DOCUMENT."""
    files = text_files(inputs)
    with TokenFileWriter(output, BYTE_VOCAB) as writer:
        for n, path in enumerate(files, 1):
            with open(path, "rb") as f:
                while chunk := f.read(_WRITE_CHUNK):
                    writer.write(np.frombuffer(chunk, dtype=np.uint8))
            writer.write(np.array([END_OF_DOCUMENT]))
            if progress:
                progress(f"[{n}/{len(files)}] {path}: {writer.num_tokens} tokens so far")
    return TokenFile(output)


def decode_byte_level(tokens: np.ndarray) -> list[str]:
    """Inverse of the byte-level build: the documents' texts."""
    docs, current = [], bytearray()
    for token in tokens.tolist():
        if token == END_OF_DOCUMENT:
            docs.append(current.decode("utf-8", errors="replace"))
            current = bytearray()
        else:
            current.append(token)
    return docs


def _corpus_records(path: Path, text_field: str) -> Iterator[Record]:
    """A `tokenize` input's documents: each record of a .jsonl or .parquet file, or a whole text file."""
    if path.suffix == ".jsonl":
        return read_jsonl(path, text_field, "--text-field")
    if path.suffix == ".parquet":
        return read_parquet(path, text_field, "--text-field")
    try:
        return iter([Record(str(path), path.read_text(encoding="utf-8"))])
    except UnicodeDecodeError as e:
        raise DataError(f"{path}: not UTF-8 text ({e}); pass text, .jsonl or .parquet files") from None


def build_with_tokenizer(inputs: list[str], output: str | Path, tokenizer: Tokenizer,
                         text_field: str = "text", progress: Callable[[str], None] | None = None
                         ) -> TokenFile:
    """Tokenise jsonl/parquet records (their `text_field`) and text files (one document each) with a
    model's own tokenizer, each document as data.source jsonl would (post-processor, then EOS), into a
    token file whose header holds the tokenizer's vocabulary size. Streams: a chunk of documents at a
    time is in memory, never the corpus."""
    if tokenizer.eos_id is None:
        raise DataError(f"{tokenizer.model_dir}: the tokenizer has no eos_token, which separates the "
                        "documents of a token file; set eos_token in its tokenizer_config.json")
    files = text_files(inputs)
    documents = 0
    with TokenFileWriter(output, tokenizer.vocab_size) as writer:
        for n, path in enumerate(files, 1):
            records = _corpus_records(path, text_field)
            while chunk := list(islice(records, _TOKENIZE_CHUNK)):
                encoded = tokenizer.encode_batch([record_text(r, "--text-field") for r in chunk])
                writer.write(np.concatenate([np.asarray(with_eos(tokenizer, ids), dtype=np.int64)
                                             for ids in encoded]))
                before, documents = documents, documents + len(chunk)
                if progress and documents // _PROGRESS_EVERY > before // _PROGRESS_EVERY:
                    progress(f"  {path}: {documents} documents, {writer.num_tokens} tokens so far")
            if progress:
                progress(f"[{n}/{len(files)}] {path}: {documents} documents, {writer.num_tokens} tokens "
                         "so far")
    return TokenFile(output)


# -- sample sources ----------------------------------------------------------------------------------


class SampleSource(Protocol):
    num_samples: int | None  # None: unbounded

    def samples(self, indices: torch.Tensor) -> Batch: ...  # one row per index, on the CPU


class SyntheticSource:
    """A learnable token stream: each token is the previous one plus a fixed stride (mod vocab),
    except that with probability `noise` a token is drawn at random and the run restarts from it.
    Sample i depends only on (seed, i), so any rank computes any sample. The loss falls from
    ln(vocab) towards the noise entropy as the model learns the stride."""

    num_samples = None

    def __init__(self, vocab_size: int, seq_len: int, seed: int, noise: float = 0.1):
        self.vocab_size, self.seq_len, self.seed, self.noise = vocab_size, seq_len, seed, noise
        self.stride = 2 * (seed % max(1, vocab_size // 4)) + 1  # odd: visits every token

    def samples(self, indices: torch.Tensor) -> Batch:
        length = self.seq_len + 1
        gen = torch.Generator()
        out = torch.empty((len(indices), length), dtype=torch.long)
        positions = torch.arange(length)
        for row, index in enumerate(indices.tolist()):
            gen.manual_seed(stream_seed(self.seed, "sample", index))
            restart = torch.rand(length, generator=gen) < self.noise
            restart[0] = True
            fresh = torch.randint(self.vocab_size, (length,), generator=gen)
            last_restart = torch.cummax(torch.where(restart, positions, 0), 0).values
            out[row] = (fresh[last_restart] + self.stride * (positions - last_restart)) % self.vocab_size
        return Batch.from_windows(out)


class TokenFileSource:
    """Non-overlapping windows of seq_len + 1 tokens from each token file (a window never spans two
    files), over one or more files or a directory of *.bin files."""

    def __init__(self, path: str, seq_len: int):
        root = Path(path)
        paths = sorted(root.glob("*.bin")) if root.is_dir() else [root]
        if not paths or not paths[0].exists():
            raise DataError(f"data.path={path}: no token files there; make one with "
                            "`python -m trainer.data build --output FILE.bin TEXT_FILES...`")
        self.files = [TokenFile(p) for p in paths]
        self.seq_len = seq_len
        self.vocab_size = max(f.vocab_size for f in self.files)
        counts = [max(0, (f.num_tokens - 1) // seq_len) for f in self.files]
        self._starts = np.cumsum([0, *counts])
        self.num_samples = int(self._starts[-1])
        if self.num_samples == 0:
            raise DataError(f"data.path={path}: fewer than data.seq_len + 1 = {seq_len + 1} tokens per "
                            "file; add text or lower data.seq_len")

    def samples(self, indices: torch.Tensor) -> Batch:
        out = np.empty((len(indices), self.seq_len + 1), dtype=np.int64)
        for row, index in enumerate(indices.tolist()):
            file_no = int(np.searchsorted(self._starts, index, side="right")) - 1
            start = (index - int(self._starts[file_no])) * self.seq_len
            out[row] = self.files[file_no].tokens[start: start + self.seq_len + 1]
        return Batch.from_windows(torch.from_numpy(out))


def build_source(data_cfg, vocab_size: int, seed: int, tokenizer: Tokenizer | None = None,
                 log: Callable[[str], None] = lambda _message: None) -> SampleSource:
    """The configured source. jsonl/parquet records are tokenized with `tokenizer` (the model's own,
    Tokenizer.from_dir(model.hf_dir)) and packed (trainer.documents); `log` gets what was packed."""
    if data_cfg.source == "synthetic":
        return SyntheticSource(vocab_size, data_cfg.seq_len, seed)
    if data_cfg.source in ("jsonl", "parquet"):
        if tokenizer is None:
            raise DataError(f"data.source={data_cfg.source} needs a tokenizer: set model.hf_dir to the "
                            "model's directory (its tokenizer.json tokenizes the records)")
        return packed_source(data_cfg, tokenizer, vocab_size, log)
    source = TokenFileSource(data_cfg.path, data_cfg.seq_len)
    if source.vocab_size > vocab_size:
        raise DataError(f"data.path={data_cfg.path}: token ids go up to {source.vocab_size - 1} but "
                        f"model.vocab_size={vocab_size}; set model.vocab_size >= {source.vocab_size}")
    return source


# -- per-rank batches ----------------------------------------------------------------------------------


class BatchLoader:
    """Micro-batches for one rank. Micro-step k covers global sample positions
    [k*G, (k+1)*G) with G = micro_batch_size * world_size; rank r takes its own contiguous slice, so
    every rank gets an equal batch (the tail of an epoch that does not fill G is dropped) and the
    order depends only on (seed, k), not on the world size. A finite source is reshuffled every epoch
    (`log` gets a line when the next one starts). A background thread reads ahead; on CUDA the next
    batches are copied on a side stream while the current one computes.

    state_dict()/load_state_dict() hold the number of micro-batches consumed, so a resumed run (on
    any world size with the same global batch) continues with exactly the next samples."""

    def __init__(self, source: SampleSource, *, micro_batch_size: int, rank: int, world_size: int,
                 seed: int, device: torch.device, prefetch: int = 2,
                 log: Callable[[str], None] = lambda _message: None):
        self.source, self.micro, self.rank, self.world = source, micro_batch_size, rank, world_size
        self.seed, self.device, self.prefetch, self.log = seed, device, prefetch, log
        self.global_micro = micro_batch_size * world_size
        if source.num_samples is not None and source.num_samples < self.global_micro:
            raise DataError(f"the data has {source.num_samples} samples, fewer than one global "
                            f"micro-batch ({self.global_micro}); add data or lower the batch size")
        # None: an unbounded source, which has no epochs.
        self.steps_per_epoch = None if source.num_samples is None else source.num_samples // self.global_micro
        self.micro_step = 0
        self._perm_epoch, self._perm = -1, None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._queue: queue.Queue = queue.Queue(maxsize=prefetch)
        self._staged: deque[Batch] = deque()
        self._copy_stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def _indices(self, k: int) -> torch.Tensor:
        offset = self.rank * self.micro
        if self.steps_per_epoch is None:
            return torch.arange(self.micro) + k * self.global_micro + offset
        epoch, within = divmod(k, self.steps_per_epoch)
        if epoch != self._perm_epoch:
            gen = torch.Generator().manual_seed(stream_seed(self.seed, "epoch", epoch))
            self._perm, self._perm_epoch = torch.randperm(self.source.num_samples, generator=gen), epoch
        start = within * self.global_micro + offset
        return self._perm[start: start + self.micro]

    def batch(self, k: int) -> Batch:
        """Micro-step k's batch for this rank (on the CPU)."""
        return self.source.samples(self._indices(k))

    def _produce(self, start: int) -> None:
        k = start
        pin = self.device.type == "cuda"
        try:
            while not self._stop.is_set():
                batch = self.batch(k)
                item = batch.pin_memory() if pin else batch
                while not self._stop.is_set():
                    try:
                        self._queue.put(item, timeout=0.1)
                        break
                    except queue.Full:
                        continue
                k += 1
        except Exception as e:  # handed to the training thread, which raises it
            self._queue.put(e)

    def _stage(self) -> None:
        item = self._queue.get()
        if isinstance(item, Exception):
            raise item
        if self._copy_stream is None:
            self._staged.append(item.to(self.device))
            return
        with torch.cuda.stream(self._copy_stream):
            self._staged.append(item.to(self.device, non_blocking=True))

    def next(self) -> Batch:
        if self._thread is None:
            self._thread = threading.Thread(target=self._produce, args=(self.micro_step,), daemon=True,
                                            name="batch-prefetch")
            self._thread.start()
        while len(self._staged) < self.prefetch:
            self._stage()
        batch = self._staged.popleft()
        if self._copy_stream is not None:
            current = torch.cuda.current_stream(self.device)
            current.wait_stream(self._copy_stream)
            for t in batch.tensors():
                t.record_stream(current)
        # Logged as the batch is consumed (not when the prefetch thread reads it), so once per epoch.
        if self.steps_per_epoch and self.micro_step and self.micro_step % self.steps_per_epoch == 0:
            self.log(f"data: epoch {self.epoch} starts at micro-step {self.micro_step} "
                     f"({self.source.num_samples} samples, {self.steps_per_epoch} micro-steps per epoch)")
        self.micro_step += 1
        return batch

    @property
    def epoch(self) -> int | None:
        """The epoch (from 1) of the next micro-batch; None for an unbounded source."""
        return None if self.steps_per_epoch is None else self.micro_step // self.steps_per_epoch + 1

    def close(self) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._thread = None
        self._stop.clear()
        self._queue = queue.Queue(maxsize=self.prefetch)
        self._staged.clear()

    def state_dict(self) -> dict:
        return {"micro_step": self.micro_step, "epoch": self.epoch, "global_micro_batch": self.global_micro,
                "seed": self.seed, "num_samples": self.source.num_samples}

    def load_state_dict(self, state: dict) -> None:
        for key in ("global_micro_batch", "seed", "num_samples"):
            if state[key] != self.state_dict()[key]:
                raise DataError(f"the checkpoint's data loader has {key}={state[key]}, this run "
                                f"{self.state_dict()[key]}: the sample order would change. Resume with "
                                "the same training.global_batch_size / gradient_accumulation, seed and data")
        self.close()
        self.micro_step = int(state["micro_step"])


# -- command line ------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m trainer.data", allow_abbrev=False,
                                     description="Make and inspect token files for the trainer.")
    sub = parser.add_subparsers(dest="command", required=True)
    build = sub.add_parser("build", allow_abbrev=False,
                           help="byte-level tokenise text files (or directories of them) into a .bin")
    build.add_argument("--output", required=True, help="token file to write (.bin)")
    build.add_argument("inputs", nargs="+", help="text files or directories")
    tokenize = sub.add_parser("tokenize", allow_abbrev=False,
                              help="tokenise jsonl/parquet/text files with a model's tokenizer into a .bin")
    tokenize.add_argument("--tokenizer", required=True, metavar="MODEL_DIR",
                          help="a Hugging Face model directory with tokenizer.json")
    tokenize.add_argument("--output", required=True, help="token file to write (.bin)")
    tokenize.add_argument("--text-field", default="text", help="the jsonl/parquet field holding the text")
    tokenize.add_argument("inputs", nargs="+",
                          help=".jsonl, .parquet or text files (a text file is one document), or directories")
    info = sub.add_parser("info", allow_abbrev=False, help="print a token file's header")
    info.add_argument("path")
    args = parser.parse_args(argv)
    progress = functools.partial(print, file=sys.stderr)
    try:
        if args.command in ("build", "tokenize"):
            if args.command == "build":
                made = build_byte_level(args.inputs, args.output, progress=progress)
            else:
                made = build_with_tokenizer(args.inputs, args.output, Tokenizer.from_dir(args.tokenizer),
                                            args.text_field, progress=progress)
            print(f"{made.path}: {made.num_tokens} tokens, vocab {made.vocab_size}")
        else:
            tf = TokenFile(args.path)
            print(f"{tf.path}: {tf.num_tokens} tokens, vocab {tf.vocab_size}, {tf.tokens.dtype}")
    except DataError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
