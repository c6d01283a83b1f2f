"""Bad input is refused before anything starts (one line on stderr, exit status 2, no library noise,
no run directory), and the three commands print their options with --help.

Every check is asyncgrpo/checks.py check_inputs, which launch.sh runs as ``python -m ps --check_only``:
each case is checked in process, and a few through launch.sh from a user's folder."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import PROCESS_ENV, PYTHON, REPO, launch_sh, write_user_folder

from asyncgrpo.checks import check_inputs
from asyncgrpo.config import ConfigError
from asyncgrpo.config_parser import parse_config

STRICT_REWARDS = """
import functools

def needs_solution(completions, solution, **kwargs):
    return [1.0]

def no_kwargs(prompts, completions):
    return [1.0]

def positional(prompts, completions, /, **kwargs):
    return [1.0]

def star_args(*args):
    return [1.0]

def needs_environments(completions, environments, **kwargs):
    return [1.0]

def needs_rollout_field(completions, env_reward, **kwargs):  # (a --rollout_func's output field)
    return env_reward

def passing_what_it_names(function):  # a decorator whose wrapper takes everything TRL passes
    @functools.wraps(function)
    def wrapper(**kwargs):
        return function(**{k: kwargs[k] for k in ("completions",)})
    return wrapper

@passing_what_it_names
def decorated(completions):
    return [1.0]

def rollout(prompts, trainer):
    return {}
"""


@pytest.fixture
def user_folder(tmp_path, monkeypatch):
    """A user's folder (tests/helpers/configs.py write_user_folder) plus broken variants of its model and dataset,
    as the current folder."""
    folder = write_user_folder(tmp_path / "user")
    (folder / "noprompt.jsonl").write_text(json.dumps({"question": "1:"}) + "\n")
    (folder / "empty.jsonl").write_text("")
    rows = [json.dumps({"prompt": f"{d}:"}) for d in range(4)]
    (folder / "nullprompt.jsonl").write_text("\n".join([*rows, json.dumps({"other": 1})]) + "\n")
    (folder / "emptyprompt.jsonl").write_text("\n".join([*rows, json.dumps({"prompt": ""})]) + "\n")
    talk = [json.dumps({"prompt": [{"role": "user", "content": f"{d}:"}]}) for d in range(5)]
    (folder / "mixed.jsonl").write_text("\n".join([*talk, json.dumps({"prompt": "5:"})]) + "\n")
    # Past the 320 KB blocks pyarrow reads a file in (it counts rows within a block).
    (folder / "garbled.jsonl").write_text("\n".join([*rows * 5000, '{"prompt": "4:", }']) + "\n")
    (folder / "cut.jsonl").write_text("\n".join([*rows, '{"prompt": "4:"']) + "\n")  # its closing brace lost
    (folder / "long.jsonl").write_text(json.dumps({"prompt": " ".join(["1"] * 30) + ":"}) + "\n")  # 60 tokens
    (folder / "typo.yaml").write_text("learning_rate: 1.0e-3\nmax_step: 5\nenv:\n  HF_HUB_OFFLINE: '1'\n")
    (folder / "typos.yaml").write_text("temprature: 0.7\nmax_step: 5\n")
    (folder / "badvalue.yaml").write_text("learning_rate: fast\n")
    (folder / "strict.py").write_text(STRICT_REWARDS)
    (folder / "agent.py").write_text("LIMIT = 3\n\nclass Env:\n    def reset(self, **row):\n        pass\n")
    for name, fix in {"corrupt": lambda m: (m / "config.json").write_text("{not json"),
                      "unknown_type": lambda m: (m / "config.json").write_text('{"model_type": "no-such-model"}'),
                      "no_weights": lambda m: (m / "model.safetensors").unlink(),
                      "bad_tokenizer": lambda m: (m / "tokenizer.json").write_text("{not json")}.items():
        shutil.copytree(folder / "mymodel", folder / name)
        fix(folder / name)
    monkeypatch.chdir(folder)
    return folder


USER_FLAGS = ["--model_name_or_path", "mymodel", "--dataset_name", "data", "--reward_funcs", "rewards:ones"]
BAD_INPUTS = [  # (flags on top of USER_FLAGS, the start of the one line)
    (["--dataset_name", "noprompt.jsonl"], "--dataset_name noprompt.jsonl: no 'prompt' column"),
    (["--dataset_name", "empty.jsonl"], "--dataset_name empty.jsonl: the dataset is empty (no rows)"),
    (["--dataset_name", "nullprompt.jsonl"], "--dataset_name nullprompt.jsonl: row 5 (counting from 1): its prompt is "
     "None, not a text or a conversation"),
    (["--dataset_name", "emptyprompt.jsonl"], "--dataset_name emptyprompt.jsonl: row 5 (counting from 1): its "
     "prompt '' has no token in mymodel's tokenizer: nothing to generate from"),
    (["--dataset_name", "mixed.jsonl"], "--dataset_name mixed.jsonl: row 6 (counting from 1): its prompt is a text, "
     "and row 1's a conversation: TRL takes a dataset's prompts all as texts, or all as conversations"),
    (["--reward_funcs", "strict:needs_solution"], "--reward_funcs: needs_solution needs 'solution', which TRL passes "
     "only as a column of the dataset, and --dataset_name data has none of that name (its columns: prompt)"),
    (["--reward_funcs", "strict:no_kwargs"], "--reward_funcs: no_kwargs takes no **kwargs, and TRL passes every reward "
     "function completion_ids, log_extra, log_metric, trainer_state as well: add **kwargs to its parameters"),
    (["--reward_funcs", "strict:positional"], "--reward_funcs: positional takes prompts, completions by position "
     "only, and TRL passes every argument by keyword: drop the '/' from its parameters"),
    (["--reward_funcs", "strict:star_args"], "--reward_funcs: star_args takes no **kwargs"),
    (["--reward_funcs", "strict:needs_environments"], "--reward_funcs: needs_environments needs 'environments', which "
     "TRL passes only as a column of the dataset, and --dataset_name data has none of that name (its columns: prompt); "
     "TRL passes environments only with --environment_factory"),
    (["--dataset_name", "garbled.jsonl"], "--dataset_name garbled.jsonl: cannot load: line 20001 is not JSON "
     "(Expecting property name enclosed in double quotes, at column 18)"),
    (["--dataset_train_split", "nope"], "--dataset_train_split nope: --dataset_name data has no split 'nope'"),
    (["--model_name_or_path", "corrupt"], "--model_name_or_path corrupt: bad config"),
    (["--model_name_or_path", "unknown_type"], "--model_name_or_path unknown_type: bad config"),
    (["--model_name_or_path", "no_weights"], "--model_name_or_path no_weights: no weights"),
    (["--model_name_or_path", "bad_tokenizer"], "--model_name_or_path bad_tokenizer: cannot load its tokenizer"),
    (["--dataset_name", "data/train.jsonl", "--eval_strategy", "steps"],
     "--eval_strategy steps: no evaluation data: --dataset_name data/train.jsonl has no split 'test'"),
    (["--dataset_test_split", "validation", "--eval_strategy", "epoch"],
     "--eval_strategy epoch: no evaluation data: --dataset_name data has no split 'validation'"),
    (["--dtype", "int8"], "argument --dtype: invalid choice: 'int8'"),
    (["--model_init_kwargs", "{dtype: bfloat16}"], "--model_init_kwargs '{dtype: bfloat16}': not valid JSON"),
    (["--reward_funcs", "rewards:nope"], "--reward_funcs 'rewards:nope': rewards has no function nope"),
    (["--reward_funcs", "rewards:one"], "--reward_funcs 'rewards:one': rewards has no function one; did you mean "
     "ones?"),
    (["--reward_funcs", "rewards.py:ones"], "--reward_funcs 'rewards.py:ones': cannot import rewards.py: No module "
     "named 'rewards.py'; 'rewards' is not a package: name the module, not its file: rewards:ones"),
    (["--run_dir", str(REPO / "runs" / "x")], f"--run_dir {REPO / 'runs' / 'x'}: inside the source tree"),
    (["--model_name_or_path", "/nonexistent/model"], "--model_name_or_path /nonexistent/model: no such folder"),
    (["--model_name_or_path", "data/train.jsonl"], "--model_name_or_path data/train.jsonl: a file, not a model's "
     "folder: give the folder that holds its config.json, weights and tokenizer"),
    (["--reward_funcs", "no_such_module:fn"], "--reward_funcs 'no_such_module:fn': cannot import no_such_module"),
    (["--tools", "agent:Env", "no_such_module:fn"], "--tools 'no_such_module:fn': cannot import no_such_module"),
    (["--tools", "agent:lookup"], "--tools 'agent:lookup': agent has no function lookup"),
    (["--tools", "agent:LIMIT"], "--tools 'agent:LIMIT': agent.LIMIT is not callable (a int)"),
    (["--environment_factory", "agent:Sandbox"], "--environment_factory 'agent:Sandbox': agent has no class Sandbox"),
    (["--rollout_func", "agent"], "--rollout_func 'agent': expected 'module:function' or 'module.function'"),
    (["--tool_timeout_s", "-1"], "--tool_timeout_s -1"),
    (["--max_steps", "0"], "--max_steps 0: must be >= 1 (or -1, TRL's default: --num_train_epochs sets the length)"),
    (["--max_steps", "-5"], "--max_steps -5: must be >= 1"),
    (["--use_vllm", "true"], "--use_vllm: asyncgrpo's workers generate with their own decoding engine"),
    (["--resume_from_checkpoint", "runs/old/checkpoints/checkpoint-12"],
     "--resume_from_checkpoint runs/old/checkpoints/checkpoint-12: a run resumes from its own newest checkpoint when "
     "relaunched with the same --run_dir; to start a new run from a checkpoint's weights, give its folder as "
     "--model_name_or_path"),
    (["--sync_ref_model", "true", "--beta", "0.04"], "--sync_ref_model: not with asyncgrpo: the workers compute the "
     "reference log-probs with their own copy of the initial model"),
    (["--warmup_ratio", "0.1"], "--warmup_ratio: not a flag: transformers 5 has no such flag: --warmup_steps takes a "
     "fraction of the run's steps as well (a value below 1, e.g. --warmup_steps 0.1)"),
    (["--use_peft", "--worker_dtype", "bfloat16"], "--worker_dtype bfloat16 with --use_peft: the workers' base model "
     "is the parameter server's, loaded in --dtype; give --dtype instead"),
    (["--worker_decoding", "paged"],
     "--worker_decoding 'paged': must be one of auto, eager, compiled, graph, continuous"),
    (["--decoding_slots", "7"], "--decoding_slots 7: must be 0 (automatic) or at least one job's rows"),
    (["--tools", "rewards:ones"], "--tools rewards:ones: the chat template of mymodel cannot call tools"),
    (["--learning_rat", "1e-5"], "--learning_rat: not a flag; did you mean --learning_rate?"),  # not abbreviated
    (["--num_gen=4"], "--num_gen: not a flag; did you mean --num_generations or --num_generations_eval?"),
    (["--lerning_rate", "1e-5"], "--lerning_rate: not a flag; did you mean --learning_rate?"),
    (["--worker", "2"], "--worker: not a flag; did you mean --worker_decoding or --worker_dtype or launch.sh's "
     "--workers?"),  # (launch.sh's own flags it takes: a typo of one reaches the parameter server's parse)
    (["--no_such_flag", "1"], "--no_such_flag: not a flag (--help lists them)"),
    (["--decoding", "eager"], "--decoding: not a flag; did you mean --decoding_slots or --worker_decoding?"),
    (["--max-prompt-length", "256"], "--max-prompt-length: not a flag: this TRL has no such flag and does not cut "
     "prompts; a prompt that with --max_completion_length would not fit the model's positions is refused before the "
     "run starts (docs/options.md)"),
    (["--config", "typo.yaml"], "--config typo.yaml: max_step: not a config key; did you mean max_steps?"),
    (["--config", "typo.yaml", "--config", "typos.yaml"], "--config: give one YAML file"),
    (["--config=typo.yaml"], "--config typo.yaml: max_step: not a config key; did you mean max_steps?"),
    (["--config", "badvalue.yaml"], "--config badvalue.yaml: learning_rate: invalid float value: 'fast'"),
    (["--config", "typos.yaml"], "--config typos.yaml: temprature: not a config key; did you mean temperature? "
                                 "max_step: not a config key; did you mean max_steps?"),
]
# Without --reward_funcs an environment must score the rollouts itself.
BAD_INPUTS_WITHOUT_REWARDS = [
    (["--environment_factory", "agent:Env"], "--environment_factory agent:Env: no get_reward method, and no "
                                             "--reward_funcs: nothing would score the rollouts"),
]


@pytest.mark.parametrize("flags, message", BAD_INPUTS, ids=[m.split(":")[0] + "|" + f[-1] for f, m in BAD_INPUTS])
def test_each_bad_input_is_named_in_one_line(user_folder, flags, message):
    with pytest.raises(ConfigError) as refused:
        cfg = parse_config(["--device_type", "cpu", "--run_dir", "runs/r", *USER_FLAGS, *flags])
        check_inputs(cfg, cfg.run_dir)
    assert str(refused.value).startswith(message) and "\n" not in str(refused.value)
    assert not (REPO / "runs" / "x").exists()


@pytest.mark.parametrize("flags, message", BAD_INPUTS_WITHOUT_REWARDS)
def test_an_environment_without_a_reward_needs_reward_functions(user_folder, flags, message):
    with pytest.raises(ConfigError) as refused:
        cfg = parse_config(["--device_type", "cpu", "--run_dir", "runs/r", *USER_FLAGS[:4], *flags])
        check_inputs(cfg, cfg.run_dir)
    assert str(refused.value) == message


@pytest.mark.parametrize("task, refused", [("repeat", True), ("lookup", False)])
def test_tools_with_a_built_in_model_whose_template_cannot_call_them_are_refused(user_folder, task, refused):
    cfg = parse_config(["--device_type", "cpu", "--builtin_task", task, "--tools", "rewards:ones"])
    if not refused:  # the tool-calling task's template renders tool calls
        check_inputs(cfg, user_folder / "run")
        return
    with pytest.raises(ConfigError, match="^--tools rewards:ones: the chat template of the built-in 'repeat' task's "
                                          "model cannot call tools"):
        check_inputs(cfg, user_folder / "run")


def test_prompts_and_completions_beyond_the_models_positions_are_refused_or_said(user_folder):
    """Beyond a model's learned positions nothing can be encoded: refused with the numbers. A rotary model (the
    demo's Llama) goes on beyond them, untrained: one note, and the run starts."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from asyncgrpo.tasks.demo import build_tokenizer

    tok = build_tokenizer()
    GPT2LMHeadModel(GPT2Config(n_positions=64, n_embd=32, n_layer=1, n_head=2, vocab_size=len(tok),
                               bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)).save_pretrained("gpt2ish")
    tok.save_pretrained("gpt2ish")
    long_prompts = ["--dataset_name", "long.jsonl", "--max_completion_length", "8"]  # 60 + 8 tokens
    with pytest.raises(ConfigError) as refused:
        cfg = parse_config(["--device_type", "cpu", *USER_FLAGS, *long_prompts, "--model_name_or_path", "gpt2ish"])
        check_inputs(cfg, cfg.run_dir)
    assert str(refused.value) == ("--max_completion_length 8: prompts of up to 60 tokens plus 8 completion tokens "
                                  "exceed the 64 positions of gpt2ish (its max_position_embeddings): shorten the "
                                  "prompts or --max_completion_length")
    cfg = parse_config(["--device_type", "cpu", *USER_FLAGS, *long_prompts])
    assert ("--max_completion_length 8: prompts of up to 60 tokens plus 8 completion tokens exceed the 64 positions "
            "of mymodel (its max_position_embeddings): its rotary positions go on beyond them, untrained"
            ) in check_inputs(cfg, user_folder / "run")
    cfg = parse_config(["--device_type", "cpu", *USER_FLAGS, "--max_completion_length", "8"])
    assert not [n for n in check_inputs(cfg, user_folder / "run") if "positions" in n]
    # The evaluation's prompts too: one too long would end the run at its first evaluation.
    (user_folder / "evallong").mkdir()
    (user_folder / "evallong" / "train.jsonl").write_text(json.dumps({"prompt": "1:"}) + "\n")
    (user_folder / "evallong" / "test.jsonl").write_text((user_folder / "long.jsonl").read_text())
    with pytest.raises(ConfigError) as refused:
        check_inputs(parse_config(["--device_type", "cpu", *USER_FLAGS, "--dataset_name", "evallong",
                                   "--max_completion_length", "8", "--model_name_or_path", "gpt2ish",
                                   "--eval_strategy", "steps"]), user_folder / "run")
    assert str(refused.value) == ("--max_completion_length 8: prompts of up to 60 tokens (--dataset_name evallong, "
                                  "its 'test' split (--dataset_test_split, evaluated)) plus 8 completion tokens exceed "
                                  "the 64 positions of gpt2ish (its max_position_embeddings): shorten the prompts or "
                                  "--max_completion_length")


def test_a_relaunch_on_a_damaged_checkpoint_is_refused_before_any_process_starts(user_folder):
    """launch.sh's input check reads the newest checkpoint's files as the PS would resume from them: a damaged one is
    refused there, before the workers start and the PS loads the model (minutes for a large one)."""
    from asyncgrpo.run.checkpoints import write_ledger

    checkpoint = user_folder / "run" / "checkpoints" / "checkpoint-4"
    checkpoint.mkdir(parents=True)
    (checkpoint / "model.safetensors").write_bytes(b"\x08")  # cut short
    write_ledger(checkpoint, 4, {"consumed": []})
    with pytest.raises(ConfigError) as refused:
        check_inputs(parse_config(["--device_type", "cpu", *USER_FLAGS]), user_folder / "run")
    assert str(refused.value).startswith(f"{checkpoint} is damaged (model.safetensors: SafetensorError: "), \
        refused.value
    assert str(refused.value).endswith("and relaunch to train from the beginning")
    assert checkpoint.is_dir()  # (read only)


def test_a_model_folder_without_its_tokenizer_is_said_so(user_folder):
    """transformers makes some models' tokenizer class from the config alone, empty: every prompt then looked like
    the dataset's fault."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    Qwen2ForCausalLM(Qwen2Config(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                 num_key_value_heads=1, vocab_size=64)).save_pretrained("notokenizer")
    with pytest.raises(ConfigError) as refused:
        check_inputs(parse_config(["--device_type", "cpu", *USER_FLAGS, "--model_name_or_path", "notokenizer"]),
                     user_folder / "run")
    assert str(refused.value) == (
        "--model_name_or_path notokenizer: no tokenizer in that folder (its files, tokenizer.json or the vocabulary, "
        "are not there): save the tokenizer with the model (tokenizer.save_pretrained)")


def test_a_users_data_without_a_model_is_told_which_model_and_defaults_train(user_folder):
    cfg = parse_config(["--device_type", "cpu", *USER_FLAGS[2:]])  # data and reward, no model
    [note] = [n for n in check_inputs(cfg, user_folder / "run") if "--model_name_or_path" in n]
    assert note == ("no --model_name_or_path: training the built-in 'repeat' task's tiny model, with TRL's defaults "
                    "for what you did not set (learning_rate 1e-06, max_steps -1, ...), not the task's own; give "
                    "--model_name_or_path for your model")
    cfg = parse_config(["--device_type", "cpu", *USER_FLAGS])
    assert not [n for n in check_inputs(cfg, user_folder / "run") if "--model_name_or_path" in n]


@pytest.mark.parametrize("flags", [
    ["--reward_funcs", "strict:decorated"],  # (the wrapper TRL calls takes **kwargs; what it wraps does not)
    ["--reward_funcs", "strict:needs_rollout_field", "--rollout_func", "strict:rollout"],
], ids=["decorated", "rollout_field"])
def test_reward_functions_trl_can_call_are_not_refused(user_folder, flags):
    cfg = parse_config(["--device_type", "cpu", *USER_FLAGS, *flags])
    check_inputs(cfg, user_folder / "run")


def test_liger_kernels_that_are_not_installed_are_refused_before_the_run_starts(user_folder, monkeypatch):
    import transformers.utils

    monkeypatch.setattr(transformers.utils, "is_liger_kernel_available", lambda: False)
    cfg = parse_config(["--device_type", "cpu", *USER_FLAGS, "--use_liger_kernel", "true"])
    with pytest.raises(ConfigError, match=r"^--use_liger_kernel: the liger-kernel package is not installed: \S*pip "
                                          r"install liger-kernel \(its kernels run on a GPU\)$"):
        check_inputs(cfg, user_folder / "run")


def test_vllm_flags_that_do_nothing_here_are_said(user_folder):
    cfg = parse_config(["--device_type", "cpu", *USER_FLAGS, "--vllm_mode", "server", "--vllm_server_host", "1.2.3.4"])
    assert ("--vllm_mode, --vllm_server_host: ignored: asyncgrpo's workers generate with their own decoding engine "
            "(--worker_decoding), not vLLM") in check_inputs(cfg, user_folder / "run")
    cfg = parse_config(["--device_type", "cpu", *USER_FLAGS])
    assert not [note for note in check_inputs(cfg, user_folder / "run") if "vllm" in note]


def test_mixed_precision_asked_for_on_cpu_is_said_to_be_off(user_folder):
    cfg = parse_config(["--device_type", "cpu", *USER_FLAGS, "--bf16", "true"])
    assert ("--bf16: mixed precision is off on CPU: the model computes in its --dtype, float32 (--dtype bfloat16 runs "
            "it in bfloat16)") in check_inputs(cfg, user_folder / "run")
    cfg = parse_config(["--device_type", "cpu", *USER_FLAGS])  # (GRPOConfig's default bf16: nothing asked)
    assert not [note for note in check_inputs(cfg, user_folder / "run") if "mixed precision is off" in note]


def test_a_line_that_is_not_json_is_said_once_with_its_column(user_folder, caplog):
    """datasets' JSON builder logged pyarrow's error (twice on the terminal: its own handler and the PS's) before
    the one line; the column was the next line's first."""
    cfg = parse_config(["--device_type", "cpu", *USER_FLAGS, "--dataset_name", "cut.jsonl"])
    with pytest.raises(ConfigError, match=r"^--dataset_name cut.jsonl: cannot load: line 5 is not JSON \(Expecting "
                                          r"',' delimiter, at column 16\)$"):
        check_inputs(cfg, cfg.run_dir)
    assert not [r for r in caplog.records if r.name.startswith("datasets")], caplog.records


def test_a_run_directory_that_cannot_be_written_is_refused(user_folder):
    (user_folder / "a_file").write_text("x")
    cfg = parse_config(["--device_type", "cpu", *USER_FLAGS])
    with pytest.raises(ConfigError, match=f"^--run_dir {user_folder / 'a_file' / 'run'}: not writable: "):
        check_inputs(cfg, user_folder / "a_file" / "run")


def test_evaluation_without_evaluation_data_is_refused_for_the_demo_too(user_folder):
    cfg = parse_config(["--device_type", "cpu", "--eval_strategy", "steps"])
    with pytest.raises(ConfigError, match="^--eval_strategy steps: no evaluation data: the demo task"):
        check_inputs(cfg, user_folder / "run")


@pytest.mark.process
def test_launch_refuses_bad_input_with_one_line_and_starts_nothing(user_folder):
    # Each bad input's line is checked in process above; through launch.sh, one of them stands for all: the same
    # check_inputs runs in `python -m ps --check_only` before any process starts.
    flags, message = BAD_INPUTS[0]
    result = launch_sh(user_folder, "--workers", "1", "--run-dir", "runs/r", *USER_FLAGS, *flags)
    assert result.returncode == 2
    assert len(result.stderr.splitlines()) == 1, f"not one line:\n{result.stderr}"  # no warnings, no usage block
    assert result.stderr.startswith(f"ps: error: {message}"), result.stderr
    assert result.stdout == "" and not (user_folder / "runs").exists()


@pytest.mark.process
def test_the_ps_leaves_its_reason_for_launch_sh_where_its_log_cannot_take_it(tmp_path):
    """On a full disk the PS's log (its stderr) took no "ps: error:" line, and launch.sh showed none: the PS also
    writes it after its status into the file launch.sh names, which is not in the run's folder."""
    status = tmp_path / "status"
    with open("/dev/full", "w") as full:  # every write fails with ENOSPC
        ps = subprocess.run([PYTHON, "-m", "ps", "--run_dir", str(tmp_path / "run"), "--ps_processes", "2"], cwd=REPO,
                            env={**PROCESS_ENV, "ASYNCGRPO_PS_STATUS_FILE": str(status)}, stdout=full, stderr=full,
                            timeout=300)
    assert ps.returncode == 2
    assert status.read_text().splitlines() == [
        "2", "ps: error: --ps_processes 2, but the PS was started as 1 process(es) (start it with torchrun "
             "--nproc_per_node K, or launch.sh --ps-procs K)"]


@pytest.mark.process
def test_launch_refuses_a_run_directory_it_cannot_make_in_one_line(user_folder):
    (user_folder / "a_file").write_text("x")
    result = launch_sh(user_folder, "--workers", "1", "--run-dir", "a_file/run", *USER_FLAGS)
    assert result.returncode == 2
    [line] = result.stderr.splitlines()
    assert line.startswith("launch.sh: error: --run-dir a_file/run: cannot create it: "), line  # (then mkdir's why)
    result = launch_sh(user_folder, "--workers", "1", "--run-dir", "a_file", *USER_FLAGS)
    assert (result.returncode, result.stderr) == (2, "launch.sh: error: --run-dir a_file: not a folder (a file of "
                                                     "that name is there)\n")
    # An unset variable (--run-dir "$RUN"): refused, not a new run in the default folder.
    result = launch_sh(user_folder, "--workers", "1", "--run-dir", "", *USER_FLAGS,
                       env={"ASYNCGRPO_RUNS": str(user_folder / "runs")})
    assert (result.returncode, result.stderr) == (2, "launch.sh: error: --run-dir is empty: give the run's folder, or "
                                                     f"leave the flag out for a new run under {user_folder / 'runs'}\n")
    assert not (user_folder / "runs").exists()


@pytest.mark.parametrize("hub, message", [
    ({"HF_ENDPOINT": "http://127.0.0.1:9"},  # nothing listens there: the hub cannot be reached
     "not a local folder, not in the Hugging Face cache, and the hub cannot be reached (ConnectError"),
    ({"HF_HUB_OFFLINE": "1"}, "not a local folder, and not in the Hugging Face cache (HF_HUB_OFFLINE is set)")])
@pytest.mark.process
def test_a_hub_model_that_cannot_be_had_is_refused_in_one_line_without_retries(user_folder, tmp_path, hub, message):
    """transformers retries an unreachable hub 5 times over half a minute, two warning lines a try."""
    env = {**PROCESS_ENV, "HF_HUB_CACHE": str(tmp_path / "empty_cache"), **hub}
    result = subprocess.run(["bash", str(REPO / "launch.sh"), "--workers", "1", "--run-dir", "runs/r",
                             *USER_FLAGS[2:], "--model_name_or_path", "someorg/somemodel"], cwd=user_folder, env=env,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 2
    assert result.stderr.splitlines() == [line for line in result.stderr.splitlines()
                                          if line.startswith("ps: error: --model_name_or_path someorg/somemodel: ")
                                          and message in line], result.stderr
    assert len(result.stderr.splitlines()) == 1


def run_python(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([PYTHON, *args], cwd=REPO, env=PROCESS_ENV, capture_output=True, text=True,
                          timeout=300)


@pytest.mark.process
@pytest.mark.parametrize("module", ["ps", "worker"])
def test_ps_and_worker_print_their_options(module):
    result = run_python("-m", module, "--help")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(f"usage: python -m {module}")
    for flag in ("--run_dir", "--dtype", "--model_revision", "--dataset_test_split", "--max_staleness",
                 "--learning_rate", "--output_dir"):
        assert flag in result.stdout, flag
    assert ("--check_only" if module == "ps" else "--device N") in result.stdout


@pytest.mark.process
def test_launch_help_prints_only_its_help(tmp_path):
    result = launch_sh(tmp_path, "--workers", "2", "--help", "--dataset_name", "x.jsonl", timeout=30)
    assert result.returncode == 0 and result.stderr == ""
    lines = result.stdout.splitlines()
    assert lines[0].startswith("usage: bash launch.sh") and "--run-dir DIR" in result.stdout
    assert not any(line.startswith(("#", "set ", "Placement")) for line in lines), result.stdout
    assert list(tmp_path.iterdir()) == []  # nothing created, nothing started


@pytest.mark.process
def test_join_help_is_whole_and_join_without_a_run_says_what_is_missing(tmp_path):
    result = launch_sh(tmp_path, "--join", str(tmp_path), "--help", timeout=30)
    assert result.returncode == 0 and result.stderr == ""
    assert result.stdout.startswith("Start and supervise workers only")
    assert result.stdout.rstrip().endswith("it stops as soon as RUN/ps.json says finished."), result.stdout  # whole
    assert launch_sh(tmp_path, "--join", "--help", timeout=30).stdout == result.stdout  # (not a run named --help)
    alone = subprocess.run(["bash", str(REPO / "scripts" / "join.sh")], cwd=tmp_path, capture_output=True,
                           text=True, timeout=30)
    assert alone.returncode == 2
    assert alone.stderr == "launch.sh: error: no run directory: bash launch.sh --join RUN [--workers N] [flags...] " \
                           "(--help says more)\n"


def test_a_report_to_integration_that_is_not_installed_is_refused_with_how_to_install(monkeypatch):
    import transformers.integrations

    from asyncgrpo.checks import check_report_to

    cfg = parse_config(["--device_type", "cpu", "--report_to", "tensorboard"])
    monkeypatch.setattr(transformers.integrations, "get_available_reporting_integrations", lambda: [])
    with pytest.raises(ConfigError) as refused:
        check_report_to(cfg)
    pip = Path(sys.executable).with_name("pip")  # the environment's own pip (launch.sh's: .venv/bin/pip)
    assert pip.exists()
    assert str(refused.value) == f"--report_to tensorboard: tensorboard is not installed: {pip} install tensorboard"
    monkeypatch.setattr(transformers.integrations, "get_available_reporting_integrations", lambda: ["tensorboard"])
    check_report_to(cfg)
    with pytest.raises(ConfigError, match="--report_to nosuch: not an integration transformers knows"):
        check_report_to(parse_config(["--device_type", "cpu", "--report_to", "nosuch"]))


def test_tensorboard_logs_go_under_output_dir_as_with_trl(monkeypatch, tmp_path):
    from ps.__main__ import set_tensorboard_dir

    monkeypatch.delenv("TENSORBOARD_LOGGING_DIR", raising=False)
    set_tensorboard_dir(str(tmp_path / "out"))
    logs = os.environ["TENSORBOARD_LOGGING_DIR"]
    assert logs.startswith(str(tmp_path / "out" / "runs") + os.sep)
    monkeypatch.setenv("TENSORBOARD_LOGGING_DIR", "/elsewhere")  # the user's choice wins
    set_tensorboard_dir(str(tmp_path / "out"))
    assert os.environ["TENSORBOARD_LOGGING_DIR"] == "/elsewhere"


def test_the_users_folder_is_on_the_path_only_while_reward_modules_import(tmp_path, monkeypatch):
    from asyncgrpo.inputs import load_reward_funcs

    (tmp_path / "my_rewards.py").write_text("import my_helper\n\ndef score(prompts, completions, **kwargs):\n"
                                            "    return [my_helper.ONE] * len(prompts)\n")
    (tmp_path / "my_helper.py").write_text("ONE = 1.0\n")  # imported by the reward module: found
    (tmp_path / "shadow_of_a_library.py").write_text("raise ImportError('a user file shadowed a module')\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    [score] = load_reward_funcs(parse_config(["--device_type", "cpu", "--reward_funcs", "my_rewards:score"]))
    assert score(["1:"], ["1"]) == [1.0]
    assert str(tmp_path) not in sys.path  # later imports do not look in the user's folder
    import importlib.util
    assert importlib.util.find_spec("shadow_of_a_library") is None


def test_a_flag_that_is_not_one_is_refused_before_the_heavy_imports_with_the_full_parse_s_line(tmp_path, monkeypatch):
    """The full parse records the flags it knows (asyncgrpo/flag_check.py); the quick check refuses with its line,
    and says nothing when the record is not this environment's (another TRL, another config source)."""
    from asyncgrpo import flag_check

    monkeypatch.setattr(flag_check, "RECORD", tmp_path / "flags.json")
    assert flag_check.check(["--learning_rat", "1"]) is None  # no record yet: the full parse decides
    with pytest.raises(ConfigError) as refused:
        parse_config(["--device_type", "cpu", "--learning_rat", "1"])
    assert flag_check.check(["--device_type", "cpu", "--learning_rat", "1"]) == str(refused.value)
    assert str(refused.value) == "--learning_rat: not a flag; did you mean --learning_rate?"
    assert flag_check.check(["--learning_rate", "1e-5", "--max_steps=3", "--config", "x.yaml"]) is None
    record = json.loads((tmp_path / "flags.json").read_text())
    (tmp_path / "flags.json").write_text(json.dumps({**record, "key": "another trl"}))
    assert flag_check.check(["--learning_rat", "1"]) is None


@pytest.mark.process
def test_launch_refuses_a_flag_that_is_not_one_before_it_looks_for_a_gpu(user_folder):
    """With the flags recorded (any earlier parse in this environment), launch.sh refuses a bad flag before its
    first heavy import: here before it finds that --device cuda has no GPU (which it says otherwise)."""
    parse_config(["--device_type", "cpu"])  # records this environment's flags
    result = launch_sh(user_folder, "--workers", "1", "--device", "cuda", "--run-dir", "runs/r", "--nosuch_flag", "1")
    assert result.returncode == 2
    assert result.stderr.strip() == "ps: error: --nosuch_flag: not a flag (--help lists them)"
    assert not (user_folder / "runs").exists()


def lookup_tool(key: int) -> str:
    """Look up the secret digit stored under a key.

    Args:
        key: The key to look up, a digit.

    Returns:
        The secret digit, or "no such key".
    """
    return str(key)


CONVERSATION = [{"role": "user", "content": "key 7? " + " ".join("3" * 40)}]


@pytest.mark.parametrize("returns", ["BatchEncoding", "dict"])
@pytest.mark.parametrize("prompt, tools", [("key 7? " + " ".join("3" * 40), []), (CONVERSATION, []),
                                           (CONVERSATION, [lookup_tool])], ids=["plain", "conversational", "tools"])
def test_a_prompt_is_measured_as_the_workers_tokenise_it(tmp_path, monkeypatch, prompt, tools, returns):
    """What TRL's _tokenize_prompts gives a worker's model, whatever mapping the tokenizer returns (transformers 5's
    apply_chat_template returns a BatchEncoding, which is no dict: a conversation once counted as its 2 keys)."""
    from helpers import demo_config

    from asyncgrpo.checks import prompt_tokens
    from asyncgrpo.tasks import lookup
    from asyncgrpo.user_code import RolloutHooks
    from worker.generate import build_trainer

    tok = lookup.build_tokenizer()
    # (its template leaves tools out: here they are rendered first, as real templates do)
    tok.chat_template = "{% for tool in tools or [] %}{{ tool.function.description }}{% endfor %}" + tok.chat_template
    cfg = demo_config(tmp_path, max_completion_length=8)
    trainer = build_trainer(cfg, lookup.build_model(tokenizer=tok), tok, [lambda completions, **kw: [0.0]],
                            lookup.build_dataset(n=4), hooks=RolloutHooks(tools=tools))
    fed = len(trainer._tokenize_prompts([prompt])[0][0])
    if returns == "dict":
        template = type(tok).apply_chat_template
        monkeypatch.setattr(type(tok), "apply_chat_template", lambda self, *a, **kw: dict(template(self, *a, **kw)))
    assert prompt_tokens(cfg, tok, prompt, tools) == fed > 40
    if tools:
        assert fed > prompt_tokens(cfg, tok, prompt, [])  # (the tool's schema is in the prompt)


def test_conversations_beyond_a_models_learned_positions_are_refused_and_without_a_chat_template_too(user_folder):
    from transformers import GPT2Config, GPT2LMHeadModel

    from asyncgrpo.tasks import lookup

    tok = lookup.build_tokenizer()
    model = GPT2LMHeadModel(GPT2Config(n_positions=64, n_embd=32, n_layer=1, n_head=2, vocab_size=len(tok),
                                       bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id))
    model.save_pretrained("gpt2chat")
    tok.save_pretrained("gpt2chat")
    (user_folder / "chat.jsonl").write_text(json.dumps({"prompt": CONVERSATION}) + "\n")
    flags = ["--device_type", "cpu", *USER_FLAGS, "--dataset_name", "chat.jsonl", "--max_completion_length", "8"]
    with pytest.raises(ConfigError) as refused:
        check_inputs(parse_config([*flags, "--model_name_or_path", "gpt2chat"]), user_folder / "run")
    words = len(CONVERSATION[0]["content"])  # (a character tokenizer) and the template's role tokens
    assert str(refused.value).startswith("--max_completion_length 8: prompts of up to ")
    assert int(str(refused.value).split("up to ")[1].split()[0]) > words
    with pytest.raises(ConfigError) as refused:  # the demo's tokenizer has no chat template
        check_inputs(parse_config(flags), user_folder / "run")
    assert str(refused.value) == (
        "--dataset_name chat.jsonl: its prompts are conversations (lists of role/content messages), and the tokenizer "
        "of mymodel has no chat template to turn them into tokens: give a --model_name_or_path whose tokenizer has "
        "one (a chat or instruct model), or plain-text prompts")
