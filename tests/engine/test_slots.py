"""The slot registry: each patch point's call signature is a Protocol, and every implementation
the engine, the dispatch and the built-in patches install takes the arguments it names."""
from __future__ import annotations

import inspect
import typing

import pytest

from graft.engine.attention import default_slots
from graft.engine.engine import no_outcome
from graft.engine.patches import builtin, testing
from graft.engine.patches.slots import SLOT_NAMES, SLOTS, SlotTable
from graft.engine.sampler import sample_per_row
from graft.engine.scheduler import default_policy
from graft.kernels import cpu_avx512, cpu_decode, dispatch, reference, torch_attention


def positional_arity(protocol: type) -> int:
    """How many positional arguments the engine passes to a slot of this Protocol."""
    params = list(inspect.signature(protocol.__call__).parameters.values())[1:]     # past `self`
    assert all(p.kind is inspect.Parameter.POSITIONAL_ONLY for p in params), protocol
    return len(params)


def takes(fn, protocol: type) -> bool:
    """Whether `fn` can be called the way the engine calls a slot of `protocol`."""
    try:
        inspect.signature(fn).bind(*range(positional_arity(protocol)))
    except TypeError:
        return False
    return True


def test_every_slot_is_named_with_its_protocol():
    assert SLOT_NAMES == tuple(SLOTS) and len(SLOTS) == 8
    for name, protocol in SLOTS.items():
        assert typing.Protocol in protocol.__mro__ and f"``{name}``" in protocol.__doc__, name
        assert positional_arity(protocol) >= 1 and "return" in protocol.__call__.__annotations__, name


def installed() -> list[tuple[str, object]]:
    """(slot, implementation) of every table and patch the engine can run."""
    pairs = []
    for paths in ("fast", "plain"):
        for device in ("cpu", "cuda"):
            table = default_slots(default_policy, sample_per_row, paths, device)
            pairs += table.items()
    pairs.append(("request.outcome", no_outcome))
    for patch in [*builtin.patches(), *testing.patches()]:
        pairs += patch.slots.items()
        if patch.configure is not None:
            pairs += patch.configure({}).items()
    kernels = {"attention.decode": [cpu_decode.paged_decode_attention_cpu, cpu_avx512.paged_decode_attention,
                                    torch_attention.decode_attention_varlen, torch_attention.decode_attention_batched,
                                    reference.decode_attention],
               "attention.prefill": [cpu_avx512.prefill_attention, torch_attention.prefill_attention_fused,
                                     reference.prefill_attention],
               "kv.gather": [reference.gather_kv]}
    pairs += [(name, fn) for name, fns in kernels.items() for fn in fns]
    pairs += dispatch.kernel_slots("cpu", use_triton=True).items()
    return pairs


@pytest.mark.parametrize("slot,fn", installed(), ids=lambda x: getattr(x, "__qualname__", str(x)))
def test_every_installed_implementation_takes_its_slots_arguments(slot, fn):
    assert takes(fn, SLOTS[slot]), f"{fn} does not take the {slot} arguments"


def test_a_wrong_arity_is_seen_and_an_unknown_slot_refused():
    assert not takes(lambda q, k, v: q, SLOTS["attention.prefill"])
    assert takes(lambda *args: None, SLOTS["attention.decode"])
    with pytest.raises(KeyError, match="unknown patch point"):
        SlotTable({"attention.prefil": lambda q, k, v, s: q})
