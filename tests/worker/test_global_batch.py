"""A worker for a PS of several processes (--ps_processes K) generates and logs the PS's global batch: every
completion of a job of per_device_train_batch_size x K rows is in the result and in its completions table."""

from helpers import demo_config

from asyncgrpo.events import EventLog
from asyncgrpo.tasks.demo import build_dataset, build_model, build_tokenizer
from worker.generate import build_trainer, completion_logs, generate_and_score


def test_a_job_of_two_ps_processes_is_generated_and_logged_whole(tmp_path):
    cfg = demo_config(tmp_path, per_device_train_batch_size=8, ps_processes=2)
    tokenizer = build_tokenizer()
    dataset = build_dataset(n=40)
    trainer = build_trainer(cfg, build_model(seed=0, tokenizer=tokenizer), tokenizer, [lambda completions, **_:
                            [float(len(c)) for c in completions]], dataset)
    rows = [dataset[i // cfg.num_generations] for i in range(16)]  # 8 per PS process
    batch, _ = generate_and_score(trainer, rows, EventLog.off(), seed=0)
    assert batch["advantages"].numel() == 16
    logs = completion_logs(trainer)
    assert len(logs["completion"]) == len(logs["advantages"]) == 16
