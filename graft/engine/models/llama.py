"""Llama-family decoder (Llama, SmolLM2, Qwen2) over a paged KV cache.

The attention maths lives behind the slot table (`kv.store`, `kv.gather`, `attention.prefill`,
`attention.decode`, `linear.qkv`); the model passes the table in on every call and never keeps it,
so a hot patch that swaps the table changes the next forward pass and nothing else. The work
around attention (norms, residual adds, RoPE, the MLP) runs in torch's operators, or, once the
engine has found the kernels fit (graft.kernels.dispatch.native_layers), through the AVX-512 BF16
layer kernels (`use_native_layers`): a model mode chosen at load, the same slots either way.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from graft.engine.context import StepContext
from graft.kernels import cpu_avx512
from graft.kernels.dispatch import linear

if TYPE_CHECKING:
    from graft.engine.loader import ModelConfig
    from graft.engine.patches.slots import SlotTable


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # statistics in fp32 whatever the model dtype, as the reference implementation does
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


class RotaryEmbedding(nn.Module):
    """Half-rotation RoPE with cos/sin precomputed for every position up to `max_position`."""

    def __init__(self, head_dim: int, theta: float, max_position: int):
        super().__init__()
        self.head_dim, self.theta, self.max_position = head_dim, theta, max_position
        self.register_buffer("cos", torch.empty(0), persistent=False)
        self.register_buffer("sin", torch.empty(0), persistent=False)

    def build(self, device: torch.device) -> None:
        inv_freq = 1.0 / (self.theta ** (torch.arange(0, self.head_dim, 2, device=device).float() / self.head_dim))
        freqs = torch.outer(torch.arange(self.max_position, device=device).float(), inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos, self.sin = emb.cos(), emb.sin()

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        # [T, 1, head_dim], broadcast over heads
        return self.cos[positions].to(dtype).unsqueeze(1), self.sin[positions].to(dtype).unsqueeze(1)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return x * cos + _rotate_half(x) * sin


class Attention(nn.Module):
    """Projections of one layer; `qkv_weight`/`qkv_bias` exist only while the model is fused."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.scale = cfg.head_dim ** -0.5
        self.q_proj = nn.Linear(cfg.hidden_size, self.q_size, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(cfg.hidden_size, self.kv_size, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(cfg.hidden_size, self.kv_size, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=cfg.o_bias)
        self.qkv_weight: torch.Tensor | None = None
        self.qkv_bias: torch.Tensor | None = None


class MLP(nn.Module):
    """SwiGLU; `gate_up_weight` exists once `fuse()` has put gate and up in one matmul."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        self.gate_up_weight: torch.Tensor | None = None

    def fuse(self) -> None:
        """One [2 * intermediate, hidden] weight for gate and up (the same dot products, one matmul
        instead of two: about a fifth off the MLP of a decode step on a CPU). The two projections
        become views into it, so the weights are not held twice."""
        n = self.gate_proj.weight.shape[0]
        fused = torch.cat([self.gate_proj.weight, self.up_proj.weight])
        self.gate_proj.weight = nn.Parameter(fused[:n], requires_grad=False)
        self.up_proj.weight = nn.Parameter(fused[n:], requires_grad=False)
        self.gate_up_weight = fused

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up_weight is not None:
            gate, up = F.linear(x, self.gate_up_weight).chunk(2, dim=-1)
            return self.down_proj(F.silu(gate) * up)
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_eps)
        self.mlp = MLP(cfg)


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_eps)


class LlamaForCausalLM(nn.Module):
    """The decoder; parameter names follow Hugging Face's so a safetensors state dict loads as is."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.model = LlamaModel(cfg)
        self.rotary_emb = RotaryEmbedding(cfg.head_dim, cfg.rope_theta, cfg.max_position)
        self.lm_head = None if cfg.tie_embeddings else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self._qkv_pinned = False
        self.native_layers = False

    @classmethod
    def from_state_dict(
        cls, cfg: ModelConfig, state_dict: dict[str, torch.Tensor], dtype: torch.dtype, device: torch.device
    ) -> "LlamaForCausalLM":
        """Build the model around the given weights without ever initialising random ones."""
        with torch.device("meta"):
            model = cls(cfg)
        weights = {name: w.to(device=device, dtype=dtype) for name, w in state_dict.items()}
        model.load_state_dict(weights, strict=True, assign=True)
        model.rotary_emb.build(device)
        return model.eval().requires_grad_(False)

    @property
    def layers(self) -> nn.ModuleList:
        return self.model.layers

    def fuse_qkv(self, pin: bool = False) -> None:
        """Concatenate each layer's q/k/v weights (and biases) for the one-matmul `linear.qkv`.

        `pin` keeps them for good: an engine that runs the fast paths from the start fuses at
        load, and reverting a patch that also fuses must not take them away from it.
        """
        self._qkv_pinned = self._qkv_pinned or pin
        for layer in self.layers:
            attn = layer.self_attn
            attn.qkv_weight = torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight])
            if attn.q_proj.bias is not None:
                attn.qkv_bias = torch.cat([attn.q_proj.bias, attn.k_proj.bias, attn.v_proj.bias])

    def unfuse_qkv(self) -> None:
        """Free what `fuse_qkv` built, unless it was pinned."""
        if self._qkv_pinned:
            return
        for layer in self.layers:
            layer.self_attn.qkv_weight = None
            layer.self_attn.qkv_bias = None

    def fuse_mlp(self) -> None:
        """Fuse every layer's gate and up projections (see `MLP.fuse`); for good."""
        for layer in self.layers:
            layer.mlp.fuse()

    def use_native_layers(self) -> None:
        """Run the work around attention and the matmuls through graft/kernels/cpu_avx512.py from
        now on; the engine calls it where graft.kernels.dispatch.native_layers says the kernels fit
        (the fast paths, bf16 weights on a CPU with AVX-512 BF16, sizes the kernels take).

        A decode step of this model is some 50 small torch operators per layer (the norms, the
        residual adds, RoPE, SiLU-and-mul) around five matmuls; their dispatch costs more than
        their arithmetic, and torch's bf16 matmul at a decode step's few rows reads the weights
        at well under the memory's speed. The native forward makes each layer about ten calls:
        two norms, each fused with the residual add before it, RoPE on queries and keys at once,
        SiLU-and-mul, the slots, and the small-row linear kernel for the projections. Same results
        within bf16 rounding. It runs gate and up as one matmul, so `fuse_mlp` comes first.
        """
        if not all(layer.mlp.gate_up_weight is not None for layer in self.layers):
            raise ValueError("the native layers need gate and up fused: call fuse_mlp() first")
        self.native_layers = True

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        ctx: StepContext,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        slots: SlotTable,
    ) -> torch.Tensor:
        """Logits (fp32) of the rows `ctx.logits_indices` of the flat batch `input_ids` [T]."""
        if len(kv_caches) != len(self.layers):
            raise ValueError(f"expected {len(self.layers)} KV caches, got {len(kv_caches)}")
        if self.native_layers:
            return self._forward_native(input_ids, ctx, kv_caches, slots)
        x = self.model.embed_tokens(input_ids)
        cos, sin = self.rotary_emb(ctx.positions, x.dtype)
        for layer, (k_cache, v_cache) in zip(self.layers, kv_caches):
            h = self._attention(layer.self_attn, layer.input_layernorm(x), cos, sin, ctx, k_cache, v_cache, slots)
            x = x + h
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        x = self.model.norm(x[ctx.logits_indices])
        head = self.lm_head.weight if self.lm_head is not None else self.model.embed_tokens.weight
        return F.linear(x, head).float()

    def _forward_native(
        self,
        input_ids: torch.Tensor,
        ctx: StepContext,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        slots: SlotTable,
    ) -> torch.Tensor:
        """`forward` through the native kernels (see `use_native_layers`); x is the residual
        stream, added to in place by each norm that follows an attention or MLP output."""
        x = self.model.embed_tokens(input_ids)
        layers = self.layers
        h = cpu_avx512.rms_norm(x, layers[0].input_layernorm.weight, layers[0].input_layernorm.eps)
        for i, (layer, (k_cache, v_cache)) in enumerate(zip(layers, kv_caches)):
            a = self._attention_native(layer.self_attn, h, ctx, k_cache, v_cache, slots)
            norm = layer.post_attention_layernorm
            h = cpu_avx512.rms_norm(x, norm.weight, norm.eps, delta=a)
            mlp = layer.mlp
            m = linear(cpu_avx512.silu_mul(linear(h, mlp.gate_up_weight)), mlp.down_proj.weight)
            if i + 1 < len(layers):
                norm = layers[i + 1].input_layernorm
                h = cpu_avx512.rms_norm(x, norm.weight, norm.eps, delta=m)
        idx = ctx.logits_indices
        x = cpu_avx512.rms_norm(x[idx], self.model.norm.weight, self.model.norm.eps, delta=m[idx])
        head = self.lm_head.weight if self.lm_head is not None else self.model.embed_tokens.weight
        return linear(x, head).float()

    def _attention_native(
        self,
        attn: Attention,
        x: torch.Tensor,
        ctx: StepContext,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slots: SlotTable,
    ) -> torch.Tensor:
        T = x.shape[0]
        q, k, v = slots["linear.qkv"](attn, x)
        q = q.view(T, attn.num_heads, attn.head_dim)
        k = k.view(T, attn.num_kv_heads, attn.head_dim)
        rot = self.rotary_emb
        if cpu_avx512.supports_rope(q, k, rot.cos):
            q = cpu_avx512.rope(q, k, ctx.positions, rot.cos, rot.sin)     # k rotated in place
        else:   # a patched `linear.qkv` handed over another layout
            cos, sin = rot(ctx.positions, x.dtype)
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out = self._attend(attn, q, k, v.view(T, attn.num_kv_heads, attn.head_dim), ctx, k_cache, v_cache, slots)
        return linear(out.view(T, attn.q_size), attn.o_proj.weight, attn.o_proj.bias)

    def _attention(
        self,
        attn: Attention,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        ctx: StepContext,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slots: SlotTable,
    ) -> torch.Tensor:
        T = x.shape[0]
        q, k, v = slots["linear.qkv"](attn, x)
        q = apply_rope(q.view(T, attn.num_heads, attn.head_dim), cos, sin)
        k = apply_rope(k.view(T, attn.num_kv_heads, attn.head_dim), cos, sin)
        v = v.view(T, attn.num_kv_heads, attn.head_dim)
        out = self._attend(attn, q, k, v, ctx, k_cache, v_cache, slots)
        return attn.o_proj(out.view(T, attn.q_size))

    def _attend(
        self,
        attn: Attention,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        ctx: StepContext,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slots: SlotTable,
    ) -> torch.Tensor:
        """Store this step's keys and values, then attend: each prefill over its context, all
        decodes at once. q [T, H, d], k and v [T, n_kv, d] -> [T, H, d]."""
        T = q.shape[0]
        slots["kv.store"](k, v, k_cache, v_cache, ctx.slot_mapping)

        out = torch.empty_like(q)
        start = 0
        for i in range(ctx.num_prefills):
            qlen, clen = ctx.query_lens[i], ctx.context_lens[i]
            end = start + qlen
            if clen == qlen:  # no earlier context: this step's own K/V are the whole of it
                ki, vi = k[start:end], v[start:end]
            else:
                ki, vi = slots["kv.gather"](k_cache, v_cache, ctx.block_tables[i], clen)
            out[start:end] = slots["attention.prefill"](q[start:end], ki, vi, attn.scale)
            start = end
        if ctx.num_decodes:
            assert T - start == ctx.num_decodes, "decodes take exactly one query token each"
            out[start:] = slots["attention.decode"](
                q[start:],
                k_cache,
                v_cache,
                ctx.block_tables[ctx.num_prefills :],
                ctx.context_lens[ctx.num_prefills :],
                attn.scale,
                slots["kv.gather"],
            )
        return out
