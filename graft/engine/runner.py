"""The model runner: owns the device, the weights and the paged KV cache; turns a scheduled batch
into one forward pass and sampled tokens.

On CUDA, decode steps of common batch sizes replay CUDA graphs captured at start-up; everywhere
else the same code runs eagerly.
"""
from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from types import MappingProxyType

import torch

from graft.engine.config import EngineConfig
from graft.engine.context import StepContext
from graft.engine.loader import ModelConfig
from graft.engine.patches.slots import SlotTable
from graft.engine.scheduler import ScheduledBatch
from graft.engine.sequence import Sequence
from graft.kernels.dispatch import native_layers

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def num_kv_blocks(config: EngineConfig, model_config: ModelConfig, dtype: torch.dtype) -> int:
    """How many blocks of KV cache fit in the configured memory budget."""
    per_block = (2 * model_config.num_layers * config.block_size * model_config.num_kv_heads
                 * model_config.head_dim * torch.empty((), dtype=dtype).element_size())
    blocks = config.kv_cache_memory // per_block
    if blocks < 1:
        raise ValueError(f"kv_cache_memory={config.kv_cache_memory} bytes holds no {per_block}-byte KV block")
    return int(blocks)


def _tokens(seq: Sequence, start: int, end: int) -> list[int]:
    """seq.token_ids[start:end] without building the whole list (a decode needs one token)."""
    n = seq.num_prompt_tokens
    if end <= n:
        return seq.prompt_token_ids[start:end]
    if start >= n:
        return seq.output_token_ids[start - n:end - n]
    return seq.prompt_token_ids[start:] + seq.output_token_ids[:end - n]


@dataclass(slots=True)
class PreparedStep:
    input_ids: torch.Tensor
    ctx: StepContext
    sampled: list[Sequence]     # the sequences that get a token from this step, in logits order


class ModelRunner:
    def __init__(self, config: EngineConfig, model: torch.nn.Module, model_config: ModelConfig,
                 device: torch.device, dtype: torch.dtype):
        self.config = config
        self.model = model
        self.model_config = model_config
        self.device = device
        self.dtype = dtype
        self.num_blocks = num_kv_blocks(config, model_config, dtype)
        shape = (self.num_blocks, config.block_size, model_config.num_kv_heads, model_config.head_dim)
        self.kv_caches = [(torch.zeros(shape, dtype=dtype, device=device),
                           torch.zeros(shape, dtype=dtype, device=device))
                          for _ in range(model_config.num_layers)]
        self.generators: dict[int, torch.Generator] = {}
        if config.threads:
            torch.set_num_threads(config.threads)
        fast = config.paths == "fast"
        if fast:
            model.fuse_qkv(pin=True)   # the fast `linear.qkv` is one matmul over these
            model.fuse_mlp()
        if native_layers(device, dtype, fast, hidden_size=model_config.hidden_size, head_dim=model_config.head_dim,
                         intermediate_size=model_config.intermediate_size):
            model.use_native_layers()
            log.info("native CPU layers on (RMSNorm, RoPE, SiLU-and-mul, small-row linear)")

    # inputs
    def prepare(self, batch: ScheduledBatch) -> PreparedStep:
        bs = self.config.block_size
        items = [*batch.prefills, *((seq, 1) for seq in batch.decodes)]
        input_ids: list[int] = []
        positions: list[int] = []
        slot_mapping: list[int] = []
        query_lens: list[int] = []
        context_lens: list[int] = []
        logits_indices: list[int] = []
        sampled: list[Sequence] = []
        tables: list[list[int]] = []
        for seq, n in items:
            start = seq.num_computed_tokens
            end = start + n
            tokens = _tokens(seq, start, end)
            input_ids.extend(tokens)
            table = seq.block_table
            for pos in range(start, end):
                positions.append(pos)
                slot_mapping.append(table[pos // bs] * bs + pos % bs)
            query_lens.append(n)
            context_lens.append(end)
            tables.append(table)
            if end == len(seq):
                logits_indices.append(len(input_ids) - 1)
                sampled.append(seq)
        width = max(len(t) for t in tables)
        padded = [t + [0] * (width - len(t)) for t in tables]
        dev = self.device
        cu = [0]
        for q in query_lens:
            cu.append(cu[-1] + q)
        ctx = StepContext(
            positions=torch.tensor(positions, dtype=torch.long, device=dev),
            slot_mapping=torch.tensor(slot_mapping, dtype=torch.long, device=dev),
            query_lens=query_lens,
            context_lens=context_lens,
            block_tables=torch.tensor(padded, dtype=torch.int32, device=dev),
            context_lens_t=torch.tensor(context_lens, dtype=torch.int32, device=dev),
            cu_query_lens=torch.tensor(cu, dtype=torch.int32, device=dev),
            logits_indices=torch.tensor(logits_indices, dtype=torch.long, device=dev),
            num_prefills=len(batch.prefills),
            block_size=bs,
        )
        return PreparedStep(torch.tensor(input_ids, dtype=torch.long, device=dev), ctx, sampled)

    def _generator(self, seq: Sequence) -> torch.Generator | None:
        seed = seq.params.seed
        if seed is None or seq.params.greedy:
            return None
        gen = self.generators.get(seq.seq_id)
        if gen is None:
            gen = torch.Generator(device=self.device)
            gen.manual_seed(seed)
            self.generators[seq.seq_id] = gen
        return gen

    @torch.inference_mode()
    def forward(self, step: PreparedStep, slots: SlotTable) -> torch.Tensor:
        return self.model(step.input_ids, step.ctx, self.kv_caches, slots)

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch, slots: SlotTable) -> dict[int, int]:
        """One step: forward, then sample a token for each sequence whose known tokens are all computed."""
        step = self.prepare(batch)
        logits = self.forward(step, slots)
        if not step.sampled:
            return {}
        params = [s.params for s in step.sampled]
        gens = [self._generator(s) for s in step.sampled]
        tokens = slots["sampler"](logits, params, gens)
        return {seq.seq_id: tok for seq, tok in zip(step.sampled, tokens)}

    def release(self, seq: Sequence) -> None:
        self.generators.pop(seq.seq_id, None)

    @torch.inference_mode()
    def probe_logits(self, token_ids: list[int], slots: SlotTable, scratch_blocks: list[int]) -> torch.Tensor:
        """Logits of every position of `token_ids`, teacher-forced in `scratch_blocks`.

        The tokens go through the paths a request takes: a first prefill chunk, a second chunk over
        the cached first (`kv.gather`), and the last token as a decode step (`attention.decode`). A
        tool for comparing one slot against another on a given text (the kernels' accuracy tests);
        the self-check runs the richer `ProbePlan` below.
        """
        bs = self.config.block_size
        n = len(token_ids)
        if n < 3 or len(scratch_blocks) * bs < n:
            raise ValueError(f"probe_logits needs 3 tokens or more and room for them, "
                             f"got {n} tokens and {len(scratch_blocks)} blocks of {bs}")
        seq = Sequence(prompt_token_ids=list(token_ids[:-1]))
        seq.block_table = list(scratch_blocks)
        logits = []
        for chunk in ((n - 1) // 2, n - 1 - (n - 1) // 2):
            step = self.prepare(ScheduledBatch(prefills=[(seq, chunk)], decodes=[], preempted=[]))
            step.ctx.logits_indices = torch.arange(chunk, device=self.device)
            logits.append(self.forward(step, slots))
            seq.num_computed_tokens += chunk
        seq.output_token_ids.append(token_ids[-1])
        logits.append(self.forward(self.prepare(ScheduledBatch(prefills=[], decodes=[seq], preempted=[])), slots))
        return torch.cat(logits).float()


# ---- the patch self-check's probe ----
#
# The probe runs the engine the way requests do, on KV blocks kept aside for it, with every input
# teacher-forced (fixed token ids, never sampled), so two slot tables can be compared logit by
# logit. The built-in plan, at 64-token blocks (A's lengths and B's shared prefix scale with the
# block size `b`):
#
# - A, a long context: 188 prompt tokens (3b - 4, four blocks once decoded) prefilled in three
#   chunks ending at 40, 130 and 188, so chunk boundaries fall inside blocks, chunks cross block
#   boundaries and the later chunks read the earlier ones back through the cache (`kv.gather`);
#   then decode steps from context 189 to 196, across the boundary at 192;
# - B, a prefix-cache hit: its block table starts with A's first two full blocks (the same 128
#   token ids) and its own prefill starts at position 128, over the cached blocks;
# - C, a short sequence (24 tokens, less than a block);
# - one mixed step (B's and C's prefills beside A's decode), then decode steps of A, B and C
#   together, each at its own context length.
#
# User prompts (`graft serve --probe-prompts`) follow, one at a time on the same blocks: each
# prefilled in chunks of PROBE_USER_CHUNK tokens, then PROBE_USER_DECODES decode steps. The logits
# of every position of every forward are compared.

PROBE_TEXT = """\
A lighthouse is a tower built near a coast or on a small island to guide ships at night and in \
poor weather. Its lamp sits behind large glass lenses that gather the light into a narrow beam, and \
a slow rotation makes the beam sweep across the water. Each lighthouse has its own pattern of \
flashes, so a sailor who counts the seconds between them can tell which one is in sight and work \
out where the ship is. Before electric lamps, keepers lived in small houses at the foot of the \
tower and climbed the stairs every evening to trim the wicks and wind the clockwork that turned \
the lens.

Bread is made from flour, water, salt and yeast. When the dough is kneaded, proteins in the flour \
form long elastic strands called gluten, which trap the gas that the yeast releases as it feeds on \
sugars. The dough rises for an hour or two in a warm place, is shaped into loaves, and rises again \
before it goes into a hot oven. In the first minutes of baking the gas expands quickly and the \
loaf grows, then the crust dries and browns while the inside sets into a soft crumb full of small \
holes.

Most rivers begin as small streams in hills or mountains, fed by rain, melting snow or springs. As \
streams join, the river carries more water and can move larger stones, cutting a valley as it \
flows toward the sea. Near its mouth the land is flatter, the current slows down, and the river \
drops the fine sand and mud it has carried, sometimes building a wide delta of new land.

Honey bees live in colonies of many thousands of workers, a few hundred males and a single queen. \
Workers collect nectar and pollen from flowers and tell the others where good sources are with a \
dance on the comb: the angle of the dance gives the direction of the flowers against the sun, and \
its length gives how far away they are.
"""

PROBE_SOLO_DECODES = 2      # A alone, right after its prefill
PROBE_BATCH_DECODES = 5     # A, B and C together, after the mixed step
PROBE_SHORT = 24            # B's own prompt tokens past the shared blocks; C's prompt
PROBE_USER_MAX_TOKENS = 2048
PROBE_USER_CHUNK = 200      # not a multiple of 64: chunk boundaries fall inside blocks
PROBE_USER_DECODES = 2


def _blocks(tokens: int, block_size: int) -> int:
    return -(-tokens // block_size)


@dataclass(frozen=True, slots=True)
class ProbeSeq:
    """One probe sequence: every token it is fed (prompt, then each decode step's input), its block
    table as indices into the probe's blocks, and how many leading tokens are in the cache already
    (another probe sequence's blocks) when it starts."""

    name: str
    token_ids: tuple[int, ...]
    blocks: tuple[int, ...]
    cached: int = 0


@dataclass(frozen=True, slots=True)
class ProbeForward:
    """One forward pass of the plan: prefill chunks (sequence name, tokens), then decodes."""

    prefills: tuple[tuple[str, int], ...] = ()
    decodes: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class ProbeRow:
    """Where one compared row of logits comes from: its part ("decode A") and the exact place."""

    part: str
    where: str


@dataclass(frozen=True, slots=True)
class ProbePlan:
    seqs: Mapping[str, ProbeSeq]
    forwards: tuple[ProbeForward, ...]
    rows: tuple[ProbeRow, ...]          # one per logits row, in the order the forwards produce them
    num_blocks: int                     # KV blocks the plan needs kept aside
    longest: int                        # the longest context it runs, in tokens


def _builtin_geometry(block_size: int) -> dict[str, int]:
    b = block_size
    return {"a_prompt": 3 * b - 4, "chunk1": b * 5 // 8, "chunk2_end": 2 * b + 2, "shared": 2 * b,
            "a_len": 3 * b - 4 + PROBE_SOLO_DECODES + 1 + PROBE_BATCH_DECODES,
            "b_len": 2 * b + PROBE_SHORT + PROBE_BATCH_DECODES, "c_len": PROBE_SHORT + PROBE_BATCH_DECODES}


def builtin_probe_blocks(block_size: int = 64) -> int:
    """KV blocks the built-in plan needs: A's, B's past the two it shares with A, and C's."""
    g = _builtin_geometry(block_size)
    return (_blocks(g["a_len"], block_size) + _blocks(g["b_len"], block_size) - 2
            + _blocks(g["c_len"], block_size))


def build_probe_plan(encode: Callable[[str], list[int]], user_prompts: Iterable[str] = (),
                     block_size: int = 64, max_model_len: int = 8192) -> ProbePlan:
    """The probe plan: the built-in sequences A, B and C, then each user prompt.

    `encode` turns text into token ids. A user prompt longer than PROBE_USER_MAX_TOKENS (or than
    the model's context allows) is cut to it, with a log line; one of fewer than three tokens is
    left out. The plan needs `num_blocks` KV blocks: the built-in part's or the longest user
    prompt's, whichever is more (they run one after the other on the same blocks).
    """
    g = _builtin_geometry(block_size)
    ids = list(encode(PROBE_TEXT))
    need = g["a_len"] + (g["b_len"] - g["shared"]) + g["c_len"]
    if not ids:
        raise ValueError("the probe text encodes to no tokens")
    while len(ids) < need:
        ids = ids + ids
    a_ids = ids[:g["a_len"]]
    rest = ids[g["a_len"]:]
    b_own = g["b_len"] - g["shared"]
    b_ids = a_ids[:g["shared"]] + rest[:b_own]
    c_ids = rest[b_own:b_own + g["c_len"]]
    na = _blocks(g["a_len"], block_size)
    nb = _blocks(g["b_len"], block_size)
    seqs = {"A": ProbeSeq("A", tuple(a_ids), tuple(range(na))),
            "B": ProbeSeq("B", tuple(b_ids), (0, 1, *range(na, na + nb - 2)), cached=g["shared"]),
            "C": ProbeSeq("C", tuple(c_ids), (na + nb - 2,))}
    chunk1, chunk2_end, a_prompt = g["chunk1"], g["chunk2_end"], g["a_prompt"]
    forwards = [ProbeForward(prefills=(("A", chunk1),)),
                ProbeForward(prefills=(("A", chunk2_end - chunk1),)),
                ProbeForward(prefills=(("A", a_prompt - chunk2_end),)),
                *(ProbeForward(decodes=("A",)) for _ in range(PROBE_SOLO_DECODES)),
                ProbeForward(prefills=(("B", PROBE_SHORT), ("C", PROBE_SHORT)), decodes=("A",)),
                *(ProbeForward(decodes=("A", "B", "C")) for _ in range(PROBE_BATCH_DECODES))]
    num_blocks = builtin_probe_blocks(block_size)
    longest = g["a_len"]
    limit = max(3, min(PROBE_USER_MAX_TOKENS, max_model_len - 1))
    for i, text in enumerate(user_prompts, 1):
        name = f"prompt {i}"
        tokens = list(encode(text))
        if len(tokens) > limit:
            log.info("probe prompt %d has %d tokens: the self-check uses its first %d", i, len(tokens), limit)
            tokens = tokens[:limit]
        if len(tokens) < 3:
            log.warning("probe prompt %d has %d tokens, too few to probe with: left out", i, len(tokens))
            continue
        n = len(tokens)
        seqs[name] = ProbeSeq(name, tuple(tokens), tuple(range(_blocks(n, block_size))))
        prefill = n - PROBE_USER_DECODES
        forwards += [ProbeForward(prefills=((name, min(PROBE_USER_CHUNK, prefill - s)),))
                     for s in range(0, prefill, PROBE_USER_CHUNK)]
        forwards += [ProbeForward(decodes=(name,)) for _ in range(PROBE_USER_DECODES)]
        num_blocks = max(num_blocks, _blocks(n, block_size))
        longest = max(longest, n)
    return ProbePlan(MappingProxyType(seqs), tuple(forwards), _rows(seqs, forwards), num_blocks, longest)


def _rows(seqs: Mapping[str, ProbeSeq], forwards: list[ProbeForward]) -> tuple[ProbeRow, ...]:
    """Label every logits row the forwards produce, replaying where each sequence stands."""
    done = {name: s.cached for name, s in seqs.items()}
    rows: list[ProbeRow] = []
    for f in forwards:
        for name, n in f.prefills:
            start = done[name]
            rows += [ProbeRow(f"prefill {name}", f"prefill {name} at position {p}") for p in range(start, start + n)]
            done[name] += n
        for name in f.decodes:
            done[name] += 1
            rows.append(ProbeRow(f"decode {name}", f"decode {name} at context {done[name]}"))
    return tuple(rows)


class ProbeRun:
    """The probe plan under one slot table, on the blocks kept aside for it: each `step()` is one
    forward pass of the plan and returns the logits of every token it ran ([tokens, vocab], fp32).

    The steps go through the runner's own `prepare()` and `forward()`, as a scheduled batch does,
    with the logits taken at every position instead of the last. Step loop only; the run's KV
    entries live in the probe's blocks until the next run overwrites them.
    """

    def __init__(self, runner: "ModelRunner", plan: ProbePlan, slots: SlotTable, blocks: list[int]):
        if len(blocks) < plan.num_blocks:
            raise ValueError(f"the probe plan needs {plan.num_blocks} KV blocks, {len(blocks)} are kept aside")
        self.runner, self.plan, self.slots = runner, plan, slots
        self.index = 0
        self._seqs: dict[str, Sequence] = {}
        for name, spec in plan.seqs.items():
            seq = Sequence(prompt_token_ids=list(spec.token_ids))
            seq.block_table = [blocks[i] for i in spec.blocks]
            seq.num_computed_tokens = spec.cached
            self._seqs[name] = seq

    @property
    def done(self) -> bool:
        return self.index >= len(self.plan.forwards)

    @torch.inference_mode()
    def step(self) -> torch.Tensor:
        f = self.plan.forwards[self.index]
        batch = ScheduledBatch(prefills=[(self._seqs[name], n) for name, n in f.prefills],
                               decodes=[self._seqs[name] for name in f.decodes], preempted=[])
        runner = self.runner
        step = runner.prepare(batch)
        step.ctx.logits_indices = torch.arange(step.input_ids.shape[0], device=runner.device)
        logits = runner.forward(step, self.slots)
        for seq, n in batch.prefills:
            seq.num_computed_tokens += n
        for seq in batch.decodes:
            seq.num_computed_tokens += 1
        self.index += 1
        return logits.float()
