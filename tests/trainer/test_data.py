"""Token files round-trip; batches are deterministic, equal and disjoint across ranks, independent
of the world size, and resumable."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from trainer.config import DataConfig
from trainer.data import (
    BYTE_VOCAB,
    BatchLoader,
    DataError,
    SyntheticSource,
    TokenFile,
    TokenFileSource,
    TokenFileWriter,
    build_source,
    decode_byte_level,
    main,
)

CPU = torch.device("cpu")


def test_byte_level_build_round_trips(tmp_path):
    docs = {"a.txt": "hello world\n", "b.txt": "zweite Datei: äöü ✓\n" * 3}
    for name, text in docs.items():
        (tmp_path / "corpus" / name).parent.mkdir(exist_ok=True)
        (tmp_path / "corpus" / name).write_text(text)
    out = tmp_path / "out" / "corpus.bin"
    assert main(["build", "--output", str(out), str(tmp_path / "corpus")]) == 0
    tf = TokenFile(out)
    assert tf.vocab_size == BYTE_VOCAB and tf.tokens.dtype == np.uint16
    assert tf.num_tokens == sum(len(t.encode()) + 1 for t in docs.values())
    assert decode_byte_level(np.asarray(tf.tokens)) == [docs["a.txt"], docs["b.txt"]]


def test_wide_vocab_uses_uint32_and_bad_files_are_named(tmp_path):
    path = tmp_path / "wide.bin"
    tokens = np.array([0, 70000, 123456, 5], dtype=np.int64)
    with TokenFileWriter(path, vocab_size=200000) as writer:
        writer.write(tokens)
    tf = TokenFile(path)
    assert tf.tokens.dtype == np.uint32 and list(tf.tokens) == list(tokens)
    with pytest.raises(DataError, match="token ids must lie"), TokenFileWriter(tmp_path / "x.bin", 10) as w:
        w.write(np.array([10]))
    truncated = tmp_path / "cut.bin"
    truncated.write_bytes(path.read_bytes()[:-3])
    with pytest.raises(DataError, match=r"cut\.bin.*truncated"):
        TokenFile(truncated)
    (tmp_path / "junk.bin").write_bytes(b"x" * 64)
    with pytest.raises(DataError, match="not a token file"):
        TokenFile(tmp_path / "junk.bin")


def _token_dir(tmp_path, sizes=(1000, 537)) -> str:
    rng = np.random.default_rng(0)
    for i, size in enumerate(sizes):
        with TokenFileWriter(tmp_path / f"part{i}.bin", vocab_size=300) as writer:
            writer.write(rng.integers(0, 300, size))
    return str(tmp_path)


def test_token_source_windows_never_span_files(tmp_path):
    source = TokenFileSource(_token_dir(tmp_path), seq_len=16)
    assert source.num_samples == 999 // 16 + 536 // 16
    first_of_second = source.samples(torch.tensor([999 // 16]))
    second = TokenFile(tmp_path / "part1.bin").tokens
    assert first_of_second.inputs[0].tolist() == second[:16].tolist()
    assert first_of_second.targets[0].tolist() == second[1:17].tolist()
    assert first_of_second.positions is None and first_of_second.document_ids is None
    with pytest.raises(DataError, match=r"model\.vocab_size"):
        build_source(DataConfig(source="tokens", path=str(tmp_path), seq_len=16), vocab_size=256, seed=0)


@pytest.mark.parametrize("kind", ["synthetic", "tokens"])
def test_ranks_get_equal_disjoint_slices_of_the_global_batch(tmp_path, kind):
    source = SyntheticSource(256, 16, seed=3) if kind == "synthetic" else \
        TokenFileSource(_token_dir(tmp_path), seq_len=16)
    single = BatchLoader(source, micro_batch_size=8, rank=0, world_size=1, seed=3, device=CPU)
    ranks = [BatchLoader(source, micro_batch_size=4, rank=r, world_size=2, seed=3, device=CPU)
             for r in range(2)]
    # Enough micro-steps to wrap an epoch of the token files (90 samples / 8 per micro-step).
    for k in range(14):
        whole = single.batch(k).inputs
        parts = [loader.batch(k).inputs for loader in ranks]
        assert all(p.shape == (4, 16) for p in parts)
        assert torch.equal(torch.cat(parts), whole)
        assert not torch.equal(parts[0], parts[1])


def test_order_depends_on_seed_and_targets_are_shifted():
    a = BatchLoader(SyntheticSource(256, 16, 0), micro_batch_size=2, rank=0, world_size=1, seed=0, device=CPU)
    b = BatchLoader(SyntheticSource(256, 16, 1), micro_batch_size=2, rank=0, world_size=1, seed=1, device=CPU)
    batch = a.batch(0)
    assert torch.equal(batch.inputs[:, 1:], batch.targets[:, :-1])
    assert torch.equal(a.batch(5).inputs, a.batch(5).inputs)
    assert not torch.equal(a.batch(0).inputs, b.batch(0).inputs)


def test_resume_continues_with_the_next_batches(tmp_path):
    source = TokenFileSource(_token_dir(tmp_path), seq_len=16)

    def loader():
        return BatchLoader(source, micro_batch_size=4, rank=1, world_size=2, seed=7, device=CPU, prefetch=3)

    straight = loader()
    expected = [straight.next().inputs for _ in range(20)]
    straight.close()
    first = loader()
    for _ in range(7):
        first.next()
    state = first.state_dict()
    first.close()
    assert state["micro_step"] == 7 and state["epoch"] == 1  # 90 samples: 11 micro-steps per epoch
    resumed = loader()
    resumed.load_state_dict(state)
    got = [resumed.next().inputs for _ in range(13)]
    resumed.close()
    assert all(torch.equal(g, e) for g, e in zip(got, expected[7:], strict=True))
    other = BatchLoader(source, micro_batch_size=2, rank=0, world_size=2, seed=7, device=CPU)
    with pytest.raises(DataError, match="global_micro_batch"):
        other.load_state_dict(state)


def test_synthetic_data_is_learnable_and_too_little_data_is_refused(tmp_path):
    source = SyntheticSource(256, 64, seed=0)
    batch = source.samples(torch.arange(32))
    follows_rule = ((batch.targets - batch.inputs) % 256 == source.stride).float().mean()
    assert 0.8 < follows_rule < 0.95
    (tmp_path / "small").mkdir()
    small = TokenFileSource(_token_dir(tmp_path / "small", sizes=(40,)), seq_len=16)
    with pytest.raises(DataError, match="fewer than one global micro-batch"):
        BatchLoader(small, micro_batch_size=4, rank=0, world_size=2, seed=0, device=CPU)
