"""Real text and chat data: the model's own tokenizer read without transformers (checked against
transformers here), assistant-only masks, packing with document masking, the jsonl/parquet readers,
the packed source under the batch loader, and the `tokenize` command."""

from __future__ import annotations

import json
import random
import shutil

import numpy as np
import pyarrow
import pyarrow.parquet
import pytest
import torch
import torch.nn.functional as F
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

from trainer.batch import IGNORE
from trainer.config import DataConfig, parse_config
from trainer.data import BatchLoader, DataError, TokenFile, build_source, main
from trainer.documents import Document, PackedSource, eval_batches, first_fit, packed_source
from trainer.errors import ConfigError
from trainer.tokenizer import Tokenizer

CPU = torch.device("cpu")
BOS, EOS = "<|begin_of_text|>", "<|end_of_text|>"
# ChatML behind a BOS. The {% generation %} marks are transformers' own record of the assistant text:
# its return_assistant_tokens_mask is the oracle our prefix-rendering spans are checked against.
CHATML = ("{{ bos_token }}{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' }}"
          "{% if message['role'] == 'assistant' %}{% generation %}{{ message['content'] + '<|im_end|>' }}"
          "{% endgeneration %}{% else %}{{ message['content'] + '<|im_end|>' }}{% endif %}{{ '\n' }}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
SENTENCES = ["Hello world, how are you today?", "The quick brown fox jumps over the lazy dog.",
             "Packing documents into rows keeps the accelerator busy.", "Grüße aus Köln: 1, 2, 3!"]
CHAT = [{"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Say hello."},
        {"role": "assistant", "content": "Hello world."},
        {"role": "user", "content": "And the fox?"},
        {"role": "assistant", "content": "The quick brown fox jumps."}]


def _backend(post_processor_eos: bool = False) -> BackendTokenizer:
    tok = BackendTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=[BOS, EOS, "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(SENTENCES * 4, trainer)
    specials = [(BOS, tok.token_to_id(BOS)), (EOS, tok.token_to_id(EOS))]
    single = f"{BOS} $A {EOS}" if post_processor_eos else f"{BOS} $A"
    tok.post_processor = processors.TemplateProcessing(single=single, pair=f"{BOS} $A {BOS} $B",
                                                       special_tokens=specials)
    return tok


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("model")
    PreTrainedTokenizerFast(tokenizer_object=_backend(), bos_token=BOS, eos_token=EOS,
                            chat_template=CHATML).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def tok(model_dir) -> Tokenizer:
    return Tokenizer.from_dir(model_dir)


@pytest.fixture(scope="module")
def hf(model_dir) -> PreTrainedTokenizerFast:
    return PreTrainedTokenizerFast.from_pretrained(model_dir)


def _jsonl(path, records) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


# -- tokenizer ---------------------------------------------------------------------------------------


def test_encode_matches_transformers(tok, hf, model_dir):
    assert (model_dir / "chat_template.jinja").is_file()  # transformers 5's layout is what is read
    texts = [*SENTENCES, "", "  two leading spaces\n\nand blank lines\n", "emoji 🙂 and ✓",
             "inline <|im_start|>special<|im_end|> tokens", EOS]
    for text in texts:
        assert tok.encode(text) == hf(text)["input_ids"], text
        assert tok.encode(text, add_special_tokens=False) == hf(text, add_special_tokens=False)["input_ids"]
    assert tok.encode("Hello")[0] == tok.bos_id == hf.bos_token_id
    assert tok.eos_id == hf.eos_token_id and tok.pad_id == tok.eos_id  # no pad token: EOS pads
    assert tok.vocab_size == len(hf)


def test_encode_chat_matches_transformers_and_marks_exactly_the_replies(tok, hf):
    ids, mask = tok.encode_chat(CHAT)
    reference = hf.apply_chat_template(CHAT, tokenize=True, return_dict=True,
                                       return_assistant_tokens_mask=True)
    assert ids == reference["input_ids"]
    assert mask == [bool(m) for m in reference["assistant_masks"]]
    runs, current = [], []
    for token, trainable in zip(ids, mask, strict=True):
        if trainable:
            current.append(token)
        elif current:
            runs.append(current)
            current = []
    assert [hf.decode(run) for run in runs] == ["Hello world.<|im_end|>",
                                                "The quick brown fox jumps.<|im_end|>"]
    # The template writes the BOS itself; it is not doubled by the post-processor.
    assert ids.count(tok.bos_id) == 1


def test_the_assistant_mask_decides_the_loss(tok):
    """Counting the system/user tokens too would change the loss: the packed targets must count the
    replies only."""
    ids, mask = tok.encode_chat(CHAT)
    source = PackedSource([Document(np.array(ids, dtype=np.int32), np.array(mask))], seq_len=128,
                          pad_id=tok.pad_id)
    batch = source.samples(torch.tensor([0]))
    logits = torch.randn(1, 128, tok.vocab_size, generator=torch.Generator().manual_seed(0))
    counted = F.cross_entropy(logits[0], batch.targets[0], ignore_index=IGNORE)
    n = len(ids)
    # Independently: the next-token loss over the targets that are reply tokens.
    reply = torch.tensor(mask[1:])
    expected = F.cross_entropy(logits[0, : n - 1][reply], torch.tensor(ids[1:])[reply])
    everything = F.cross_entropy(logits[0, : n - 1], torch.tensor(ids[1:]))
    assert torch.allclose(counted, expected)
    assert not torch.allclose(counted, everything)
    assert int((batch.targets != IGNORE).sum()) == sum(mask[1:]) < n - 1


def _variant(model_dir, tmp_path, config: dict | None = None, template: str | None = None):
    """A copy of the model's tokenizer.json with another tokenizer_config.json / chat template."""
    path = tmp_path / "variant"
    path.mkdir()
    shutil.copy(model_dir / "tokenizer.json", path)
    if config is not None:
        (path / "tokenizer_config.json").write_text(json.dumps(config))
    if template is not None:
        (path / "chat_template.jinja").write_text(template)
    return path


def test_config_formats_dict_tokens_and_named_templates(model_dir, tmp_path, tok):
    config = {"bos_token": {"content": BOS, "lstrip": False, "__type": "AddedToken"},
              "eos_token": {"content": EOS}, "pad_token": "<|im_end|>",
              "chat_template": [{"name": "tool_use", "template": "TOOLS"},
                                {"name": "default",
                                 "template": "{{ bos_token }}{{ messages[0]['content'] }}"}]}
    variant = Tokenizer.from_dir(_variant(model_dir, tmp_path, config))
    assert (variant.bos_id, variant.eos_id) == (tok.bos_id, tok.eos_id)
    assert variant.pad_id == tok.encode("<|im_end|>", add_special_tokens=False)[0]
    assert variant.render_chat([{"role": "user", "content": "hi"}]) == f"{BOS}hi"
    # chat_template.jinja wins over the config's template.
    (tmp_path / "variant" / "chat_template.jinja").write_text("J{{ messages[0]['content'] }}")
    assert Tokenizer.from_dir(tmp_path / "variant").render_chat([{"role": "user", "content": "x"}]) == "Jx"
    (tmp_path / "variant" / "tokenizer_config.json").write_text(json.dumps({**config, "eos_token": "</s>"}))
    with pytest.raises(DataError, match=r"tokenizer_config\.json: eos_token '</s>' is not a token"):
        Tokenizer.from_dir(tmp_path / "variant")


def test_declared_added_tokens_join_the_vocabulary(model_dir, tmp_path, tok):
    extra = {"content": "<|extra|>", "special": True, "lstrip": False, "rstrip": False, "normalized": False,
             "single_word": False}
    config = {"bos_token": BOS, "eos_token": EOS, "added_tokens_decoder": {str(tok.vocab_size): extra}}
    path = _variant(model_dir, tmp_path, config)
    variant, hf = Tokenizer.from_dir(path), PreTrainedTokenizerFast.from_pretrained(path)
    assert variant.vocab_size == tok.vocab_size + 1 == len(hf)
    text = "Hello<|extra|>world"
    assert variant.encode(text) == hf(text)["input_ids"] and tok.vocab_size in variant.encode(text)
    (path / "tokenizer_config.json").write_text(json.dumps(
        {**config, "added_tokens_decoder": {str(tok.vocab_size + 5): extra}}))
    with pytest.raises(DataError, match=rf"'<\|extra\|>' is declared with id {tok.vocab_size + 5} but "
                                        rf"tokenizer\.json would give it id {tok.vocab_size}"):
        Tokenizer.from_dir(path)


def test_a_template_that_rewrites_earlier_turns_is_refused(model_dir, tmp_path):
    rewrites = "{% for m in messages %}{% if loop.last %}LAST {% endif %}{{ m['content'] }}|{% endfor %}"
    variant = Tokenizer.from_dir(_variant(model_dir, tmp_path, {"eos_token": EOS}, rewrites))
    with pytest.raises(DataError, match=r"chat_template\.jinja: cannot find assistant spans.*message 1"):
        variant.encode_chat(CHAT[1:3])


def test_chats_need_a_template(model_dir, tmp_path):
    variant = _variant(model_dir, tmp_path, {"bos_token": BOS, "eos_token": EOS})
    data = tmp_path / "chats.jsonl"
    _jsonl(data, [{"messages": CHAT}])
    cfg = DataConfig(source="jsonl", path=str(data), messages_field="messages", seq_len=64)
    with pytest.raises(DataError, match=rf"{variant}: the tokenizer has no chat template.*data\.text_field"):
        build_source(cfg, vocab_size=512, seed=0, tokenizer=Tokenizer.from_dir(variant))
    with pytest.raises(DataError, match=r"no tokenizer\.json"):
        Tokenizer.from_dir(tmp_path)


def test_text_documents_end_in_one_eos(model_dir, tmp_path, tok):
    data = _jsonl(tmp_path / "a.jsonl", [{"text": s} for s in SENTENCES[:2]])
    cfg = DataConfig(source="jsonl", path=data, seq_len=64)
    (batch,) = eval_batches(packed_source(cfg, tok, 512), batch_size=1)
    row = batch.inputs[0].tolist()
    expected = [*tok.encode(SENTENCES[0]), tok.eos_id, *tok.encode(SENTENCES[1]), tok.eos_id]
    assert row[: len(expected)] == expected
    (batch,) = eval_batches(packed_source(cfg, tok, 512, append_eos=False), batch_size=1)
    without_eos = [*tok.encode(SENTENCES[0]), *tok.encode(SENTENCES[1])]
    assert batch.inputs[0, : len(without_eos)].tolist() == without_eos
    # A post-processor that adds EOS already: not doubled.
    eos_dir = tmp_path / "eos_model"
    PreTrainedTokenizerFast(tokenizer_object=_backend(post_processor_eos=True), bos_token=BOS,
                            eos_token=EOS).save_pretrained(eos_dir)
    eos_tok = Tokenizer.from_dir(eos_dir)
    (batch,) = eval_batches(packed_source(cfg, eos_tok, 512), batch_size=1)
    assert batch.inputs[0, : len(expected) - 1].tolist() == expected[:-1]


# -- packing -----------------------------------------------------------------------------------------


def _doc(k: int, length: int, trainable=None) -> Document:
    mask = np.ones(length, dtype=bool) if trainable is None else np.asarray(trainable, dtype=bool)
    return Document(np.arange(length, dtype=np.int32) + 100 * k, mask)


def test_packing_keeps_documents_whole_and_masks_across_them():
    # seq_len 8: rows of 9 slots. First fit: row0 = d0 d2, row1 = d1 d5, row2 = d3, row3 = d4 (cut to 8).
    docs = [_doc(0, 5), _doc(1, 6), _doc(2, 3, [0, 0, 1]), _doc(3, 4), _doc(4, 11), _doc(5, 2)]
    source = PackedSource(docs, seq_len=8, pad_id=7)
    assert source.num_samples == 4
    assert (source.stats.documents, source.stats.truncated, source.stats.dropped) == (6, 1, 0)
    batch = source.samples(torch.arange(4))
    assert batch.inputs.shape == batch.targets.shape == batch.positions.shape == (4, 8)
    slots = torch.cat([batch.inputs, batch.targets[:, -1:]], dim=1)  # last slot only seen as a target
    assert slots[0].tolist()[:8] == [100 * 0 + i for i in range(5)] + [200, 201, 202]
    assert batch.document_ids[0].tolist() == [0, 0, 0, 0, 0, 1, 1, 1]
    assert batch.positions[0].tolist() == [0, 1, 2, 3, 4, 0, 1, 2]
    # d0's targets count; the boundary d0 -> d2 and d2's untrained tokens do not; padding never does.
    assert batch.targets[0].tolist() == [1, 2, 3, 4, IGNORE, IGNORE, 202, IGNORE]
    assert batch.inputs[1].tolist() == [100, 101, 102, 103, 104, 105, 500, 501]
    assert batch.targets[1].tolist() == [101, 102, 103, 104, 105, IGNORE, 501, IGNORE]
    assert batch.inputs[2].tolist() == [300, 301, 302, 303, 7, 7, 7, 7]
    assert batch.document_ids[2].tolist() == [0, 0, 0, 0, 1, 1, 1, 1]  # padding: an id of its own
    assert batch.positions[2].tolist() == [0, 1, 2, 3, 0, 1, 2, 3]
    assert batch.targets[2].tolist() == [301, 302, 303] + [IGNORE] * 5
    assert batch.inputs[3].tolist() == [400 + i for i in range(8)]
    assert batch.targets[3].tolist() == [401 + i for i in range(7)] + [IGNORE]  # cut at seq_len, then pad


def test_documents_without_a_counted_target_are_dropped():
    source = PackedSource([_doc(0, 4, [1, 0, 0, 0]), _doc(1, 3)], seq_len=8, pad_id=0)
    assert (source.stats.documents, source.stats.dropped, source.num_samples) == (1, 1, 1)
    assert source.samples(torch.tensor([0])).inputs[0, :3].tolist() == [100, 101, 102]


def test_first_fit_matches_the_definition():
    rng = random.Random(0)
    lengths = [rng.randint(1, 17) for _ in range(500)]
    free, expected = [], []
    for length in lengths:
        row = next((i for i, room in enumerate(free) if room >= length), len(free))
        if row == len(free):
            free.append(17)
        free[row] -= length
        expected.append(row)
    assert first_fit(lengths, 17) == expected


# -- readers -----------------------------------------------------------------------------------------


def test_jsonl_errors_name_the_file_and_line(tmp_path, tok):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"text": "fine"}\n\n{"body": "no text here", "id": 3}\n')
    cfg = DataConfig(source="jsonl", path=str(path), seq_len=32)
    with pytest.raises(DataError, match=rf"{path}:3: no field 'text' \(data\.text_field\); "
                                        r"the keys are \['body', 'id'\]"):
        build_source(cfg, 512, 0, tok)
    path.write_text('{"text": "fine"}\n{"text": oops}\n')
    with pytest.raises(DataError, match=rf"{path}:2: not JSON"):
        build_source(cfg, 512, 0, tok)
    path.write_text('{"messages": "not a list"}\n')
    chat_cfg = DataConfig(source="jsonl", path=str(path), seq_len=32, messages_field="messages")
    with pytest.raises(DataError, match=rf"{path}:1: data\.messages_field must hold a non-empty list"):
        build_source(chat_cfg, 512, 0, tok)


def test_parquet_missing_column_names_the_file_and_columns(tmp_path, tok):
    path = tmp_path / "part.parquet"
    pyarrow.parquet.write_table(pyarrow.table({"body": ["a"], "id": [1]}), path)
    with pytest.raises(DataError, match=rf"{path}: no column 'text' \(data\.text_field\); "
                                        r"the columns are \['body', 'id'\]"):
        build_source(DataConfig(source="parquet", path=str(path), seq_len=32), 512, 0, tok)


def test_directories_are_read_in_sorted_order(tmp_path, tok):
    chats = tmp_path / "chats"
    chats.mkdir()
    pyarrow.parquet.write_table(pyarrow.table({"conv": [CHAT[1:3]]}), chats / "b.parquet")
    pyarrow.parquet.write_table(pyarrow.table({"conv": [CHAT[3:5]]}), chats / "a.parquet")
    (chats / "notes.txt").write_text("not data")
    cfg = DataConfig(source="parquet", path=str(chats), messages_field="conv", seq_len=128)
    (batch,) = eval_batches(packed_source(cfg, tok, 512), batch_size=1)
    first, second = tok.encode_chat(CHAT[3:5])[0], tok.encode_chat(CHAT[1:3])[0]
    assert batch.inputs[0, : len(first) + len(second)].tolist() == first + second
    assert batch.document_ids[0, len(first)].item() == 1
    with pytest.raises(DataError, match=r"no \*\.jsonl files in this directory"):
        build_source(DataConfig(source="jsonl", path=str(chats), seq_len=64), 512, 0, tok)


def test_sources_need_the_tokenizer_of_the_model(tmp_path, tok):
    cfg = DataConfig(source="jsonl", path=_jsonl(tmp_path / "a.jsonl", [{"text": "x"}]), seq_len=32)
    with pytest.raises(DataError, match=r"data\.source=jsonl needs a tokenizer: set model\.hf_dir"):
        build_source(cfg, 512, 0)
    with pytest.raises(DataError, match=rf"tokenizer\.json has token ids up to {tok.vocab_size - 1} but "
                                        r"model\.vocab_size=256"):
        build_source(cfg, 256, 0, tok)
    assert "data.path" in _problem_keys({"source": "parquet"})
    assert _problem_keys({"messages_field": "messages"}) == {"data.messages_field"}


def _problem_keys(data: dict) -> set[str]:
    with pytest.raises(ConfigError) as err:
        parse_config({"data": data})
    return {p.key for p in err.value.problems}


# -- the packed source under the loader --------------------------------------------------------------


@pytest.fixture
def corpus(tmp_path, tok):
    rng = random.Random(1)
    records = [{"text": " ".join(rng.choice(SENTENCES) for _ in range(rng.randint(0, 2)))} for _ in range(60)]
    logs: list[str] = []
    cfg = DataConfig(source="jsonl", path=_jsonl(tmp_path / "corpus.jsonl", records), seq_len=24)
    source = build_source(cfg, 512, 0, tok, log=logs.append)
    assert len(logs) == 1 and "60 documents" in logs[0] and f"{source.num_samples} rows" in logs[0]
    return source


def _fields(batch) -> list[torch.Tensor]:
    return [batch.inputs, batch.targets, batch.positions, batch.document_ids]


def test_packed_batches_are_deterministic_and_disjoint_across_ranks(corpus):
    single = BatchLoader(corpus, micro_batch_size=4, rank=0, world_size=1, seed=5, device=CPU)
    ranks = [BatchLoader(corpus, micro_batch_size=2, rank=r, world_size=2, seed=5, device=CPU)
             for r in range(2)]
    other_seed = BatchLoader(corpus, micro_batch_size=4, rank=0, world_size=1, seed=6, device=CPU)
    steps = 2 * (corpus.num_samples // 4) + 1  # into the third epoch
    for k in range(steps):
        whole, parts = single.batch(k), [loader.batch(k) for loader in ranks]
        for field, *split in zip(_fields(whole), *map(_fields, parts), strict=True):
            assert torch.equal(torch.cat(split), field)
        assert not torch.equal(parts[0].inputs, parts[1].inputs)
        assert all(torch.equal(a, b) for a, b in zip(_fields(whole), _fields(single.batch(k)), strict=True))
    assert not torch.equal(single.batch(0).inputs, other_seed.batch(0).inputs)


def test_resume_continues_exactly_and_epochs_are_logged_once(corpus):
    per_epoch = corpus.num_samples // 4

    def loader(logs):
        return BatchLoader(corpus, micro_batch_size=2, rank=1, world_size=2, seed=3, device=CPU, prefetch=3,
                           log=logs.append)

    logs: list[str] = []
    straight = loader(logs)
    expected = [straight.next() for _ in range(2 * per_epoch + 2)]
    straight.close()
    assert logs == [f"data: epoch 2 starts at micro-step {per_epoch} ({corpus.num_samples} samples, "
                    f"{per_epoch} micro-steps per epoch)",
                    f"data: epoch 3 starts at micro-step {2 * per_epoch} ({corpus.num_samples} samples, "
                    f"{per_epoch} micro-steps per epoch)"]
    first = loader([])
    for _ in range(per_epoch + 1):
        first.next()
    state = first.state_dict()
    first.close()
    assert state["epoch"] == 2 and state["micro_step"] == per_epoch + 1
    resumed_logs: list[str] = []
    resumed = loader(resumed_logs)
    resumed.load_state_dict(state)
    got = [resumed.next() for _ in range(per_epoch + 1)]
    resumed.close()
    for g, e in zip(got, expected[per_epoch + 1:], strict=True):
        assert all(torch.equal(a, b) for a, b in zip(_fields(g), _fields(e), strict=True))
    assert [line.split(" starts")[0] for line in resumed_logs] == ["data: epoch 3"]


def test_eval_batches_cover_every_row_once_in_order_on_equal_terms(corpus):
    batch_size, world = 3, 2
    per_rank = [list(eval_batches(corpus, batch_size, rank, world)) for rank in range(world)]
    assert len(per_rank[0]) == len(per_rank[1]) == -(-corpus.num_samples // (batch_size * world))
    # Step by step, rank by rank, the rows are the source's in file order, then filler.
    in_order = [per_rank[rank][step] for step in range(len(per_rank[0])) for rank in range(world)]
    inputs, targets = torch.cat([b.inputs for b in in_order]), torch.cat([b.targets for b in in_order])
    reference = corpus.samples(torch.arange(corpus.num_samples))
    assert torch.equal(inputs[: corpus.num_samples], reference.inputs)
    assert torch.equal(targets[: corpus.num_samples], reference.targets)
    assert len(targets) > corpus.num_samples and (targets[corpus.num_samples:] == IGNORE).all()


# -- the tokenize command ----------------------------------------------------------------------------


def test_tokenize_command_round_trips(tmp_path, model_dir, tok, capsys):
    inputs = tmp_path / "in"
    inputs.mkdir()
    _jsonl(inputs / "a.jsonl", [{"body": SENTENCES[0]}, {"body": SENTENCES[1]}])
    pyarrow.parquet.write_table(pyarrow.table({"body": [SENTENCES[2]]}), inputs / "b.parquet")
    (inputs / "c.txt").write_text(SENTENCES[3])
    out = tmp_path / "corpus.bin"
    assert main(["tokenize", "--tokenizer", str(model_dir), "--output", str(out), "--text-field", "body",
                 str(inputs)]) == 0
    made = TokenFile(out)
    assert made.vocab_size == tok.vocab_size
    assert made.tokens.tolist() == [t for s in SENTENCES for t in [*tok.encode(s), tok.eos_id]]
    assert "[3/3]" in capsys.readouterr().err
    assert main(["tokenize", "--tokenizer", str(model_dir), "--output", str(out), str(inputs)]) == 2
    assert "no field 'text' (--text-field)" in capsys.readouterr().err
