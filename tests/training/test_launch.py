"""The launcher: commands, the gloo-abort rule, and a real 2-process DDP round under torchrun."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.workflows.warm_ranks import warm_env
from xffl.aggregator.exchange import Manifest, verify_checkpoint
from xffl.training.checkpoint import load_model
from xffl.training.config import TrainJob
from xffl.training.data import TokenShards
from xffl.training.launch import FORK_ENV, build_command, forkable, launch
from xffl.training.model import export_state_dict, lm_loss
from xffl.training.optimizer import make_optimizer

JobFactory = Callable[..., TrainJob]


def test_build_command() -> None:
    args = ["--job", "j.json"]
    torchrun = build_command(2, "torchrun", args, python="py")
    assert torchrun == ["py", "-m", "torch.distributed.run", "--standalone", "--nnodes", "1",
                        "--nproc-per-node", "2", "-m", "xffl.training", "--job", "j.json"]
    srun = build_command(4, "srun", args, python="py")
    assert srun[0] == "srun" and "--ntasks=4" in srun
    assert srun[-5:] == ["py", "-m", "xffl.training", "--job", "j.json"]
    forked = build_command(2, "torchrun", args, python="py", fork=True)
    assert forked == ["py", "-m", "xffl.training.forked", "--nproc-per-node", "2", "-m",
                      "xffl.training", "--job", "j.json"]
    assert build_command(4, "srun", args, python="py", fork=True) == srun  # srun execs
    assert build_command(1, "none", args, python="py") == ["py", "-m", "xffl.training", *args]
    assert build_command(1, "torchrun", args, python="py") == build_command(1, "none", args,
                                                                             python="py")
    with pytest.raises(ValueError, match="one process"):
        build_command(2, "none", args)
    with pytest.raises(ValueError, match="launcher"):
        build_command(1, "mpirun", args)  # type: ignore[arg-type]


def test_forkable_only_without_accelerator_devices(tmp_path: Path) -> None:
    dev = tmp_path / "dev"
    (dev / "dri").mkdir(parents=True)
    (dev / "null").touch()
    (dev / "dri" / "card0").touch()  # a display, not a render node
    assert forkable({}, dev)
    assert not forkable({FORK_ENV: "0"}, dev)
    (dev / "accel").mkdir()  # the kernel's compute-accelerator class, none present yet
    (dev / "nvidiactl").touch()  # NVIDIA's control node: present without a GPU in a container
    assert forkable({}, dev)
    # one device file of each family a rank could compute on: NVIDIA, AMD (ROCm's kfd), a DRM
    # render node (Intel, AMD), and the kernel's accel class (Intel Gaudi, NPUs: accel0)
    for gpu in ("nvidia0", "nvidia7", "kfd", "dri/renderD128", "accel/accel0"):
        (dev / gpu).touch()
        assert not forkable({}, dev), f"/dev/{gpu} present, and the ranks would be forked"
        (dev / gpu).unlink()
    assert forkable({}, dev)


FAKE_RANK = """
import json, multiprocessing, os, sys, threading
WARMED = []


def warm_imports(argv):
    WARMED.append(list(argv))


def nothing():
    pass


def own_fork_server():
    \"\"\"The exit code of a process this rank starts through a fork server of its own (as a
    DataLoader's workers may be started); None if that start is still stuck after 60 s.\"\"\"
    done = []

    def start():
        proc = multiprocessing.get_context("forkserver").Process(target=nothing)
        proc.start()
        proc.join(60)
        done.append(proc.exitcode)

    thread = threading.Thread(target=start, daemon=True)
    thread.start()
    thread.join(60)
    return done[0] if done else None


if __name__ == "__main__":
    out, mode = sys.argv[1:3]
    preloaded = sys.modules.get("fake_rank")  # set only in a process that imported it
    rank = os.environ["RANK"]
    with open(os.path.join(out, f"rank{rank}.json"), "w") as fh:
        json.dump({"world": os.environ["WORLD_SIZE"], "master": os.environ["MASTER_ADDR"],
                   "warmed": preloaded.WARMED if preloaded else None,
                   "parent": os.getppid(),
                   "parent_threads": len(os.listdir(f"/proc/{os.getppid()}/task")),
                   "own_fork_server": own_fork_server() if rank == "1" and preloaded else 0},
                  fh)
    if rank == "1" and mode == "exit3":
        sys.exit(3)
    if rank == "1" and mode == "abort":
        os.abort()
"""


@pytest.mark.parametrize("fork", [True, False])
def test_torchrun_ranks_forked_from_one_warmed_interpreter(tmp_path: Path, fork: bool) -> None:
    """Forked ranks find the module imported and warmed before the fork; exec'd ones do not.

    Both ways torch's elastic agent sets the ranks' rendezvous environment, and a rank's
    failure is the launcher's exit code (forked: the rank's own; torchrun's exec'd ranks: 1).
    Forked ranks come from a process that runs one thread (the fork server), not from the
    agent, whose rendezvous threads may hold a libc lock at the fork: a rank forked from the
    agent (4 threads) hung in getaddrinfo once in a few hundred rounds on a busy machine.
    The fork server's socket lives in a short folder, whatever the TMPDIR, and a rank can
    start a fork server of its own (the one it was forked from left no lock held).
    """
    (tmp_path / "fake_rank.py").write_text(FAKE_RANK)
    long_tmp = tmp_path / ("t" * 100)  # a site job's TMPDIR: too long for a socket's path
    long_tmp.mkdir()
    env = {**os.environ, "PYTHONPATH": str(tmp_path), FORK_ENV: "1" if fork else "0",
           "TMPDIR": str(long_tmp)}
    out = tmp_path / "out"
    out.mkdir()
    assert launch(2, "torchrun", [str(out), "ok"], out, module="fake_rank", env=env) == 0
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert [r["world"] for r in ranks] == ["2", "2"]
    assert [r["own_fork_server"] for r in ranks] == [0, 0]
    assert ranks[0]["parent"] == ranks[1]["parent"] != os.getpid()
    if fork:
        assert [r["warmed"] for r in ranks] == [[[str(out), "ok"]]] * 2
        assert [r["parent_threads"] for r in ranks] == [1, 1]
    else:
        assert [r["warmed"] for r in ranks] == [None, None]
    if fork:  # the failing rank's own exit code, or 128 + its signal
        assert launch(2, "torchrun", [str(out), "exit3"], out, module="fake_rank",
                      env=env) == 3
        assert launch(2, "torchrun", [str(out), "abort"], out, module="fake_rank",
                      env=env) == 128 + 6
    else:
        assert launch(2, "torchrun", [str(out), "exit3"], out, module="fake_rank",
                      env=env) != 0


FAKE_TRAINER = """
import os, shutil, sys
src, out, mode = sys.argv[1:4]
if mode in ("write", "corrupt"):
    shutil.copytree(src, out, dirs_exist_ok=True)
if mode == "corrupt":
    with open(os.path.join(out, "model.safetensors"), "r+b") as fh:
        fh.truncate(100)
if mode == "exit3":
    sys.exit(3)
sys.stderr.write("terminate called without an active exception\\n")
sys.stderr.flush()
os.abort()
"""


@pytest.fixture
def fake_launch(tmp_path: Path, global0: tuple[Path, Manifest]) -> Callable[[str, Path], int]:
    """launch() of a stand-in trainer that writes (or not) a checkpoint, then aborts."""
    (tmp_path / "fake_trainer.py").write_text(FAKE_TRAINER)
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}

    def run(mode: str, out: Path) -> int:
        args = [str(global0[0]), str(out), mode]
        return launch(1, "none", args, out, module="fake_trainer", env=env)

    return run


def test_abort_after_a_valid_checkpoint_counts_as_success(
    tmp_path: Path, fake_launch: Callable[[str, Path], int], capfd: pytest.CaptureFixture[str]
) -> None:
    assert fake_launch("write", tmp_path / "out") == 0
    err = capfd.readouterr().err
    assert "terminate called" in err  # the child's output is streamed through
    assert "warning" in err and "passes verification" in err


def test_abort_without_a_new_valid_checkpoint_fails(
    tmp_path: Path, fake_launch: Callable[[str, Path], int], global0: tuple[Path, Manifest]
) -> None:
    assert fake_launch("nothing", tmp_path / "none") == 128 + 6  # SIGABRT
    assert fake_launch("corrupt", tmp_path / "corrupt") != 0
    stale = tmp_path / "stale"
    shutil.copytree(global0[0], stale)  # a valid checkpoint from an earlier attempt
    assert fake_launch("nothing", stale) != 0
    assert fake_launch("exit3", tmp_path / "other") == 3


LAUNCH_ALONE = """
import json, sys
from pathlib import Path
import xffl.training.launch as launcher
launcher.TRAINER_MODULE = "fake_trainer"  # the trainer's paths: chain list, step log, keep
g0, out, keep = sys.argv[1:4]
rc = launcher.launch(1, "none", [g0, out, "write", "--round", "1", "--model", g0], Path(out),
                     module="fake_trainer", keep=Path(keep))
print(json.dumps({"rc": rc, "torch": sorted(m for m in sys.modules
                                            if m == "torch" or m.startswith("torch."))}))
"""


def test_the_launcher_itself_never_imports_torch(
    tmp_path: Path, global0: tuple[Path, Manifest]
) -> None:
    """The launcher runs once per site and round beside the ranks (in the SLURM job, on a
    login node's allocation); importing torch there costs 1.5-2 CPU-seconds and ~300 MB for
    nothing. A round with a kept update, the chain's files and the round checkpoints' folder
    (every path of :func:`launch` that once imported torch for a constant) stays torch-free."""
    (tmp_path / "fake_trainer.py").write_text(FAKE_TRAINER)
    keep, out = tmp_path / "keep", tmp_path / "out"
    (keep / "checkpoints").mkdir(parents=True)  # a round's checkpoints, dropped once kept
    done = subprocess.run([sys.executable, "-c", LAUNCH_ALONE, str(global0[0]), str(out),
                           str(keep)], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(tmp_path)})
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.splitlines()[-1])
    assert result == {"rc": 0, "torch": []}
    assert (keep / "r1" / "manifest.json").is_file() and not (keep / "checkpoints").exists()


@pytest.mark.slow
def test_two_rank_ddp_round_equals_one_process_on_the_global_batch(
    tmp_path: Path, global0: tuple[Path, Manifest], make_job: JobFactory
) -> None:
    """DDP averages the ranks' gradients, so 2 ranks x batch B must equal 1 process x 2B.

    Step s of the reference uses the concatenation of both ranks' step-s batches (the
    sampler is a pure function of seed, round and rank). 7 sequences over 2 ranks leave 3
    per rank per epoch, so batches of 2 straddle epochs and one sequence is left out.

    Tolerance (u = 2^-24, fp32). DDP's all-reduced gradient and the one process's
    full-batch gradient sum the same N = 2 x 2 x 16 = 64 per-token terms (S = sum|term| / N
    <= 0.36 here) in different orders, and the dot products along each gradient's forward
    and backward path (C ~ 1200 terms in all; first order, layer gains ~ 1) may be blocked
    differently for 2 and 4 rows: the gradients differ by dg <= 2 (N + C) u S = 5.4e-5.
    The gradient norm (1.4-1.8) exceeds grad_clip = 1, so the clip factor c = 1/|g|
    (<= 0.71) enters too: |g| sums squares of <= 8192 elements (the embeddings), relative
    error <= 8192 u / 2 per run, and moves by |dg|_2 / |g| <= 2 (N + C) u |S|_2 (<= 3.6)
    / 1.4: the two factors differ by eps_c <= 8.6e-4 relative. AdamW's step
    lr * m / (sqrt(v) + eps) moves by at most 2 lr / eps per unit of gradient change, so
    with eps = 1 (a momentum-SGD-like AdamW, whose steps cannot flip sign on rounding as
    they do at eps = 1e-8: up to 2 lr per element) and lr = 0.1 a step differs by
    <= 0.2 (c dg + eps_c max|c g|) + 2^-23 (rounding |w| <= 1) <= 4.3e-5 (max|c g| <=
    0.22): 4 steps by <= 1.4e-4: atol 3e-4. Losses (per-token <= 5.8, logits' sums
    S_z <= 0.74): logits differ by <= 2 * 600 u S_z = 5.3e-5 (600: the forward path),
    cross-entropy is 2-Lipschitz in them, the mean of 64 and the ranks' means of 32 differ
    by <= 2 * 63 u * 5.8, and the weight gap (2-norm <= 0.2 (c |dg|_2 + eps_c * 1) per
    step) moves a loss by <= |grad| (<= 1.8) times it: <= 1.4e-3 at step 4: abs 3e-3.
    A missing reduction (each rank on its own half) moves the weights by ~2e-2 and the
    losses by ~3e-2 here; reporting rank 0's loss alone is off by up to 3e-2 (step 2), a
    sum instead of the mean by 5.5.
    """
    g0, g0_manifest = global0
    steps, batch, seq_len = 4, 2, 16
    job = make_job(tmp_path / "data", sequences=7, steps=steps, batch_size=batch,
                   seq_len=seq_len, seed=3, lr=0.1, adam_eps=1.0)
    job_file = tmp_path / "job.json"
    job_file.write_text(job.model_dump_json())
    out = tmp_path / "update"
    args = ["--job", str(job_file), "--round", "1", "--model", str(g0), "--out", str(out)]
    assert launch(2, "torchrun", args, out, env=warm_env()) == 0  # the warm server's ranks

    manifest = verify_checkpoint(out)
    assert manifest.kind == "update" and manifest.round == 1
    assert manifest.parent == g0_manifest.digest()
    assert manifest.num_samples == 7
    assert manifest.num_tokens == steps * batch * seq_len * 2
    assert manifest.extra["world_size"] == 2

    model = load_model(g0)
    optimizer = make_optimizer(model, job.training)
    shards = TokenShards(tmp_path / "data", seq_len)  # generated by the ranks
    per_rank = [shards.batches(batch, r, 2, job.training.seed, 1) for r in range(2)]

    def global_batches() -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        while True:
            parts = [next(it) for it in per_rank]
            yield torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])

    batches, losses = global_batches(), torch.zeros(steps, dtype=torch.float64)
    for step in range(steps):  # a plain single-process loop over both ranks' batches
        inputs, targets = next(batches)
        optimizer.zero_grad()
        loss = lm_loss(model(inputs), targets)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), job.training.grad_clip)
        optimizer.step()
        losses[step] = float(loss.detach())
    assert manifest.extra["losses"] == pytest.approx(losses.tolist(), abs=3e-3)
    assert manifest.metrics["loss"] == pytest.approx(float(losses.mean()), abs=3e-3)
    trained = load_file(out / "model.safetensors")
    reference = export_state_dict(model)
    assert trained.keys() == reference.keys()
    for name in reference:
        torch.testing.assert_close(trained[name], reference[name], atol=3e-4, rtol=0,
                                   msg=f"{name} differs from the 1-process reference")
    initial = load_file(g0 / "model.safetensors")
    assert not torch.equal(initial["lm_head.weight"], trained["lm_head.weight"])


@pytest.mark.slow
def test_launch_module_entry_reports_failure(tmp_path: Path) -> None:
    """The command-line launcher returns the trainer's failure code (bad job: exit 2)."""
    job = tmp_path / "job.json"
    job.write_text("{}")
    out = tmp_path / "out"
    code = (
        "import sys; from xffl.training.launch import main; "
        f"sys.exit(main(['--ranks', '1', '--launcher', 'none', '--', '--job', {str(job)!r}, "
        f"'--round', '1', '--model', 'm', '--out', {str(out)!r}]))"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=warm_env())  # its rank forked from the warm rank server
    assert proc.returncode == 2, proc.stderr
    assert "run_id" in proc.stderr and "training failed" in proc.stderr


def test_startup_seconds_from_the_launcher_time() -> None:
    from xffl.training.launch import LAUNCHED_AT_ENV
    from xffl.training.trainer import startup_seconds

    assert startup_seconds({LAUNCHED_AT_ENV: repr(100.25)}, 102.75) == 2.5
    assert startup_seconds({LAUNCHED_AT_ENV: "200.0"}, 150.0) == 0.0  # clocks: never < 0
    for bad in ({}, {LAUNCHED_AT_ENV: "soon"}, {LAUNCHED_AT_ENV: "nan"},
                {LAUNCHED_AT_ENV: "inf"}):
        assert startup_seconds(bad, 1.0) is None
