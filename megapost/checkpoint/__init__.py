"""Checkpoints, through the Engine protocol only (``megapost.engine``; no DeepSpeed object here but the
allowlist loader of DeepSpeed's own files in ``safety``). Roles (docs/architecture.md, docs/checkpoints.md):
``format`` (names, FORMAT, the manifest and headers), ``codec`` (pickle-free state, RNG), ``specs`` (which
slice a TP piece is), ``writer`` (a rank's files), ``stream_write`` (safetensors streamed), ``snapshot``
(the async host copy), ``saver`` (``AsyncSaver``: sync/async saves, agreement, publishing), ``reader`` (the
index, any layout) and ``own_shard`` (its fast path), ``optimizer_state`` (state in through the Engine),
``resume`` (a --load), ``layout`` (what a tag is of; checks), ``folder`` (the one reader of ``latest`` and
maker of tag names; ``retention``), ``finite_guard``, ``data_identity``, ``hf``/``hf_command`` (Hugging
Face interchange, with the ``hf_remote`` files copied into exports).

May import ``megapost.engine``, ``megapost.parallel``, ``megapost.model``, ``megapost.config`` and
``megapost.utils`` (and ``ds_adapter.internals`` for ``safety``); never ``megapost.train``.
"""
