"""The load cache: a second load of the same GGUF file reads no GGUF at all and gives the very same
model; a damaged entry or a changed file is read afresh; a cache that cannot be written costs
nothing but time."""
from __future__ import annotations

import os
import shutil

import pytest
import torch

import gguf
from graft.engine import loader
from graft.engine.loader import load_config, load_model, load_tokenizer

TEXT = "Hot patches are code: <|im_start|> stays text."


@pytest.fixture(scope="module")
def first(tmp_path_factory):
    """A load into an empty cache (it reads the GGUF file), and that cache."""
    folder = tmp_path_factory.mktemp("model-cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(loader.CACHE_ENV, str(folder))
        model, tokenizer, cfg = load_model(dtype=torch.bfloat16)
    return folder, model.state_dict(), tokenizer, cfg


def _same(state, model):
    got = model.state_dict()
    assert set(got) == set(state)
    for name, w in state.items():
        assert got[name].dtype == w.dtype and torch.equal(got[name], w), name


def _no_gguf_reads(monkeypatch):
    def refuse(*_a, **_k):
        raise AssertionError("the GGUF file was read although the cache holds it")
    monkeypatch.setattr(gguf, "GGUFReader", refuse)


def _copy(first, tmp_path, monkeypatch):
    folder = tmp_path / "cache"
    shutil.copytree(first[0], folder)
    monkeypatch.setenv(loader.CACHE_ENV, str(folder))
    return folder


def test_a_second_load_reads_no_gguf_and_gives_the_same_model(first, tmp_path, monkeypatch):
    folder, state, tokenizer, cfg = first
    entries = sorted(p.name for p in folder.iterdir())
    assert len(entries) == 2 and "-bfloat16-" in entries[0] and entries[1].endswith(".json"), entries
    _copy(first, tmp_path, monkeypatch)
    _no_gguf_reads(monkeypatch)
    model, tok, cfg2 = load_model(dtype=torch.bfloat16)
    _same(state, model)
    assert cfg2 == cfg
    assert tok.encode(TEXT) == tokenizer.encode(TEXT)
    assert load_tokenizer().encode(TEXT) == tokenizer.encode(TEXT)
    assert load_config() == cfg


def test_a_damaged_entry_is_read_afresh_and_written_anew(first, tmp_path, monkeypatch):
    state = first[1]
    folder = _copy(first, tmp_path, monkeypatch)
    (weights,) = folder.glob("*.safetensors")
    size = weights.stat().st_size
    weights.write_bytes(weights.read_bytes()[: size // 3])         # a load cut off mid-write elsewhere
    _same(state, load_model(dtype=torch.bfloat16)[0])
    assert weights.stat().st_size == size, "the entry was written anew"
    (meta,) = folder.glob("*.json")
    meta.write_text('{"format": 1, "meta": ')                      # metadata that is no JSON
    assert load_config() == first[3]
    _no_gguf_reads(monkeypatch)
    _same(state, load_model(dtype=torch.bfloat16)[0])


def test_a_changed_file_gets_entries_of_its_own(tmp_path, monkeypatch):
    monkeypatch.setenv(loader.CACHE_ENV, str(tmp_path / "cache"))
    model = tmp_path / "model.gguf"
    model.write_bytes(b"GGUF and the rest")
    names = {loader._entry(model, what, ".x") for what in ("meta", "bfloat16", "float32")}
    assert len(names) == 3
    st = model.stat()
    os.utime(model, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))    # replaced in place, say
    assert loader._entry(model, "meta", ".x") not in names
    model.write_bytes(b"GGUF and another rest")
    assert loader._entry(model, "meta", ".x") not in names


def test_a_cache_that_cannot_be_written_costs_only_time(tmp_path, monkeypatch, first):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    monkeypatch.setenv(loader.CACHE_ENV, str(blocker / "cache"))
    assert load_config() == first[3]


def test_off_means_no_cache(monkeypatch):
    for value in ("off", "OFF", "0", "none"):
        monkeypatch.setenv(loader.CACHE_ENV, value)
        assert loader.cache_dir() is None
    monkeypatch.delenv(loader.CACHE_ENV)
    monkeypatch.setenv("XDG_CACHE_HOME", "/somewhere")
    assert str(loader.cache_dir()) == "/somewhere/graft/models"
