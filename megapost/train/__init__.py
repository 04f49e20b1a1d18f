"""The training loop and its composition root. ``prepare`` parses and validates the flags before any
process group forms; ``build`` (the one build path: pretrain, benchmarks and the tests' layout harness
use it) resolves the typed config and composes the ``Trainer`` from its parts, one job each:
``step`` (micro-batches through the engine), ``evaluator``, ``logger`` (monitor lines, memory report),
``checkpoints`` (save/load, log continuation, in-memory snapshots), ``plugin_host`` and ``watchdog``
(heartbeat, injected failures, exit conditions).

The top layer: may import every other megapost package; nothing in megapost imports it (except the
``megapost.pretrain`` entry point).
"""
