"""What a save costs, measured on megapost's real trainer (``megapost.pretrain``, DeepSpeed engine,
the embedded corpus in $MEGAPOST_DATA_DIR):

* ``bytes``: bytes written per save / training-state bytes, per --ckpt-format (megapost, deepspeed).
* ``rss``: peak host RSS growth of each rank during a synchronous save (psutil, sampled every 2 ms),
  / that rank's shard bytes — ZeRO-2 at DP4 by default — and, for comparison, the growth of gathering
  the full fp32 state on every rank (what the layout-free copy did before: ``safe_get_full_*``).
* ``kill9``: kill -9 at random moments of an async save; resume bit-exact from what 'latest' names.
* ``beside``: what a 1-thread matmul loop (the training thread's kind of work) loses while the other
  core runs each phase of the background writer on a state of --mib MiB (snapshot copy + finite check;
  the staged ``O_DIRECT`` write; a buffered write) in $TMPDIR, against idle rounds interleaved with them.
* ``async``: training time lost per ``--async-save`` save / the synchronous save's wall time. Lost =
  the time save() blocks + how much the steps overlapping the background write exceed the median
  step outside any write; also in the training thread's CPU time (robust to other jobs on the machine).

    nice python benchmarks/checkpoint_save.py bytes
    nice python benchmarks/checkpoint_save.py rss --layers 12 --hidden 1024 --dp 4
    nice python benchmarks/checkpoint_save.py async --layers 8 --hidden 768 --seq 128 --iters 91 --interval 30
    nice python benchmarks/checkpoint_save.py async --layers 4 --hidden 512 --seq 256 --batch 4 \
        --iters 61 --interval 20
    nice python benchmarks/checkpoint_save.py beside --mib 540 --trials 4
    nice python benchmarks/checkpoint_save.py kill9 --iters 8 --trials 3 --layers 8 --hidden 768 --seq 128
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DATA = os.environ.get("MEGAPOST_DATA_DIR", "/work/data")


def _flags(a: argparse.Namespace, save: str, iters: int, extra: list[str]) -> list[str]:
    return ["--data-path", f"{DATA}/news_text_document", "--tokenizer-model", f"{DATA}/tokenizer.model",
            "--num-layers", str(a.layers), "--hidden-size", str(a.hidden), "--ffn-hidden-size",
            str(a.hidden * 8 // 3 // 64 * 64), "--num-attention-heads", str(max(1, a.hidden // 64)),
            "--seq-length", str(a.seq), "--micro-batch-size", "1",
            "--global-batch-size", str(a.batch or a.dp),
            "--train-iters", str(iters), "--lr", "1e-4", "--lr-warmup-iters", "0", "--eval-interval", "0",
            "--log-interval", "1", "--save", save, "--allow-tokenizer-mismatch", *extra]


class Sampler(threading.Thread):
    def __init__(self) -> None:
        import psutil

        super().__init__(daemon=True)
        self.proc, self.peak, self.running = psutil.Process(), 0, True

    def run(self) -> None:
        while self.running:
            self.peak = max(self.peak, self.proc.memory_info().rss)
            time.sleep(0.002)

    def stop(self) -> int:
        self.running = False
        self.join()
        return self.peak


def _old_gather(engine) -> None:
    """What the layout-free copy did before: the full fp32 master and moments of every parameter."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    held = [(safe_get_full_fp32_param(p).float().cpu(), safe_get_full_optimizer_state(p, "exp_avg").cpu(),
             safe_get_full_optimizer_state(p, "exp_avg_sq").cpu()) for p in engine.module.parameters()]
    del held


def _child_rss(out: str, flags: list[str]) -> None:
    """Inside each rank: measure the save (and the old gather) with a psutil sampler."""
    import psutil

    from megapost import pretrain
    from megapost.checkpoint import saver

    real = saver.AsyncSaver.save

    def measured(self, engine, config, iteration, consumed, plugins, pstate, **kw):
        engine.optimizer_header()  # the state views linked, as a save does first
        base = psutil.Process().memory_info().rss
        s = Sampler()
        s.start()
        if os.environ.get("CKPT_BENCH_OLD") == "1":
            _old_gather(engine)
        old_peak = s.stop()
        base2 = psutil.Process().memory_info().rss
        s = Sampler()
        s.start()
        t0 = time.perf_counter()
        tag = real(self, engine, config, iteration, consumed, plugins, pstate, **kw)
        written = self.wait_pending()  # --async-save: the snapshot and the background write count too
        seconds = time.perf_counter() - t0
        peak = s.stop()
        rank = pstate.global_rank
        from megapost.checkpoint.format import DIR, shard_file

        shard = os.path.join(config.checkpoint.save, tag, DIR,
                             shard_file(pstate.tp_rank, pstate.pp_rank, pstate.dp_rank))
        nbytes = written or os.path.getsize(shard)  # async: rank 0 may not have published the tag yet
        with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
            json.dump({"rank": rank, "shard_bytes": nbytes, "rss_before": base2, "save_growth": peak - base2,
                       "old_growth": old_peak - base, "save_s": seconds}, f)
        return tag

    saver.AsyncSaver.save = measured
    pretrain.main(flags)


def rss(a: argparse.Namespace) -> None:
    work = tempfile.mkdtemp(prefix="ckpt-rss-")
    ds = os.path.join(work, "ds.json")
    with open(ds, "w") as f:  # DeepSpeed's default 5e8-element buckets are 2 GB a rank: keep the host small
        json.dump({"zero_optimization": {"reduce_bucket_size": 2e7, "allgather_bucket_size": 2e7}}, f)
    flags = _flags(a, os.path.join(work, "ckpt"), a.iters, ["--zero-stage", str(a.zero), "--save-interval",
                                                             str(a.iters), "--deepspeed_config", ds,
                                                             *(["--async-save"] if a.async_save else [])])
    cmd = ["deepspeed", "--num_gpus", str(a.dp), "--master_port", str(29700 + os.getpid() % 200),
           __file__, "child-rss", "--out", work, "--", *flags]
    env = dict(os.environ, OMP_NUM_THREADS="1", CKPT_BENCH_OLD="1" if a.old else "0")
    subprocess.run(cmd, cwd=REPO, check=True, env=env)
    for path in sorted(glob.glob(os.path.join(work, "rank*.json"))):
        r = json.load(open(path))
        print(f"rank {r['rank']}: shard {r['shard_bytes'] / 1e6:.0f} MB, save {r['save_s']:.1f} s, "
              f"peak RSS growth during save {r['save_growth'] / 1e6:.1f} MB = "
              f"{r['save_growth'] / r['shard_bytes']:.3f} x shard (shard + growth: "
              f"{(r['shard_bytes'] + r['save_growth']) / r['shard_bytes']:.3f}); old full gather: "
              f"{r['old_growth'] / 1e6:.0f} MB = {r['old_growth'] / r['shard_bytes']:.2f} x shard")


def _child_async(out: str, flags: list[str]) -> None:
    from megapost import pretrain
    from megapost.checkpoint import saver
    from megapost.train.step import StepRunner

    events: dict[str, list] = {"steps": [], "saves": [], "waits": []}
    real_step, real_save = StepRunner.train_step, saver.AsyncSaver.save
    real_wait = saver.AsyncSaver.before_state_changes

    def wait(self) -> None:  # the optimizer step waiting for an async snapshot
        t0 = time.perf_counter()
        real_wait(self)
        events["waits"].append(time.perf_counter() - t0)

    def step(self, n):
        t0, c0 = time.perf_counter(), time.thread_time()
        loss = real_step(self, n)
        events["steps"].append((n, t0, time.perf_counter(), time.thread_time() - c0))
        return loss

    def save(self, *args, **kw):
        t0, c0 = time.perf_counter(), time.thread_time()
        tag = real_save(self, *args, **kw)
        t1 = time.perf_counter()
        job = self.pending
        events["saves"].append([t0, t1, job, time.thread_time() - c0])
        return tag

    StepRunner.train_step, saver.AsyncSaver.save, saver.AsyncSaver.before_state_changes = step, save, wait
    pretrain.main(flags)
    saves = []
    for t0, t1, job, blocked_cpu in events["saves"]:
        end, cpu = t1, 0.0
        if job is not None:
            job.thread.join()
            end, cpu = job.done_at, job.cpu_s
        saves.append((t0, t1, end, cpu, blocked_cpu))
    json.dump({"steps": events["steps"], "saves": saves, "snapshot_wait_s": sum(events["waits"])},
              open(os.path.join(out, "events.json"), "w"))


def _lost(events: dict, cpu: bool = False) -> tuple[list[float], list[float]]:
    """(blocking seconds, total lost seconds) per save before the last step; ``cpu``: in the training
    thread's CPU time instead of wall time (what other jobs on a shared machine do to the wall time of a
    step does not show in it)."""
    steps, saves = events["steps"], events["saves"][:-1]
    inside = [any(s0 <= a <= e or s0 <= b <= e for s0, _, e, *_ in saves) for _, a, b, _ in steps]
    took = [c if cpu else b - a for _, a, b, c in steps]
    base = statistics.median(t for t, x in zip(took, inside, strict=True) if not x)
    blocking, lost = [], []
    for s0, s1, e, _, blocked_cpu in saves:
        over = [t - base for (_, a, _, _), t in zip(steps, took, strict=True) if s1 <= a <= e]
        blocking.append(blocked_cpu if cpu else s1 - s0)
        lost.append(blocking[-1] + max(0.0, sum(over)))
    return blocking, lost


def _quiet(events: dict) -> tuple[float, float]:
    """(median, 90th percentile - median) wall seconds of the steps no save overlaps, after the first 3."""
    saves = events["saves"]
    took = sorted(b - a for n, a, b, _ in events["steps"][3:]
                  if not any(s0 <= a <= e or s0 <= b <= e for s0, _, e, *_ in saves))
    median = statistics.median(took)
    return median, took[int(0.9 * (len(took) - 1))] - median


def async_(a: argparse.Namespace) -> None:
    res = {}
    for mode in ("sync", "async"):
        work = tempfile.mkdtemp(prefix=f"ckpt-{mode}-")
        extra = ["--save-interval", str(a.interval)] + (["--async-save"] if mode == "async" else [])
        flags = _flags(a, os.path.join(work, "ckpt"), a.iters, extra)
        subprocess.run([sys.executable, __file__, "child-async", "--out", work, "--", *flags], cwd=REPO,
                       check=True, env=dict(os.environ, OMP_NUM_THREADS="1"), stdout=subprocess.DEVNULL)
        events = json.load(open(os.path.join(work, "events.json")))
        res[mode], res[mode + " cpu"] = _lost(events), _lost(events, cpu=True)
        res[mode + " quiet"] = _quiet(events)
        if mode == "async":
            cpu = statistics.mean(c for *_, c, _ in events["saves"][:-1])
            wall = statistics.mean(e - s1 for _, s1, e, *_ in events["saves"][:-1])
            waited = events["snapshot_wait_s"] / len(events["saves"])
            print(f"async background write: {wall:.2f} s wall, {cpu:.2f} s CPU of its thread per save; the "
                  f"optimizer step waited {waited:.3f} s per save for the host snapshot")
    sync_wall = statistics.mean(res["sync"][0])
    blocking, lost = (statistics.mean(x) for x in res["async"])
    print(f"lost per save, each: {', '.join(f'{x:.3f}' for x in res['async'][1])} s; quiet steps: median "
          f"{res['async quiet'][0]:.3f} s, 90th percentile +{res['async quiet'][1]:.3f} s (the noise one "
          f"overlapping step carries)")
    print(f"sync save wall {sync_wall:.2f} s; async: save() blocks {blocking:.3f} s, training time lost per "
          f"save {lost:.3f} s; lost / sync wall = {lost / sync_wall:.3f} (blocking only: "
          f"{blocking / sync_wall:.3f})")
    sync_cpu = statistics.mean(res["sync cpu"][0])
    blocking, lost = (statistics.mean(x) for x in res["async cpu"])
    print(f"in the training thread's CPU time: sync save {sync_cpu:.2f} s; async: save() {blocking:.3f} s, "
          f"lost per save {lost:.3f} s; lost / sync = {lost / sync_cpu:.3f} (blocking only: "
          f"{blocking / sync_cpu:.3f})")


def bytes_(a: argparse.Namespace) -> None:
    from megapost.checkpoint.folder import tag_of
    from megapost.checkpoint.reader import ShardIndex

    for fmt in ("megapost", "deepspeed"):
        work = tempfile.mkdtemp(prefix=f"ckpt-bytes-{fmt}-")
        flags = _flags(a, os.path.join(work, "ckpt"), 1, ["--ckpt-format", fmt, "--zero-stage", "1"])
        subprocess.run([sys.executable, "-m", "megapost.pretrain", *flags], cwd=REPO, check=True,
                       env=dict(os.environ, OMP_NUM_THREADS="1"), stdout=subprocess.DEVNULL)
        tag = os.path.join(work, "ckpt", tag_of(1))
        n = sum(math.prod(s) for s in ShardIndex(tag).shapes.values())
        written = sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(tag) for f in fs)
        print(f"--ckpt-format {fmt}: {written / 1e6:.1f} MB written; training state (fp32 weights + "
              f"2 moments, {n / 1e6:.1f}M params) {12 * n / 1e6:.1f} MB; ratio {written / (12 * n):.4f}")


def _scalars(tb: str, tag: str = "train/lm_loss") -> dict[int, float]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(tb, size_guidance={"scalars": 0})
    acc.Reload()
    return {e.step: e.value for e in acc.Scalars(tag)} if tag in acc.Tags()["scalars"] else {}


def kill9(a: argparse.Namespace) -> None:
    """Trials: kill -9 at a random moment after the async save of iteration 4 starts; 'latest' must
    name a complete tag (2, or 4 when the write had finished), and resuming from it must give the
    losses of an uninterrupted run bit for bit."""
    import random
    import signal

    from megapost.checkpoint.folder import TMP_SUFFIX, CheckpointFolder, tag_of

    env = dict(os.environ, OMP_NUM_THREADS="1")
    work = tempfile.mkdtemp(prefix="ckpt-kill9-")
    ref_tb = os.path.join(work, "ref")
    flags = _flags(a, os.path.join(work, "unused"), a.iters,
                   ["--tensorboard-dir", ref_tb, "--save-interval", "0"])
    subprocess.run([sys.executable, "-m", "megapost.pretrain", *flags], cwd=REPO, env=env, check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    ref = _scalars(ref_tb)
    rng = random.Random(0)
    for trial in range(a.trials):
        ckpt = os.path.join(work, f"ckpt{trial}")
        flags = _flags(a, ckpt, a.iters, ["--save-interval", "2", "--async-save"])
        proc = subprocess.Popen([sys.executable, "-m", "megapost.pretrain", *flags], cwd=REPO, env=env,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        while not os.path.isdir(os.path.join(ckpt, tag_of(4) + TMP_SUFFIX)) and proc.poll() is None:
            time.sleep(0.01)
        delay = rng.uniform(0, a.max_delay)
        time.sleep(delay)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        latest = CheckpointFolder(ckpt).latest_name()
        tb = os.path.join(work, f"tb{trial}")
        subprocess.run([sys.executable, "-m", "megapost.pretrain", *_flags(a, ckpt, a.iters, [
            "--load", ckpt, "--tensorboard-dir", tb])], cwd=REPO, env=env, check=True,
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        resumed = _scalars(tb)
        if not resumed:
            print(f"trial {trial}: the run had ended {delay:.2f} s after iter_0000004.tmp appeared (latest "
                  f"{latest}), before the kill: not a trial (a larger model writes longer)")
            continue
        exact = all(resumed[s] == ref[s] for s in resumed)
        print(f"trial {trial}: killed {delay:.2f} s after iter_0000004.tmp appeared; latest {latest}; "
              f"resumed steps {min(resumed)}..{max(resumed)} bit-exact vs uninterrupted: {exact}")


def _loop_rate(work, seconds: float = 4.0) -> float:
    """Iterations/s of a 1-thread 512x1365 @ 1365x512 matmul loop while this thread runs ``work``."""
    import torch

    a, b = torch.randn(512, 1365), torch.randn(1365, 512)
    stop, count = threading.Event(), []

    def loop() -> None:
        n = 0
        while not stop.is_set():
            a @ b
            n += 1
        count.append(n)

    th = threading.Thread(target=loop)
    th.start()
    t0 = time.perf_counter()
    work()
    time.sleep(max(0.0, seconds - (time.perf_counter() - t0)))
    stop.set()
    th.join()
    return count[0] / (time.perf_counter() - t0)


def beside(a: argparse.Namespace, seconds: float = 4.0) -> None:
    import torch

    from megapost.checkpoint import finite_guard, stream_write

    torch.set_num_threads(1)
    src = torch.randn(a.mib << 18)
    pool = torch.empty_like(src).zero_()
    path = os.path.join(tempfile.mkdtemp(prefix="ckpt-beside-"), "shard.safetensors")

    def write(direct: bool) -> None:
        stream_write.write_safetensors(path, [("x", pool)], {}, stream_write.Staging(), direct=direct)
        os.unlink(path)

    phases = {"idle": lambda: None, "snapshot copy + finite check": lambda: finite_guard.all_finite(
                  [pool.copy_(src)], torch.device("cpu"), everywhere=False),
              "staged O_DIRECT write": lambda: write(True), "buffered write": lambda: write(False)}
    rates: dict[str, list[float]] = {k: [] for k in phases}
    for _ in range(a.trials):
        for name, work in phases.items():
            rates[name].append(_loop_rate(work, seconds))
    idle = statistics.mean(rates["idle"])
    print(f"{a.mib} MiB, $TMPDIR {tempfile.gettempdir()}, {a.trials} rounds of {seconds:.0f} s each; seconds "
          f"of the loop's work lost per phase (idle rounds show the noise):")
    for name, r in rates.items():
        lost = [seconds * (1 - x / idle) for x in r]
        each = ", ".join(f"{x:+.2f}" for x in lost)
        print(f"  {name:30s} mean {statistics.mean(lost):+.2f} s  each {each}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("what", choices=["bytes", "rss", "async", "kill9", "beside", "child-rss", "child-async"])
    p.add_argument("--trials", type=int, default=3)
    p.add_argument("--mib", type=int, default=540, help="beside: the state's size")
    p.add_argument("--async-save", action="store_true", help="rss: measure an --async-save save")
    p.add_argument("--old", action="store_true", help="rss: also measure the old full gather (12 B/param)")
    p.add_argument("--max-delay", type=float, default=3.0, help="kill9: seconds after the save starts")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--dp", type=int, default=1)
    p.add_argument("--batch", type=int, default=0, help="--global-batch-size (default: --dp)")
    p.add_argument("--zero", type=int, default=2)
    p.add_argument("--iters", type=int, default=1)
    p.add_argument("--interval", type=int, default=3)
    p.add_argument("--out")
    p.add_argument("--local_rank", type=int, help="set by DeepSpeed's launcher")
    argv = sys.argv[1:]
    cut = argv.index("--") if "--" in argv else len(argv)
    a, rest = p.parse_args(argv[:cut]), argv[cut + 1:]  # after "--": the trainer's flags (children)
    if a.what == "child-rss":
        _child_rss(a.out, rest)
    elif a.what == "child-async":
        _child_async(a.out, rest)
    else:
        {"bytes": bytes_, "rss": rss, "async": async_, "kill9": kill9, "beside": beside}[a.what](a)


if __name__ == "__main__":
    main()
