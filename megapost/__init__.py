"""megapost: Megatron-style, DeepSpeed-backed training of Post-Norm / Pre-Norm Llama models."""

import os as _os


def _name_the_cpu_accelerator() -> None:
    """DeepSpeed's accelerator probe warns "Setting accelerator to CPU" on stdout in every process that
    imports it without CUDA (3-4 lines a launch; it broke ``--json``). Naming the CPU accelerator before
    DeepSpeed is imported makes its choice an INFO record it does not print; the ``deepspeed``
    launcher's own line stays, one per launch. A DS_ACCELERATOR set is kept."""
    if _os.environ.get("DS_ACCELERATOR"):
        return
    import torch

    if not torch.cuda.is_available():
        _os.environ["DS_ACCELERATOR"] = "cpu"


_name_the_cpu_accelerator()
