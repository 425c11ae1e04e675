"""The engine's tokenizer encodes, decodes and chat-formats exactly as transformers does for the GGUF."""
from __future__ import annotations

import json
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import jinja2
import pytest

from graft.engine.loader import default_model_path, load_tokenizer
from graft.engine.tokenizer import IncrementalDetokenizer, Tokenizer

BBH_TASKS = ["date_understanding", "multistep_arithmetic_two", "dyck_languages", "penguins_in_a_table", "word_sorting"]

UNUSUAL = [
    "Hello, world! 👋🏽 Family: 👨‍👩‍👧‍👦, flag: 🇫🇷, keycap: 1️⃣",
    "日本語のテキストと中文字符，还有한국어 문장。",
    "e\u0301 n\u0303 a\u030a\u0323 Zalgo: Z\u0336\u0353a\u0337l\u0338g\u0335o",
    "שלום עולם — مرحبا بالعالم \u200f(RTL)\u200e mixed",
    "zero\u200bwidth\u200cnon\u200djoiner\ufeffbom",
    "tabs\t\tand   spaces    \n\n\n  newlines \r\n end   ",
    "   leading and trailing   ",
    "0123456789 3.14159 1,000,000 12:30 2024-01-31 x1y22z333",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<|endoftext|><repo_name>",
    "not special: <|im_start |> <im_end> <|unknown|>",
    "math ∑ ∫ √ ≠ ≤, symbols ©®™ and \x00\x01\x7f control bytes",
    "",
]


def data_dir() -> Path:
    root = Path(__file__).resolve().parents[2]
    path = Path(os.environ.get("GRAFT_DATA_DIR", root.parent / "shared" / "data"))
    assert (path / "bbh").is_dir(), f"BBH data not found under {path}: set GRAFT_DATA_DIR"
    return path


def bbh_texts() -> list[str]:
    texts = []
    for task in BBH_TASKS:
        texts.append((data_dir() / "bbh" / "cot-prompts" / f"{task}.txt").read_text())
        examples = json.loads((data_dir() / "bbh" / "bbh" / f"{task}.json").read_text())["examples"]
        texts += [f"\n\nQ: {ex['input']}\nA: Let's think step by step." for ex in examples[:3]]
    return texts


@pytest.fixture(scope="module")
def ours() -> Tokenizer:
    return load_tokenizer()


@pytest.fixture(scope="module")
def theirs():
    from transformers import AutoTokenizer

    path = Path(default_model_path())
    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


@pytest.mark.parametrize("text", bbh_texts(), ids=lambda t: t[:20])
def test_bbh_prompts_encode_like_transformers(ours, theirs, text):
    ids = ours.encode(text)
    assert ids == theirs.encode(text, add_special_tokens=False)
    assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True) == text


@pytest.mark.parametrize("text", UNUSUAL)
def test_unusual_unicode_encodes_and_decodes_like_transformers(ours, theirs, text):
    ids = ours.encode(text)
    assert ids == theirs.encode(text, add_special_tokens=False)
    for skip in (True, False):
        assert ours.decode(ids, skip_special_tokens=skip) == theirs.decode(ids, skip_special_tokens=skip)


def test_special_tokens_in_text_are_single_tokens_and_skipped_on_decode(ours):
    ids = ours.encode("<|im_start|>user\nhi<|im_end|>")
    assert ids[0] == ours.bos_token_id and ids[-1] == ours.eos_token_id
    assert ours.decode(ids) == "user\nhi"


def test_a_whitespace_run_before_digits_splits_as_the_smollm_pretokenizer_does(ours):
    # SmolLM2's own tokenizer.json and llama.cpp's `smollm` split digits off before GPT-2's split,
    # so the spaces before a number stay one run; transformers' GGUF conversion (5.x) skips the digit step.
    ids = ours.encode("x  12")
    assert [ours.backend.id_to_token(i) for i in ids] == ["x", "ĠĠ", "1", "2"]


def test_stop_tokens_are_eos_and_turn_ends(ours, theirs):
    assert ours.eos_token_id == theirs.eos_token_id
    assert ours.bos_token_id == theirs.bos_token_id
    assert ours.eos_token_id in ours.stop_token_ids
    assert ours.token_id("<|im_end|>") in ours.stop_token_ids
    assert ours.token_id("<|endoftext|>") in ours.stop_token_ids
    assert ours.vocab_size == len(theirs)


CONVERSATION = [
    {"role": "system", "content": "You answer in one short sentence."},
    {"role": "user", "content": "What is the capital of France?"},
    {"role": "assistant", "content": "Paris is the capital of France."},
    {"role": "user", "content": "And of Japan? 日本 🗾"},
]


@pytest.mark.parametrize("messages", [CONVERSATION, CONVERSATION[1:]], ids=["with-system", "default-system"])
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_renders_like_transformers(ours, theirs, messages, add_generation_prompt):
    expected = theirs.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    assert ours.apply_chat_template(messages, add_generation_prompt=add_generation_prompt) == expected


def test_chat_template_sandbox_helpers_and_errors(ours):
    template = (
        "{% if messages|length > 1 %}{{ raise_exception('one message only') }}{% endif %}"
        "{{ bos_token }}{{ messages[0] | tojson }}{{ eos_token }}"
    )
    tok = Tokenizer(ours.backend, bos_token="<s>", eos_token="</s>", chat_template=template)
    assert tok.apply_chat_template([{"role": "user", "content": "<b>é</b>"}]) == (
        '<s>{"role": "user", "content": "<b>é</b>"}</s>'
    )
    with pytest.raises(jinja2.exceptions.TemplateError, match="one message only"):
        tok.apply_chat_template(CONVERSATION)
    with pytest.raises(jinja2.exceptions.SecurityError):
        Tokenizer(ours.backend, bos_token=None, eos_token=None,
                  chat_template="{{ messages.__class__.__mro__ }}").apply_chat_template([{"role": "user"}])
    with pytest.raises(ValueError, match="no chat template"):
        Tokenizer(ours.backend, bos_token=None, eos_token=None).apply_chat_template(CONVERSATION)


STREAMED = [UNUSUAL[0], UNUSUAL[1], "Ünïcödé 🤖🧠 and 数学 ∑ mixed with ascii text 123"]


@pytest.mark.parametrize("text", STREAMED)
def test_incremental_detokenizer_pieces_concatenate_to_the_full_decode(ours, text):
    ids = ours.encode(text)
    detok = IncrementalDetokenizer(ours)
    pieces = [detok.push(i) for i in ids]
    pieces.append(detok.flush())
    assert "".join(pieces) == ours.decode(ids) == text
    assert not any("\ufffd" in p for p in pieces)
    assert sum(1 for p in pieces if p) > len(ids) // 4  # it streams, it does not hold everything back


def test_incremental_detokenizer_holds_back_a_split_character(ours):
    ids = ours.encode("🤖")
    assert len(ids) > 1 and "\ufffd" in ours.decode(ids[:1])  # the emoji spans several byte tokens
    detok = IncrementalDetokenizer(ours)
    assert [detok.push(i) for i in ids] == [""] * (len(ids) - 1) + ["🤖"]


def test_tokenizer_is_shared_by_threads(ours):
    texts = bbh_texts() + UNUSUAL
    expected = [ours.encode(t) for t in texts]
    with ThreadPoolExecutor(4) as pool:
        assert list(pool.map(ours.encode, texts * 3)) == expected * 3


def test_folder_tokenizer_reads_tokenizer_json_and_config(ours, tmp_path):
    ours.backend.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": {"content": "<|im_start|>"}, "eos_token": "<|im_end|>", "chat_template": ours.chat_template,
    }))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7]}))
    folder = load_tokenizer(str(tmp_path))
    assert folder.encode(UNUSUAL[0]) == ours.encode(UNUSUAL[0])
    assert folder.apply_chat_template(CONVERSATION) == ours.apply_chat_template(CONVERSATION)
    assert folder.bos_token_id == 1 and 7 in folder.stop_token_ids


def test_missing_tokenizer_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        load_tokenizer(str(tmp_path))
    with pytest.raises(FileNotFoundError, match="not found"):
        load_tokenizer(str(tmp_path / "nope.gguf"))
