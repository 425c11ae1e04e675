"""Tokenizer: byte-level BPE from GGUF metadata or a `tokenizer.json`, the model's own chat template,
and incremental detokenization for streaming.

`tokenizers.Tokenizer` is safe to share between threads, and so is everything here apart from an
`IncrementalDetokenizer`, which belongs to one request.
"""
from __future__ import annotations

import json
import re
import secrets
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as Backend

# end-of-turn markers of common chat formats; generation stops on whichever the vocabulary has
_TURN_END_TOKENS = ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|end_of_text|>", "<|end|>", "<end_of_turn>")

_GGUF_CONTROL, _GGUF_USER_DEFINED = 3, 4

_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _byte_level() -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.ByteLevel(add_prefix_space=False)


def _split_then_bytes(pattern: str) -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(pattern), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )


# llama.cpp's `tokenizer.ggml.pre` names -> how text is split before BPE
_GGUF_PRE_TOKENIZERS = {
    # digits one by one, then GPT-2's split: the order llama.cpp applies for `smollm`
    "smollm": lambda: pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), _byte_level()]),
    "default": _byte_level,
    "gpt2": _byte_level,
    "llama3": lambda: _split_then_bytes(_LLAMA3_SPLIT),
    "llama-bpe": lambda: _split_then_bytes(_LLAMA3_SPLIT),
    "qwen2": lambda: _split_then_bytes(_QWEN2_SPLIT),
}


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's printable spelling of the 256 byte values."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    spelled = {b: chr(b) for b in printable}
    others = [b for b in range(256) if b not in spelled]
    spelled.update({b: chr(256 + i) for i, b in enumerate(others)})
    return spelled


class Tokenizer:
    """Encode, decode and chat-format text for one model."""

    def __init__(
        self,
        backend: Backend,
        *,
        bos_token: str | None,
        eos_token: str | None,
        chat_template: str | None = None,
        unk_token: str | None = None,
        pad_token: str | None = None,
        extra_stop_token_ids: Sequence[int] = (),
    ):
        self.backend = backend
        self.bos_token, self.eos_token, self.unk_token, self.pad_token = bos_token, eos_token, unk_token, pad_token
        self.chat_template = chat_template
        self._template: jinja2.Template | None = None
        self._extra_stop = tuple(extra_stop_token_ids)
        self._plain: Backend | None = None   # the same vocabulary, reading control-token strings as text

    # ---- construction ----

    @classmethod
    def from_gguf_metadata(cls, fields: dict[str, Any]) -> "Tokenizer":
        """Build from a GGUF file's `tokenizer.*` metadata (values already decoded to Python)."""
        kind = fields.get("tokenizer.ggml.model")
        if kind != "gpt2":
            raise ValueError(
                f"GGUF tokenizer {kind!r} is not supported (only byte-level BPE, 'gpt2'); "
                "use the model's Hugging Face folder with its tokenizer.json instead"
            )
        pre = fields.get("tokenizer.ggml.pre", "default")
        if pre not in _GGUF_PRE_TOKENIZERS:
            raise ValueError(f"GGUF pre-tokenizer {pre!r} is not supported; known: {sorted(_GGUF_PRE_TOKENIZERS)}")
        tokens: list[str] = fields["tokenizer.ggml.tokens"]
        types: list[int] = fields.get("tokenizer.ggml.token_type") or [1] * len(tokens)
        spelling = _bytes_to_unicode()
        alphabet = set(spelling.values())
        # a token written outside the byte alphabet is plain text: respell it byte by byte
        vocab = {
            t if set(t) <= alphabet else "".join(spelling[b] for b in t.encode()): i for i, t in enumerate(tokens)
        }
        merges = [tuple(m.split(" ", 1)) for m in fields["tokenizer.ggml.merges"]]
        backend = Backend(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
        backend.pre_tokenizer = _GGUF_PRE_TOKENIZERS[pre]()
        backend.decoder = decoders.ByteLevel()
        backend.add_special_tokens(
            [
                AddedToken(t, special=True, normalized=False)
                for t, type_ in zip(tokens, types)
                if type_ == _GGUF_CONTROL and set(t) <= alphabet
            ]
        )
        backend.add_tokens(
            [
                AddedToken(t, special=False, normalized=False)
                for t, type_ in zip(tokens, types)
                if type_ == _GGUF_USER_DEFINED
            ]
        )

        def token(key: str) -> str | None:
            i = fields.get(f"tokenizer.ggml.{key}_token_id")
            return tokens[i] if i is not None and 0 <= i < len(tokens) else None

        bos, eos = token("bos"), token("eos")
        add_bos = bos is not None and fields.get("tokenizer.ggml.add_bos_token", False)
        add_eos = eos is not None and fields.get("tokenizer.ggml.add_eos_token", False)
        if add_bos or add_eos:
            single = [*([bos] if add_bos else []), "$A", *([eos] if add_eos else [])]
            specials = {t: backend.token_to_id(t) for t in single if t != "$A"}
            backend.post_processor = processors.TemplateProcessing(single=single, special_tokens=list(specials.items()))
        return cls(
            backend,
            bos_token=bos,
            eos_token=eos,
            unk_token=token("unknown"),
            pad_token=token("padding"),
            chat_template=fields.get("tokenizer.chat_template"),
        )

    @classmethod
    def from_folder(cls, folder: str | Path, extra_stop_token_ids: Sequence[int] = ()) -> "Tokenizer":
        """Build from a Hugging Face folder: tokenizer.json, plus tokenizer_config.json / chat_template.jinja."""
        folder = Path(folder)
        path = folder / "tokenizer.json"
        if not path.is_file():
            raise FileNotFoundError(f"no tokenizer.json in {folder}")
        backend = Backend.from_file(str(path))
        config_path = folder / "tokenizer_config.json"
        config = json.loads(config_path.read_text()) if config_path.is_file() else {}
        template_path = folder / "chat_template.jinja"
        template = template_path.read_text() if template_path.is_file() else config.get("chat_template")
        if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}, ...]
            template = next((t["template"] for t in template if t.get("name") == "default"), None)

        def token(key: str) -> str | None:
            value = config.get(key)
            return value.get("content") if isinstance(value, dict) else value

        return cls(
            backend,
            bos_token=token("bos_token"),
            eos_token=token("eos_token"),
            unk_token=token("unk_token"),
            pad_token=token("pad_token"),
            chat_template=template,
            extra_stop_token_ids=extra_stop_token_ids,
        )

    # ---- ids and text ----

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of `text`; special tokens written in the text are recognised as such (for text
        the server itself writes, such as a chat template's; a client's text goes through `encode_text`)."""
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_text(self, text: str) -> list[int]:
        """Token ids of text a client wrote: a control token's spelling in it (`<|im_end|>`) is
        plain text, encoded as the characters it is made of, never as the control token."""
        if self._plain is None:
            plain = Backend.from_str(self.backend.to_str())
            plain.encode_special_tokens = True
            self._plain = plain
        return self._plain.encode(text, add_special_tokens=False).ids

    def encode_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> list[int]:
        """Token ids of `messages` through the chat template, where only the template writes
        control tokens: each message's content is encoded as client text (`encode_text`), so a
        message cannot forge a turn by spelling `<|im_end|>\n<|im_start|>system` in it.

        The template is rendered with a one-off placeholder for each content; the text around them
        is the template's own. A template that does not copy a content through unchanged (once,
        verbatim) is refused rather than guessed at.
        """
        nonce = secrets.token_hex(8)
        marks = [f"\ue000{nonce}:{i}\ue001" for i in range(len(messages))]
        marked = [{**m, "content": mark} if isinstance(m.get("content"), str) else m
                  for m, mark in zip(messages, marks)]
        rendered = self.apply_chat_template(marked, add_generation_prompt=add_generation_prompt)
        pieces = re.split(f"\ue000{nonce}:(\\d+)\ue001", rendered)
        used = [int(i) for i in pieces[1::2]]
        if len(used) != len(set(used)) or any(
                isinstance(m.get("content"), str) and i not in used for i, m in enumerate(messages)):
            raise ValueError("the model's chat template does not place each message's content once as written")
        ids: list[int] = []
        for k, piece in enumerate(pieces):
            if k % 2:
                ids += self.encode_text(messages[int(piece)]["content"])
            elif piece:
                ids += self.encode(piece)
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_id(self, token: str | None) -> int | None:
        return None if token is None else self.backend.token_to_id(token)

    @property
    def bos_token_id(self) -> int | None:
        return self.token_id(self.bos_token)

    @property
    def eos_token_id(self) -> int | None:
        return self.token_id(self.eos_token)

    @property
    def stop_token_ids(self) -> list[int]:
        """EOS and the end-of-turn markers this vocabulary has: generation ends on any of them."""
        ids = [self.eos_token_id, *self._extra_stop, *(self.token_id(t) for t in _TURN_END_TOKENS)]
        return list(dict.fromkeys(i for i in ids if i is not None))

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    # ---- chat ----

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **kwargs: Any
    ) -> str:
        """Render `messages` with the model's own chat template, as Hugging Face transformers does."""
        if not self.chat_template:
            raise ValueError("this model has no chat template; send a plain completion instead")
        for message in messages:
            if not isinstance(message, dict) or "role" not in message:
                raise ValueError(f"a chat message must be a dict with a 'role', got {message!r}")
        if self._template is None:
            self._template = _compile(self.chat_template)
        specials = {
            "bos_token": self.bos_token, "eos_token": self.eos_token,
            "unk_token": self.unk_token, "pad_token": self.pad_token,
        }
        return self._template.render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            **{k: v for k, v in specials.items() if v is not None},
            **kwargs,
        )


def _compile(template: str) -> jinja2.Template:
    """The same sandboxed environment transformers renders chat templates in."""

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(
        x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None, sort_keys: bool = False
    ) -> str:
        # jinja's own tojson escapes HTML characters, which would change the prompt
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(template)
    except jinja2.exceptions.TemplateSyntaxError as e:
        raise ValueError(f"the model's chat template does not parse: {e}") from e


class IncrementalDetokenizer:
    """Turns a stream of token ids into text pieces, never cutting a multi-byte character.

    Byte-level tokens can end mid-character; such text decodes to U+FFFD and is held back until the
    next token completes it. Decoding a short window that starts a few tokens back keeps each push
    cheap and gives decoders that strip a leading space the context they need.
    """

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int] = (), skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = list(prompt_ids[-5:])
        self.prefix_offset = 0           # start of the window decoded for context
        self.read_offset = len(self.ids)  # tokens before this one have been emitted

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def push(self, token_id: int) -> str:
        """Add one token; return the text it completed (possibly empty)."""
        self.ids.append(token_id)
        prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
        text = self._decode(self.ids[self.prefix_offset :])
        if len(text) <= len(prefix) or text.endswith("\ufffd"):
            return ""
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return text[len(prefix) :]

    def flush(self) -> str:
        """Whatever is still held back (an incomplete character comes out as U+FFFD)."""
        prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
        text = self._decode(self.ids[self.prefix_offset :])
        self.prefix_offset = self.read_offset = len(self.ids)
        return text[len(prefix) :]
