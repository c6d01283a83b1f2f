"""LoRA (``--use_peft``): TRL's flags, adapter-only weight sharing, sampling without dropout, the
reference model of ``beta > 0``, a worker on another base refused, and a real PS + worker run
that learns, trains each job once, shares only the adapter and resumes from an adapter checkpoint.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
from pathlib import Path

import pytest
import torch
import yaml
from helpers import (
    PROCESS_ENV,
    PYTHON,
    REPO,
    assert_exactly_once,
    demo_config,
    expect_exit,
    metrics,
    ps_events,
    run_flags,
    start_process,
)
from safetensors.torch import load_file
from trl import GRPOTrainer, ModelConfig, get_peft_config

from asyncgrpo.config import AsyncGRPOConfig, ConfigError
from asyncgrpo.config_parser import parse_config
from asyncgrpo.events import EventLog, read_events
from asyncgrpo.peft_args import PeftArgs
from asyncgrpo.run import RunDir, fileops
from asyncgrpo.tasks.demo import (
    build_dataset,
    build_model,
    build_tokenizer,
    repeat_digit_reward,
    write_demo_model,
)
from asyncgrpo.weights import WeightsMismatch, make_publisher, make_subscriber
from asyncgrpo.weights.adapter import check_model, layout_of, shared_tensors
from asyncgrpo.weights.layout import Layout
from worker.generate import build_trainer, generate_and_score

pytestmark = pytest.mark.filterwarnings("ignore")

# An adapter on every linear layer of the demo's tiny Llama, and its output layer trained whole: its
# tied embeddings are so small (std 0.02, 64 wide) that, frozen, they cap every logit near 1.3 and
# the policy cannot get far from uniform; with the head trainable the demo task is learned.
LORA_FLAGS = ["--use_peft", "--lora_r", "16", "--lora_alpha", "32", "--lora_target_modules", "all-linear",
              "--lora_modules_to_save", "lm_head"]
TIMEOUT_S = 600


def lora_config(tmp_path, **overrides) -> AsyncGRPOConfig:
    return demo_config(tmp_path, **{"use_peft": True, "lora_r": 8, "lora_target_modules": "all-linear",
                                    "lora_modules_to_save": ["lm_head"], **overrides})


def trainers(cfg, worker_base_seed: int = 0):
    """A trainer built as the PS builds its own (GRPOTrainer with the config's peft_config) and a worker's."""
    tok = build_tokenizer()
    ps = GRPOTrainer(model=build_model(seed=0, tokenizer=tok), reward_funcs=[repeat_digit_reward], args=cfg,
                     train_dataset=build_dataset(n=40), processing_class=tok, peft_config=cfg.peft_config())
    worker = build_trainer(cfg, build_model(seed=worker_base_seed, tokenizer=tok), tok, [repeat_digit_reward],
                           build_dataset(n=40))
    return ps, worker


def perturb_adapter(model, seed: int = 1) -> None:
    """Trained-looking adapter values (a fresh LoRA adapter is a no-op: lora_B starts at zero)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for t in shared_tensors(model).values():
            t.copy_(torch.randn(t.shape, generator=gen) * 0.2)


def logps(trainer, model=None) -> torch.Tensor:
    ids = torch.tensor([[4 + i % 10 for i in range(j, j + 9)] for j in range(4)])
    with torch.no_grad():
        out, _, _ = trainer._get_per_token_logps_and_entropies(model or trainer.model, ids, torch.ones_like(ids), 6)
    return out


def aligned_bytes(tensors: dict) -> int:
    return Layout.of(tensors).total_bytes


# ---------------------------------------------------------------------- flags


def test_peft_flags_mean_what_they_mean_in_trl_on_the_command_line_and_in_yaml(tmp_path):
    values = {"lora_r": 8, "lora_alpha": 16, "lora_dropout": 0.1, "lora_target_modules": ["q_proj", "v_proj"],
              "lora_modules_to_save": ["lm_head"], "use_rslora": True, "lora_task_type": "CAUSAL_LM"}
    trl_config = get_peft_config(ModelConfig(use_peft=True, **values)).to_dict()
    flags = ["--use_peft", "--lora_r", "8", "--lora_alpha", "16", "--lora_dropout", "0.1", "--lora_target_modules",
             "q_proj", "v_proj", "--lora_modules_to_save", "lm_head", "--use_rslora", "--lora_task_type", "CAUSAL_LM"]
    assert parse_config(flags).peft_config().to_dict() == trl_config
    config_file = tmp_path / "run.yaml"
    config_file.write_text(yaml.safe_dump({"use_peft": True, **values}))
    assert parse_config(["--config", str(config_file)]).peft_config().to_dict() == trl_config
    # One target is a string, as in TRL: 'all-linear' is PEFT's shorthand only as a string.
    assert parse_config(["--use_peft", "--lora_target_modules", "all-linear"]).peft_config().target_modules == \
        "all-linear"
    assert parse_config([]).peft_config() is None


@pytest.mark.parametrize("flags, says", [
    (["--use_peft", "--load_in_4bit"], "--load_in_4bit: bitsandbytes quantization needs a CUDA GPU"),
    (["--load_in_8bit"], "--load_in_8bit: a quantized base model can only train an adapter; add --use_peft"),
    (["--use_peft", "--lora_target_modules", "q_proj", "lm_head"], "--lora_target_modules lm_head:"),
    (["--use_peft", "--lora_r", "0"], "--lora_r 0: must be >= 1"),
])
def test_bad_peft_flags_are_one_line(flags, says):
    with pytest.raises(ConfigError, match="^" + says.replace("(", r"\(")):
        parse_config(["--device_type", "cpu", *flags])


def test_qlora_on_cpu_stops_the_launch_with_one_line_and_status_2(tmp_path):
    proc = subprocess.run([PYTHON, "-m", "ps", "--check_only", "--run_dir", str(tmp_path / "run"),
                           "--device_type", "cpu", "--use_peft", "--load_in_4bit"],
                          cwd=REPO, env=PROCESS_ENV, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip() and "Warning" not in line
             and not line.startswith("  warnings.warn")]
    assert lines == ["ps: error: --load_in_4bit: bitsandbytes quantization needs a CUDA GPU, and this run is on cpu"]
    assert not (tmp_path / "run" / "queue").exists()


def test_lora_target_modules_the_model_lacks_stop_the_ps_with_one_line_and_status_2(tmp_path):
    """peft finds no module of the given names when TRL wraps the model: bad input naming the model's linear layers,
    not a crash (status 1, a traceback's last line) that a relaunch would repeat."""
    proc = subprocess.run([PYTHON, "-m", "ps", "--run_dir", str(tmp_path / "run"), "--device_type", "cpu",
                           "--max_steps", "1", "--use_peft", "--lora_target_modules", "q_prj"],
                          cwd=REPO, env=PROCESS_ENV, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines()[-1] == (
        "ps: error: --lora_target_modules q_prj: no module of the model has that name (its linear layers: down_proj, "
        "gate_proj, k_proj, lm_head, o_proj, q_proj, up_proj, v_proj; or all-linear)")


@pytest.mark.skipif(__import__("importlib").util.find_spec("bitsandbytes") is not None,
                    reason="bitsandbytes is installed here")
def test_qlora_on_a_gpu_without_bitsandbytes_names_the_package():
    problem = PeftArgs(use_peft=True, load_in_4bit=True).peft_args_problem("cuda")
    assert problem == "--load_in_4bit needs the bitsandbytes package, which is not installed (pip install bitsandbytes)"


def test_qlora_training_saved_modules_without_mixed_precision_is_refused():
    """TRL trains a quantized base's --lora_modules_to_save in bfloat16: without autocast every generation
    fails on a dtype mismatch (seen with bitsandbytes on CPU, and TRL's own generation fails the same way)."""
    qlora = PeftArgs(use_peft=True, load_in_4bit=True, lora_modules_to_save=["lm_head"])
    assert "needs --bf16 or --fp16" in qlora.peft_args_problem("cuda", mixed_precision=False)
    assert "needs --bf16 or --fp16" not in (qlora.peft_args_problem("cuda", mixed_precision=True) or "")
    with pytest.raises(ConfigError, match="^--load_in_4bit with --lora_modules_to_save needs --bf16 or --fp16"):
        parse_config(["--device_type", "cuda", "--use_peft", "--load_in_4bit", "--lora_modules_to_save", "lm_head",
                      "--bf16", "False"])


def test_a_worker_generates_under_the_trainers_mixed_precision(tmp_path):
    """TRL casts a quantized base's adapter (and --lora_modules_to_save) to bfloat16 while the base computes
    in float32; the PS trains under bf16 autocast, and a worker must generate under it too (on a GPU every
    QLoRA generation failed: 'expected mat1 and mat2 to have the same dtype'). The same on CPU: bf16
    autocast, the adapter and head cast as TRL casts them."""
    cfg = lora_config(tmp_path)
    cfg.bf16, cfg.mixed_precision = True, "bf16"  # as parsed on a GPU (off for CPU runs; CPU autocast has bf16 too)
    _, worker = trainers(cfg)
    for param in worker.model.parameters():
        if param.requires_grad:
            param.data = param.data.to(torch.bfloat16)
    dataset = build_dataset(n=40)
    rows = [dataset[i // cfg.num_generations] for i in range(cfg.generation_batch_size)]
    batch, _ = generate_and_score(worker, rows, EventLog.off(), seed=0)
    assert batch["completion_ids"].shape[0] == cfg.generation_batch_size


def test_a_lora_worker_captures_behaviour_log_probs_without_a_second_forward_pass(tmp_path):
    # Generation runs inside the PEFT wrapper's transformers model: the capture watches that model's forwards.
    _, worker = trainers(lora_config(tmp_path))
    perturb_adapter(worker.model)
    forward_passes = []
    recompute = worker._get_per_token_logps_and_entropies
    worker._get_per_token_logps_and_entropies = lambda *a, **k: forward_passes.append(1) or recompute(*a, **k)
    dataset = build_dataset(n=40)
    rows = [dataset[i // worker.num_generations] for i in range(worker.args.generation_batch_size)]
    batch, _ = generate_and_score(worker, rows, EventLog.off(), seed=0)
    assert forward_passes == []
    del worker._get_per_token_logps_and_entropies
    ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1)
    mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1)
    with torch.no_grad():
        trl, _, _ = worker._get_per_token_logps_and_entropies(worker.model, ids, mask, batch["completion_ids"].size(1))
    assert ((batch["old_per_token_logps"] - trl).abs() * batch["completion_mask"]).max() < 1e-4


def test_qlora_loads_the_base_as_trl_quantizes_it_onto_this_process_s_gpu(monkeypatch):
    cfg = parse_config(["--use_peft", "--device_type", "cpu", "--dtype", "bfloat16"])
    assert cfg.quantization_kwargs() == {}
    cfg.load_in_4bit = True  # (refused on CPU when parsed; the kwargs are what a GPU process loads with)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    kwargs = cfg.quantization_kwargs()
    assert kwargs["device_map"] == {"": 3}
    quantization = kwargs["quantization_config"]
    assert quantization.load_in_4bit and quantization.bnb_4bit_quant_type == "nf4"
    assert quantization.bnb_4bit_compute_dtype == torch.bfloat16  # TRL computes in --dtype
    cfg.dtype = "auto"
    assert cfg.quantization_kwargs()["quantization_config"].bnb_4bit_compute_dtype == torch.float32


# ---------------------------------------------------------------------- sharing the adapter


@pytest.mark.parametrize("transport", ["mmap", "safetensors", "cuda_ipc"])
def test_an_adapter_only_sync_gives_the_worker_the_ps_log_probs(tmp_path, transport):
    if transport == "cuda_ipc" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    device = "cuda" if transport == "cuda_ipc" else "cpu"
    overrides = {} if device == "cpu" else {"use_cpu": False, "device_type": "cuda", "bf16": False}
    ps, worker = trainers(lora_config(tmp_path, lora_dropout=0.3, **overrides))
    perturb_adapter(ps.model)
    adapter = shared_tensors(ps.model)
    assert all(".lora_" in name or ".modules_to_save." in name for name in adapter), list(adapter)
    assert [n for n in adapter] == [n for n in shared_tensors(worker.model)]
    run = RunDir.create(tmp_path / "run")
    publisher, subscriber = make_publisher(run, ps.model, transport), make_subscriber(run)
    addresses = [t.data_ptr() for t in shared_tensors(worker.model).values()]
    try:
        assert publisher.publish(1, 1)
        assert subscriber.sync(worker.model) == 1
        # Into the adapter's own storage: compiled decoding's graphs (CUDA graphs) hold these addresses.
        assert [t.data_ptr() for t in shared_tensors(worker.model).values()] == addresses
        # Only the adapter went through the transport: its bytes, not the model's.
        assert publisher.layout.total_bytes == aligned_bytes(adapter)
        # (safetensors: the file it read, the adapter's tensors packed, with their header)
        assert subscriber.synced_bytes == (publisher.published_bytes if transport == "safetensors"
                                           else aligned_bytes(adapter)) < aligned_bytes(ps.model.state_dict()) / 2
        assert aligned_bytes(adapter) < aligned_bytes(ps.model.state_dict()) / 2
        if transport == "mmap":
            assert all(os.path.getsize(p) == aligned_bytes(adapter) for p in publisher.paths)
        # The worker samples in TRL's train mode (its metric names), with LoRA dropout 0.3 and yet no dropout:
        # its log-probs are the policy's, which the PS's are in eval mode, exactly.
        assert worker.model.training
        ps.model.eval()
        assert torch.equal(logps(worker), logps(ps))
        assert torch.equal(logps(worker), logps(worker))
    finally:
        publisher.close()
        subscriber.close()


def test_the_reference_of_beta_is_the_base_with_the_adapter_disabled_on_the_worker(tmp_path):
    cfg = lora_config(tmp_path, beta=0.04, lora_modules_to_save=None)
    worker = trainers(cfg)[1]
    assert worker.ref_model is None  # no second copy of the model
    perturb_adapter(worker.model)
    rows = [worker.train_dataset[i // worker.num_generations] for i in range(worker.args.generation_batch_size)]
    batch, _ = generate_and_score(worker, rows, EventLog.off(), seed=0)
    base = build_model(seed=0)
    ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1)
    mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1)
    with torch.no_grad():
        logits = base(input_ids=ids, attention_mask=mask).logits[:, -batch["completion_ids"].size(1) - 1:-1]
    base_logps = torch.log_softmax(logits / cfg.temperature, dim=-1).gather(-1, batch["completion_ids"][..., None])
    completion = batch["completion_mask"].bool()
    reference = batch["ref_per_token_logps"]
    assert torch.allclose(reference[completion], base_logps[..., 0][completion], atol=1e-5)
    # ... and not the policy's: the adapter changes the log-probs.
    assert (reference - batch["old_per_token_logps"])[completion].abs().max() > 0.1


def test_a_worker_model_that_cannot_take_the_adapter_is_refused(tmp_path):
    ps, same = trainers(lora_config(tmp_path))
    layout = layout_of(ps.model)
    check_model(layout, same.model)  # same base, same adapter modules
    _, other_base = trainers(lora_config(tmp_path), worker_base_seed=1)
    with pytest.raises(WeightsMismatch, match="this worker's base model is not the parameter server's"):
        check_model(layout, other_base.model)
    with pytest.raises(WeightsMismatch, match="publishes a LoRA adapter and this worker's model has none"):
        check_model(layout, build_model(seed=0))
    with pytest.raises(WeightsMismatch, match="publishes a whole model and this worker's model has a LoRA adapter"):
        check_model(layout_of(build_model(seed=0)), same.model)
    # One value of one frozen tensor changed (at a sampled position) is another base.
    with torch.no_grad():
        same.model.get_base_model().model.layers[1].mlp.up_proj.base_layer.weight[0, 0] += 1.0
    with pytest.raises(WeightsMismatch):
        check_model(layout, same.model)


def test_a_worker_process_on_another_base_exits_2_with_one_line(tmp_path):
    """A real worker started on another base model than its PS's: it refuses before its first job."""
    ps_base, worker_base = tmp_path / "ps_base", tmp_path / "worker_base"
    write_demo_model(ps_base, seed=0)
    write_demo_model(worker_base, seed=1)  # same architecture, same names and shapes: other weights
    flags = [*LORA_FLAGS, "--device_type", "cpu", "--report_to", "none", "--gradient_checkpointing", "false"]
    cfg = parse_config([*flags, "--model_name_or_path", str(ps_base), "--output_dir", str(tmp_path / "out")])
    run = RunDir.create(tmp_path / "run")
    from asyncgrpo.inputs import load_model_and_tokenizer

    model, tok = load_model_and_tokenizer(str(ps_base))
    ps = GRPOTrainer(model=model, reward_funcs=[repeat_digit_reward], args=cfg, train_dataset=build_dataset(n=40),
                     processing_class=tok, peft_config=cfg.peft_config())
    publisher = make_publisher(run, ps.model, "mmap")
    try:
        publisher.publish(1, 1)
        fileops.write_json(run.root / "ps.json", {"pid": os.getpid(), "state": "training"})
        proc = subprocess.run([PYTHON, "-m", "worker", "--device", "1", "--run_dir", str(run.root), *flags,
                               "--model_name_or_path", str(worker_base)],
                              cwd=REPO, env=PROCESS_ENV, capture_output=True, text=True, timeout=TIMEOUT_S)
    finally:
        publisher.close()
    assert proc.returncode == 2, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("worker: error:")]
    assert len(errors) == 1 and "this worker's base model is not the parameter server's" in errors[0], proc.stderr
    assert "Traceback" not in proc.stderr


# ---------------------------------------------------------------------- a real run


# The learning rate decays as in the demo: at a constant 3e-3 the reward rose, then sometimes fell back to where it
# started by step 80 (2 runs of 4, seen with two jobs per generate call).
RUN_FLAGS = [*LORA_FLAGS, "--learning_rate", "3e-3", "--lr_scheduler_type", "linear", *run_flags(save_steps=40)]
STEPS = 80


def run_ps_and_worker(run_root: Path, *flags: str) -> None:
    logs = run_root.parent
    ps = start_process(run_root, logs / "ps.log", "ps", *flags)
    worker = start_process(run_root, logs / "w1.log", "worker", "--device", "1", *flags)
    try:
        expect_exit(ps, 0, logs / "ps.log", TIMEOUT_S)
    finally:
        worker.send_signal(signal.SIGTERM)
        expect_exit(worker, 0, logs / "w1.log", 120)


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory) -> Path:
    """A finished 80-step LoRA run of the demo task: a PS and one worker, real processes."""
    root = tmp_path_factory.mktemp("lora80") / "run"
    run_ps_and_worker(root, "--max_steps", str(STEPS), *RUN_FLAGS)
    return root


def adapter_layout_of_the_run(run_root: Path) -> tuple[Layout, int]:
    """The adapter layout a model built from the run's base with the run's flags has, and the whole model's
    bytes (built here, apart from the processes)."""
    from peft import get_peft_model

    from asyncgrpo.inputs import load_model_and_tokenizer

    cfg = demo_config(run_root.parent, *RUN_FLAGS)
    base, _ = load_model_and_tokenizer(str(run_root / "demo_model"))
    full_bytes = aligned_bytes(base.state_dict())
    return layout_of(get_peft_model(base, cfg.peft_config())), full_bytes


def test_a_lora_run_learns_trains_each_job_once_and_shares_only_the_adapter(lora_run):
    rewards = [m["reward"] for m in metrics(lora_run)]
    assert len(rewards) == STEPS
    first, last = sum(rewards[:10]) / 10, sum(rewards[-20:]) / 20
    assert last >= first + 0.08, f"reward did not rise: first 10 steps {first:.3f}, last 20 {last:.3f}"
    assert_exactly_once(lora_run, jobs=STEPS)
    # What went through the transport: the adapter's bytes (lora_A/B and the head), on both sides.
    layout, full_bytes = adapter_layout_of_the_run(lora_run)
    assert layout.base is not None and layout.total_bytes < full_bytes
    published = {r["bytes"] for r in ps_events(lora_run, "weights_published")}
    synced = {r["bytes"] for r in read_events(lora_run, process="worker-dev1", event="weights_synced")}
    assert published == synced == {layout.total_bytes}, (published, synced, layout.total_bytes, full_bytes)
    # Checkpoints and the final save hold the adapter, not the model.
    for folder in (lora_run / "checkpoints" / "checkpoint-80", lora_run / "final_model"):
        names = set(os.listdir(folder))
        assert {"adapter_model.safetensors", "adapter_config.json", "tokenizer.json"} <= names, names
        assert not names & {"model.safetensors", "pytorch_model.bin"}, names


def test_a_lora_run_says_at_its_start_that_an_adapter_trains_and_at_its_end_that_it_saved_the_adapter(lora_run):
    lines = (lora_run.parent / "ps.log").read_text().splitlines()
    [start] = [line for line in lines if "[train] run " in line]
    assert start.endswith(", a LoRA adapter (r=16, alpha=32) trained on the frozen model"), start
    [end] = [line for line in lines if "[train] final" in line]
    assert end.endswith(f"[train] final LoRA adapter saved to {lora_run / 'final_model'} (the adapter only: load it "
                        f"onto {lora_run / 'demo_model'} with peft's PeftModel.from_pretrained)"), end


def test_the_saved_adapter_merges_into_its_base(lora_run):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(lora_run / "demo_model")
    trained = PeftModel.from_pretrained(base, lora_run / "final_model").eval()
    ids = torch.tensor([[4, 14, 4, 4, 4]])
    with torch.no_grad():
        unmerged = trained(input_ids=ids).logits
        merged = trained.merge_and_unload()(input_ids=ids).logits
    assert torch.allclose(merged, unmerged, atol=1e-5)
    assert not torch.allclose(merged, AutoModelForCausalLM.from_pretrained(lora_run / "demo_model")(
        input_ids=ids).logits, atol=1e-3)  # the adapter did change the model


def test_a_lora_run_resumes_from_its_adapter_checkpoint(lora_run, tmp_path):
    """Relaunched for one more step, the PS loads checkpoint-80's adapter and publishes exactly it first
    (kept on disk by the safetensors transport), then trains step 81; still every job once."""
    root = tmp_path / "run"
    shutil.copytree(lora_run, root, symlinks=True)
    run_ps_and_worker(root, "--max_steps", str(STEPS + 1), "--weight_transport", "safetensors", *RUN_FLAGS)
    # Only step 81 was trained again (a PS that started over would retrain steps 1-80 as well).
    assert [r["step"] for r in ps_events(root, "train_step_end")] == list(range(1, STEPS + 2))
    saved = load_file(lora_run / "checkpoints" / "checkpoint-80" / "adapter_model.safetensors")
    published = load_file(root / "weights" / "snapshots" / f"v{STEPS:08d}.safetensors")

    def saved_name(name):  # a parameter's name in PEFT's adapter file
        return name.replace("modules_to_save.default.", "").replace(".default.", ".")

    assert sorted(saved_name(n) for n in published) == sorted(saved)
    assert all(torch.equal(t, saved[saved_name(n)]) for n, t in published.items())
    assert [m["step"] for m in metrics(root)] == list(range(1, STEPS + 2))
    assert_exactly_once(root, jobs=STEPS + 1)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("quantized", [False, True], ids=["lora", "qlora_4bit"])
def test_a_lora_run_on_the_gpu_shares_only_the_adapter_through_cuda_ipc(tmp_path, quantized):
    if quantized and __import__("importlib").util.find_spec("bitsandbytes") is None:
        pytest.skip("bitsandbytes is not installed")
    root = tmp_path / "run"
    flags = ["--max_steps", "6", *RUN_FLAGS, "--save_steps", "3", "--device_type", "cuda",
             *(["--load_in_4bit"] if quantized else [])]
    env = {**PROCESS_ENV, "CUDA_VISIBLE_DEVICES": "0"}  # launch.sh's placement of the PS and worker 1 on one GPU
    ps = start_process(root, tmp_path / "ps.log", "ps", *flags, env=env)
    worker = start_process(root, tmp_path / "w1.log", "worker", "--device", "1", *flags, env=env)
    try:
        expect_exit(ps, 0, tmp_path / "ps.log", TIMEOUT_S)
    finally:
        worker.send_signal(signal.SIGTERM)
        expect_exit(worker, 0, tmp_path / "w1.log", 120)
    assert_exactly_once(root, jobs=6)
    version = json.loads((root / "weights" / "published_version.json").read_text())
    assert version["transport"] == "cuda_ipc"
    layout = json.loads((root / "weights" / version["layout_file"]).read_text())
    assert layout["base"] is not None
    assert all(".lora_" in t["name"] or ".modules_to_save." in t["name"] for t in layout["tensors"]), layout
    published = {r["bytes"] for r in ps_events(root, "weights_published")}
    assert published == {layout["total_bytes"]}
    names = set(os.listdir(root / "final_model"))
    assert "adapter_model.safetensors" in names and "model.safetensors" not in names, names
