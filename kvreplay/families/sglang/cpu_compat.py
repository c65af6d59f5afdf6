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


def _meta_params_on_server_device(module: ModuleType) -> None:
    # Up to 0.5.12 the transformers backend materializes a model's meta-device parameters
    # (a mixture of experts' weights) on "cuda" by name; later releases ask for the
    # server's device. Here: where the loader put the model's other parameters.
    import torch
    from torch import nn

    def init_parameters(self: nn.Module, mod: nn.Module) -> None:
        device = next((p.device for p in self.parameters() if p.device.type != "meta"), torch.device("cpu"))
        for name, param in mod.named_parameters(recurse=False):
            if param.device.type == "meta":
                setattr(mod, name, nn.Parameter(torch.empty_like(param.data, device=device)))
        for child in mod.children():
            init_parameters(self, child)

    module.TransformersBase._init_parameters = init_parameters


def _rope_in_torch(module: ModuleType) -> None:
    # A host that is neither CUDA, ROCm nor sglang's CPU engine falls through to vLLM's
    # rotary kernel, which is not installed; its MPS branch keeps the rotation in torch.
    module._is_mps = True  # noqa: SLF001 - the flag is the module's own switch


PATCHES = (
    Patch("eagle-tree-triton", "sglang.kernels.ops.speculative.spec_tree",
          why="speculative decoding builds and verifies its draft tree with sgl_kernel, which does not load "
              "without a GPU; sglang's own Triton tree kernels (its XPU path) do the same work in Triton's "
              "interpreter",
          apply=_tree_kernels_in_triton, env={"TRITON_INTERPRET": "1"}),
    Patch("transformers-meta-params", "sglang.srt.models.transformers",
          why="up to 0.5.12 the transformers backend puts a model's meta-device parameters (a mixture of "
              "experts' weights) on 'cuda' by name; the patch puts them on the server's device, as 0.5.13 on do",
          apply=_meta_params_on_server_device),
    Patch("rope-native", "sglang.srt.layers.rotary_embedding.base",
          why="sglang's own models (not the transformers backend) take vLLM's rotary kernel on a host that is "
              "neither CUDA, ROCm nor sglang's CPU engine; the patch keeps the rotation in torch (the MPS path)",
          apply=_rope_in_torch),
)
