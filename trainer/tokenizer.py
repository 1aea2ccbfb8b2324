"""A Hugging Face model's own tokenizer, read from its directory with the `tokenizers` package (no
transformers, no network), and its chat template rendered the way transformers renders it.

Files read from the model directory:
    tokenizer.json         the fast tokenizer (vocabulary, merges, added tokens, post-processor)
    tokenizer_config.json  bos/eos/pad token strings, the chat template, added_tokens_decoder
    special_tokens_map.json  older models' special tokens (tokenizer_config.json wins)
    chat_template.jinja    the chat template as transformers 5 saves it (wins over the config's)
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import tokenizers
from jinja2.sandbox import ImmutableSandboxedEnvironment

from trainer.batch import DataError

# The named special tokens transformers passes to chat templates (its SPECIAL_TOKENS_ATTRIBUTES).
SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token",
                      "mask_token")
# The ones the trainer needs as ids; a string the tokenizer does not know is refused for these.
_ID_KEYS = ("bos_token", "eos_token", "pad_token")


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}`, transformers' marker of assistant text, renders its
    body unchanged: the assistant spans come from rendering conversation prefixes instead, which works
    for every template, marked or not."""

    tags = {"generation"}

    def parse(self, parser):
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


def _raise_exception(message: str):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    # transformers' override: jinja's own tojson escapes HTML characters, which changes the text.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _environment() -> ImmutableSandboxedEnvironment:
    """The environment transformers compiles chat templates in (utils/chat_template_utils.py)."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


def _token_string(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string, or an AddedToken dict."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise DataError(f"{path}: unreadable ({e}); restore the model's original file") from None
    if not isinstance(data, dict):
        raise DataError(f"{path}: not a JSON object; restore the model's original file")
    return data


class Tokenizer:
    """Encodes text exactly as transformers' fast tokenizer of the same directory does."""

    def __init__(self, backend: tokenizers.Tokenizer, *, model_dir: Path, special_tokens: dict[str, str],
                 chat_template: str | None, chat_template_source: str):
        self.model_dir = model_dir
        self.special_tokens = special_tokens  # key (bos_token, ...) -> token string
        self.chat_template_source = chat_template_source  # the file the template came from, for errors
        self._backend = backend
        self._template = _environment().from_string(chat_template) if chat_template else None
        self._ids = {key: backend.token_to_id(special_tokens[key])
                     for key in _ID_KEYS if key in special_tokens}
        self._vocab_size = max(backend.get_vocab(with_added_tokens=True).values()) + 1

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> Tokenizer:
        model_dir = Path(model_dir)
        path = model_dir / "tokenizer.json"
        if not path.is_file():
            raise DataError(f"{model_dir}: no tokenizer.json (the trainer reads the model's fast tokenizer); "
                            "copy it from the model repository, or write it with transformers: "
                            "AutoTokenizer.from_pretrained(NAME).save_pretrained(DIR)")
        try:
            backend = tokenizers.Tokenizer.from_file(str(path))
        except Exception as e:  # the Rust side raises plain Exceptions
            raise DataError(f"{path}: not a tokenizers file ({e}); restore the model's original file"
                            ) from None
        # transformers switches off the truncation and padding a tokenizer.json may carry unless asked.
        backend.no_truncation()
        backend.no_padding()
        config_path = model_dir / "tokenizer_config.json"
        config = _read_json(config_path)
        _add_declared_tokens(backend, config.get("added_tokens_decoder") or {}, config_path)
        legacy = _read_json(model_dir / "special_tokens_map.json")
        special = {}
        for key in SPECIAL_TOKEN_KEYS:
            token = _token_string(config.get(key)) or _token_string(legacy.get(key))
            if token is None:
                continue
            if key in _ID_KEYS and backend.token_to_id(token) is None:
                raise DataError(f"{config_path}: {key} {token!r} is not a token of {path}; the two files are "
                                "from different tokenizers: restore the model's original files")
            special[key] = token
        template, source = _chat_template(model_dir, config, config_path)
        return cls(backend, model_dir=model_dir, special_tokens=special, chat_template=template,
                   chat_template_source=source)

    # -- ids -------------------------------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        """The largest token id + 1, added tokens included (ids may leave gaps)."""
        return self._vocab_size

    @property
    def bos_id(self) -> int | None:
        return self._ids.get("bos_token")

    @property
    def eos_id(self) -> int | None:
        return self._ids.get("eos_token")

    @property
    def pad_id(self) -> int | None:
        """The pad token, else EOS (padding is never a counted target, so any valid id works)."""
        pad = self._ids.get("pad_token")
        return self.eos_id if pad is None else pad

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids; add_special_tokens applies tokenizer.json's post-processor (e.g. BOS first)."""
        return self._backend.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_batch(self, texts: list[str], add_special_tokens: bool = True) -> list[list[int]]:
        """encode() of many texts at once (in parallel threads)."""
        return [e.ids for e in self._backend.encode_batch(texts, add_special_tokens=add_special_tokens)]

    # -- chat ------------------------------------------------------------------------------------------

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = False) -> str:
        """The chat template's text, with the variables transformers' apply_chat_template passes."""
        if self._template is None:
            raise DataError(f"{self.model_dir}: the tokenizer has no chat template (no chat_template.jinja, "
                            "no chat_template in tokenizer_config.json), so chats cannot be rendered; copy "
                            "the chat model's template there, or train on plain text (data.text_field)")
        # transformers drops None-valued keys: templates test for a key's presence, not for None.
        messages = [{k: v for k, v in m.items() if v is not None} for m in messages]
        try:
            return self._template.render(messages=messages, tools=None, documents=None,
                                         add_generation_prompt=add_generation_prompt, **self.special_tokens)
        except jinja2.exceptions.TemplateError as e:
            raise DataError(f"{self.chat_template_source}: the chat template failed: {e}") from None

    def encode_chat(self, messages: list[dict]) -> tuple[list[int], list[bool]]:
        """The whole conversation's ids (the template writes any BOS itself, so the post-processor is
        not applied) and which of them are assistant text.

        Assistant message i spans the characters from the end of render(messages[:i],
        add_generation_prompt=True) (its role header) to the end of render(messages[:i+1]) less trailing
        whitespace: the reply and its end-of-turn marker, but not the newline some templates write after
        the marker (layout: generation stops at the marker). A token is the assistant's when its first
        character lies in such a span."""
        full = self.render_chat(messages)
        spans = []
        for i, message in enumerate(messages):
            if message.get("role") != "assistant":
                continue
            header = self.render_chat(messages[:i], add_generation_prompt=True)
            through = self.render_chat(messages[: i + 1])
            if not (full.startswith(header) and full.startswith(through)):
                raise DataError(
                    f"{self.chat_template_source}: cannot find assistant spans: the chat template renders "
                    f"the conversation up to assistant message {i} differently from the whole conversation "
                    "(e.g. it rewrites earlier turns), so the reply's tokens cannot be located. Use a "
                    "template that renders earlier turns unchanged, or pre-render the chats as text and "
                    "train on data.text_field (then every token counts)")
            spans.append((len(header), len(through.rstrip())))
        encoding = self._backend.encode(full, add_special_tokens=False)
        mask = [any(start <= first < end for start, end in spans) for first, _ in encoding.offsets]
        return encoding.ids, mask


def check_vocabulary(tokenizer: Tokenizer, vocab_size: int) -> None:
    """Refuses a tokenizer whose ids reach past the model's embedding rows: a tokenizer from another
    model would otherwise fail on the device with an index error, or train on the wrong rows."""
    if tokenizer.vocab_size > vocab_size:
        raise DataError(f"{tokenizer.model_dir}/tokenizer.json has token ids up to "
                        f"{tokenizer.vocab_size - 1} but model.vocab_size={vocab_size}: the tokenizer is not "
                        "this model's. Point "
                        "model.hf_dir at the model's own directory, or set model.vocab_size >= "
                        f"{tokenizer.vocab_size}")


def _add_declared_tokens(backend: tokenizers.Tokenizer, declared: dict, config_path: Path) -> None:
    """tokenizer_config.json's added_tokens_decoder entries that tokenizer.json lacks, added the way
    transformers adds them; each must land on its declared id or the ids would not match the model."""
    for id_text, entry in sorted(declared.items(), key=lambda item: int(item[0])):
        content = _token_string(entry)
        if content is None or backend.token_to_id(content) is not None:
            continue
        token = tokenizers.AddedToken(content, single_word=entry.get("single_word", False),
                                      lstrip=entry.get("lstrip", False), rstrip=entry.get("rstrip", False),
                                      normalized=entry.get("normalized", True),
                                      special=entry.get("special", False))
        backend.add_tokens([token])
        if backend.token_to_id(content) != int(id_text):
            raise DataError(f"{config_path}: added token {content!r} is declared with id {id_text} but "
                            f"tokenizer.json would give it id {backend.token_to_id(content)}; the files are "
                            "from different tokenizers: restore the model's original files")


def _chat_template(model_dir: Path, config: dict, config_path: Path) -> tuple[str | None, str]:
    """The default chat template and the file it came from: chat_template.jinja (transformers 5) wins
    over tokenizer_config.json's chat_template, a string or a list of {name, template}."""
    jinja_path = model_dir / "chat_template.jinja"
    if jinja_path.is_file():
        return jinja_path.read_text(encoding="utf-8"), str(jinja_path)
    template = config.get("chat_template")
    if isinstance(template, list):
        template = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}.get("default")
    return (template if isinstance(template, str) else None), str(config_path)
