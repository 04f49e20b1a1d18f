"""``srun python -m megapost.pretrain`` without torchrun: SLURM's task variables make one world."""

from __future__ import annotations

import subprocess
import sys

import pytest
from dist_utils import free_port
from launch_utils import REPO, child_env, tiny_model_flags

from megapost.config.errors import ConfigError
from megapost.runtime.slurm import first_host, slurm_world


@pytest.mark.parametrize("nodelist, host", [
    ("node[01-04]", "node01"), ("node[07,09-12]", "node07"), ("gpu[3-4]-ib,cpu1", "gpu3-ib"),
    ("a1,b2", "a1"), ("login.cluster", "login.cluster"), ("r[1-2]n[01-04]", None), ("", None),
])
def test_first_host_of_a_node_list(nodelist: str, host: str | None) -> None:
    assert first_host(nodelist) == host


def test_srun_task_variables_map_to_torch_distributed() -> None:
    env = {"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1", "SLURM_JOB_NODELIST": "gpu[12-13]",
           "SLURM_JOB_ID": "4242"}
    assert slurm_world(env) == {"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "MASTER_ADDR": "gpu12",
                                "MASTER_PORT": str(29500 + 4242)}
    assert slurm_world({**env, "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "6000"})["MASTER_ADDR"] == "10.0.0.1"
    assert slurm_world({**env, "RANK": "0"}) is None  # torchrun / deepspeed under srun: theirs wins
    assert slurm_world({"SLURM_JOB_ID": "1"}) is None  # not an srun task
    with pytest.raises(ConfigError, match="export MASTER_ADDR") as e:
        slurm_world({**env, "SLURM_JOB_NODELIST": "r[1-2]n[01-04]"})
    assert "\n" not in str(e.value.code)


@pytest.mark.integration
@pytest.mark.slow  # two ranks of the real trainer on 2 cores: ~40 s
def test_two_srun_tasks_without_a_launcher_form_one_world_of_two(tiny_data) -> None:
    flags = tiny_model_flags(tiny_data, **{"--train-iters": 2})
    port = str(free_port())
    procs = [subprocess.Popen([sys.executable, "-m", "megapost.pretrain", *flags], cwd=REPO, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              env=child_env(SLURM_PROCID=str(r), SLURM_NTASKS="2", SLURM_LOCALID=str(r),
                                            SLURM_JOB_NODELIST="localhost", MASTER_PORT=port,
                                            SLURM_JOB_ID="7"))
             for r in (0, 1)]
    outs = [p.communicate(timeout=300)[0] for p in procs]
    print(outs[0][-3000:], "=====", outs[1][-2000:])
    assert [p.returncode for p in procs] == [0, 0], outs[1][-3000:]
    assert "rank 0 of 2" in outs[0] and f"localhost:{port}" in outs[0]
    # one run logged by its last rank (Megatron's convention), not two runs logging each
    assert "(TP,PP,DP)=(1,1,2)" in outs[1] and "(TP,PP,DP)" not in outs[0]
    assert outs[1].count("iteration      2/2") == 1
