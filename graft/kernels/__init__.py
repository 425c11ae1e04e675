"""The engine's hot loops: kernels, their torch twins, and the one dispatch between them.

- `dispatch`: which implementation runs each hot loop (device, dtype, CPU features, `--paths`,
  patches); the engine asks it and decides nothing of this itself;
- Triton kernels: `kv_store`, `paged_decode`, `prefill`; their float32 twins: `reference`;
- C kernels for a CPU: `cpu_decode` (portable paged decode attention) and `cpu_avx512` (prefill
  and decode attention, and the layer around attention, on AVX-512 BF16), in `csrc/`, built and
  loaded by `native_build` (which also reads the CPU's flags);
- `torch_attention`: attention in torch operators where no kernel serves, the C kernels' twins.

This layer imports nothing of graft.engine (an import-linter contract holds it to that). The
package imports nothing itself: Triton must see TRITON_INTERPRET before it is first imported, and
`native_build`, which the engine's configuration reads, must load without torch.
"""
