"""Checkpoints: save/load through the engine, the layout-free safetensors shards that let any layout
resume, loading that never runs code (the allowlist unpickler), the finite-state guard, and
Hugging Face interchange (with the ``hf_remote`` files copied into exports).

May import ``megapost.engine``, ``megapost.parallel``, ``megapost.model``, ``megapost.config``,
``megapost.runtime`` and ``megapost.utils``; never ``megapost.train``.
"""
