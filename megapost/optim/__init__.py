"""The optimizer step and its DeepSpeed wiring: the generated DeepSpeed config, the optimizer and lr
schedule handed to ``deepspeed.initialize``, the hooks megapost adds to DeepSpeed's engine, the skip
counter, and the reads of the engine's private state (gradients, clip coefficient) that the rest of
megapost and the plugins need.

May import ``megapost.parallel``, ``megapost.model``, ``megapost.config`` and ``megapost.utils``.
"""
