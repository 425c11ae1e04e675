"""Write new keys and values into the paged KV cache: one program per token, both heads and dims in one tile."""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _store_kv_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
    stride_kt, stride_kh, stride_kd,
    stride_vt, stride_vh, stride_vd,
    stride_kcb, stride_kco, stride_kch, stride_kcd,
    stride_vcb, stride_vco, stride_vch, stride_vcd,
    N_KV: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    N_KV_P: tl.constexpr, HEAD_DIM_P: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    # A negative slot marks a padding token (e.g. a CUDA-graph batch filled up): nothing is written.
    if slot >= 0:
        block = slot // BLOCK_SIZE
        offset = slot % BLOCK_SIZE
        heads = tl.arange(0, N_KV_P)[:, None]
        dims = tl.arange(0, HEAD_DIM_P)[None, :]
        mask = (heads < N_KV) & (dims < HEAD_DIM)
        k = tl.load(k_ptr + token * stride_kt + heads * stride_kh + dims * stride_kd, mask=mask)
        v = tl.load(v_ptr + token * stride_vt + heads * stride_vh + dims * stride_vd, mask=mask)
        k_dst = k_cache_ptr + block * stride_kcb + offset * stride_kco + heads * stride_kch + dims * stride_kcd
        v_dst = v_cache_ptr + block * stride_vcb + offset * stride_vco + heads * stride_vch + dims * stride_vcd
        tl.store(k_dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
        tl.store(v_dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def store_kv(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Write k, v [T, n_kv, d] into k_cache, v_cache [num_blocks, block_size, n_kv, d] at slot_mapping [T].

    A slot is block * block_size + offset; a negative slot is skipped. k and v may be strided
    views (e.g. slices of a fused QKV projection); values are cast to the cache dtype.
    """
    _check_store_args(k, v, k_cache, v_cache, slot_mapping)
    num_tokens, n_kv, head_dim = k.shape
    if num_tokens == 0:
        return
    _store_kv_kernel[(num_tokens,)](
        k, v, k_cache, v_cache, slot_mapping,
        *k.stride(), *v.stride(), *k_cache.stride(), *v_cache.stride(),
        N_KV=n_kv, HEAD_DIM=head_dim, BLOCK_SIZE=k_cache.shape[1],
        N_KV_P=triton.next_power_of_2(n_kv), HEAD_DIM_P=triton.next_power_of_2(head_dim),
    )


def _check_store_args(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    if k.dim() != 3 or k.shape != v.shape:
        raise ValueError(f"k and v must both be [T, n_kv, d], got {tuple(k.shape)} and {tuple(v.shape)}")
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(
            f"caches must both be [num_blocks, block_size, n_kv, d], got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}"
        )
    if k.shape[1:] != k_cache.shape[2:]:
        raise ValueError(f"k is [T, {k.shape[1]}, {k.shape[2]}] but the cache holds [.., {k_cache.shape[2]}, "
                         f"{k_cache.shape[3]}]")
    if slot_mapping.shape != (k.shape[0],) or slot_mapping.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"slot_mapping must be an int tensor of shape [{k.shape[0]}], "
                         f"got {slot_mapping.dtype} {tuple(slot_mapping.shape)}")
    devices = {t.device for t in (k, v, k_cache, v_cache, slot_mapping)}
    if len(devices) != 1:
        raise ValueError(f"all tensors must be on one device, got {sorted(map(str, devices))}")
