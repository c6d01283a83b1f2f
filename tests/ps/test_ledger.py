"""The exactly-once ledger (ps/ledger.py): what enters it when, what the final checkpoint counts, and that its
checkpointed form reads back the same."""

from asyncgrpo.config_parser import parse_config
from asyncgrpo.jobqueue import JobQueue
from ps.ledger import GroupsTaken, Ledger
from ps.pipeline import BatchInTraining, JobPipeline


def part(job_id: str, groups: list[int], of_groups: int = 2) -> GroupsTaken:
    return GroupsTaken(job_id, weights_version=0, groups=groups, of_groups=of_groups, samples=0, tokens=0)


def test_a_batch_of_two_steps_enters_the_ledger_only_after_its_last_step(run):
    cfg = parse_config(["--generation_batch_size=4", "--per_device_train_batch_size=4", "--num_generations=2",
                        "--num_iterations=2", "--model_name_or_path=unused", "--output_dir=unused"])
    pipeline = JobPipeline(cfg, run, JobQueue(run), dataset=[])
    try:
        pipeline.in_training = BatchInTraining([part("000000_000", [0, 1])], metrics={}, steps_left=2)
        pipeline.on_step_end(1)
        assert not pipeline.ledger.is_consumed("000000_000") and pipeline.ledger.state_dict()["consumed"] == []
        pipeline.on_step_end(2)
        assert pipeline.ledger.is_consumed("000000_000") and pipeline.in_training is None
    finally:
        pipeline.stop()


def test_a_result_split_across_batches_is_consumed_when_its_last_groups_train():
    ledger = Ledger()
    ledger.trained([part("000000_000", [0]), part("000000_001", [0, 1])])
    assert ledger.is_partly_done("000000_000") and ledger.groups_done_of("000000_000") == {0}
    assert ledger.is_consumed("000000_001") and not ledger.is_partly_done("000000_001")
    assert ledger.state_dict() == {"consumed": ["000000_001"], "groups_done": {"000000_000": [0]}}
    ledger.trained([part("000000_000", [1])])
    assert ledger.is_consumed("000000_000") and not ledger.is_partly_done("000000_000")
    assert ledger.state_dict() == {"consumed": ["000000_000", "000000_001"], "groups_done": {}}


def test_dropped_groups_are_done_and_a_result_closed_untrained_leaves_groups_done():
    ledger = Ledger()
    ledger.drop("000000_000", [1])
    assert ledger.groups_done_of("000000_000") == {1} and not ledger.is_consumed("000000_000")
    ledger.trained([part("000000_000", [0])])  # its last group trains: consumed
    assert ledger.is_consumed("000000_000")
    ledger.drop("000000_001", [0])
    ledger.close("000000_001", consumed=False)  # archived filtered: never consumed
    ledger.drop("000000_002", [0])
    ledger.close("000000_002", consumed=True)  # groups of it trained before a restart: archived consumed
    assert ledger.state_dict() == {"consumed": ["000000_000", "000000_002"], "groups_done": {}}


def test_the_final_state_counts_the_cut_short_batch_and_the_leftover_as_consumed():
    ledger = Ledger()
    ledger.trained([part("000000_000", [0, 1]), part("000000_001", [0]), part("000000_002", [0])])
    # 000000_001: the batch cut short by max_steps; 000000_002: a result whose group 1 waits for a next batch
    final = ledger.state_dict(cut_short={"000000_001", "000000_002", "000000_003"})
    assert final == {"consumed": ["000000_000", "000000_001", "000000_002", "000000_003"], "groups_done": {}}
    assert ledger.state_dict()["groups_done"] == {"000000_001": [0], "000000_002": [0]}  # the ledger is unchanged


def test_a_ledger_loaded_from_its_state_dict_is_the_same():
    ledger = Ledger()
    ledger.trained([part("000000_001", [0, 1]), part("000000_000", [1], of_groups=3)])
    ledger.drop("000000_000", [2])
    state = ledger.state_dict()
    assert state == {"consumed": ["000000_001"], "groups_done": {"000000_000": [1, 2]}}
    loaded = Ledger()
    loaded.load_state_dict(state)
    assert loaded.state_dict() == state
    assert loaded.is_consumed("000000_001") and loaded.groups_done_of("000000_000") == {1, 2}
    empty = Ledger()
    empty.load_state_dict({})  # a fresh run's
    assert empty.state_dict() == {"consumed": [], "groups_done": {}}
