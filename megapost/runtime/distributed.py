"""Process-group start-up that works under DeepSpeed's launcher, torchrun, or plain ``python``."""

from __future__ import annotations

import contextlib
import datetime
import os
from collections.abc import Iterator

import deepspeed
import torch

from megapost.config.errors import ConfigError
from megapost.utils.ports import free_port


def skip_cpu_shm_op_build() -> None:
    """DeepSpeed compiles a shared-memory C++ op (~1.5 min on 2 cores) when its comm backend starts on
    CPU; it serves only inference all-reduce, which training never calls. Skip it unless
    MEGAPOST_DS_SHM_COMM=1. Nothing else DeepSpeed compiles is used: megapost brings torch's AdamW."""
    if os.environ.get("MEGAPOST_DS_SHM_COMM") != "1":
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False


def default_group_timeout(timeout: datetime.timedelta) -> None:
    """Make ``timeout`` the default of every process group created from now on.

    ``torch.distributed.new_group()`` without a timeout, which is how DeepSpeed builds the tensor,
    pipeline and data-parallel groups, takes torch's built-in default (30 min for gloo, 10 for NCCL),
    not the world group's; a rank that hangs would then stall the others that long, whatever
    --distributed-timeout-minutes says. torch reads these module defaults at each new_group call.
    """
    c10d = torch.distributed.distributed_c10d
    c10d.default_pg_timeout = timeout
    if isinstance(getattr(c10d, "default_pg_nccl_timeout", None), datetime.timedelta):
        c10d.default_pg_nccl_timeout = timeout


def device_index(device_count: int, local_rank: int | None = None) -> int:
    """This rank's GPU: ``LOCAL_RANK`` (torchrun, DeepSpeed's launcher), else ``SLURM_LOCALID`` (srun),
    modulo the GPUs this process sees (one per task under ``--gpus-per-task``: always 0)."""
    env = os.environ.get("LOCAL_RANK") or os.environ.get("SLURM_LOCALID")
    rank = int(env) if env is not None else int(local_rank or 0)
    return rank % max(1, device_count)


def check_backend(backend: str | None, device_type: str) -> None:
    """``--distributed-backend nccl`` needs a CUDA device (checked at parse time and at init)."""
    if backend == "nccl" and device_type != "cuda":
        raise ConfigError("--distributed-backend nccl: no CUDA device on this machine (NCCL runs on GPUs); "
                          "use --distributed-backend gloo, or leave the flag out")


def init_distributed(local_rank: int | None, backend: str | None, timeout_minutes: float) -> torch.device:
    """Initialise torch.distributed (``backend``: --distributed-backend, None: by device) with a
    bounded timeout (--distributed-timeout-minutes); returns this rank's device."""
    if "RANK" not in os.environ:  # plain `python ...`: a world of one
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(free_port()))
    if torch.cuda.is_available():
        index = device_index(torch.cuda.device_count(), local_rank)
        torch.cuda.set_device(index)
        device = torch.device("cuda", index)
    else:
        device = torch.device("cpu")
        skip_cpu_shm_op_build()
    check_backend(backend, device.type)
    backend = backend or ("nccl" if device.type == "cuda" else "gloo")
    timeout = datetime.timedelta(minutes=timeout_minutes)
    default_group_timeout(timeout)
    try:
        deepspeed.init_distributed(dist_backend=backend, auto_mpi_discovery=False, timeout=timeout,
                                   verbose=False)
    except RuntimeError as e:  # the port was taken between the check and the bind (DistNetworkError)
        if "address already in use" not in str(e).lower() and "EADDRINUSE" not in str(e):
            raise
        port = os.environ.get("MASTER_PORT")
        raise ConfigError(f"port {port} (MASTER_PORT) is already in use on this node, another job holds it; "
                          "launch with another, e.g. `deepspeed --master_port N ...` (make train "
                          'LAUNCHER="--master_port N")') from None
    return device


def tp_overlap_env(tp: int, overlap: bool) -> str | None:
    """On CUDA at TP > 1 with the backward overlap of megapost.parallel.async_linear: set
    ``CUDA_DEVICE_MAX_CONNECTIONS=1`` where it is unset, before CUDA initialises (one hardware queue keeps
    kernels in issue order, so the input-gradient collective on NCCL's stream starts before the
    weight-gradient GEMM fills the GPU: Megatron's requirement); returns the start-up note."""
    if tp == 1 and not overlap:
        return "--no-async-tensor-model-parallel-allreduce changes nothing at TP 1 (no TP collectives)"
    if tp == 1 or not overlap or not torch.cuda.is_available():
        return None
    key, value = "CUDA_DEVICE_MAX_CONNECTIONS", os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS")
    if value is None and not torch.cuda.is_initialized():
        os.environ[key] = "1"
        return f"{key}=1 set: the TP input-gradient collectives start before the weight-gradient GEMMs"
    if value != "1":
        return (f"{key}={value or 'unset (CUDA already initialised)'}: the TP input-gradient collectives may "
                "queue behind the weight-gradient GEMMs they overlap; set it to 1 before the launch")
    return None


def world_size_from_env() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


WORLD_OF_ONE = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


@contextlib.contextmanager
def process_group_scope() -> Iterator[None]:
    """The process group a run creates ends with it: destroyed after a run of this process (as
    torchtitan does at the end of training) and after an error in a world of one, so a caller that goes
    on (an in-process test, a notebook) is left as it was, the world-of-one variables included. A
    failed multi-rank run keeps its group: destroying one whose peers may be inside a collective can
    block (NCCL), and the process is about to exit anyway."""
    had_group = torch.distributed.is_initialized()
    env = {k: os.environ.get(k) for k in WORLD_OF_ONE}
    ok = False
    try:
        yield
        ok = True
    finally:
        alone = int(os.environ.get("WORLD_SIZE", "1")) == 1
        if not had_group and torch.distributed.is_initialized() and (ok or alone):
            torch.distributed.destroy_process_group()
        if env["RANK"] is None:  # init_distributed set a world of one for plain `python`
            for key in WORLD_OF_ONE:
                if env[key] is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = env[key]
