"""megapost's native torch engine: the Engine protocol (``megapost.engine``) over megapost's parallel
model and its own distributed optimizer (``megapost.parallel.dist_optimizer``), without DeepSpeed;
chosen by ``--use-distributed-optimizer`` in ``megapost.train.build`` (docs/multi-gpu.md). Imports
nothing of DeepSpeed (tests/test_native_engine.py)."""

from __future__ import annotations
