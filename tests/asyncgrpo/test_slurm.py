"""asyncgrpo/slurm.py: what each node of a Slurm job starts, from Slurm's variables as srun sets them (set here by
the test: no Slurm needed). The whole batch script on a real Slurm is scripts/slurm_check.sh."""

import subprocess
import sys

import pytest
from helpers import PROCESS_ENV, REPO

from asyncgrpo.run.hosts import HOST_ID_ENV, host_id
from asyncgrpo.slurm import SlurmError, expand_nodelist, node_task, per_node

LAUNCH = "/repo/launch.sh"


def job_env(node="n1", nodelist="n[1-2]", job="77", tasks_per_node="3(x2)", **more):
    return {"SLURM_JOB_ID": job, "SLURM_JOB_NODELIST": nodelist, "SLURMD_NODENAME": node,
            "ASYNCGRPO_SLURM_TASKS_PER_NODE": tasks_per_node, "HOME": "/home/u", **more}


def task(env, *args):
    return node_task(env, list(args), launch_sh=LAUNCH)


@pytest.mark.parametrize(("spec", "names"), [
    ("n[1-2]", ["n1", "n2"]),
    ("gpu[08-10,3],login", ["gpu08", "gpu09", "gpu10", "gpu3", "login"]),
    ("rack[1-2]-n[1-2]", ["rack1-n1", "rack1-n2", "rack2-n1", "rack2-n2"]),
    ("solo", ["solo"]),
])
def test_node_lists_expand_as_scontrol_show_hostnames_prints_them(spec, names):
    assert expand_nodelist(spec) == names


def test_per_node_counts_expand_slurms_repeat_notation():
    assert per_node("2(x3),1") == [2, 2, 2, 1]
    with pytest.raises(SlurmError):
        per_node("two")


def test_on_cpu_the_first_node_runs_the_ps_and_a_worker_per_other_task_the_others_join():
    first = task(job_env("n1"), "--max-steps", "9")
    assert first.argv == ["bash", LAUNCH, "--run-dir", "/home/u/asyncgrpo-runs/slurm-77", "--workers", "2",
                          "--ps-procs", "1", "--weight_transport", "safetensors", "--checkpoint_on_sigterm", "true",
                          "--max-steps", "9"]
    assert first.wait_for is None
    second = task(job_env("n2"), "--max-steps", "9")
    assert second.argv == ["bash", LAUNCH, "--join", "/home/u/asyncgrpo-runs/slurm-77", "--workers", "3",
                           "--max-steps", "9"]
    assert str(second.wait_for) == "/home/u/asyncgrpo-runs/slurm-77"  # the first node creates it


def test_on_gpus_each_node_has_a_slot_per_gpu_slurm_gave_it_and_the_user_keeps_their_transport():
    env = job_env("n1", CUDA_VISIBLE_DEVICES="4,5,6,7", SLURM_GPUS_ON_NODE="4")
    first = task(env, "--run-dir", "runs/r1", "--ps-procs", "2", "--weight_transport", "auto")
    assert first.argv[2:8] == ["--run-dir", first.argv[3], "--workers", "2", "--ps-procs", "2"]
    assert first.argv[3].endswith("/runs/r1") and first.argv[3].startswith("/")  # absolute for every node
    assert "safetensors" not in first.argv and first.argv[-2:] == ["--weight_transport", "auto"]
    with pytest.raises(SlurmError, match="--ps-procs 5: the job's first node has 4 GPU"):
        task(env, "--ps-procs", "5")
    assert task({**job_env("n2"), "SLURM_GPUS_ON_NODE": "8"}).argv[5] == "8"  # no CUDA_VISIBLE_DEVICES: the count


def test_a_job_array_of_workers_joins_on_every_node_and_leaves_when_the_run_has_finished():
    env = job_env("n2", nodelist="n2", job="80", tasks_per_node="1")
    assert task(env, "--join", "/shared/r1", "--lease_s", "60").argv == [
        "bash", LAUNCH, "--join", "/shared/r1", "--workers", "1", "--exit-when-finished", "--lease_s", "60"]


def test_worker_names_never_collide_across_nodes_jobs_or_hosts():
    ids = {host_id({HOST_ID_ENV: task(job_env(node, job=job)).env[HOST_ID_ENV]})
           for node in ("n1", "n2") for job in ("77", "78")}
    assert len(ids) == 4 and all(len(i) == 8 for i in ids)  # hashed: safe in file names (dev1.{id})
    assert task(job_env("n1")).env == task(job_env("n1")).env  # a requeued job keeps its names on its node


@pytest.mark.parametrize(("env", "args", "message"), [
    ({}, [], "$SLURM_JOB_ID is not set"),
    (job_env("elsewhere"), [], "this node (elsewhere) is not in the job's node list"),
    (job_env("n1"), ["--workers", "4"], "--workers: under Slurm"),
    (job_env("n1"), ["--device", "cuda"], "--device cuda, but Slurm gave this node no GPU"),
])
def test_what_cannot_make_a_run_is_refused_in_one_line(env, args, message):
    with pytest.raises(SlurmError, match=message.replace("(", r"\(").replace(")", r"\)").replace("$", r"\$")):
        task(env, *args)


@pytest.mark.process
def test_the_module_says_why_in_one_line_and_exits_2_outside_a_job():
    out = subprocess.run([sys.executable, "-m", "asyncgrpo.slurm"], cwd=REPO, capture_output=True, text=True,
                         env={k: v for k, v in PROCESS_ENV.items() if not k.startswith("SLURM")}, timeout=60)
    assert out.returncode == 2
    assert out.stderr.strip() == ("asyncgrpo.slurm: error: $SLURM_JOB_ID is not set: run this through srun inside "
                                  "a Slurm job (sbatch scripts/slurm/asyncgrpo.sbatch ...)")
