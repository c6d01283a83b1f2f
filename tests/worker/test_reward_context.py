"""What a reward function sees on a worker: TRL's keyword arguments, with the PS's step as
``trainer_state.global_step`` (a worker never trains, so its own step would always be 0)."""

from helpers import demo_config

from asyncgrpo.events import EventLog
from asyncgrpo.tasks.demo import build_dataset, build_model, build_tokenizer
from worker.generate import build_trainer, generate_and_score


def test_a_reward_function_sees_the_ps_step_the_job_was_thrown_at(tmp_path):
    seen = []

    def reward_reading_the_step(prompts, completions, trainer_state, **kwargs):
        seen.append(trainer_state.global_step)
        return [0.0] * len(prompts)

    cfg = demo_config(tmp_path)
    tokenizer = build_tokenizer()
    dataset = build_dataset(n=40)
    trainer = build_trainer(cfg, build_model(seed=0, tokenizer=tokenizer), tokenizer, [reward_reading_the_step],
                            dataset)
    rows = [dataset[i // cfg.num_generations] for i in range(cfg.generation_batch_size)]
    for ps_step in (7, 12):
        generate_and_score(trainer, rows, EventLog.off(), seed=0, ps_step=ps_step)
    assert seen == [7, 12]
