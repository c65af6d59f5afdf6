"""sglang's CPU compatibility patches (``kvreplay record --cpu-compat``; recorder/compat.py).

sglang 0.5.23 serves speculative decoding (``--speculative-algorithm STANDALONE``, the
EAGLE worker with a plain draft model) on a CPU host with ``--attention-backend triton``
and Triton's interpreter, except for one step: it builds and verifies each step's draft
tree with ``sgl_kernel``, whose CUDA build does not load without a GPU driver and whose
CPU build is taken only for ``SGLANG_USE_CPU_ENGINE`` hosts that have it. The tree
kernels decide which draft tokens are accepted; the KV slots they are accepted into are
allocated and freed by the scheduler, as on a GPU."""

from __future__ import annotations

from types import ModuleType

from kvreplay.recorder.compat import Patch


def _tree_kernels_in_triton(module: ModuleType) -> None:
    # The module picks its kernels by platform flags read at import; its XPU branch runs
    # sglang's own Triton versions of both kernels, which the interpreter runs on a CPU.
    module._is_xpu = True  # noqa: SLF001 - the flag is the module's own switch


PATCHES = (
    Patch("eagle-tree-triton", "sglang.kernels.ops.speculative.spec_tree",
          why="speculative decoding builds and verifies its draft tree with sgl_kernel, which does not load "
              "without a GPU; sglang's own Triton tree kernels (its XPU path) do the same work in Triton's "
              "interpreter",
          apply=_tree_kernels_in_triton, env={"TRITON_INTERPRET": "1"}),
)
