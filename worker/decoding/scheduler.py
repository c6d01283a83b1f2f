"""The continuous engine's scheduler (worker/decoding/continuous.py): which row decodes in which slot, and what the
runner (worker/decoding/slot_runner.py) does next. It touches no tensor: it returns plans, and the runner carries
them out on the cache.

- ``admit``: waiting rows into free slots, in the order they came, up to a job's rows at a time. Each row joins
  ``fed`` (a short prompt through its slot's next steps, where the prefill is eager), ``copied`` (a row of its
  group holds its prompt in a slot, or is prefilled in the same round: a copy of that slot's prompt columns) or
  ``prefilled`` (one row of each group; padded up to one of ``prefill_sizes`` rows where the prefill is compiled).
- ``schedule``: the rows the next steps compute and the columns they read (worker/decoding/slot_cache.py
  ``SlotReads``), with the moves of rows between slots that it needs.
- ``ended``: frees the slots of rows that ended, and returns the jobs whose rows have all ended.
"""

from __future__ import annotations

from worker.decoding.sequence import Joining, Sequence
from worker.decoding.slot_cache import SlotReads, StepPlan


class Scheduler:
    """The engine's jobs and slots. ``fed_prompt_tokens``: the longest prompt fed through the steps (0: every row is
    prefilled); ``prefill_sizes``: the rows a prefill is padded up to (None: a prefill takes its rows as they are);
    ``share_prompts``: a group's rows copy one prefill of its prompt."""

    def __init__(self, slots: int, rows_per_job: int, reads: SlotReads, fed_prompt_tokens: int,
                 prefill_sizes: list[int] | None, share_prompts: bool):
        self.rows_per_job, self.reads = rows_per_job, reads
        self.fed_prompt_tokens, self.prefill_sizes, self.share_prompts = fed_prompt_tokens, prefill_sizes, share_prompts
        self.residents: list[Sequence] = []
        self.owners: dict[int, tuple[Sequence, int]] = {}  # slot: the job and row it decodes
        self.free: list[int] = list(range(slots))
        self.waiting: list[tuple[Sequence, int]] = []  # rows waiting for a slot, in the order they came
        self.steps = 0  # decoding steps scheduled, over every slot
        self.version: int | None = None  # the weights the model holds

    def reallocated(self, reads: SlotReads) -> None:
        """The runner's caches were made anew, read by ``reads`` (the engine is empty): every slot free."""
        assert not self.residents, "reallocating with jobs in the slots"
        self.reads, self.free, self.waiting = reads, list(range(reads.slots)), []

    def add(self, job: Sequence) -> None:
        self.residents.append(job)
        self.waiting += [(job, row) for row in range(len(job.prompt_ids))]

    def wants_a_job(self) -> bool:
        """A slot is free and no row waits for one: a job claimed now starts decoding at once (never earlier: a
        claimed job ages)."""
        return bool(self.free) and not self.waiting

    def empty(self) -> bool:
        return not self.residents

    def admit(self) -> list[Joining]:
        """Waiting rows into free slots, as joinings for the runner to carry out in order."""
        joinings = []
        while self.waiting and self.free:
            n = min(len(self.waiting), len(self.free), self.rows_per_job)
            rows, self.waiting = self.waiting[:n], self.waiting[n:]
            fed, prefilled, copied = [], [], []
            for job, row in rows:
                if len(job.prompt_ids[row]) <= self.fed_prompt_tokens:
                    fed.append((job, row))
                elif self.share_prompts and (job.seated_sibling(row) is not None or any(
                        j is job and j.group[r] == job.group[row] for j, r in prefilled)):
                    copied.append((job, row))
                else:
                    prefilled.append((job, row))
            if fed:  # token 0 of each is sampled by the step that reads its prompt's last token
                joinings.append(Joining("fed", fed, self._seated(fed, [self.steps + len(job.prompt_ids[row])
                                                                       for job, row in fed])))
            if prefilled:
                size = len(prefilled) if self.prefill_sizes is None else next(
                    size for size in self.prefill_sizes if size >= len(prefilled))
                if self.share_prompts:
                    for job, row in prefilled:
                        job.prefilled.add(job.group[row])
                joinings.append(Joining("prefilled", prefilled, self._seated(prefilled), size))
            if copied:  # (each origin found before the copies sit: none copies a slot being written)
                origins = [job.seated_sibling(row) for job, row in copied]
                joinings.append(Joining("copied", copied, self._seated(copied), origins=origins))
        return joinings

    def _seated(self, rows: list[tuple[Sequence, int]], joined: list[int] | None = None) -> list[int]:
        """Free slots for ``rows``, each row's token 1 sampled by the step of ``joined`` (default: the next one)."""
        slots, self.free = self.free[:len(rows)], self.free[len(rows):]
        for (job, row), slot, step in zip(rows, slots, joined or [self.steps] * len(rows), strict=True):
            job.slots[row], job.joined[row], job.runs[row] = slot, step, [(0, self.version)]
            self.owners[slot] = (job, row)
        return slots

    def schedule(self, steps: int) -> StepPlan:
        """The plan of the next ``steps`` steps (counted as run from now)."""
        # A row reads its prompt's columns and one more a step from the one it joined at (its first token's).
        reach = {slot: min(self.reads.size, self.reads.prompt_part + self.steps + steps - job.joined[row])
                 for slot, (job, row) in self.owners.items()}
        plan = self.reads.plan(reach)
        if plan.moves:
            owners = {to: self.owners.pop(origin) for origin, to in plan.moves}
            self.owners.update(owners)
            for slot, (job, row) in owners.items():
                job.slots[row] = slot
            self.free = sorted(set(self.free) - owners.keys() | set(plan.vacated))
        self.steps += steps
        return plan

    def ended(self, rows: dict[int, tuple]) -> list[Sequence]:
        """Frees the slots of the rows that ended ({slot: (tokens, log-probs)}) and returns the jobs whose rows
        have all ended."""
        for slot, outputs in rows.items():
            job, row = self.owners.pop(slot)
            job.ended[row], job.slots[row] = outputs, None
        self._freed(list(rows))
        finished = [job for job in self.residents if len(job.ended) == len(job.slots)]
        self.residents = [job for job in self.residents if job not in finished]
        return finished

    def drop(self, job: Sequence) -> list[int]:
        """Frees a job's slots as they are (its rows' tokens are not wanted); returns them."""
        slots = [slot for slot in job.slots if slot is not None]
        for slot in slots:
            del self.owners[slot]
        self._freed(slots)
        self.residents.remove(job)
        self.waiting = [(j, row) for j, row in self.waiting if j is not job]
        return slots

    def _freed(self, slots: list[int]) -> None:
        self.free = sorted(self.free + slots)  # (joining rows take the slots that read fewest columns first)

    def weights_changed(self, version: int) -> None:
        """The model now holds ``version``: each decoding row's next token is sampled by it (a waiting row's
        first)."""
        self.version = version
        for job in self.residents:
            for row, slot in enumerate(job.slots):
                if slot is None:
                    continue
                first = max(0, self.steps - job.joined[row] + 1)  # the row's next token's index (0: its first's)
                runs = job.runs[row]
                if runs[-1][0] == first:
                    runs[-1] = (first, version)
                else:
                    runs.append((first, version))
