"""The manual against the code (README.md and docs/*.md).

- The flag tables (docs/options.md): the asyncgrpo table has a row for every field of asyncgrpo's own
  (AsyncGRPOConfig's fields that are neither TRL's GRPOConfig fields nor TRL's model, dataset and PEFT
  flags mixed into it), every flag either table names is a field of AsyncGRPOConfig (what parse_config
  parses), and every default written as a value is the dataclass default.
- Every relative link reaches a file in the repository, and its #anchor a heading of that file
  (GitHub's slugs).
- Every path of the code (asyncgrpo/, ps/, worker/, queue_tools/, bench/, scripts/, docs/) the pages
  name exists.

No process, no network: the markdown is read as text and the config's dataclasses are inspected.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]

# Defaults written as prose rather than a value: not compared. Keep this list short and explicit.
PROSE_DEFAULTS = {
    "demo model",  # model_name_or_path None: the demo task's model
    "demo prompts",  # dataset_name None: the demo task's prompts
    "demo reward",  # reward_funcs None: the demo task's reward
    "transformers'",  # attn_implementation None: transformers chooses
    "PEFT's per model",  # lora_target_modules None: PEFT chooses per architecture
    "`RUN/final_model`",  # output_dir None: the PS saves the final model there
    "a new folder under `$ASYNCGRPO_RUNS`",  # run_dir None: a new run directory
    "`--dtype`'s",  # worker_dtype None: the workers load --dtype as the PS does
}
# Fields of AsyncGRPOConfig's own that are TRL's flags all the same (`trl grpo`'s script arguments).
TRL_SCRIPT_FLAGS = {"reward_funcs", "reward_model_name_or_path", "datasets", "streaming", "test_split_size"}
ASYNCGRPO_TABLE = "flag"  # the first header cell of each table
TRL_TABLE = "TRL's flag"
CODE_ROOTS = ("asyncgrpo", "ps", "worker", "queue_tools", "bench", "scripts", "docs", "tests")


# ------------------------------------------------------------------------------------------ markdown

def prose_lines(text: str) -> list[str]:
    """The lines outside fenced code blocks."""
    lines, fenced = [], False
    for line in text.splitlines():
        if line.lstrip().startswith(("```", "~~~")):
            fenced = not fenced
            continue
        if not fenced:
            lines.append(line)
    return lines


def cells(line: str) -> list[str]:
    """A table row's cells (``\\|`` inside a cell is not a separator)."""
    return [c.strip() for c in re.split(r"(?<!\\)\|", line.strip().strip("|"))]


def tables(path: Path) -> list[list[list[str]]]:
    """Each markdown table of ``path`` as rows of cells, the header first, the separator row left out."""
    found, current = [], []
    for line in prose_lines(path.read_text()) + [""]:
        if line.lstrip().startswith("|"):
            current.append(cells(line))
            continue
        if len(current) >= 2:
            found.append([current[0]] + current[2:])
        current = []
    return found


def flag_table(header: str) -> tuple[str, list[list[str]]]:
    """The one table in the pages whose first header cell is ``header``: (where, its rows)."""
    matches = [(f"{page.relative_to(REPO)}", table[1:]) for page in PAGES for table in tables(page)
               if table[0][0] == header]
    assert len(matches) == 1, f"expected one table headed {header!r}, found {[where for where, _ in matches]}"
    return matches[0]


def row_flags(cell: str) -> tuple[list[str], list[str]]:
    """The flags a row's first cell names: (the row's own, every one). Flags in parentheses (older names,
    companions such as ``(+ `--bnb_4bit_quant_type`, ...)``) are real flags without a default in the row."""
    everything = re.findall(r"`--([A-Za-z0-9_]+)", cell)
    own = re.findall(r"`--([A-Za-z0-9_]+)", re.sub(r"\([^)]*\)", "", cell))
    return own, everything


def row_defaults(flags: list[str], cell: str) -> list[str]:
    """The default of each flag in ``flags``: one value for all, or one per flag (``16, 32, 0.05``)."""
    parts = [p.strip() for p in cell.split(", ")]
    if len(flags) > 1 and len(parts) == len(flags):
        return parts
    return [cell.strip()] * len(flags)


def same_default(written: str, value) -> bool:
    """Whether a table's default (``4``, ``2.0``, `` `auto` ``, ``false``, ``none``) is ``value``."""
    text = written.strip().strip("`").strip()
    if value is None or isinstance(value, bool):
        return text.lower() == {None: "none", True: "true", False: "false"}[value]
    if isinstance(value, (int, float)):
        try:
            return float(text) == float(value)
        except ValueError:
            return False
    return text == str(value)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: its text, lower case, without punctuation, spaces as hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    found = set()
    for line in prose_lines(path.read_text()):
        if m := re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line):
            base = slug(m.group(1))
            n = seen.get(base, 0)
            seen[base] = n + 1
            found.add(base if n == 0 else f"{base}-{n}")
    return found


def links(path: Path) -> list[str]:
    """The targets of the markdown links of ``path`` (outside code blocks and code spans)."""
    text = re.sub(r"`[^`\n]*`", "", "\n".join(prose_lines(path.read_text())))
    return re.findall(r"\[[^\]]*\]\(\s*([^)\s]+)(?:\s+\"[^\"]*\")?\s*\)", text)


# ------------------------------------------------------------------------------------------ the config

@dataclasses.dataclass
class Fields:
    defaults: dict  # every field of AsyncGRPOConfig a flag sets -> its default
    own: set  # asyncgrpo's own fields
    trl_mixed_in: set  # TRL's model, dataset and PEFT flags mixed into AsyncGRPOConfig


def default_of(field: dataclasses.Field):
    if field.default is not dataclasses.MISSING:
        return field.default
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return None


@pytest.fixture(scope="module")
def config() -> Fields:
    from trl import GRPOConfig

    from asyncgrpo.config import AsyncGRPOConfig, DatasetArguments, ModelArguments
    from asyncgrpo.peft_args import PeftArgs

    fields = {f.name: default_of(f) for f in dataclasses.fields(AsyncGRPOConfig) if f.init}
    grpo = {f.name for f in dataclasses.fields(GRPOConfig)}
    mixed_in = {f.name for group in (ModelArguments, DatasetArguments, PeftArgs) for f in dataclasses.fields(group)}
    own = set(fields) - grpo - mixed_in - TRL_SCRIPT_FLAGS
    return Fields(defaults=fields, own=own, trl_mixed_in=mixed_in)


# ------------------------------------------------------------------------------------------ tests

def test_every_asyncgrpo_field_has_a_row_and_every_row_is_one(config):
    where, rows = flag_table(ASYNCGRPO_TABLE)
    named = [flag for row in rows for flag in row_flags(row[0])[1]]
    assert sorted(config.own - set(named)) == [], f"fields of asyncgrpo's own without a row in {where}"
    assert sorted(set(named) - config.own) == [], f"rows of {where} that are no field of asyncgrpo's own"
    assert len(named) == len(set(named)), f"a flag with two rows in {where}"


def test_every_trl_row_is_a_trl_flag_and_every_mixed_in_flag_has_a_row(config):
    where, rows = flag_table(TRL_TABLE)
    named = {flag for row in rows for flag in row_flags(row[0])[1]}
    trl_flags = set(config.defaults) - config.own
    assert sorted(named - trl_flags) == [], f"rows of {where} that are no TRL flag of AsyncGRPOConfig"
    assert sorted(config.trl_mixed_in - named) == [], f"TRL flags mixed into AsyncGRPOConfig without a row in {where}"


@pytest.mark.parametrize("header", [ASYNCGRPO_TABLE, TRL_TABLE])
def test_defaults_in_the_tables_are_the_code_defaults(config, header):
    where, rows = flag_table(header)
    wrong = []
    for row in rows:
        flags = row_flags(row[0])[0]
        assert flags, f"{where}: a row names no flag: {row[0]}"
        if row[1] in PROSE_DEFAULTS:
            continue
        for flag, written in zip(flags, row_defaults(flags, row[1]), strict=True):
            if flag in config.defaults and not same_default(written, config.defaults[flag]):
                wrong.append(f"--{flag}: {written!r} in the table, {config.defaults[flag]!r} in the code")
    assert wrong == [], f"{where}: defaults that are not the code's: {wrong}"


def test_the_prose_defaults_are_all_in_use():
    used = {row[1] for header in (ASYNCGRPO_TABLE, TRL_TABLE) for row in flag_table(header)[1]}
    assert sorted(PROSE_DEFAULTS - used) == [], "PROSE_DEFAULTS entries no table uses any more"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_relative_links_reach_a_file_and_a_heading(page):
    broken = []
    for target in links(page):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto:
            continue
        file_part, _, anchor = target.partition("#")
        dest = (page.parent / file_part).resolve() if file_part else page
        if REPO != dest and REPO not in dest.parents:
            broken.append(f"{target}: outside the repository")
        elif not dest.exists():
            broken.append(f"{target}: no such file")
        elif anchor and (dest.suffix != ".md" or anchor not in anchors(dest)):
            broken.append(f"{target}: no heading #{anchor} in {dest.relative_to(REPO)}")
    assert broken == [], f"{page.relative_to(REPO)}: broken links: {broken}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_code_paths_named_exist(page):
    roots = "|".join(CODE_ROOTS)
    named = re.findall(rf"(?<![\w./~$-])((?:{roots})/[\w./-]*)", page.read_text())
    missing = sorted({p.rstrip(".") for p in named if not (REPO / p.rstrip(".")).exists()})
    assert missing == [], f"{page.relative_to(REPO)} names paths that do not exist: {missing}"


def test_slugs_are_githubs():
    assert slug("TRL's flags") == "trls-flags"
    assert slug("queue_tools ls") == "queue_tools-ls"
    assert slug("Throughput on one GPU, against TRL") == "throughput-on-one-gpu-against-trl"
    assert slug("LoRA / QLoRA") == "lora--qlora"


def test_the_design_layout_names_every_module():
    design = (REPO / "docs" / "design.md").read_text()
    layout = design[design.index("\n## Layout\n"):design.index("\n## Words of the house\n")]
    modules = [path for root in ("asyncgrpo", "ps", "worker", "queue_tools", "bench") for path in
               sorted((REPO / root).rglob("*.py")) if path.name not in ("__init__.py", "__main__.py")]
    unnamed = [str(path.relative_to(REPO)) for path in modules if path.name not in layout]
    assert unnamed == [], f"docs/design.md's Layout does not name {unnamed}"
