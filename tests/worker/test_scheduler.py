"""The continuous engine's scheduler (worker/decoding/scheduler.py) on its own: no model, no tensor. What it plans
for the runner: which rows join which slots and how (one prefill a group of one prompt, the others copying its
slot; short prompts fed), rows waiting for slots and joining as others end, the moves of a step's plan, and a job
handed out once its rows have all ended."""

from __future__ import annotations

from worker.decoding.scheduler import Scheduler
from worker.decoding.sequence import Sequence
from worker.decoding.slot_cache import SlotReads

PROMPT_A, PROMPT_B = list(range(10, 22)), list(range(30, 40))  # longer than the fed prompts'
SHORT = [1, 2, 3]


def scheduler(slots: int, rows_per_job: int = 8, fed: int = 0, sizes=None, share: bool = True,
              narrower: int = 0) -> Scheduler:
    return Scheduler(slots, rows_per_job, SlotReads(slots, 16, 64, narrower), fed, sizes, share)


def a_job(key, prompts: list[list[int]], step: int = 0) -> Sequence:
    return Sequence(key, prompts, list(range(len(prompts))), added_step=step)


def test_one_row_of_each_group_is_prefilled_and_the_others_copy_its_slot():
    s = scheduler(8)
    job = a_job("a", [PROMPT_A] * 4 + [PROMPT_B] * 4)
    s.add(job)
    prefilled, copied = s.admit()
    assert (prefilled.how, [row for _, row in prefilled.rows], prefilled.slots, prefilled.size) == \
        ("prefilled", [0, 4], [0, 1], 2)
    assert (copied.how, [row for _, row in copied.rows]) == ("copied", [1, 2, 3, 5, 6, 7])
    assert copied.origins == [0, 0, 0, 1, 1, 1]  # the slots of their group's prefilled row
    assert copied.slots == [2, 3, 4, 5, 6, 7] and job.slots == [0, 2, 3, 4, 1, 5, 6, 7]
    assert job.prefilled == {0, 4} and s.admit() == [] and not s.wants_a_job()


def test_without_sharing_every_row_is_prefilled_padded_up_to_a_prefill_size():
    s = scheduler(16, sizes=[8, 16], share=False)
    s.add(a_job("a", [PROMPT_A] * 4 + [PROMPT_B] * 4))
    [prefilled] = s.admit()
    assert (prefilled.how, len(prefilled.rows), prefilled.size) == ("prefilled", 8, 8)
    s.add(a_job("b", [PROMPT_A] * 3 + [SHORT] + [PROMPT_B] * 4))
    [prefilled] = s.admit()
    assert (len(prefilled.rows), prefilled.size) == (8, 8) and prefilled.slots == list(range(8, 16))


def test_short_prompts_are_fed_and_sample_their_first_token_once_their_prompt_is_through():
    s = scheduler(8, fed=8)
    s.steps = 5
    job = a_job("a", [SHORT] * 4 + [PROMPT_A] * 4)
    s.add(job)
    fed, prefilled, copied = s.admit()
    assert (fed.how, fed.slots, prefilled.how, copied.how) == ("fed", [0, 1, 2, 3], "prefilled", "copied")
    assert job.joined == [5 + len(SHORT)] * 4 + [5] * 4  # the step that samples their token 1
    assert job.runs == [[(0, None)]] * 8


def test_rows_wait_for_slots_and_join_as_others_end_copying_a_sibling_that_still_decodes():
    s = scheduler(6)
    job = a_job("a", [PROMPT_A] * 4 + [PROMPT_B] * 4)
    s.add(job)
    s.admit()
    assert [row for j, row in s.waiting] == [6, 7] and not s.wants_a_job()
    assert s.ended({1: ("tokens", "logps"), 2: ("tokens", "logps")}) == []  # rows 4 (B's prefilled) and 1 ended
    assert job.ended.keys() == {4, 1} and s.free == [1, 2]
    [copied] = s.admit()
    assert (copied.how, [row for _, row in copied.rows], copied.origins) == ("copied", [6, 7], [5, 5])  # row 5's
    assert s.wants_a_job() is False and s.waiting == []


def test_a_row_whose_group_has_left_the_slots_is_prefilled_again():
    s = scheduler(4, rows_per_job=4)
    job = a_job("a", [PROMPT_A] * 2 + [PROMPT_B] * 2)
    s.add(job)
    s.admit()
    s.add(a_job("b", [PROMPT_A] * 4))
    s.ended({0: (), 2: ()})  # a's rows 0 and 1 (group A) ended; b's first two rows take their slots
    prefilled, copied = s.admit()
    assert [(j.key, row) for j, row in prefilled.rows] == [("b", 0)] and copied.origins == [prefilled.slots[0]]
    s.ended({1: (), 3: ()})  # a's group B ended: a has ended
    assert s.residents[0].key == "b" and len(s.residents) == 1


def test_a_plan_moves_rows_into_a_narrower_steps_slots_and_says_which_it_vacates():
    s = scheduler(32, rows_per_job=4, narrower=2)
    jobs = [a_job(i, [PROMPT_A] * 4) for i in range(8)]
    for job in jobs:
        s.add(job)
    s.admit()
    s.ended({slot: () for slot in range(20)})  # 12 rows left, in slots 20..31
    plan = s.schedule(2)
    assert (plan.width, plan.moves) == (16, [(20 + i, i) for i in range(12)])  # into the first 16 slots' free ones
    assert plan.vacated == list(range(20, 32)) and sorted(s.owners) == list(range(12)) and s.steps == 2
    assert s.free == list(range(12, 32)) and jobs[-1].slots == [8, 9, 10, 11]


def test_a_job_is_handed_out_once_its_rows_have_all_ended_and_a_dropped_one_frees_its_slots():
    s = scheduler(8, rows_per_job=4)
    a, b = a_job("a", [PROMPT_A] * 4), a_job("b", [PROMPT_B] * 4)
    s.add(a)
    s.add(b)
    s.admit()
    assert s.ended({0: (1,), 1: (2,), 2: (3,)}) == []
    assert s.ended({3: (4,)}) == [a] and a.ended == {0: (1,), 1: (2,), 2: (3,), 3: (4,)}
    assert s.drop(b) == [4, 5, 6, 7] and s.empty() and s.free == list(range(8)) and not s.owners


def test_weights_changed_starts_a_run_at_each_decoding_rows_next_token():
    s = scheduler(8, rows_per_job=4)
    s.version = 1
    job = a_job("a", [PROMPT_A] * 4)
    s.add(job)
    s.admit()
    s.schedule(3)
    s.weights_changed(2)
    assert job.runs == [[(0, 1), (4, 2)]] * 4  # token 0 from the prefill, 1..3 from the steps 0..2


def test_the_scheduler_module_itself_imports_no_tensor_library():
    """It returns plans; the runner carries them out. (The job and the plans of reads it uses live in modules that
    import torch: this checks the scheduler's own code, which the tests above run with no tensor.)"""
    import ast

    import worker.decoding.scheduler as module

    tree = ast.parse(open(module.__file__).read())
    imported = {alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import)
                for alias in node.names}
    imported |= {node.module.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    assert imported == {"__future__", "worker"}
