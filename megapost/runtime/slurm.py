"""``srun python -m megapost.pretrain ...`` without torchrun: SLURM's task variables become the
torch.distributed ones, so the tasks of one step form one world instead of N worlds of one."""

from __future__ import annotations

import os
import re
from collections.abc import MutableMapping

from megapost.config.errors import ConfigError

_HOST = r"[A-Za-z0-9._-]+"
_BRACKETED = re.compile(r"([A-Za-z0-9._-]*)\[(\d+)(?:-\d+)?(?:,[\d,-]*)?\]([A-Za-z0-9._-]*)(?:,|$)")
_PLAIN = re.compile(rf"({_HOST})(?:,|$)")
DEFAULT_PORT = 29500


def first_host(nodelist: str) -> str | None:
    """The first host of a SLURM node list (``node[01-04,07]`` -> ``node01``, ``a,b`` -> ``a``,
    ``gpu[3-4]-ib`` -> ``gpu3-ib``); None for a form this does not read (several brackets in a name)."""
    nodelist = nodelist.strip()
    m = _BRACKETED.match(nodelist)
    if m:
        return m.group(1) + m.group(2) + m.group(3)
    m = _PLAIN.match(nodelist)
    return m.group(1) if m else None


def slurm_world(env: MutableMapping[str, str]) -> dict[str, str] | None:
    """RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR / MASTER_PORT for an ``srun`` task that no launcher
    set up (None when RANK is set or this is not an srun task). MASTER_ADDR: the environment's, else the
    first host of SLURM_STEP_NODELIST / SLURM_JOB_NODELIST / SLURM_NODELIST; MASTER_PORT: the
    environment's, else one derived from SLURM_JOB_ID (the same on every task)."""
    if "RANK" in env or "SLURM_PROCID" not in env:
        return None
    tasks = env.get("SLURM_STEP_NUM_TASKS") or env.get("SLURM_NTASKS")
    if not tasks:
        return None
    addr = env.get("MASTER_ADDR")
    if not addr:
        keys = ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST")
        lists = [env[k] for k in keys if env.get(k)]
        addr = first_host(lists[0]) if lists else None
        if addr is None:
            raise ConfigError(f"srun without torchrun: cannot read the first host of SLURM's node list "
                              f"{lists[0] if lists else '(unset)'!r}; export MASTER_ADDR=<first node> (e.g. "
                              "$(scontrol show hostnames \"$SLURM_JOB_NODELIST\" | head -n1)) before srun")
    port = env.get("MASTER_PORT") or str(DEFAULT_PORT + int(env.get("SLURM_JOB_ID", "0")) % 10000)
    return {"RANK": env["SLURM_PROCID"], "WORLD_SIZE": tasks, "LOCAL_RANK": env.get("SLURM_LOCALID", "0"),
            "MASTER_ADDR": addr, "MASTER_PORT": port}


def adopt_slurm_env() -> str | None:
    """Under a bare ``srun`` task, set the torch.distributed variables from SLURM's (``slurm_world``);
    returns a start-up note, or None when a launcher (or nothing) set them."""
    world = slurm_world(os.environ)
    if world is None:
        return None
    os.environ.update(world)
    return (f"srun task without a launcher: rank {world['RANK']} of {world['WORLD_SIZE']} (SLURM_PROCID/"
            f"NTASKS/LOCALID), rendezvous {world['MASTER_ADDR']}:{world['MASTER_PORT']}")
