"""The one home of megapost's use of DeepSpeed's private API (docs/scaling_study.md): the sync-free
optimizer steps that skip a non-finite gradient (``steps``), the engine hooks (``engine``), the
per-parameter fragments of the flat fp32 partitions and their state relinking (``fragments``), the
pipeline grid, layer partition and checkpoint classes (``internals``), and a start-up self-test of a few
milliseconds (``selftest``) that says in one line when an installed DeepSpeed no longer behaves as the
tested one. Nothing else in megapost reaches into ``deepspeed.runtime`` or DeepSpeed's private attributes
(tests/test_import_contracts.py); public DeepSpeed (``deepspeed.initialize``, ``deepspeed.pipe``, the
accelerator) is used where it is needed.

Imports nothing of megapost (pyproject.toml's contracts), so every layer may use it.
"""

from __future__ import annotations

TESTED = ">=0.19.8,<0.20"  # setup.py pins this range; 0.19.8 is what the test suite runs
